// Warp-specialised, persistent Hopper grouped GEMM: one producer warp issues bulk tensor copies (TMA, 128-byte
// swizzle, completing on mbarriers) into a 4-stage ring; two consumer warpgroups run wgmma m64n256k16 on 128x256x64
// tiles; one CTA per SM walks the tiles.
// Same scheduling, tile layout and epilogue as grouped_gemm_mma.cuh. TMA bounds come from static shapes, so a tile
// may read rows of the next group (or up to max_rows): harmless for nt/nn, where those rows only feed output rows
// that are never stored; for tn (reduction over the group's rows) the consumers zero those rows in shared memory.
// Included by grouped_gemm_kernels.cuh only.
#pragma once
#include <cuda.h>

namespace moekit::cuda::gemm_detail {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Tensor maps (host-encoded, 128B swizzle, boxes of 64 elements along the contiguous dimension):
//   NT: a = {k, max_rows} box {64,128};      b = {k, n, G} box {64,256,1}
//   NN: a = {k, max_rows} box {64,128};      b = {n, k, G} box {64,64,1}  (4 boxes per stage)
//   TN: a = {m, max_rows} box {64,64} (x2);  b = {n, max_rows} box {64,64} (x4)
template <Op kOp>
__global__ void __launch_bounds__(384, 1)
    tma_kernel(Params p, const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int BM = 128, BN = 256, kStages = 4;
    constexpr uint32_t kStageA = BM * kBK * 2, kStageB = BN * kBK * 2, kStageBytes = kStageA + kStageB;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t bars = base + kStages * kStageBytes;  // full[kStages], empty[kStages]
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (kStages + s); };
    auto sA = [&](int s) { return base + s * kStageBytes; };
    auto sB = [&](int s) { return base + s * kStageBytes + kStageA; };
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 2);  // one arrival per consumer warpgroup
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // Persistent: the CTA walks tiles blockIdx.x, +gridDim.x, ... Producer and consumers walk the same sequence and
    // count k-steps globally (it), so the ring's stages and phases carry over from one tile to the next and the
    // producer fills the next tile's first stages while the consumers run the epilogue of the current one.

    if (wg == 0) {                 // producer warpgroup: warp 0 finds the jobs, its lane 0 issues every copy
#ifndef MOEKIT_GEMM_NO_SETMAXNREG  // (sanitizer builds: instrumented code may not fit in 40 registers)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
#endif
        if (tid >= 32) return;
        int it = 0;
        for (int pid = blockIdx.x; pid < p.total_tiles; pid += gridDim.x) {
            const TileJob job = find_job_warp<kOp, BM, BN>(p, pid);
            if (!job.active) continue;
            const int nk = num_ktiles<kOp>(p, job);
            // Boxes entirely past n (or m) would only feed output columns that are never stored: skip them, and
            // expect only the bytes of the boxes issued.
            const int a_boxes = kOp == Op::kTN ? min(BM / 64, (p.k - job.m0 + 63) / 64) : 1;
            const int b_boxes = kOp == Op::kNT ? 1 : min(BN / 64, (p.n - job.n0 + 63) / 64);
            const uint32_t bytes = kOp == Op::kTN   ? uint32_t(a_boxes + b_boxes) * kBlockBytes
                                   : kOp == Op::kNT ? kStageBytes
                                                    : kStageA + uint32_t(b_boxes) * kBlockBytes;
            for (int kt = 0; kt < nk; ++kt, ++it) {
                if (tid != 0) continue;
                const int s = it % kStages;
                if (it >= kStages) mbar_wait(empty(s), ((it / kStages) + 1) & 1);
                mbar_expect_tx(full(s), bytes);
                const int k0 = kt * kBK;
                if constexpr (kOp == Op::kTN) {
                    const int r0 = int(job.row0) + k0;
                    for (int j = 0; j < a_boxes; ++j)
                        tma_2d(sA(s) + j * kBlockBytes, &map_a, job.m0 + 64 * j, r0, full(s));
                    for (int j = 0; j < b_boxes; ++j)
                        tma_2d(sB(s) + j * kBlockBytes, &map_b, job.n0 + 64 * j, r0, full(s));
                } else {
                    tma_2d(sA(s), &map_a, k0, int(job.row0), full(s));
                    if constexpr (kOp == Op::kNT) {
                        tma_3d(sB(s), &map_b, k0, job.n0, job.group, full(s));
                    } else {
                        for (int j = 0; j < b_boxes; ++j)
                            tma_3d(sB(s) + j * kBlockBytes, &map_b, job.n0 + 64 * j, k0, job.group, full(s));
                    }
                }
            }
            __syncwarp();  // lanes 1-31 skipped the copies: meet lane 0 before the next job search
        }
        return;
    }

#ifndef MOEKIT_GEMM_NO_SETMAXNREG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
#endif
    const int cw = wg - 1;  // consumer warpgroup 0/1: output rows 64*cw ..
    const int ctid = tid - 128;
    const int w = (ctid >> 5) & 3, lane = ctid & 31;
    constexpr int kTransA = kOp == Op::kTN ? 1 : 0;
    constexpr int kTransB = kOp == Op::kNT ? 0 : 1;
    int it = 0;
    float d[128];
    for (int pid = blockIdx.x; pid < p.total_tiles; pid += gridDim.x) {
        const TileJob job = find_job_warp<kOp, BM, BN>(p, pid);
        if (!job.active) continue;
        const int nk = num_ktiles<kOp>(p, job);
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.f;
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(full(s), (it / kStages) & 1);
            if constexpr (kOp == Op::kTN) {
                // Reduction rows at or past the group's end (the next group's, or past max_rows) must count as zero.
                const int valid = int(job.row_end - (job.row0 + int64_t(kt) * kBK));
                if (valid < kBK) {
                    const int bad_rows = kBK - valid, blocks = (BM + BN) / 64;
                    for (int c = ctid; c < bad_rows * blocks * 8; c += 256) {
                        int blk = c / (bad_rows * 8), rest = c % (bad_rows * 8);
                        int r = valid + rest / 8, ch = rest % 8;
                        const uint32_t dst = sA(s) + blk * kBlockBytes + r * 128 + ch * 16;
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
                    }
                    fence_proxy_async();
                    named_barrier(1, 256);
                }
            }
            const uint32_t a_s = sA(s), b_s = sB(s);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk) {
                uint64_t da = kTransA ? make_desc(a_s + cw * kBlockBytes + kk * 2048, kBlockBytes, 1024)
                                      : make_desc(a_s + cw * 64 * 128 + kk * 32, 16, 1024);
                uint64_t db =
                    kTransB ? make_desc(b_s + kk * 2048, kBlockBytes, 1024) : make_desc(b_s + kk * 32, 16, 1024);
                wgmma_m64n256k16<kTransA, kTransB>(d, da, db, 1);
            }
            wgmma_commit();
            wgmma_wait<1>();  // step it-1 retired by this warpgroup: hand its stage back to the producer
            if (kt > 0 && (ctid & 127) == 0) mbar_arrive(empty((it - 1) % kStages));
        }
        wgmma_wait<0>();
        if (nk > 0 && (ctid & 127) == 0) mbar_arrive(empty((it - 1) % kStages));
        const int row = cw * 64 + w * 16 + (lane >> 2);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            int col = i * 8 + (lane & 3) * 2;
            store_pair<kOp>(p, job, row, col, d[4 * i], d[4 * i + 1]);
            store_pair<kOp>(p, job, row + 8, col, d[4 * i + 2], d[4 * i + 3]);
        }
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
