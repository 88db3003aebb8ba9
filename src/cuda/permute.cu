// CUDA permutation (see permute.cuh). The plan is built in three deterministic passes over chunks of
// plan_chunk_tokens(T, E) tokens, each chunk's [chunk, E] slice of the routing map staged in shared memory with one
// coalesced 16-byte load a thread at a time: (1) a block per chunk counts each expert's tokens in the chunk and each
// token's experts; (2) one block turns the per-chunk counts into per-chunk bases (a running sum down each expert's
// chunks, split into segments walked in parallel), the expert offsets and the chunks' token bases; (3) a block per
// chunk ranks its tokens inside each expert (a walk down each column of the staged slice, four threads a column,
// writing the ranks and the rows' probabilities), scans its token counts into token offsets and walks each token's
// experts in ascending order, writing both index directions. The walks read shared memory only: the global-memory
// walks before them (a thread an expert stepping down the chunk) ran at 2-3 % of the copy bandwidth (qwen3-30b:
// 200 us of plan against 240 us of row copies, ncu, H200, 2026-11-27).
// Same results as src/cpu/permute.cpp, integer-exact.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "core/hd.h"
#include "cuda/column_runs.cuh"
#include "cuda/cuda_check.h"
#include "cuda/permute.cuh"

namespace moekit::cuda {

namespace {

constexpr int kScanThreads = 1024;

// Exclusive scan of in[0, n) into out[0, n] (out[n] = total), one block of kScanThreads, slice by slice. In place
// (in == out) is fine: each thread reads its element before any thread writes it.
__device__ void block_exclusive_scan(const int32_t* in, int64_t n, int32_t* out) {
    using Scan = cub::BlockScan<int, kScanThreads>;
    __shared__ typename Scan::TempStorage temp;
    int running = 0;
    for (int64_t base = 0; base < n; base += kScanThreads) {
        const int64_t i = base + threadIdx.x;
        const int v = i < n ? in[i] : 0;
        int excl = 0, total = 0;
        Scan(temp).ExclusiveSum(v, excl, total);
        __syncthreads();  // every read of this slice is done before it is overwritten
        if (i < n) out[i] = running + excl;
        running += total;
    }
    if (threadIdx.x == 0) out[n] = running;
}

// The map's entries are 0 or 1: the routed experts of a token in 4 of them at once.
__device__ __forceinline__ int bytes_set(uint32_t w) { return int((w * 0x01010101u) >> 24); }

// Rows [t0, t0 + rows) of the [T, E] map into the shared tile (row stride plan_tile_stride(E)): 16 bytes a load
// where rows are 16-byte aligned in global memory, else a byte a load (both coalesced).
__device__ void stage_chunk(const uint8_t* __restrict__ map, int64_t t0, int rows, int64_t E, int64_t stride,
                            uint8_t* tile) {
    const uint8_t* src = map + t0 * E;
    if (E % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        const int64_t vecs = E / 16;
        for (int64_t i = threadIdx.x; i < rows * vecs; i += blockDim.x) {
            const int64_t r = i / vecs, v = i - r * vecs;
            *reinterpret_cast<uint4*>(tile + r * stride + v * 16) = reinterpret_cast<const uint4*>(src + r * E)[v];
        }
    } else {
        for (int64_t i = threadIdx.x; i < rows * E; i += blockDim.x) {
            const int64_t r = i / E;
            tile[r * stride + (i - r * E)] = src[i];
        }
    }
}

// Pass 1, block per chunk: per-(chunk, expert) counts, per-token counts and the chunk's token total.
__global__ void plan_count_kernel(const uint8_t* __restrict__ map, int64_t T, int64_t E, int64_t chunk,
                                  int32_t* __restrict__ chunk_counts, int32_t* __restrict__ token_counts,
                                  int32_t* __restrict__ chunk_tokens) {
    extern __shared__ __align__(16) uint8_t plan_smem[];
    const int64_t c = blockIdx.x, t0 = c * chunk, stride = plan_tile_stride(E);
    const int rows = int(min(T, t0 + chunk) - t0);
    stage_chunk(map, t0, rows, E, stride, plan_smem);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {  // a thread an expert, down the staged column
        int n = 0;
#pragma unroll 8
        for (int r = 0; r < rows; ++r) n += plan_smem[r * stride + e];
        chunk_counts[c * E + e] = n;
    }
    int n = 0;
    if (int(threadIdx.x) < rows) {  // a thread a token (chunk <= blockDim)
        const uint8_t* row = plan_smem + threadIdx.x * stride;
        int64_t e = 0;
        for (; e + 4 <= E; e += 4) n += bytes_set(*reinterpret_cast<const uint32_t*>(row + e));
        for (; e < E; ++e) n += row[e];
        token_counts[t0 + threadIdx.x] = n;
    }
    using Reduce = cub::BlockReduce<int, kPlanThreads>;
    __shared__ typename Reduce::TempStorage temp;
    const int total = Reduce(temp).Sum(n);
    if (threadIdx.x == 0) chunk_tokens[c] = total;
}

// Pass 2, one block: chunk_counts -> each chunk's base row inside its expert (in place), expert counts and
// offsets, chunk_tokens -> each chunk's first token row (in place; chunk_tokens[C] = the total). An expert's chunks
// are split into ColumnRuns: each thread sums its run, the run sums are scanned in shared memory, then each thread
// rewrites its run as running bases.
__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(int64_t C, int64_t E, int32_t* __restrict__ chunk_counts, int32_t* __restrict__ chunk_tokens,
                     int32_t* __restrict__ counts, int32_t* __restrict__ offsets) {
    __shared__ int32_t run_sum[kScanThreads];
    const ColumnRuns cr(E, kScanThreads, C, 32);
    for (int64_t e0 = 0; e0 < E; e0 += cr.width) {
        const int64_t e = e0 + cr.lane;
        const bool mine = cr.active() && e < E;
        int sum = 0;
        if (mine)
#pragma unroll 8
            for (int64_t c = cr.lo; c < cr.hi; ++c) sum += chunk_counts[c * E + e];
        if (cr.active()) run_sum[cr.slot(cr.part)] = sum;
        __syncthreads();
        if (mine) {
            int running = 0;
            for (int q = 0; q < cr.part; ++q) running += run_sum[cr.slot(q)];
            if (cr.part == cr.parts - 1) counts[e] = running + sum;
#pragma unroll 8
            for (int64_t c = cr.lo; c < cr.hi; ++c) {
                const int v = chunk_counts[c * E + e];
                chunk_counts[c * E + e] = running;
                running += v;
            }
        }
        __syncthreads();  // run_sum is read before the next round writes it; counts are written before the scan
    }
    block_exclusive_scan(counts, E, offsets);
    __syncthreads();
    block_exclusive_scan(chunk_tokens, C, chunk_tokens);
}

// Pass 3, block per chunk: the chunk's rows split into kFillSegments segments, a thread an (expert, segment): each
// counts the routed entries of its piece of the expert's column in the staged slice, then, from the counts of the
// segments above it, walks the piece: each routed entry's rank inside its expert (the chunk's base + its place in
// the chunk, which replaces the entry's 1 in the tile: a chunk has at most kPlanThreads tokens, so a byte holds it)
// and its row's probability. Then a thread a token: token offsets, and the token's rows in ascending expert order.
// The probabilities are read for whole rows of the piece, kProbRows rows in flight a thread (consecutive experts,
// so coalesced). Read inside the token walk instead (a load a routed entry behind a branch the warp's tokens
// diverge on) and with a thread walking a whole column, the pass took 34 us on qwen3-30b (ncu, H200).
constexpr int kProbRows = 16, kFillSegments = 4, kFillThreads = kPlanThreads * kFillSegments;

template <typename R>
__global__ void __launch_bounds__(kFillThreads)
    plan_fill_kernel(const uint8_t* __restrict__ map, const R* __restrict__ probs,
                     const int32_t* __restrict__ chunk_bases, const int32_t* __restrict__ chunk_tokens, int64_t chunk,
                     RoutingPlan<R> p) {
    extern __shared__ __align__(16) uint8_t plan_smem[];
    __shared__ int32_t segment_count[kFillSegments][kPlanThreads];
    const int64_t T = p.num_tokens, E = p.num_experts, c = blockIdx.x, t0 = c * chunk, stride = plan_tile_stride(E);
    const int rows = int(min(T, t0 + chunk) - t0);
    int32_t* base = reinterpret_cast<int32_t*>(plan_smem);  // [E] this chunk's first rank inside each expert
    int32_t* offset = base + E;                              // [E] the experts' first rows
    uint8_t* tile = plan_smem + plan_tile_offset(E);
    stage_chunk(map, t0, rows, E, stride, tile);
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) base[e] = chunk_bases[c * E + e], offset[e] = p.offsets[e];
    __syncthreads();
    int32_t* __restrict__ rank = p.rank;
    R* __restrict__ row_prob = p.row_prob;
    const int lane = int(threadIdx.x) % kPlanThreads, segment = int(threadIdx.x) / kPlanThreads;
    const int segment_rows = (rows + kFillSegments - 1) / kFillSegments;
    const int r_lo = min(rows, segment * segment_rows), r_hi = min(rows, r_lo + segment_rows);
    for (int64_t e0 = 0; e0 < E; e0 += kPlanThreads) {
        const int64_t e = e0 + lane;
        int n = 0;
        if (e < E)
            for (int r = r_lo; r < r_hi; ++r) n += tile[r * stride + e];
        segment_count[segment][lane] = n;
        __syncthreads();
        if (e < E) {
            int local = 0;
            for (int q = 0; q < segment; ++q) local += segment_count[q][lane];
            const int32_t b = base[e], o = offset[e];
            for (int r0 = r_lo; r0 < r_hi; r0 += kProbRows) {
                R prob[kProbRows];
#pragma unroll
                for (int i = 0; i < kProbRows; ++i)
                    prob[i] = probs && r0 + i < r_hi ? probs[(t0 + r0 + i) * E + e] : R(1);
#pragma unroll
                for (int i = 0; i < kProbRows; ++i) {
                    if (r0 + i >= r_hi) break;
                    uint8_t& v = tile[(r0 + i) * stride + e];
                    if (!v) continue;
                    v = uint8_t(++local);
                    const int32_t r = b + local - 1;
                    rank[(t0 + r0 + i) * E + e] = r;
                    row_prob[o + r] = prob[i];
                }
            }
        }
        __syncthreads();  // the counts are read before the next experts' overwrite them; the tile is complete
    }
    const bool mine = int(threadIdx.x) < rows;
    const int64_t t = t0 + threadIdx.x;
    const int n = mine ? p.token_counts[t] : 0;
    using Scan = cub::BlockScan<int, kFillThreads>;
    __shared__ typename Scan::TempStorage temp;
    int excl = 0, total = 0;
    Scan(temp).ExclusiveSum(n, excl, total);
    int32_t j = chunk_tokens[c] + excl;
    if (!mine) return;
    p.token_offsets[t] = j;
    if (t == T - 1) p.token_offsets[T] = j + n;
    const uint8_t* row = tile + threadIdx.x * stride;
    auto take = [&](int64_t e, int local) {
        const int32_t out = offset[e] + base[e] + local - 1;
        p.token_rows[j++] = out;
        p.row_token[out] = int32_t(t);
    };
    int64_t e = 0;
    for (; e + 16 <= E; e += 16) {  // 16 experts a load; most are not routed
        const uint4 v = *reinterpret_cast<const uint4*>(row + e);
        if ((v.x | v.y | v.z | v.w) == 0) continue;
        for (int i = 0; i < 16; ++i)
            if (row[e + i]) take(e + i, row[e + i]);
    }
    for (; e < E; ++e)
        if (row[e]) take(e, row[e]);
}

// Token by token (a block a token), in 16-byte vectors when hidden % 8 == 0, else element by element: each token
// row is read once and written to each of its rows. Walking the rows instead read a token once per row, and at
// qwen3-30b sizes (a 67 MB token matrix, 8 rows a token) the re-reads missed L2: 940 MB of DRAM traffic for 604 MB
// of data (ncu, H200, 2026-11-27).
template <typename V>
__global__ void permute_rows_kernel(const int32_t* __restrict__ token_offsets, const int32_t* __restrict__ token_rows,
                                    int64_t T, int64_t vecs_per_row, int64_t max_rows, const V* __restrict__ tokens,
                                    V* __restrict__ rows) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int32_t lo = token_offsets[t], hi = token_offsets[t + 1];
        if (lo == hi) continue;
        const V* src = tokens + t * vecs_per_row;
        for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
            const V v = src[i];
            for (int32_t j = lo; j < hi; ++j) {
                const int64_t r = token_rows[j];
                if (r < max_rows) rows[r * vecs_per_row + i] = v;
            }
        }
    }
}

