// Device side of the grouped GEMMs (grouped_gemm.h): tile scheduling from device offsets, cp.async loaders into
// 128-byte-swizzled shared memory, and two compute cores over the same layout: mma.sync m16n8k16 (+ldmatrix) and
// Hopper wgmma m64n256k16 (descriptors on the same swizzled tiles). bf16 operands, fp32 accumulation.
// Host dispatch: grouped_gemm.cu; tests: tests/gpu/test_grouped_gemm.cu.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "core/activation_math.h"
#include "core/tile_interleave_math.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_wgmma.cuh"

namespace moekit::cuda {
// Which compute core grouped_gemm_* use. Default: kTma on sm_90 devices, mma.sync elsewhere; the environment
// variable MOEKIT_GEMM_KERNEL=mma|wgmma|tma overrides it, and tests/benchmarks set it explicitly.
// kWgmma: cp.async loads by all threads; kTma: warp-specialised TMA producer + 2 wgmma consumer warpgroups;
// kCutlass: CUTLASS's SM90 pointer-array grouped GEMM (grouped_gemm_cutlass.h; MOEKIT_GEMM_KERNEL=cutlass).
enum class GroupedGemmKernel { kAuto, kMmaSync, kWgmma, kTma, kCutlass };
void set_grouped_gemm_kernel(GroupedGemmKernel kernel);
// The kernel that will run on the current device; kAuto = chosen per call from the shape (Hopper with CUTLASS
// built: grouped_gemm.cu's choose_for_shape picks the own TMA kernel or a CUTLASS configuration).
GroupedGemmKernel grouped_gemm_kernel();
const char* grouped_gemm_kernel_name(GroupedGemmKernel kernel);  // "tma+wgmma", "cutlass", ... (benchmark tables)
// Cluster size of the kTma kernel: 2 (default: CTA pairs multicast their shared A tile) or 1 (one CTA per tile
// job, no cluster); 0 = the environment variable MOEKIT_GEMM_CLUSTER=1|2, else 2.
void set_grouped_gemm_cluster(int size);
// wgrad (tn) on the kTma kernel: groups of >= hot_rows rows (math-bound tiles) interleaved with the smaller ones
// (write-bound: each tile still stores its whole fp32 gradient tile) instead of walked in group order, so stores and
// math overlap on uneven groups (ECHO's ranks: docs/perf.md). 0 = group order; -1 (default) = the environment
// variable MOEKIT_WGRAD_HOT_ROWS=N, else 0. Off unless asked for: it removes the own kernel's skew penalty (ECHO's
// fc1 wgrad 6.39 ms vs 6.38 under forced balance, H200, 2026-11-26) but the own kernel's wgrad is slower than
// CUTLASS's in group order (5.2-5.4 ms there), which the per-shape choice takes.
void set_tn_interleave(int hot_rows);
// wgrad (tn) on the kTma kernel: 1 = the ping-pong schedule (tma_wgrad_pingpong_kernel: a 128x128 tile a consumer
// warpgroup, one warpgroup's gradient stores under the other's main loop), 0 = the cooperative 128x256 tile of
// tma_kernel; -1 (default) = the environment variable MOEKIT_TN_SCHEDULE=pingpong|cooperative, else ping-pong.
// Either runs on single CTAs or CTA pairs (set_grouped_gemm_cluster). The ping-pong needs the staged epilogue (a
// 16-byte aligned gradient); without it the cooperative kernel stores from registers.
void set_tn_pingpong(int on);
// The ping-pong wgrad's fp32 staging buffers a consumer warpgroup: 2 (with 6 ring stages) or 4 (with 5 stages: a
// tile's eight store chunks wait on their shared-memory reads half as often); -1 (default) = the environment variable
// MOEKIT_TN_PP_BUFFERS=2|4, else 2.
void set_tn_pingpong_buffers(int buffers);
}  // namespace moekit::cuda

