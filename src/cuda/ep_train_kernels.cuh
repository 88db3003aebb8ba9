// Kernels of the CUDA data/expert-parallel training step (src/cuda/ep_train_engine.cu) beyond the single-GPU
// engine's (train_kernels.cuh, reused): per-micro-batch sums of the record's values, their rank-order sum after
// an all-gather over data-parallel ranks, and the OR of the ranks' non-finite flags. Fixed order everywhere: the
// same bits on every rank and transport. Twin: the sums of src/train/ep_engine.cpp. Tests: tests/gpu/test_cuda_train_ep.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::cuda {

// The record's sums of one step, in double: [loss, layer 0's 4 losses, layer 1's, ..., layer 0's E counts, ...].
constexpr int64_t step_sum_count(int64_t layers, int64_t experts) { return 1 + 4 * layers + layers * experts; }

// sums += this micro-batch's values: *loss, each layer's [4] losses (double if router_fp64, else float) and [E]
// i32 counts (device arrays of per-layer device pointers).
void add_micro_batch(double* sums, const double* loss, const void* const* layer_losses, bool router_fp64,
                     const int32_t* const* layer_counts, int64_t layers, int64_t experts, cudaStream_t stream);

// out[i] = sum over r = 0, 1, ... of in[r * count + i], in rank order (in: an all-gather of `ranks` blocks).
void sum_rank_blocks(const double* in, int ranks, int64_t count, double* out, cudaStream_t stream);

// From the step's summed values: means[0 .. 1 + 4·layers) = sums * inv_micro_batches (loss and losses, the mean
// over the global batch) and counts[l·E + e] = the summed counts (exact integers).
void finish_step_sums(const double* sums, int64_t layers, int64_t experts, double inv_micro_batches, double* means,
                      int32_t* counts, cudaStream_t stream);

// *p = value, in stream order (a micro-batch's jitter seed; the host value needs no lifetime).
void store_i64(int64_t* p, int64_t value, cudaStream_t stream);

// *flag = 1 if any of the `ranks` gathered flags is set (the step's non-finite verdict, the same on every rank).
void or_flags(const int32_t* gathered, int ranks, int32_t* flag, cudaStream_t stream);

}  // namespace moekit::cuda
