// CUDA token permutation (Megatron permute/unpermute): routing_map [T, E] -> device RoutingPlan
// (per-expert counts and offsets, row -> token, token -> rows), gather of token rows into the
// expert-major layout and the gather-based (deterministic) backward. Row order: expert-major,
// token ascending inside an expert (src/core/permute_math.h). Twin: src/cpu/permute.cpp.
// Test: tests/gpu/test_cuda_stages.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/chunk_math.h"

namespace moekit::cuda {

// Everything lives on the device; only the bounds are host values.
template <typename R>
struct RoutingPlan {
    int64_t num_tokens = 0, num_experts = 0;
    int64_t max_rows = 0;             // static bound on offsets[E]
    int32_t* counts = nullptr;        // [E] rows per expert
    int32_t* offsets = nullptr;       // [E + 1] exclusive scan of counts
    int32_t* rank = nullptr;          // [T, E] rank of token t among the tokens routed to e (where map[t, e] only)
    int32_t* row_token = nullptr;     // [max_rows] source token of each row (first offsets[E] valid)
    R* row_prob = nullptr;            // [max_rows] permuted probs
    int32_t* token_offsets = nullptr; // [T + 1] token t owns token_rows[token_offsets[t], token_offsets[t+1])
    int32_t* token_rows = nullptr;    // [max_rows] rows of each token, ascending (= ascending expert)
    int32_t* token_counts = nullptr;  // [T] rows per token (scratch of the plan build)
    int32_t* chunk_scratch = nullptr; // [routing_plan_scratch_elems(T, E)] per-chunk counts (scratch of the plan build)
};

// The plan is built chunk by chunk (permute.cu), a block of kPlanThreads a chunk (four times that in the fill
// pass), each chunk's [chunk, E] slice of the map staged in shared memory with rows plan_tile_stride(E) bytes apart:
// a multiple of 16 (16-byte loads) with an odd count of 16-byte words (a warp's loads of 16 bytes from 8
// consecutive rows fall in distinct banks). The chunk is chunk_length(T, kPlanThreads) tokens (core/chunk_math.h),
// halved while the slice passes kPlanTileBytes (many experts).
constexpr int kPlanThreads = 128;
constexpr int64_t kPlanTileBytes = 32 * 1024, kPlanMaxSmem = 200 * 1024;
MOEKIT_HD constexpr int64_t plan_tile_stride(int64_t num_experts) {
    const int64_t words = (num_experts + 15) / 16;
    return 16 * (words % 2 == 1 ? words : words + 1);
}
// The fill pass's shared memory: two [E] int arrays, then the tile (16-byte aligned).
MOEKIT_HD constexpr int64_t plan_tile_offset(int64_t num_experts) { return (8 * num_experts + 15) / 16 * 16; }
MOEKIT_HD constexpr int64_t plan_chunk_tokens(int64_t num_tokens, int64_t num_experts) {
    int64_t c = chunk_length(num_tokens, kPlanThreads);
    while (c > 1 && c * plan_tile_stride(num_experts) > kPlanTileBytes) c /= 2;
    return c;
}
// The fill pass's shared memory a block (the launch opts in above 48 KB; past kPlanMaxSmem the plan is refused).
MOEKIT_HD constexpr int64_t plan_fill_smem_bytes(int64_t num_tokens, int64_t num_experts) {
    return plan_tile_offset(num_experts) + plan_chunk_tokens(num_tokens, num_experts) * plan_tile_stride(num_experts);
}
MOEKIT_HD constexpr int64_t plan_chunks(int64_t num_tokens, int64_t num_experts) {
    return ceil_div(num_tokens, plan_chunk_tokens(num_tokens, num_experts));
}
MOEKIT_HD constexpr int64_t routing_plan_scratch_elems(int64_t num_tokens, int64_t num_experts) {
    return plan_chunks(num_tokens, num_experts) * (num_experts + 1) + 1;
}

// routing_map [T, E], probs [T, E] -> plan.
template <typename R>
void build_routing_plan(const uint8_t* routing_map, const R* probs, const RoutingPlan<R>& plan, cudaStream_t stream);

// rows[r, :] = tokens[row_token[r], :] for r < min(offsets[E], max_rows), written token by token (each token row
// read once). tokens [T, H], rows [max_rows, H] bf16.
template <typename R>
void permute_rows(const RoutingPlan<R>& plan, int64_t hidden, const __nv_bfloat16* tokens, __nv_bfloat16* rows,
                  cudaStream_t stream);

// grad_tokens[t, :] (= or +=) sum of grad_rows over the rows of t, in ascending row order, fp32.
template <typename R>
void permute_rows_backward(const RoutingPlan<R>& plan, int64_t hidden, const __nv_bfloat16* grad_rows,
                           float* grad_tokens, bool accumulate, cudaStream_t stream);

// Dense grad_probs [T, E] (zero off the map) from per-row grads [max_rows].
template <typename R>
void scatter_row_probs_grad(const RoutingPlan<R>& plan, const uint8_t* routing_map, const R* grad_row_probs,
                            R* grad_probs, cudaStream_t stream);

}  // namespace moekit::cuda