namespace moekit::cuda::gemm_detail {

// NT: C[r] = A[r]·B[g]ᵀ (A K-major, B [n,k] K-major).  NN: C[r] = A[r]·B[g] (B [k,n] N-major).
// TN: C[g] = A_gᵀ·B_g (both row-indexed, reduction over the group's rows: A M-major, B N-major).
enum class Op { kNT, kNN, kTN };

constexpr int kBK = 64;            // reduction tile: one 128-byte swizzle row of bf16
constexpr int kBlockBytes = 8192;  // one [64 k-rows x 64 elements] MN-major block

struct Params {
    const __nv_bfloat16* A;
    const __nv_bfloat16* B;
    void* C;
    const int32_t* offsets;
    int G;
    int max_rows;
    int n;        // output columns
    int k;        // NT/NN: reduction length; TN: output rows per group (m)
    int tiles_m;  // NT/NN: static bound on row tiles; TN: ceil(m / BM)
    int tiles_n;
    // Groups [second_from, G) take their per-group operand (nt / nn: B; tn: C) from `second`, indexed from there
    // (GroupedGemmShape::second_from; 0 = none).
    int second_from;
    void* second;
    int accumulate;
    int keep_empty;  // TN: a group with no rows leaves its block as it is (WgradWrite accumulate, overwrite_nonempty)
    int total_tiles;  // persistent kernels: tiles walked by the grid (tile ids pid = blockIdx.x + i * gridDim.x)
    int staged_epilogue;  // TMA kernel: results leave through shared memory (nt/nn: bf16 full-line stores; tn: fp32
                          // bulk tensor stores / reduce-adds through map_c)
    int tn_hot_rows;      // TMA kernel, tn: > 0 = groups of >= this many rows interleaved with the others
                          // (tn_interleaved_job); 0 = the groups in order
    // TMA kernel, nn with the gated activation's backward in the epilogue (grouped_gemm_nn_glu_backward; glu_grad
    // non-null): C is not written; each bf16-rounded result dA[r, f] becomes glu_grad[r] = [d gate | d up] of
    // glu_in[r] = [gate | up] (rows 2n wide) with da = dA * glu_probs[r], and glu_dp[r * tiles_n + tile] gets the
    // tile's sum of act(gate) * up * dA (d prob), summed over the tiles afterwards in a fixed order.
    const __nv_bfloat16* glu_in;
    const float* glu_probs;  // null = 1
    __nv_bfloat16* glu_grad;
    float* glu_dp;           // null: d prob not wanted
    int glu_act;             // Activation
    // TMA kernel, nt with the gated activation's forward in the epilogue (grouped_gemm_nt_glu_forward; glu_out
    // non-null): n = 2F, B[g] = [gate rows | up rows]; a tile's 256 columns are gate columns f0 .. f0+127 and the up
    // columns F+f0 .. (two B boxes of 128 rows), C = [gate | up] as the plain nt writes it, and glu_out[r, f] =
    // act(gate) * up * glu_probs[r] of the bf16-rounded gate and up ([max_rows, F]).
    __nv_bfloat16* glu_out;
    // TMA kernel, the fused GLU forward on single CTAs (grouped_gemm_nt_glu_forward with a RowGather;
    // gather_row_token non-null): A's rows are not read from A but gathered from the unpermuted tokens, row r =
    // gather_tokens[gather_row_token[r]] ([T, k]), by the consumers' cp.async (gather_a_chunks); the CTAs of the first
    // column tile write the rows of their tiles to gather_copy ([max_rows, k], the permuted copy the wgrad reads;
    // null: not written).
    const __nv_bfloat16* gather_tokens;
    const int32_t* gather_row_token;
    __nv_bfloat16* gather_copy;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Byte offset of 16-byte chunk c of row r in a stage of 128-byte rows with the wgmma / TMA 128B swizzle.
__device__ __forceinline__ uint32_t swizzled_chunk(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) << 4)); }

// Tile [R rows][64 k] of a K-major matrix (row stride ld elements); rows >= row_end or k >= k_end are zero-filled.
// Layout: row r at r*128 bytes, 16-byte chunk c stored at chunk c ^ (r & 7) (the wgmma 128B swizzle).
template <int R, int kThreads>
__device__ __forceinline__ void load_kmajor(uint32_t dst, const __nv_bfloat16* base, int64_t row0, int64_t row_end,
                                            int64_t ld, int k0, int k_end, int tid) {
#pragma unroll
    for (int i = 0; i < R * 8 / kThreads; ++i) {
        int c = tid + i * kThreads;
        int r = c >> 3, ch = c & 7;
        int64_t grow = row0 + r;
        int gk = k0 + ch * 8;
        bool valid = grow < row_end && gk < k_end;
        const __nv_bfloat16* src = valid ? base + grow * ld + gk : base;
        cp_async16(dst + swizzled_chunk(r, ch), src, valid);
    }
}

