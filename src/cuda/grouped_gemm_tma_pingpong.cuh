// wgrad (tn) on a ping-pong schedule: the TMA kernel's producer warp and ring (grouped_gemm_tma.cuh), but each
// consumer warpgroup owns a whole 128x128 tile (two wgmma m64n128k16 a k16 step) and the two take turns: while one
// runs its tile's main loop, the other stores its finished fp32 tile (tn_store_epilogue), so the gradient stores
// hide under math. The cooperative kernel's two warpgroups share a 128x256 tile and stop the tensor cores for its
// epilogue together (qwen3-30b fc1 wgrad: 1.79 ms there against CUTLASS ping-pong's 1.44, H200, docs/perf.md).
// Kept from the own kernel: every group is addressed through one tensor map a operand (CUTLASS's grouped scheduler
// rewrites its A, B and D maps whenever a CTA's next tile is in another group), with the rows past a group's end
// zeroed in shared memory by the warpgroup that consumes the stage.
// Measured (H200, 2026-11-28, docs/perf.md): faster than the cooperative kernel on every wgrad of qwen3-30b,
// dsv3-ep8 and mixtral (qwen3-30b fc1 1.55 vs 1.76 ms), so the own kernel's default; still 3-15 % behind CUTLASS's
// ping-pong, which the per-shape choice keeps.
// Included by grouped_gemm_kernels.cuh only, after grouped_gemm_tma.cuh.
#pragma once

