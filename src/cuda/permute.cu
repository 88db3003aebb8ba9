// CUDA permutation (see permute.cuh). The plan is built in four deterministic passes: per-expert
// ranks (block scan down each column), per-token counts, one-block scans for the expert and token
// offsets, and a per-token walk in ascending expert order that writes both index directions.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "core/hd.h"
#include "cuda/cuda_check.h"
#include "cuda/permute.cuh"

namespace moekit::cuda {

namespace {

constexpr int kScanThreads = 256;

// Block per expert e: rank[t, e] = #{t' < t : map[t', e]}; counts[e] = column sum.
__global__ void expert_rank_kernel(const uint8_t* __restrict__ map, int64_t T, int64_t E, int32_t* __restrict__ rank,
                                   int32_t* __restrict__ counts) {
    using Scan = cub::BlockScan<int, kScanThreads>;
    __shared__ typename Scan::TempStorage temp;
    const int64_t e = blockIdx.x;
    int running = 0;
    for (int64_t base = 0; base < T; base += kScanThreads) {
        const int64_t t = base + threadIdx.x;
        const int flag = t < T ? int(map[t * E + e]) : 0;
        int excl = 0, total = 0;
        Scan(temp).ExclusiveSum(flag, excl, total);
        if (t < T) rank[t * E + e] = running + excl;
        running += total;
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[e] = running;
}

__global__ void token_count_kernel(const uint8_t* __restrict__ map, int64_t T, int64_t E, int32_t* __restrict__ out) {
    const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (t >= T) return;
    int c = 0;
    for (int64_t e = 0; e < E; ++e) c += map[t * E + e];
    out[t] = c;
}

// Exclusive scan of in[0, n) into out[0, n] (out[n] = total), one block, chunk by chunk.
__device__ void block_exclusive_scan(const int32_t* in, int64_t n, int32_t* out) {
    using Scan = cub::BlockScan<int, kScanThreads>;
    __shared__ typename Scan::TempStorage temp;
    int running = 0;
    for (int64_t base = 0; base < n; base += kScanThreads) {
        const int64_t i = base + threadIdx.x;
        const int v = i < n ? in[i] : 0;
        int excl = 0, total = 0;
        Scan(temp).ExclusiveSum(v, excl, total);
        if (i < n) out[i] = running + excl;
        running += total;
        __syncthreads();
    }
    if (threadIdx.x == 0) out[n] = running;
}

// Expert offsets [E + 1] and token offsets [T + 1] in one launch.
__global__ void offsets_kernel(const int32_t* __restrict__ counts, int64_t E, int32_t* __restrict__ offsets,
                               const int32_t* __restrict__ token_counts, int64_t T,
                               int32_t* __restrict__ token_offsets) {
    block_exclusive_scan(counts, E, offsets);
    __syncthreads();
    block_exclusive_scan(token_counts, T, token_offsets);
}

template <typename R>
__global__ void fill_rows_kernel(const uint8_t* __restrict__ map, const R* __restrict__ probs, RoutingPlan<R> p) {
    const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (t >= p.num_tokens) return;
    const int64_t E = p.num_experts;
    int32_t j = p.token_offsets[t];
    for (int64_t e = 0; e < E; ++e) {
        if (!map[t * E + e]) continue;
        const int32_t row = p.offsets[e] + p.rank[t * E + e];
        p.token_rows[j++] = row;
        p.row_token[row] = int32_t(t);
        p.row_prob[row] = probs ? probs[t * E + e] : R(1);
    }
}

// Rows in 16-byte vectors when hidden % 8 == 0, else element by element.
template <typename V>
__global__ void permute_rows_kernel(const int32_t* __restrict__ offsets, int64_t E, const int32_t* __restrict__ row_token,
                                    int64_t vecs_per_row, int64_t max_rows, const V* __restrict__ tokens,
                                    V* __restrict__ rows) {
    const int64_t num_rows = offsets[E];
    for (int64_t r = blockIdx.x; r < num_rows && r < max_rows; r += gridDim.x) {
        const V* src = tokens + int64_t(row_token[r]) * vecs_per_row;
        V* dst = rows + r * vecs_per_row;
        for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) dst[i] = src[i];
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
    const int64_t T = p.num_tokens, E = p.num_experts;
    expert_rank_kernel<<<int(E), kScanThreads, 0, stream>>>(map, T, E, p.rank, p.counts);
    MOEKIT_CUDA_LAUNCH_CHECK();
    token_count_kernel<<<int(ceil_div(T, 256)), 256, 0, stream>>>(map, T, E, p.token_counts);
    MOEKIT_CUDA_LAUNCH_CHECK();
    offsets_kernel<<<1, kScanThreads, 0, stream>>>(p.counts, E, p.offsets, p.token_counts, T, p.token_offsets);
    MOEKIT_CUDA_LAUNCH_CHECK();
    fill_rows_kernel<R><<<int(ceil_div(T, 128)), 128, 0, stream>>>(map, probs, p);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void permute_rows(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* tokens, __nv_bfloat16* rows,
                  cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>(p.max_rows, 1), 8192));
    if (H % 8 == 0) {
        permute_rows_kernel<uint4><<<grid, 128, 0, stream>>>(p.offsets, p.num_experts, p.row_token, H / 8, p.max_rows,
                                                             reinterpret_cast<const uint4*>(tokens),
                                                             reinterpret_cast<uint4*>(rows));
    } else {
        permute_rows_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(p.offsets, p.num_experts, p.row_token, H,
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