// Tile [64 k-rows][E mn] of an MN-major matrix (row = reduction index, ld elements per row), stored as E/64 blocks
// of [64 rows x 128 bytes], same swizzle. Rows outside [row0, row_end) or columns >= mn_end are zero-filled.
template <int E, int kThreads>
__device__ __forceinline__ void load_mnmajor(uint32_t dst, const __nv_bfloat16* base, int64_t row0, int64_t row_end,
                                             int64_t ld, int mn0, int mn_end, int tid) {
    constexpr int kChunksPerRow = E / 8;
#pragma unroll
    for (int i = 0; i < 64 * kChunksPerRow / kThreads; ++i) {
        int c = tid + i * kThreads;
        int r = c / kChunksPerRow, mc = c % kChunksPerRow;
        int64_t grow = row0 + r;
        int gmn = mn0 + mc * 8;
        bool valid = grow < row_end && gmn < mn_end;
        const __nv_bfloat16* src = valid ? base + grow * ld + gmn : base;
        cp_async16(dst + (mc >> 3) * kBlockBytes + r * 128 + (((mc & 7) ^ (r & 7)) << 4), src, valid);
    }
}

// Which rows / columns / reduction range one CTA owns, resolved from the device offsets.
struct TileJob {
    int group;
    int64_t row0, row_end;  // NT/NN: output rows [row0, row_end); TN: reduction rows
    int m0, n0;             // TN: output tile origin inside C[g]; NT/NN: n0 only
    bool active;
};

// Raster the linear CTA id over (m-tile, n-tile) in bands of kBandM m-tiles so that one wave of CTAs reuses the
// same A rows and B columns from L2.
__device__ __forceinline__ void raster(int pid, int tiles_m, int tiles_n, int& pm, int& pn) {
    constexpr int kBandM = 8;
    int per_band = kBandM * tiles_n;
    int band = pid / per_band;
    int first_m = band * kBandM;
    int band_m = min(tiles_m - first_m, kBandM);
    int r = pid - band * per_band;
    pm = first_m + r % band_m;
    pn = r / band_m;
}

// NT/NN: the pm-th row tile over all groups (group g has ceil(count_g / BM) tiles, in group order). Warp 0 scans the
// offsets 32 groups at a time; the answer goes through shared memory.
template <int BM>
__device__ __forceinline__ TileJob find_row_tile(const Params& p, int pm, int pn, int BN, int* s_job) {
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        int before = 0;
        int found_g = -1, found_t = 0;
        for (int base = 0; base < p.G && found_g < 0; base += 32) {
            int g = base + lane;
            int tiles = 0;
            if (g < p.G) tiles = (p.offsets[g + 1] - p.offsets[g] + BM - 1) / BM;
            int incl = tiles;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                int v = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += v;
            }
            int lo = before + incl - tiles;
            unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && pm >= lo && pm < before + incl);
            if (hit) {
                int src = __ffs(hit) - 1;
                found_g = base + src;
                found_t = __shfl_sync(0xffffffffu, pm - lo, src);
            }
            before += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) {
            s_job[0] = found_g;
            s_job[1] = found_t;
        }
    }
    __syncthreads();
    TileJob job{};
    job.group = s_job[0];
    job.active = job.group >= 0;
    if (job.active) {
        job.row0 = int64_t(p.offsets[job.group]) + int64_t(s_job[1]) * BM;
        job.row_end = p.offsets[job.group + 1];
    }
    job.n0 = pn * BN;
    return job;
}

template <Op kOp, int BM, int BN>
__device__ __forceinline__ TileJob find_job(const Params& p, int* s_job) {
    int pid = blockIdx.x;
    if constexpr (kOp == Op::kTN) {
        int per_group = p.tiles_m * p.tiles_n;
        TileJob job{};
        job.group = pid / per_group;
        int pm, pn;
        raster(pid - job.group * per_group, p.tiles_m, p.tiles_n, pm, pn);
        job.m0 = pm * BM;
        job.n0 = pn * BN;
        job.row0 = p.offsets[job.group];
        job.row_end = p.offsets[job.group + 1];
        job.active = true;
        return job;
    } else {
        int pm, pn;
        raster(pid, p.tiles_m, p.tiles_n, pm, pn);
        return find_row_tile<BM>(p, pm, pn, BN, s_job);
    }
}

