// Wgrad (tn) of small groups: C[g] (+)= A_gᵀ·B_g for the groups of fewer than p.tn_small_below rows (an ECHO
// rank's cold experts; every expert of dsv3-e256 at 4096 tokens). Such a group's tiles are one to four reduction
// steps each and a whole fp32 gradient tile, so the bytes moved, not the math, set its time. Persistent over the
// groups' jobs, skipping the groups of >= p.tn_small_below rows (another launch's: CUTLASS) a group at a time.
// Empty groups as store_pair: zeroed, or left as they are (keep_empty, second base). Host side: grouped_gemm.cu
// (tn_small_rows, launch_tn_strip); tests: GroupedGemm.WgradSmallGroupsKernel and every tn test's per-shape choice.
// Included by grouped_gemm_kernels.cuh only.
#pragma once

namespace moekit::cuda::gemm_detail {

// The B-stationary small-group wgrad (tn_strip_kernel): a job is one column strip of one group's gradient (256
// columns) over p.tn_strip_chunk row tiles of 128. The group's B rows for the strip (at most 255 reduction rows: 4
// k-blocks of 64 x 256 bf16, 128 KiB) are loaded once, then the row tiles' A slabs stream through a 4-stage ring, two
// consumer warpgroups (64 rows each) run wgmma m64n256k16 against the resident B, and each finished tile's fp32
// results leave from registers while the next tile's A copies are already in flight. A tile then loads 32 KiB for its
// 128 KiB of gradient (96 KiB with both operands a tile): at these sizes the loads beside the stores, not the
// tensor cores, set the time (bench_wgrad_stores: 30 GB of fp32 gradients with per-tile slab loads 11.9 ms, with
// the B slab once a strip 8.9 ms, the stores alone 7.8 ms; H200, 2026-11-26).
constexpr int kStripRows = 256;  // the groups it takes have fewer rows (the B slab's capacity)
constexpr int kStripBM = 128;
// Strip width kBN (256: one CTA a multiprocessor, a 128 KiB slab; 128: two CTAs, 64 KiB slabs, 3 ring stages).
template <int kBN>
struct StripConfig {
    static constexpr int kAStages = kBN == 256 ? 4 : 3;
    static constexpr int kMinBlocks = kBN == 256 ? 1 : 2;
    static constexpr int kBBlockBytes = kBN * kBK * 2;                    // one k-block of the slab
    static constexpr int kBBytes = (kStripRows / kBK) * kBBlockBytes;     // 128 / 64 KiB
    static constexpr int kABytes = kStripBM * kBK * 2;                    // 16 KiB a stage
    static constexpr int kSmemBytes = kBBytes + kAStages * kABytes + 1024 /*alignment slack*/;
};

// Four fp32 gradient values at dst (16-byte aligned), added to what is there with `accumulate`.
__device__ __forceinline__ void store_f32x4(float* dst, float4 v, int accumulate) {
    float4* p4 = reinterpret_cast<float4*>(dst);
    if (accumulate) {
        const float4 old = *p4;
        v.x += old.x, v.y += old.y, v.z += old.z, v.w += old.w;
    }
    *p4 = v;
}

template <int kBN>  // (a template: this header is included by several translation units)
__global__ void __launch_bounds__(256, StripConfig<kBN>::kMinBlocks) tn_strip_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Cfg = StripConfig<kBN>;
    constexpr int kAStages = Cfg::kAStages, kAhead = kAStages - 2, kAcc = kBN / 2;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t sB = (smem_u32(smem_raw) + 1023u) & ~1023u;
    auto sA = [&](int s) { return sB + Cfg::kBBytes + s * Cfg::kABytes; };
    const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int chunks = (p.tiles_m + p.tn_strip_chunk - 1) / p.tn_strip_chunk;
    const int per_group = p.tiles_n * chunks;
    for (int job = blockIdx.x; job < p.total_tiles; job += gridDim.x) {
        const int g = job / per_group;
        const int rows = p.offsets[g + 1] - p.offsets[g];
        if (rows >= p.tn_small_below) {  // another launch's group: on to this CTA's first job past it
            job += ((g + 1) * per_group - job - 1) / int(gridDim.x) * int(gridDim.x);
            continue;
        }
        if (rows == 0 && (p.keep_empty || in_second(p, g))) continue;  // left as it is
        const int r = job - g * per_group, tn = r / chunks, chunk = r - tn * chunks;
        const int tm0 = chunk * p.tn_strip_chunk, tm1 = min(p.tiles_m, tm0 + p.tn_strip_chunk);
        const int64_t row0 = p.offsets[g], row_end = row0 + rows;
        const int n0 = tn * kBN;
        const int nk = (rows + kBK - 1) / kBK, steps = (tm1 - tm0) * nk;
        // Step s: row tile tm0 + s / nk, reduction block s % nk.
        auto load_a = [&](int s) {
            load_mnmajor<kStripBM, 256>(sA(s % kAStages), p.A, row0 + int64_t(s % nk) * kBK, row_end, p.k,
                                        (tm0 + s / nk) * kStripBM, p.k, tid);
        };
        for (int kt = 0; kt < nk; ++kt)  // the strip's B slab, in the first copy group with step 0's A
            load_mnmajor<kBN, 256>(sB + kt * Cfg::kBBlockBytes, p.B, row0 + int64_t(kt) * kBK, row_end, p.n, n0, p.n,
                                   tid);
#pragma unroll
        for (int s = 0; s < kAhead; ++s) {
            if (s < steps) load_a(s);
            cp_async_commit();
        }
        float* Cg = group_block(static_cast<float*>(p.C), p.second, p.second_from, g, int64_t(p.k) * p.n);
        const int row = wg * 64 + w * 16 + (lane >> 2), cols_left = p.n - n0;
        // Results leave as 16-byte stores: lanes l and l ^ 1 swap half their pairs, so the even lane holds four
        // consecutive columns of its row and the odd lane four of the row 8 further down.
        const bool even = (lane & 1) == 0;
        const int out_col = (lane & 3) * 2 - (even ? 0 : 2), out_row = row + (even ? 0 : 8);
        float d[kAcc];
#pragma unroll
        for (int i = 0; i < kAcc; ++i) d[i] = 0.f;
        int s = 0;
        for (int tm = tm0; tm < tm1; ++tm) {
            for (int kt = 0; kt < nk; ++kt, ++s) {
                cp_async_wait<kAhead - 1>();
                fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
                __syncthreads();      // step s visible to all; both warpgroups retired their wgmmas of step s - 2
                const uint32_t a_s = sA(s % kAStages), b_s = sB + kt * Cfg::kBBlockBytes;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBK / 16; ++kk) {
                    const uint64_t da = make_desc(a_s + wg * kBlockBytes + kk * 2048, kBlockBytes, 1024);
                    const uint64_t db = make_desc(b_s + kk * 2048, kBlockBytes, 1024);
                    if constexpr (kBN == 256)
                        wgmma_m64n256k16<1, 1>(d, da, db, 1);
                    else
                        wgmma_m64n128k16<1, 1>(d, da, db, 1);
                }
                wgmma_commit();
                if (s + kAhead < steps) load_a(s + kAhead);  // its stage last held step s + kAhead - kAStages
                cp_async_commit();
                if constexpr (kAhead >= 2)
                    wgmma_wait<1>();
                else
                    wgmma_wait<0>();
            }
            wgmma_wait<0>();
            // The row tile is complete (zeros for an empty group): store it, start the next at zero.
            const int gm = tm * kStripBM + out_row;
            float* c = Cg + int64_t(gm) * p.n + n0 + out_col;
            const bool ok = gm < p.k;
#pragma unroll
            for (int i = 0; i < kAcc / 4; ++i) {
                const float send_x = even ? d[4 * i + 2] : d[4 * i], send_y = even ? d[4 * i + 3] : d[4 * i + 1];
                const float got_x = __shfl_xor_sync(0xffffffffu, send_x, 1);
                const float got_y = __shfl_xor_sync(0xffffffffu, send_y, 1);
                const float4 v = even ? make_float4(d[4 * i], d[4 * i + 1], got_x, got_y)
                                      : make_float4(got_x, got_y, d[4 * i + 2], d[4 * i + 3]);
                if (ok && i * 8 < cols_left) store_f32x4(c + i * 8, v, p.accumulate);
                d[4 * i] = d[4 * i + 1] = d[4 * i + 2] = d[4 * i + 3] = 0.f;
            }
        }
        wgmma_wait<0>();
        cp_async_wait<0>();
        __syncthreads();  // the slab and the ring are free for the next job's copies
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
