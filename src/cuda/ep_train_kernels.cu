// Kernels of the CUDA EP training step (see ep_train_kernels.cuh).
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/ep_train_kernels.cuh"

namespace moekit::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_micro_batch_kernel(double* sums, const double* loss, const void* const* layer_losses,
                                       bool router_fp64, const int32_t* const* layer_counts, int64_t L, int64_t E) {
    if (threadIdx.x == 0) sums[0] += loss[0];
    for (int64_t i = threadIdx.x; i < 4 * L; i += blockDim.x) {
        const void* p = layer_losses[i / 4];
        sums[1 + i] += router_fp64 ? static_cast<const double*>(p)[i % 4] : double(static_cast<const float*>(p)[i % 4]);
    }
    for (int64_t i = threadIdx.x; i < L * E; i += blockDim.x) sums[1 + 4 * L + i] += double(layer_counts[i / E][i % E]);
}

__global__ void sum_rank_blocks_kernel(const double* in, int ranks, int64_t count, double* out) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
        double acc = in[i];
        for (int r = 1; r < ranks; ++r) acc += in[int64_t(r) * count + i];
        out[i] = acc;
    }
}

__global__ void finish_step_sums_kernel(const double* sums, int64_t L, int64_t E, double inv, double* means,
                                        int32_t* counts) {
    for (int64_t i = threadIdx.x; i < 1 + 4 * L; i += blockDim.x) means[i] = sums[i] * inv;
    for (int64_t i = threadIdx.x; i < L * E; i += blockDim.x) counts[i] = int32_t(sums[1 + 4 * L + i]);
}

__global__ void store_kernel(int64_t* p, int64_t v) { *p = v; }

__global__ void or_flags_kernel(const int32_t* gathered, int ranks, int32_t* flag) {
    int any = 0;
    for (int r = 0; r < ranks; ++r) any |= gathered[r] != 0;
    *flag = any;
}

}  // namespace

void add_micro_batch(double* sums, const double* loss, const void* const* layer_losses, bool router_fp64,
                     const int32_t* const* layer_counts, int64_t layers, int64_t experts, cudaStream_t stream) {
    add_micro_batch_kernel<<<1, kThreads, 0, stream>>>(sums, loss, layer_losses, router_fp64, layer_counts, layers,
                                                       experts);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void sum_rank_blocks(const double* in, int ranks, int64_t count, double* out, cudaStream_t stream) {
    const int blocks = int(std::min<int64_t>((count + kThreads - 1) / kThreads, 1024));
    sum_rank_blocks_kernel<<<std::max(blocks, 1), kThreads, 0, stream>>>(in, ranks, count, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void finish_step_sums(const double* sums, int64_t layers, int64_t experts, double inv_micro_batches, double* means,
                      int32_t* counts, cudaStream_t stream) {
    finish_step_sums_kernel<<<1, kThreads, 0, stream>>>(sums, layers, experts, inv_micro_batches, means, counts);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void store_i64(int64_t* p, int64_t value, cudaStream_t stream) {
    store_kernel<<<1, 1, 0, stream>>>(p, value);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void or_flags(const int32_t* gathered, int ranks, int32_t* flag, cudaStream_t stream) {
    or_flags_kernel<<<1, 1, 0, stream>>>(gathered, ranks, flag);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

}  // namespace moekit::cuda