// The same job as find_job for tile `pid`, computed by one whole warp (every lane gets it; no shared memory, no
// block barrier), for the persistent TMA kernel whose warps walk the tiles on their own. kCluster 2: `pid` numbers
// pairs of n-neighbour tiles (n-tile 2q + rank), so both CTAs of a cluster get the same rows (or group and m-slab).
template <Op kOp, int BM, int BN, int kCluster = 1>
__device__ __forceinline__ TileJob find_job_warp(const Params& p, int pid, int rank = 0) {
    TileJob job{};
    int pm, pn;
    const int tiles_n = (p.tiles_n + kCluster - 1) / kCluster;
    if constexpr (kOp == Op::kTN) {
        const int per_group = p.tiles_m * tiles_n;
        job.group = pid / per_group;
        raster(pid - job.group * per_group, p.tiles_m, tiles_n, pm, pn);
        pn = pn * kCluster + rank;
        job.m0 = pm * BM;
        job.n0 = pn * BN;
        job.row0 = p.offsets[job.group];
        job.row_end = p.offsets[job.group + 1];
        job.active = true;
        return job;
    }
    raster(pid, p.tiles_m, tiles_n, pm, pn);
    pn = pn * kCluster + rank;
    const int lane = threadIdx.x & 31;
    int before = 0, found_g = -1, found_t = 0;
    for (int base = 0; base < p.G && found_g < 0; base += 32) {
        const int g = base + lane;
        const int tiles = g < p.G ? (p.offsets[g + 1] - p.offsets[g] + BM - 1) / BM : 0;
        int incl = tiles;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        const int lo = before + incl - tiles;
        const unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && pm >= lo && pm < before + incl);
        if (hit) {
            const int src = __ffs(hit) - 1;
            found_g = base + src;
            found_t = __shfl_sync(0xffffffffu, pm - lo, src);
        }
        before += __shfl_sync(0xffffffffu, incl, 31);
    }
    job.group = found_g;
    job.active = found_g >= 0;
    if (job.active) {
        job.row0 = int64_t(p.offsets[found_g]) + int64_t(found_t) * BM;
        job.row_end = p.offsets[found_g + 1];
    }
    job.n0 = pn * BN;
    return job;
}

// TN, hot/cold interleave: the i-th job of CTA (pair) `first` of `stride`, or inactive past its last. Groups of at
// least p.tn_hot_rows rows are "hot" (their tiles math-bound: long reductions), the others "cold" (each tile still
// writes its whole fp32 gradient tile: write-bound). Walking the groups in order, the whole GPU would be write-bound
// through the cold groups, then math-bound through the hot ones; here every CTA alternates between its share of the
// hot tiles and of the cold ones (core/tile_interleave_math.h), so at any time about half the GPU stores while the
// other half computes; one wave's tiles of a list stay neighbours (L2). Within a list: groups in order, raster inside.
template <int BM, int BN, int kCluster>
__device__ __forceinline__ TileJob tn_interleaved_job(const Params& p, int first, int stride, int i, int rank) {
    TileJob job{};
    const int tiles_n = (p.tiles_n + kCluster - 1) / kCluster, per_group = p.tiles_m * tiles_n;
    const int lane = threadIdx.x & 31;
    int hot_groups = 0;
    for (int base = 0; base < p.G; base += 32) {
        const int g = base + lane;
        const bool hot = g < p.G && p.offsets[g + 1] - p.offsets[g] >= p.tn_hot_rows;
        hot_groups += __popc(__ballot_sync(0xffffffffu, hot));
    }
    const InterleavedSlot slot =
        interleaved_slot(first, stride, i, hot_groups * per_group, (p.G - hot_groups) * per_group);
    if (!slot.valid) return job;  // inactive
    const bool hot = slot.list == 0;
    const int j = slot.tile;            // the j-th tile of the list
    const int ordinal = j / per_group;  // the ordinal-th group of the kind
    int seen = 0, found = -1;
    for (int base = 0; base < p.G && found < 0; base += 32) {
        const int g = base + lane;
        const bool kind = g < p.G && (p.offsets[g + 1] - p.offsets[g] >= p.tn_hot_rows) == hot;
        const unsigned mask = __ballot_sync(0xffffffffu, kind);
        const int count = __popc(mask);
        if (ordinal < seen + count) {
            unsigned m = mask;
            for (int skip = ordinal - seen; skip > 0; --skip) m &= m - 1;  // drop the lowest set bits
            found = base + __ffs(m) - 1;
        }
        seen += count;
    }
    if (found < 0) return job;  // (no such group: cannot happen with offsets that hold still)
    int pm, pn;
    raster(j - ordinal * per_group, p.tiles_m, tiles_n, pm, pn);
    job.group = found;
    job.m0 = pm * BM;
    job.n0 = (pn * kCluster + rank) * BN;
    job.row0 = p.offsets[found];
    job.row_end = p.offsets[found + 1];
    job.active = true;
    return job;
}