// grad_tokens[t] (+)= sum over the rows of t, 8 columns per thread (H % 8 == 0) or one.
template <int kPer>
__global__ void permute_backward_kernel(const int32_t* __restrict__ token_offsets,
                                        const int32_t* __restrict__ token_rows, int64_t H,
                                        const __nv_bfloat16* __restrict__ grad_rows, float* __restrict__ grad_tokens,
                                        bool accumulate) {
    using V = std::conditional_t<kPer == 8, uint4, __nv_bfloat16>;
    const int64_t t = blockIdx.x, vecs = H / kPer;
    const int32_t lo = token_offsets[t], hi = token_offsets[t + 1];
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
        float acc[kPer];
        for (int k = 0; k < kPer; ++k) acc[k] = accumulate ? grad_tokens[t * H + i * kPer + k] : 0.0f;
        for (int32_t j = lo; j < hi; ++j) {
            const V v = reinterpret_cast<const V*>(grad_rows + int64_t(token_rows[j]) * H)[i];
            const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
            for (int k = 0; k < kPer; ++k) acc[k] += __bfloat162float(e[k]);
        }
        for (int k = 0; k < kPer; ++k) grad_tokens[t * H + i * kPer + k] = acc[k];
    }
}

template <typename R>
__global__ void scatter_probs_grad_kernel(RoutingPlan<R> p, const uint8_t* __restrict__ map,
                                          const R* __restrict__ grad_rows, R* __restrict__ grad_probs) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= p.num_tokens * p.num_experts) return;
    const int64_t e = i % p.num_experts;
    grad_probs[i] = map[i] ? grad_rows[p.offsets[e] + p.rank[i]] : R(0);
}

}  // namespace