namespace moekit::cuda::gemm_detail {

// kStages stages of A [64 k x 128 m] + B [64 k x 128 n] bf16 (32 KB), 1 KB for the 1024-byte alignment, 1 KB of
// mbarriers, and per consumer warpgroup kEpiBufs 8 KB fp32 staging buffers (tn_store_epilogue): 6 stages and two
// buffers, or 5 stages and four (a tile's eight chunks then wait on their stores' reads half as often; the
// epilogue must end within the other warpgroup's main loop, ~6 us at 1024 reduction rows).
constexpr int kPpStageBytes = 4 * kBlockBytes;
constexpr int pingpong_smem_bytes(int stages, int epi_bufs) {
    return stages * kPpStageBytes + 1024 + 1024 + 2 * epi_bufs * kEpiF32Bytes;
}
static_assert(pingpong_smem_bytes(6, 2) <= 232448 && pingpong_smem_bytes(5, 4) <= 232448,
              "the ping-pong wgrad's shared memory must fit an H100 / H200 SM");

// Tiles 128 x 128 (Params::tiles_m / tiles_n count them); one CTA per SM walks its jobs as tma_kernel does. Active
// job t of a CTA goes to consumer warpgroup t & 1. Order: a warpgroup starts the main loop of job t only once the
// other one has waited on every stage of job t - 1 (mbarrier turn[t & 1]), so the ring's stages are consumed in the
// producer's order. Without it a warpgroup could wait on a stage a whole phase ahead of the barrier and read its
// parity as done. (A template, as every kernel in these headers: one definition however many files include it.)
// kCluster 2: the CTA pair owns n-neighbour tiles of one group and m-slab (as tma_kernel's pairs), each CTA loads one
// half of the shared A tile and multicasts it to both (24 KB from L2 a tile and k-step instead of 32), and a stage
// is free once the consuming warpgroups of both CTAs released it.
// kBlocks3d (m and n multiples of 64): A and B come through 3-D tensor maps that view a [rows, m] operand as m / 64
// blocks of 64 columns ({64, rows, m / 64}, block stride 128 bytes), so one copy brings both 64-column blocks of a
// k-step (box {64, 64, 2}; with a cluster, A's half stays one 2-D box): two copies a k-step instead of four.
template <int kStages, int kEpiBufs, int kCluster, bool kBlocks3d>
__global__ void __launch_bounds__(384, 1)
    tma_wgrad_pingpong_kernel(Params p, const __grid_constant__ CUtensorMap map_a,
                              const __grid_constant__ CUtensorMap map_b, const __grid_constant__ CUtensorMap map_c,
                              const __grid_constant__ CUtensorMap map_2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int BM = 128, BN = 128;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t bars = base + kStages * kPpStageBytes;  // full[kStages], empty[kStages], turn[2]
    const uint32_t epi = bars + 1024;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (kStages + s); };
    auto turn = [&](int c) { return bars + 8 * (2 * kStages + c); };
    auto sA = [&](int s) { return base + s * kPpStageBytes; };
    auto sB = [&](int s) { return base + s * kPpStageBytes + 2 * kBlockBytes; };
    const int tid = threadIdx.x, wg = tid / 128;
    const int rank = kCluster > 1 ? int(cluster_ctarank()) : 0;
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);          // the producer's expect_tx
            mbar_init(empty(s), kCluster);  // the warpgroup that consumed the stage, in each CTA of the cluster
        }
        mbar_init(turn(0), 1);  // the other warpgroup's leader, once per job it finished waiting on
        mbar_init(turn(1), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    sync_cta_or_cluster<kCluster>();
    const int first = blockIdx.x / kCluster, stride = gridDim.x / kCluster;
    auto job_at = [&](int i, TileJob& job) {
        if (p.tn_hot_rows > 0) {
            job = tn_interleaved_job<BM, BN, kCluster>(p, first, stride, i, rank);
            return job.active;
        }
        const int pid = first + i * stride;
        if (pid >= p.total_tiles) return false;
        job = find_job_warp<Op::kTN, BM, BN, kCluster>(p, pid, rank);
        return true;
    };

    if (wg == 0) {  // producer: warp 0 finds the jobs, its lane 0 issues every copy
#ifndef MOEKIT_GEMM_NO_SETMAXNREG
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
#endif
        if (tid >= 32) return;
        // The ring position kept incrementally (RingPosition) and no box loops with run-time bounds: before, this
        // loop was the kernel's bottleneck (ncu, H200: 143 instructions a k-step on one thread, the consumers
        // waiting for data while no stage was ever full).
        RingPosition<kStages> ring;
        TileJob job;
        for (int i = 0; job_at(i, job); ++i) {
            if (!job.active) continue;
            if (tid == 0) {
                const int nk = num_ktiles<Op::kTN>(p, job), m0 = job.m0, n0 = job.n0;
                // Boxes past m (or n) would feed only rows that are never stored: not issued, not expected.
                const bool a2 = p.k - m0 > 64, b1 = n0 < p.n, b2 = p.n - n0 > 64;
                // A box reaching past m or n is zero-filled and still completes all its bytes.
                constexpr bool kA3d = kBlocks3d && kCluster == 1;
                const int a_blocks = kA3d || a2 ? 2 : 1, b_blocks = !b1 ? 0 : kBlocks3d || b2 ? 2 : 1;
                const uint32_t bytes = uint32_t(a_blocks + b_blocks) * kBlockBytes;
                int r0 = int(job.row0);
                for (int kt = 0; kt < nk; ++kt, r0 += kBK) {
                    const int s = ring.s;
                    const uint32_t fb = full(s), a = sA(s), b = sB(s);
                    ring.wait_free(empty(s));
                    mbar_expect_tx(fb, bytes);
                    if constexpr (kCluster > 1) {
                        if (rank == 0 || a2) tma_2d_mc(a + rank * kBlockBytes, &map_a, m0 + 64 * rank, r0, fb, 3);
                    } else if constexpr (kA3d) {
                        tma_3d(a, &map_a, 0, r0, m0 / 64, fb);
                    } else {
                        tma_2d(a, &map_a, m0, r0, fb);
                        if (a2) tma_2d(a + kBlockBytes, &map_a, m0 + 64, r0, fb);
                    }
                    if constexpr (kBlocks3d) {
                        if (b1) tma_3d(b, &map_b, 0, r0, n0 / 64, fb);
                    } else {
                        if (b1) tma_2d(b, &map_b, n0, r0, fb);
                        if (b2) tma_2d(b + kBlockBytes, &map_b, n0 + 64, r0, fb);
                    }
                    ring.advance();
                }
            }
            __syncwarp();
        }
        if constexpr (kCluster > 1) {
            if (tid == 0) drain_ring(ring, empty);
            __syncwarp();
        }
        return;
    }

#ifndef MOEKIT_GEMM_NO_SETMAXNREG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
#endif
    const int cw = wg - 1, ctid = tid & 127, bar = 2 + cw;
    const int w = ctid >> 5, lane = ctid & 31, r = w * 16 + (lane >> 2);
    const bool leader = ctid == 0;
    const uint32_t bufs = epi + cw * kEpiBufs * kEpiF32Bytes;
    auto release = [&](int s) { release_stage<kCluster>(empty(s)); };
    int s = 0, t = 0, issued = 0;  // the ring's stage and its round's parity ph, as the producer keeps them
    uint32_t ph = 0;
    float d0[64], d1[64];  // rows m0 .. m0+63 and m0+64 .. m0+127 of the tile
    TileJob job;
    for (int i = 0; job_at(i, job); ++i) {
        if (!job.active) continue;
        const int nk = num_ktiles<Op::kTN>(p, job);
        if ((t & 1) != cw) {  // the other warpgroup's job: its stages only move the ring on
            ph ^= ((s + nk) / kStages) & 1;
            s = (s + nk) % kStages;
            ++t;
            continue;
        }
        // The CTA's t-th job: wait until the other warpgroup waited on every stage of job t - 1.
        if (t > 0) mbar_wait(turn(cw), (t - 1 - (1 - cw)) / 2 & 1);
#pragma unroll
        for (int q = 0; q < 64; ++q) d0[q] = 0.f, d1[q] = 0.f;
        int prev = -1;  // the stage of the step before, released once its wgmmas retired
        for (int kt = 0; kt < nk; ++kt) {
            mbar_wait(full(s), ph);
            // Reduction rows at or past the group's end (the next group's, or past max_rows) must count as zero.
            const int valid = int(job.row_end - (job.row0 + int64_t(kt) * kBK));
            if (valid < kBK) {
                const int bad_rows = kBK - valid;
                for (int c = ctid; c < bad_rows * 4 * 8; c += 128) {
                    const int blk = c / (bad_rows * 8), rest = c % (bad_rows * 8);
                    const uint32_t dst = sA(s) + blk * kBlockBytes + (valid + rest / 8) * 128 + (rest % 8) * 16;
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
                }
                fence_proxy_async();
                named_barrier(bar, 128);
            }
            if (kt == nk - 1 && leader) mbar_arrive(turn(1 - cw));  // every stage of this job waited on
            const uint32_t a_s = sA(s), b_s = sB(s);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk) {
                const uint64_t db = make_desc(b_s + kk * 2048, kBlockBytes, 1024);
                wgmma_m64n128k16<1, 1>(d0, make_desc(a_s + kk * 2048, kBlockBytes, 1024), db, 1);
                wgmma_m64n128k16<1, 1>(d1, make_desc(a_s + kBlockBytes + kk * 2048, kBlockBytes, 1024), db, 1);
            }
            wgmma_commit();
            wgmma_wait<1>();  // the step before retired: hand its stage back to the producer(s)
            if (prev >= 0 && leader) release(prev);
            prev = s;
            if (++s == kStages) s = 0, ph ^= 1;
        }
        wgmma_wait<0>();
        if (prev >= 0 && leader) release(prev);
        if (nk == 0 && leader) mbar_arrive(turn(1 - cw));  // no stage to wait on: the next job may start
        ++t;
        // An empty group adds nothing to an accumulated gradient, and an overwrite_nonempty one is not written.
        if ((p.keep_empty || in_second(p, job.group)) && nk == 0) continue;
        tn_store_epilogue<64, kEpiBufs>(p, job, &map_c, &map_2, job.m0, bar, ctid, bufs, r, lane, d0, issued);
        tn_store_epilogue<64, kEpiBufs>(p, job, &map_c, &map_2, job.m0 + 64, bar, ctid, bufs, r, lane, d1, issued);
    }
    // The last bulk stores must have read their shared-memory source before the CTA (and its memory) ends.
    if (issued > 0 && leader) bulk_wait_all();
#endif
}

}  // namespace moekit::cuda::gemm_detail
