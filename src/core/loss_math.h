// Router-loss and capacity maths shared by the CPU reference (src/cpu/losses.cpp, router.cpp) and
// the CUDA router kernels: the aux-loss scores of one row (softmax over E, or sigmoid/sqrtsoftplus
// renormalised over E) and their backward, the switch load-balancing factor, the z-loss of one row
// and its gradient, get_capacity and the expert-bias step. Tests: tests/cpu/test_losses.cpp.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/hd.h"
#include "core/router_math.h"

namespace moekit {

// compute_routing_scores_for_aux_loss, one row: scores [E] from logits [E].
template <typename T>
MOEKIT_HD void aux_scores_row(ScoreFunction f, const T* logits, int64_t E, T* scores) {
    if (f == ScoreFunction::softmax) {
        SoftmaxStats<T> st = softmax_stats(logits, E);
        for (int64_t e = 0; e < E; ++e) scores[e] = softmax_at(logits[e], st);
        return;
    }
    T sum = T(0);
    for (int64_t e = 0; e < E; ++e) sum += elementwise_score(f, logits[e]);
    for (int64_t e = 0; e < E; ++e) scores[e] = elementwise_score(f, logits[e]) / (sum + T(1e-20));
}

// Backward of aux_scores_row: grad [E] = d loss / d scores; adds d loss / d logits into dlogits.
template <typename T>
MOEKIT_HD void aux_scores_row_backward(ScoreFunction f, const T* logits, int64_t E, const T* grad, T* dlogits) {
    if (f == ScoreFunction::softmax) {
        SoftmaxStats<T> st = softmax_stats(logits, E);
        T dot = T(0);
        for (int64_t e = 0; e < E; ++e) dot += grad[e] * softmax_at(logits[e], st);
        for (int64_t e = 0; e < E; ++e) dlogits[e] += softmax_at(logits[e], st) * (grad[e] - dot);
        return;
    }
    // s_i = a_i / D, D = sum a + 1e-20: d/da_j = g_j / D - sum_i g_i a_i / D^2.
    T sum = T(0), dot = T(0);
    for (int64_t e = 0; e < E; ++e) {
        T a = elementwise_score(f, logits[e]);
        sum += a;
        dot += grad[e] * a;
    }
    const T d = sum + T(1e-20);
    for (int64_t e = 0; e < E; ++e) dlogits[e] += (grad[e] / d - dot / (d * d)) * elementwise_score_grad(f, logits[e]);
}

// switch_load_balancing_loss_func: loss = factor * sum_i (sum_x s_{x,i}) * tokens_i with
// factor = E * coeff / (k * T_tot^2); so d loss / d s_{x,i} = factor * tokens_i.
MOEKIT_HD double switch_loss_factor(double coeff, int64_t num_experts, int64_t topk, double total_tokens) {
    return double(num_experts) * coeff / (double(topk) * total_tokens * total_tokens);
}

// z-loss of one row is logsumexp(l)^2; d/dl_e = 2 lse softmax_e. `weight` = coeff / valid rows
// (times the injection scale in backward).
template <typename T>
MOEKIT_HD T z_loss_row(const T* logits, int64_t E) {
    T lse = logsumexp(softmax_stats(logits, E));
    return lse * lse;
}

template <typename T>
MOEKIT_HD void z_loss_row_backward(const T* logits, int64_t E, T weight, T* dlogits) {
    SoftmaxStats<T> st = softmax_stats(logits, E);
    const T c = weight * T(2) * logsumexp(st);
    for (int64_t e = 0; e < E; ++e) dlogits[e] += c * softmax_at(logits[e], st);
}

// Capacities at or above this mean "no limit": more rows than any tensor can hold (2^62).
constexpr int64_t kCapacitySaturated = int64_t(1) << 62;

// get_capacity(num_tokens, E, cf, min_capacity) = max(ceil(num_tokens / E * cf), min_capacity),
// evaluated in double in Megatron's order. A value beyond int64 (a huge factor such as 1e19; Python's
// int has no limit) saturates to kCapacitySaturated: casting it would be undefined and wrapped to a
// negative capacity that dropped every token (issue 11).
MOEKIT_HD int64_t capacity_of(int64_t num_tokens, int64_t num_experts, double capacity_factor, int64_t min_capacity) {
    const double x = (double(num_tokens) / double(num_experts)) * capacity_factor;
    if (!(x < double(kCapacitySaturated))) return kCapacitySaturated;  // also NaN
    int64_t c = int64_t(x);
    if (double(c) < x) ++c;  // ceil for x >= 0
    return c < min_capacity ? min_capacity : c;
}

// get_updated_expert_bias, one expert: bias + rate * sign(mean - count).
MOEKIT_HD double expert_bias_step(double bias, double count, double mean, double rate) {
    const double offset = mean - count;
    const double sign = offset > 0 ? 1.0 : (offset < 0 ? -1.0 : 0.0);
    return bias + sign * rate;
}

}  // namespace moekit
