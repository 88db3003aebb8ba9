// The two grouped-GEMM kernels over the shared scheduling/loading code of grouped_gemm_kernels.cuh:
//  - mma_kernel:   128x128x64 tiles, 8 warps of 64x32, mma.sync m16n8k16 fed by ldmatrix(.trans), 4-stage cp.async;
//  - wgmma_kernel: 128x256x64 tiles, 2 warpgroups of 64x256, wgmma m64n256k16 reading the swizzled tiles through
//                  descriptors, 4 stages with 2 tiles of copies in flight while one wgmma batch runs.
// Included by grouped_gemm_kernels.cuh only.
#pragma once

namespace moekit::cuda::gemm_detail {

template <Op kOp, int BM, int BN, int kStages>
constexpr int smem_bytes() {
    return kStages * (BM + BN) * kBK * 2 + 1024 /*alignment slack*/ + 16 /*job*/;
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of element (row, col) in a K-major swizzled tile (row = m or n, col = k in 0..63).
__device__ __forceinline__ uint32_t kmajor_off(int row, int col) { return row * 128 + ((((col >> 3) ^ row) & 7) << 4); }
// Byte offset of element (krow, mn) in an MN-major tile of 64-wide blocks.
__device__ __forceinline__ uint32_t mnmajor_off(int krow, int mn) {
    return (mn >> 6) * kBlockBytes + krow * 128 + (((((mn & 63) >> 3) ^ krow) & 7) << 4);
}

template <Op kOp>
__global__ void __launch_bounds__(256, 1) mma_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int BM = 128, BN = 128, kStages = 4, kThreads = 256;
    constexpr uint32_t kStageA = BM * kBK * 2, kStageB = BN * kBK * 2;
    extern __shared__ uint8_t smem_raw[];
    uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    int* s_job = reinterpret_cast<int*>(smem_raw + (base - smem_u32(smem_raw)) + kStages * (kStageA + kStageB));
    TileJob job = find_job<kOp, BM, BN>(p, s_job);
    if (!job.active) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int nk = num_ktiles<kOp>(p, job);
    auto sA = [&](int s) { return base + s * kStageA; };
    auto sB = [&](int s) { return base + kStages * kStageA + s * kStageB; };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < nk) load_stage<kOp, BM, BN, kThreads>(p, job, s, sA(s), sB(s), tid);
        cp_async_commit();
    }
    float acc[4][4][4] = {};
    const int mat = lane >> 3, r8 = lane & 7;
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        int next = kt + kStages - 1;
        if (next < nk) load_stage<kOp, BM, BN, kThreads>(p, job, next, sA(next % kStages), sB(next % kStages), tid);
        cp_async_commit();
        const uint32_t a_s = sA(kt % kStages), b_s = sB(kt % kStages);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t af[4][4], bf[2][4];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                if constexpr (kOp == Op::kTN) {
                    int krow = kk * 16 + r8 + (mat >> 1) * 8, m = wm * 64 + mi * 16 + (mat & 1) * 8;
                    ldsm_x4_t(a_s + mnmajor_off(krow, m), af[mi]);
                } else {
                    int row = wm * 64 + mi * 16 + (lane & 15), col = kk * 16 + (lane >> 4) * 8;
                    ldsm_x4(a_s + kmajor_off(row, col), af[mi]);
                }
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                if constexpr (kOp == Op::kNT) {
                    int n = wn * 32 + np * 16 + r8 + (mat >> 1) * 8, col = kk * 16 + (mat & 1) * 8;
                    ldsm_x4(b_s + kmajor_off(n, col), bf[np]);
                } else {
                    int krow = kk * 16 + r8 + (mat & 1) * 8, n = wn * 32 + np * 16 + (mat >> 1) * 8;
                    ldsm_x4_t(b_s + mnmajor_off(krow, n), bf[np]);
                }
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    mma_bf16(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            int row = wm * 64 + mi * 16 + (lane >> 2), col = wn * 32 + ni * 8 + (lane & 3) * 2;
            store_pair<kOp>(p, job, row, col, acc[mi][ni][0], acc[mi][ni][1]);
            store_pair<kOp>(p, job, row + 8, col, acc[mi][ni][2], acc[mi][ni][3]);
        }
#endif
}

// wgmma matrix descriptor: start address, leading/stride byte offsets, 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <Op kOp>
__global__ void __launch_bounds__(256, 1) wgmma_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int BM = 128, BN = 256, kStages = 4, kThreads = 256, kAhead = kStages - 2;
    constexpr uint32_t kStageA = BM * kBK * 2, kStageB = BN * kBK * 2;
    extern __shared__ uint8_t smem_raw[];
    uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    int* s_job = reinterpret_cast<int*>(smem_raw + (base - smem_u32(smem_raw)) + kStages * (kStageA + kStageB));
    TileJob job = find_job<kOp, BM, BN>(p, s_job);
    if (!job.active) return;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int nk = num_ktiles<kOp>(p, job);
    auto sA = [&](int s) { return base + s * kStageA; };
    auto sB = [&](int s) { return base + kStages * kStageA + s * kStageB; };
    constexpr int kTransA = kOp == Op::kTN ? 1 : 0;
    constexpr int kTransB = kOp == Op::kNT ? 0 : 1;

#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
        if (s < nk) load_stage<kOp, BM, BN, kThreads>(p, job, s, sA(s), sB(s), tid);
        cp_async_commit();
    }
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<kAhead - 1>();
        fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async proxy
        __syncthreads();      // tile kt visible to all; every warpgroup has retired its wgmmas of tile kt-2
        const uint32_t a_s = sA(kt % kStages), b_s = sB(kt % kStages);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint64_t da = kTransA ? make_desc(a_s + wg * kBlockBytes + kk * 2048, kBlockBytes, 1024)
                                  : make_desc(a_s + wg * 64 * 128 + kk * 32, 16, 1024);
            uint64_t db = kTransB ? make_desc(b_s + kk * 2048, kBlockBytes, 1024) : make_desc(b_s + kk * 32, 16, 1024);
            wgmma_m64n256k16<kTransA, kTransB>(d, da, db, 1);
        }
        wgmma_commit();
        // Copies for tile kt+2 go out while the tensor cores work; their stage last held tile kt-2, retired by
        // every warpgroup before the barrier above.
        int next = kt + kAhead;
        if (next < nk) load_stage<kOp, BM, BN, kThreads>(p, job, next, sA(next % kStages), sB(next % kStages), tid);
        cp_async_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    const int w = (tid >> 5) & 3, lane = tid & 31;
    const int row = wg * 64 + w * 16 + (lane >> 2);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        int col = i * 8 + (lane & 3) * 2;
        store_pair<kOp>(p, job, row, col, d[4 * i], d[4 * i + 1]);
        store_pair<kOp>(p, job, row + 8, col, d[4 * i + 2], d[4 * i + 3]);
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
