// Token permutation (Megatron moe_utils.permute/unpermute), CPU reference.
// routing_map [T, E] -> RoutingPlan: rows are expert-major, token index ascending inside an expert.
// permute = gather tokens [T, H] -> rows [N, H]; unpermute = scatter-add rows -> [T, H] (no probs:
// they were applied inside the experts). Shared maths: src/core/permute_math.h. Twin: src/cuda
// permute kernels. Test: tests/cpu/test_permute.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/tensor.h"

namespace moekit::cpu {

// Host routing plan of one forward; N = number of routed (token, expert) pairs = map.sum().
template <typename T>
struct RoutingPlan {
    int64_t num_tokens = 0, num_experts = 0;
    std::vector<int64_t> tokens_per_expert;  // [E] = routing_map.sum(0)
    std::vector<int64_t> offsets;            // [E + 1] exclusive scan of tokens_per_expert
    std::vector<int64_t> row_token;          // [N] source token of each permuted row
    std::vector<int64_t> row_expert;         // [N] expert of each permuted row
    std::vector<T> permuted_probs;           // [N] probs.T.masked_select(map.T)
    // Inverse view for a deterministic combine: token t owns rows token_rows[token_offsets[t] ..
    // token_offsets[t + 1]), in ascending row (= ascending expert) order.
    std::vector<int64_t> token_offsets;  // [T + 1]
    std::vector<int64_t> token_rows;     // [N]

    int64_t num_rows() const { return int64_t(row_token.size()); }
};

// routing_map [T, E] (0/1), probs [T, E] dense (may be empty: permuted_probs is then all ones).
template <typename T>
RoutingPlan<T> build_routing_plan(const std::vector<uint8_t>& routing_map, const Matrix<T>& probs, int64_t num_tokens,
                                  int64_t num_experts);

// rows[r] = tokens[row_token[r]]: [T, H] -> [N, H].
template <typename T>
Matrix<T> permute(const Matrix<T>& tokens, const RoutingPlan<T>& plan);

// out[t] = sum of rows[r] over the rows of t, in ascending row order: [N, H] -> [T, H]; tokens
// with no rows (padding, all experts dropped) get exact zeros.
template <typename T>
Matrix<T> unpermute(const Matrix<T>& rows, const RoutingPlan<T>& plan);

// Backward of permute (a gather) is a scatter-add of the row grads: [N, H] -> [T, H].
template <typename T>
Matrix<T> permute_backward(const Matrix<T>& grad_rows, const RoutingPlan<T>& plan) {
    return unpermute(grad_rows, plan);
}

// Backward of unpermute (a scatter-add) is a gather: [T, H] -> [N, H].
template <typename T>
Matrix<T> unpermute_backward(const Matrix<T>& grad_tokens, const RoutingPlan<T>& plan) {
    return permute(grad_tokens, plan);
}

// Backward of the probs permutation: grad_probs [T, E] (dense, zero off the map) from the
// grads of permuted_probs [N].
template <typename T>
Matrix<T> permute_probs_backward(const std::vector<T>& grad_permuted_probs, const RoutingPlan<T>& plan);

}  // namespace moekit::cpu