template <typename R>
void build_routing_plan(const uint8_t* map, const R* probs, const RoutingPlan<R>& p, cudaStream_t stream) {
    const int64_t T = p.num_tokens, E = p.num_experts, C = plan_chunks(T, E), chunk = plan_chunk_tokens(T, E);
    MOEKIT_CHECK(p.chunk_scratch, "build_routing_plan: no chunk scratch (routing_plan_scratch_elems)");
    if (T == 0) {  // no chunks: the counts and offsets still exist
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * E, stream));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(p.offsets, 0, sizeof(int32_t) * (E + 1), stream));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(p.token_offsets, 0, sizeof(int32_t), stream));
        return;
    }
    const int64_t tile = chunk * plan_tile_stride(E), fill_smem = plan_fill_smem_bytes(T, E);
    // A usage error (exit 2): the expert count is the user's (--num-experts, or a rank's local experts).
    MOEKIT_REQUIRE(fill_smem <= kPlanMaxSmem, "--num-experts: the CUDA routing plan over ", E, " experts needs ",
                   fill_smem, " bytes of shared memory a block, more than its ", kPlanMaxSmem);
    if (fill_smem > 48 * 1024) {  // above the default limit of dynamic shared memory
        MOEKIT_CUDA_CHECK(
            cudaFuncSetAttribute(plan_fill_kernel<R>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(fill_smem)));
        MOEKIT_CUDA_CHECK(
            cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tile)));
    }
    int32_t* chunk_counts = p.chunk_scratch;          // [C, E]: counts, then bases
    int32_t* chunk_tokens = p.chunk_scratch + C * E;  // [C + 1]
    plan_count_kernel<<<unsigned(C), kPlanThreads, size_t(tile), stream>>>(map, T, E, chunk, chunk_counts,
                                                                           p.token_counts, chunk_tokens);
    MOEKIT_CUDA_LAUNCH_CHECK();
    plan_scan_kernel<<<1, kScanThreads, 0, stream>>>(C, E, chunk_counts, chunk_tokens, p.counts, p.offsets);
    MOEKIT_CUDA_LAUNCH_CHECK();
    plan_fill_kernel<R><<<unsigned(C), kFillThreads, size_t(fill_smem), stream>>>(map, probs, chunk_counts,
                                                                                  chunk_tokens, chunk, p);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void permute_rows(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* tokens, __nv_bfloat16* rows,
                  cudaStream_t stream) {
    if (p.num_tokens == 0) return;
    const int grid = int(std::min<int64_t>(p.num_tokens, 65535));
    if (H % 8 == 0) {
        permute_rows_kernel<uint4><<<grid, 128, 0, stream>>>(p.token_offsets, p.token_rows, p.num_tokens, H / 8,
                                                             p.max_rows, reinterpret_cast<const uint4*>(tokens),
                                                             reinterpret_cast<uint4*>(rows));
    } else {
        permute_rows_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(p.token_offsets, p.token_rows, p.num_tokens, H,
                                                                     p.max_rows, tokens, rows);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void permute_rows_backward(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* grad_rows, float* grad_tokens,
                           bool accumulate, cudaStream_t stream) {
    if (H % 8 == 0) {
        permute_backward_kernel<8><<<int(p.num_tokens), 128, 0, stream>>>(p.token_offsets, p.token_rows, H, grad_rows,
                                                                          grad_tokens, accumulate);
    } else {
        permute_backward_kernel<1><<<int(p.num_tokens), 256, 0, stream>>>(p.token_offsets, p.token_rows, H, grad_rows,
                                                                          grad_tokens, accumulate);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void scatter_row_probs_grad(const RoutingPlan<R>& p, const uint8_t* map, const R* grad_row_probs, R* grad_probs,
                            cudaStream_t stream) {
    const int64_t n = p.num_tokens * p.num_experts;
    scatter_probs_grad_kernel<R><<<int(ceil_div(n, 256)), 256, 0, stream>>>(p, map, grad_row_probs, grad_probs);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

#define MOEKIT_INSTANTIATE_PERMUTE(R)                                                                          \
    template void build_routing_plan<R>(const uint8_t*, const R*, const RoutingPlan<R>&, cudaStream_t);        \
    template void permute_rows<R>(const RoutingPlan<R>&, int64_t, const __nv_bfloat16*, __nv_bfloat16*,         \
                                  cudaStream_t);                                                               \
    template void permute_rows_backward<R>(const RoutingPlan<R>&, int64_t, const __nv_bfloat16*, float*, bool,  \
                                           cudaStream_t);                                                      \
    template void scatter_row_probs_grad<R>(const RoutingPlan<R>&, const uint8_t*, const R*, R*, cudaStream_t);
MOEKIT_INSTANTIATE_PERMUTE(float)
MOEKIT_INSTANTIATE_PERMUTE(double)

}  // namespace moekit::cuda
