// Token permutation, CPU reference (see permute.h): routing plan, gather, deterministic combine.
#include "cpu/permute.h"

#include <algorithm>

#include "core/permute_math.h"
#include "cpu/parallel.h"
#include "moekit/error.h"

namespace moekit::cpu {

template <typename T>
RoutingPlan<T> build_routing_plan(const std::vector<uint8_t>& routing_map, const Matrix<T>& probs, int64_t num_tokens,
                                  int64_t num_experts) {
    MOEKIT_CHECK(int64_t(routing_map.size()) == num_tokens * num_experts, "routing_map has ", routing_map.size(),
                 " entries, expected [", num_tokens, ", ", num_experts, "]");
    MOEKIT_CHECK(probs.empty() || (probs.rows == num_tokens && probs.cols == num_experts), "probs is [", probs.rows,
                 ", ", probs.cols, "], expected [", num_tokens, ", ", num_experts, "]");
    RoutingPlan<T> plan;
    plan.num_tokens = num_tokens;
    plan.num_experts = num_experts;
    plan.tokens_per_expert.assign(size_t(num_experts), 0);
    plan.token_offsets.assign(size_t(num_tokens + 1), 0);
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t routed = 0;
        for (int64_t e = 0; e < num_experts; ++e) {
            if (routing_map[size_t(t * num_experts + e)]) {
                ++plan.tokens_per_expert[size_t(e)];
                ++routed;
            }
        }
        plan.token_offsets[size_t(t + 1)] = routed;
    }
    plan.offsets.assign(size_t(num_experts + 1), 0);
    const int64_t num_rows = exclusive_scan(plan.tokens_per_expert.data(), num_experts, plan.offsets.data());
    for (int64_t t = 0; t < num_tokens; ++t) plan.token_offsets[size_t(t + 1)] += plan.token_offsets[size_t(t)];

    plan.row_token.assign(size_t(num_rows), 0);
    plan.row_expert.assign(size_t(num_rows), 0);
    plan.permuted_probs.assign(size_t(num_rows), T(1));
    plan.token_rows.assign(size_t(num_rows), 0);
    // Token-ascending sweep: each expert's next free row is offsets[e] + tokens seen so far, and
    // each token's rows come out in ascending expert (= ascending row) order.
    std::vector<int64_t> seen(size_t(num_experts), 0);
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t slot = plan.token_offsets[size_t(t)];
        for (int64_t e = 0; e < num_experts; ++e) {
            if (!routing_map[size_t(t * num_experts + e)]) continue;
            const int64_t row = permuted_row(plan.offsets.data(), e, seen[size_t(e)]++);
            plan.row_token[size_t(row)] = t;
            plan.row_expert[size_t(row)] = e;
            if (!probs.empty()) plan.permuted_probs[size_t(row)] = probs(t, e);
            plan.token_rows[size_t(slot++)] = row;
        }
    }
    return plan;
}

template <typename T>
Matrix<T> permute(const Matrix<T>& tokens, const RoutingPlan<T>& plan) {
    MOEKIT_CHECK(tokens.rows == plan.num_tokens, "permute: tokens has ", tokens.rows, " rows, plan has ",
                 plan.num_tokens, " tokens");
    const int64_t hidden = tokens.cols;
    Matrix<T> rows(plan.num_rows(), hidden);
    parallel_for(plan.num_rows(), 256, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* src = tokens.row(plan.row_token[size_t(r)]);
            std::copy(src, src + hidden, rows.row(r));
        }
    });
    return rows;
}

template <typename T>
Matrix<T> unpermute(const Matrix<T>& rows, const RoutingPlan<T>& plan) {
    MOEKIT_CHECK(rows.rows == plan.num_rows(), "unpermute: rows has ", rows.rows, " rows, plan has ", plan.num_rows());
    const int64_t hidden = rows.cols;
    Matrix<T> out(plan.num_tokens, hidden);
    parallel_for(plan.num_tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            T* dst = out.row(t);
            for (int64_t i = plan.token_offsets[size_t(t)]; i < plan.token_offsets[size_t(t + 1)]; ++i) {
                const T* src = rows.row(plan.token_rows[size_t(i)]);
                for (int64_t h = 0; h < hidden; ++h) dst[h] += src[h];
            }
        }
    });
    return out;
}

template <typename T>
Matrix<T> permute_probs_backward(const std::vector<T>& grad_permuted_probs, const RoutingPlan<T>& plan) {
    MOEKIT_CHECK(int64_t(grad_permuted_probs.size()) == plan.num_rows(), "grad_permuted_probs has ",
                 grad_permuted_probs.size(), " entries, plan has ", plan.num_rows(), " rows");
    Matrix<T> grad(plan.num_tokens, plan.num_experts);
    for (int64_t r = 0; r < plan.num_rows(); ++r)
        grad(plan.row_token[size_t(r)], plan.row_expert[size_t(r)]) += grad_permuted_probs[size_t(r)];
    return grad;
}

#define MOEKIT_INSTANTIATE_PERMUTE(T)                                                                               \
    template RoutingPlan<T> build_routing_plan<T>(const std::vector<uint8_t>&, const Matrix<T>&, int64_t, int64_t); \
    template Matrix<T> permute<T>(const Matrix<T>&, const RoutingPlan<T>&);                                         \
    template Matrix<T> unpermute<T>(const Matrix<T>&, const RoutingPlan<T>&);                                       \
    template Matrix<T> permute_probs_backward<T>(const std::vector<T>&, const RoutingPlan<T>&);
MOEKIT_INSTANTIATE_PERMUTE(float)
MOEKIT_INSTANTIATE_PERMUTE(double)
#undef MOEKIT_INSTANTIATE_PERMUTE

}  // namespace moekit::cpu
