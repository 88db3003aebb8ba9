// Kernels of the EP dispatchers (src/cuda/dispatch_{allgather,alltoall}.cu): chunk reordering (Megatron's
// sort_chunks_by_idxs), the local experts' columns of gathered routing, per-token partial sums for the
// allgather combine and its finishing pass, and the placement of per-owner prob-grad blocks.
// Twins: src/cpu/dispatch_alltoall.cpp (sort_chunks), src/cpu/dispatch_allgather.cpp.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/permute.cuh"

namespace moekit::cuda {

// One chunk move: rows [from, from + rows) of `in` -> rows [to, to + rows) of `out`.
struct RowChunk {
    int64_t from = 0, to = 0, rows = 0;
};

// Moves every chunk (device table [chunks]) of rows of `row_bytes` bytes; chunks never overlap in `out`.
void copy_row_chunks(const void* in, void* out, int64_t row_bytes, const RowChunk* chunks, int64_t num_chunks,
                     cudaStream_t stream);

// map_l [rows, L] and probs_l [rows, L] = columns [first, first + L) of map_g / probs_g [rows, E].
template <typename R>
void select_local_columns(const uint8_t* map_g, const R* probs_g, int64_t rows, int64_t E, int64_t first, int64_t L,
                          uint8_t* map_l, R* probs_l, cudaStream_t stream);

// out [T, H] fp32 = sum of each token's rows in ascending row order (0 for a token with none).
template <typename R>
void combine_partial(const RoutingPlan<R>& plan, int64_t hidden, const __nv_bfloat16* rows, float* out,
                     cudaStream_t stream);

// out [T, H] bf16 = sum [T, H] + shared_out * gate (shared_out, gate optional).
void finish_combine(const float* sum, const __nv_bfloat16* shared_out, const float* shared_gate, int64_t tokens,
                    int64_t hidden, __nv_bfloat16* out, cudaStream_t stream);

// grad_probs [T, EP * L]: column block q = blocks [q][T][L] (the prob grads of owner q's experts).
template <typename R>
void place_column_blocks(const R* blocks, int64_t ep, int64_t tokens, int64_t L, R* grad_probs, cudaStream_t stream);

}  // namespace moekit::cuda
