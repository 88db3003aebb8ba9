// EP dispatcher kernels (see dispatch_kernels.cuh): grid-stride loops, 16-byte vectors where rows allow.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/dispatch_kernels.cuh"

namespace moekit::cuda {
namespace {

constexpr int kThreads = 256;

// blockIdx.y strides over chunks, blockIdx.x over the chunk's vectors.
template <typename V>
__global__ void copy_row_chunks_kernel(const V* __restrict__ in, V* __restrict__ out, int64_t vecs_per_row,
                                       const RowChunk* __restrict__ chunks, int64_t num_chunks) {
    for (int64_t c = blockIdx.y; c < num_chunks; c += gridDim.y) {
        const RowChunk ch = chunks[c];
        const int64_t n = ch.rows * vecs_per_row;
        const V* src = in + ch.from * vecs_per_row;
        V* dst = out + ch.to * vecs_per_row;
        for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
            dst[i] = src[i];
    }
}

template <typename V>
void launch_copy(const void* in, void* out, int64_t row_bytes, const RowChunk* chunks, int64_t num_chunks,
                 cudaStream_t stream) {
    const dim3 grid(8, unsigned(std::min<int64_t>(num_chunks, 65535)));
    copy_row_chunks_kernel<V><<<grid, kThreads, 0, stream>>>(static_cast<const V*>(in), static_cast<V*>(out),
                                                             row_bytes / int64_t(sizeof(V)), chunks, num_chunks);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
__global__ void select_columns_kernel(const uint8_t* __restrict__ map_g, const R* __restrict__ probs_g, int64_t rows,
                                      int64_t E, int64_t first, int64_t L, uint8_t* __restrict__ map_l,
                                      R* __restrict__ probs_l) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * L; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = i / L, l = i % L;
        map_l[i] = map_g[t * E + first + l];
        probs_l[i] = probs_g[t * E + first + l];
    }
}

__global__ void combine_partial_kernel(const int32_t* __restrict__ token_offsets, const int32_t* __restrict__ token_rows,
                                       int64_t H, const __nv_bfloat16* __restrict__ rows, float* __restrict__ out) {
    const int64_t t = blockIdx.x;
    const int32_t lo = token_offsets[t], hi = token_offsets[t + 1];
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int32_t j = lo; j < hi; ++j) acc += __bfloat162float(rows[int64_t(token_rows[j]) * H + h]);
        out[t * H + h] = acc;
    }
}

__global__ void finish_combine_kernel(const float* __restrict__ sum, const __nv_bfloat16* __restrict__ shared_out,
                                      const float* __restrict__ gate, int64_t T, int64_t H,
                                      __nv_bfloat16* __restrict__ out) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H; i += int64_t(gridDim.x) * blockDim.x) {
        float v = sum[i];
        if (shared_out) v += __bfloat162float(shared_out[i]) * (gate ? gate[i / H] : 1.0f);
        out[i] = __float2bfloat16(v);
    }
}

template <typename R>
__global__ void place_blocks_kernel(const R* __restrict__ blocks, int64_t EP, int64_t T, int64_t L,
                                    R* __restrict__ grad_probs) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < EP * T * L; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t q = i / (T * L), t = (i / L) % T, l = i % L;
        grad_probs[t * EP * L + q * L + l] = blocks[i];
    }
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 8192)); }

}  // namespace

void copy_row_chunks(const void* in, void* out, int64_t row_bytes, const RowChunk* chunks, int64_t num_chunks,
                     cudaStream_t stream) {
    if (num_chunks == 0 || row_bytes == 0) return;
    const auto aligned = [&](size_t a) {
        return row_bytes % int64_t(a) == 0 && reinterpret_cast<uintptr_t>(in) % a == 0 &&
               reinterpret_cast<uintptr_t>(out) % a == 0;
    };
    if (aligned(16)) return launch_copy<uint4>(in, out, row_bytes, chunks, num_chunks, stream);
    if (aligned(8)) return launch_copy<uint2>(in, out, row_bytes, chunks, num_chunks, stream);
    if (aligned(4)) return launch_copy<uint32_t>(in, out, row_bytes, chunks, num_chunks, stream);
    if (aligned(2)) return launch_copy<uint16_t>(in, out, row_bytes, chunks, num_chunks, stream);
    launch_copy<uint8_t>(in, out, row_bytes, chunks, num_chunks, stream);
}

template <typename R>
void select_local_columns(const uint8_t* map_g, const R* probs_g, int64_t rows, int64_t E, int64_t first, int64_t L,
                          uint8_t* map_l, R* probs_l, cudaStream_t stream) {
    if (rows * L == 0) return;
    select_columns_kernel<R><<<grid_for(rows * L), kThreads, 0, stream>>>(map_g, probs_g, rows, E, first, L, map_l,
                                                                          probs_l);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void combine_partial(const RoutingPlan<R>& plan, int64_t H, const __nv_bfloat16* rows, float* out, cudaStream_t stream) {
    if (plan.num_tokens == 0) return;
    combine_partial_kernel<<<unsigned(plan.num_tokens), 128, 0, stream>>>(plan.token_offsets, plan.token_rows, H,
                                                                           rows, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void finish_combine(const float* sum, const __nv_bfloat16* shared_out, const float* gate, int64_t T, int64_t H,
                    __nv_bfloat16* out, cudaStream_t stream) {
    if (T * H == 0) return;
    finish_combine_kernel<<<grid_for(T * H), kThreads, 0, stream>>>(sum, shared_out, gate, T, H, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void place_column_blocks(const R* blocks, int64_t ep, int64_t T, int64_t L, R* grad_probs, cudaStream_t stream) {
    if (ep * T * L == 0) return;
    place_blocks_kernel<R><<<grid_for(ep * T * L), kThreads, 0, stream>>>(blocks, ep, T, L, grad_probs);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

#define MOEKIT_INSTANTIATE_DISPATCH_KERNELS(R)                                                                       \
    template void select_local_columns<R>(const uint8_t*, const R*, int64_t, int64_t, int64_t, int64_t, uint8_t*, R*, \
                                          cudaStream_t);                                                             \
    template void combine_partial<R>(const RoutingPlan<R>&, int64_t, const __nv_bfloat16*, float*, cudaStream_t);    \
    template void place_column_blocks<R>(const R*, int64_t, int64_t, int64_t, R*, cudaStream_t);
MOEKIT_INSTANTIATE_DISPATCH_KERNELS(float)
MOEKIT_INSTANTIATE_DISPATCH_KERNELS(double)

}  // namespace moekit::cuda