// Whether group g's per-group operand (nt / nn: B[g]; tn: C[g]) lies in the second base, and its index in its base.
__device__ __forceinline__ bool in_second(const Params& p, int g) { return in_second_base(p.second_from, g); }
__device__ __forceinline__ int local_group(const Params& p, int g) { return in_second(p, g) ? g - p.second_from : g; }

// Issue the cp.async copies of reduction tile kt for this CTA's job into one stage (A then B).
template <Op kOp, int BM, int BN, int kThreads>
__device__ __forceinline__ void load_stage(const Params& p, const TileJob& job, int kt, uint32_t sA, uint32_t sB,
                                           int tid) {
    if constexpr (kOp == Op::kTN) {
        int64_t r0 = job.row0 + int64_t(kt) * kBK;
        load_mnmajor<BM, kThreads>(sA, p.A, r0, job.row_end, p.k, job.m0, p.k, tid);
        load_mnmajor<BN, kThreads>(sB, p.B, r0, job.row_end, p.n, job.n0, p.n, tid);
    } else {
        int k0 = kt * kBK;
        load_kmajor<BM, kThreads>(sA, p.A, job.row0, job.row_end, p.k, k0, p.k, tid);
        const __nv_bfloat16* Bg = group_block(p.B, p.second, p.second_from, job.group, int64_t(p.n) * p.k);
        if constexpr (kOp == Op::kNT)
            load_kmajor<BN, kThreads>(sB, Bg, job.n0, p.n, p.k, k0, p.k, tid);
        else
            load_mnmajor<BN, kThreads>(sB, Bg, k0, p.k, p.n, job.n0, p.n, tid);
    }
}

template <Op kOp>
__device__ __forceinline__ int num_ktiles(const Params& p, const TileJob& job) {
    if constexpr (kOp == Op::kTN) return int((job.row_end - job.row0 + kBK - 1) / kBK);
    return (p.k + kBK - 1) / kBK;
}

// Store one accumulator pair (columns col, col+1 of row `row` within the tile). NT/NN: bf16 rows of the group;
// TN: fp32 C[g] with optional accumulation.
template <Op kOp>
__device__ __forceinline__ void store_pair(const Params& p, const TileJob& job, int row, int col, float v0, float v1) {
    if constexpr (kOp == Op::kTN) {
        int gm = job.m0 + row, gn = job.n0 + col;
        if (gm >= p.k || gn >= p.n || ((p.keep_empty || in_second(p, job.group)) && job.row_end == job.row0)) return;
        float* Cg = group_block(static_cast<float*>(p.C), p.second, p.second_from, job.group, int64_t(p.k) * p.n);
        float2* dst = reinterpret_cast<float2*>(Cg + int64_t(gm) * p.n + gn);
        if (p.accumulate) {
            float2 old = *dst;
            v0 += old.x;
            v1 += old.y;
        }
        *dst = make_float2(v0, v1);
    } else {
        int64_t gr = job.row0 + row;
        int gn = job.n0 + col;
        if (gr >= job.row_end || gn >= p.n) return;
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.C) + gr * p.n + gn) =
            __floats2bfloat162_rn(v0, v1);
    }
}

}  // namespace moekit::cuda::gemm_detail

#include "cuda/grouped_gemm_mma.cuh"
#include "cuda/grouped_gemm_tma.cuh"
#include "cuda/grouped_gemm_tma_pingpong.cuh"
