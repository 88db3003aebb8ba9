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
constexpr int kStripAStages = 4, kStripBN = 256, kStripBM = 128;
constexpr int kStripBBytes = (kStripRows / kBK) * kStripBN * kBK * 2;  // 128 KiB
constexpr int kStripABytes = kStripBM * kBK * 2;                       // 16 KiB a stage
constexpr int kStripSmemBytes = kStripBBytes + kStripAStages * kStripABytes + 1024 /*alignment slack*/;

template <int kAStages = kStripAStages>  // (a template: this header is included by several translation units)
__global__ void __launch_bounds__(256, 1) tn_strip_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int kAhead = kAStages - 2;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t sB = (smem_u32(smem_raw) + 1023u) & ~1023u;
    auto sA = [&](int s) { return sB + kStripBBytes + s * kStripABytes; };
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
        TileJob tile{};
        tile.group = g;
        tile.row0 = p.offsets[g];
        tile.row_end = p.offsets[g + 1];
        tile.n0 = tn * kStripBN;
        tile.active = true;
        const int nk = (rows + kBK - 1) / kBK, steps = (tm1 - tm0) * nk;
        // Step s: row tile tm0 + s / nk, reduction block s % nk.
        auto load_a = [&](int s) {
            const int tm = tm0 + s / nk, kt = s % nk;
            load_mnmajor<kStripBM, 256>(sA(s % kAStages), p.A, tile.row0 + int64_t(kt) * kBK, tile.row_end, p.k,
                                        tm * kStripBM, p.k, tid);
        };
        for (int kt = 0; kt < nk; ++kt)  // the strip's B slab, in the first copy group with step 0's A
            load_mnmajor<kStripBN, 256>(sB + kt * (kStripBN * kBK * 2), p.B, tile.row0 + int64_t(kt) * kBK,
                                        tile.row_end, p.n, tile.n0, p.n, tid);
#pragma unroll
        for (int s = 0; s < kAhead; ++s) {
            if (s < steps) load_a(s);
            cp_async_commit();
        }
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.f;
        for (int s = 0; s < steps; ++s) {
            cp_async_wait<kAhead - 1>();
            fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async proxy
            __syncthreads();      // step s visible to all; both warpgroups retired their wgmmas of step s - 2
            const int kt = s % nk;
            const uint32_t a_s = sA(s % kAStages), b_s = sB + kt * (kStripBN * kBK * 2);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk)
                wgmma_m64n256k16<1, 1>(d, make_desc(a_s + wg * kBlockBytes + kk * 2048, kBlockBytes, 1024),
                                       make_desc(b_s + kk * 2048, kBlockBytes, 1024), 1);
            wgmma_commit();
            if (s + kAhead < steps) load_a(s + kAhead);  // its stage last held step s - 2
            cp_async_commit();
            wgmma_wait<1>();
            if (kt == nk - 1) {  // the row tile is complete: store it, start the next from zero
                wgmma_wait<0>();
                tile.m0 = (tm0 + s / nk) * kStripBM;
                const int row = wg * 64 + w * 16 + (lane >> 2);
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const int col = i * 8 + (lane & 3) * 2;
                    store_pair<Op::kTN>(p, tile, row, col, d[4 * i], d[4 * i + 1]);
                    store_pair<Op::kTN>(p, tile, row + 8, col, d[4 * i + 2], d[4 * i + 3]);
                    d[4 * i] = d[4 * i + 1] = d[4 * i + 2] = d[4 * i + 3] = 0.f;
                }
            }
        }
        if (nk == 0) {  // an empty group written (overwrite): zeros over the job's row tiles
            const int row = wg * 64 + w * 16 + (lane >> 2);
            for (int tm = tm0; tm < tm1; ++tm) {
                tile.m0 = tm * kStripBM;
                for (int i = 0; i < 32; ++i) {
                    store_pair<Op::kTN>(p, tile, row, i * 8 + (lane & 3) * 2, 0.f, 0.f);
                    store_pair<Op::kTN>(p, tile, row + 8, i * 8 + (lane & 3) * 2, 0.f, 0.f);
                }
            }
        }
        wgmma_wait<0>();
        cp_async_wait<0>();
        __syncthreads();  // the slab and the ring are free for the next job's copies
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
