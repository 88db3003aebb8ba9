// Router maths for one token row (Megatron topk_routing_with_score_function), shared by the CPU
// reference (src/cpu/router.cpp) and the CUDA router kernels: score functions and derivatives,
// top-k with the tie-break "higher value first, then lower expert index" (NaN last), group-limited top-k,
// the selected experts' probs and their backward, and the input-jitter factor.
// Rows are E contiguous values of type T (float or double); tests: tests/cpu/test_router.cpp,
// tests/cpu/test_router_non_finite.cpp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/hd.h"
#include "core/rng.h"

namespace moekit {

enum class ScoreFunction : int { softmax = 0, sigmoid = 1, sqrtsoftplus = 2 };

// One overload set that works on host (std::) and device (CUDA's global math functions).
#if defined(__CUDA_ARCH__)
template <typename T>
MOEKIT_HD T rm_exp(T x) {
    return exp(x);
}
template <typename T>
MOEKIT_HD T rm_log(T x) {
    return log(x);
}
template <typename T>
MOEKIT_HD T rm_log1p(T x) {
    return log1p(x);
}
template <typename T>
MOEKIT_HD T rm_sqrt(T x) {
    return sqrt(x);
}
#else
template <typename T>
MOEKIT_HD T rm_exp(T x) {
    return std::exp(x);
}
template <typename T>
MOEKIT_HD T rm_log(T x) {
    return std::log(x);
}
template <typename T>
MOEKIT_HD T rm_log1p(T x) {
    return std::log1p(x);
}
template <typename T>
MOEKIT_HD T rm_sqrt(T x) {
    return std::sqrt(x);
}
#endif

// ---- scalar score functions and their derivatives (d score / d logit) ----

template <typename T>
MOEKIT_HD T score_sigmoid(T x) {
    return T(1) / (T(1) + rm_exp(-x));
}

template <typename T>
MOEKIT_HD T score_sigmoid_grad(T x) {
    T s = score_sigmoid(x);
    return s * (T(1) - s);
}

// torch.nn.functional.softplus (beta 1, threshold 20: linear above it).
template <typename T>
MOEKIT_HD T softplus(T x) {
    return x > T(20) ? x : rm_log1p(rm_exp(x));
}

template <typename T>
MOEKIT_HD T softplus_grad(T x) {
    return x > T(20) ? T(1) : score_sigmoid(x);
}

template <typename T>
MOEKIT_HD T sqrtsoftplus(T x) {
    return rm_sqrt(softplus(x));
}

template <typename T>
MOEKIT_HD T sqrtsoftplus_grad(T x) {
    return softplus_grad(x) / (T(2) * sqrtsoftplus(x));
}

// The element-wise score of sigmoid / sqrtsoftplus (softmax is a row function).
template <typename T>
MOEKIT_HD T elementwise_score(ScoreFunction f, T x) {
    return f == ScoreFunction::sigmoid ? score_sigmoid(x) : sqrtsoftplus(x);
}

template <typename T>
MOEKIT_HD T elementwise_score_grad(ScoreFunction f, T x) {
    return f == ScoreFunction::sigmoid ? score_sigmoid_grad(x) : sqrtsoftplus_grad(x);
}

// ---- softmax over a row (or over the entries idx[0..n) of a row when idx != nullptr) ----
// Forward and backward both evaluate softmax_at with the same stats, so the backward sees the
// forward's values bitwise.

template <typename T>
struct SoftmaxStats {
    T max, sum;
};

template <typename T>
MOEKIT_HD SoftmaxStats<T> softmax_stats(const T* x, int64_t n, const int64_t* idx = nullptr) {
    T m = x[idx ? idx[0] : 0];
    for (int64_t j = 1; j < n; ++j) m = x[idx ? idx[j] : j] > m ? x[idx ? idx[j] : j] : m;
    T s = T(0);
    for (int64_t j = 0; j < n; ++j) s += rm_exp(x[idx ? idx[j] : j] - m);
    return {m, s};
}

template <typename T>
MOEKIT_HD T softmax_at(T x, SoftmaxStats<T> st) {
    return rm_exp(x - st.max) / st.sum;
}

template <typename T>
MOEKIT_HD T logsumexp(SoftmaxStats<T> st) {
    return st.max + rm_log(st.sum);
}

// ---- top-k ordering ----
// (v, i) ranks before (w, j): larger value first, then lower index; a NaN ranks after every number
// (-inf included) and NaNs among themselves by index. `>` alone is no order once a NaN appears (a NaN
// neither beats nor loses), and a selection walking such a row found no next entry and returned
// index -1 (issue 11); with this rule every row is totally ordered, so a top-k always yields k valid,
// distinct indices. Shared by the CPU reference and the CUDA warp top-k (src/cuda/router_warp.cuh).
template <typename T, typename I>
MOEKIT_HD bool value_ranks_before(T v, I i, T w, I j) {
    const bool v_nan = v != v, w_nan = w != w;  // isnan without <cmath> on the device
    if (v_nan != w_nan) return w_nan;
    if (!v_nan && v != w) return v > w;
    return i < j;
}

// An fp32 value's place in value_ranks_before's order as an unsigned key, larger = earlier: numbers by value (-0
// as +0), every NaN below every number (-inf included) but above 0, the key of "no entry"; equal keys go to the lower
// index, as value_ranks_before. The CUDA top-k picks a warp's best entry with two integer reductions on it
// (router_warp.cuh) instead of shuffled comparisons. Test: tests/cpu/test_router.cpp.
MOEKIT_HD uint32_t topk_order_key(float v) {
    if (v != v) return 1u;
    if (v == 0.0f) v = 0.0f;
    uint32_t b = 0;
    memcpy(&b, &v, sizeof b);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Total order used by every selection: allowed entries first (a disallowed entry acts like
// -inf, as Megatron's masked_fill), then value_ranks_before.
template <typename T>
MOEKIT_HD bool ranks_before(const T* s, const uint8_t* allowed, int64_t a, int64_t b) {
    bool aa = !allowed || allowed[a], ab = !allowed || allowed[b];
    if (aa != ab) return aa;
    return value_ranks_before(s[a], a, s[b], b);
}

// Whether s[0..n) holds a value that is not finite (NaN or +-inf): the router counts such rows.
template <typename T>
MOEKIT_HD bool row_has_non_finite(const T* s, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (!(s[i] - s[i] == T(0))) return true;  // NaN - NaN and inf - inf are NaN
    return false;
}

// The best entry of s[0..n) strictly after `prev` in the order (prev < 0: the best overall).
// Needs no scratch, so a device thread can walk a row's ranking one step at a time.
template <typename T>
MOEKIT_HD int64_t next_ranked(const T* s, const uint8_t* allowed, int64_t n, int64_t prev) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
        if (prev >= 0 && !ranks_before(s, allowed, prev, i)) continue;
        if (best < 0 || ranks_before(s, allowed, i, best)) best = i;
    }
    return best;
}

// idx[0..k) = the k best entries in descending order (torch.topk sorted=True).
template <typename T>
MOEKIT_HD void topk_ordered(const T* s, const uint8_t* allowed, int64_t n, int64_t k, int64_t* idx) {
    int64_t prev = -1;
    for (int64_t j = 0; j < k; ++j) idx[j] = prev = next_ranked(s, allowed, n, prev);
}

// Group-limited routing: group score = sum of the top (k / group_topk) scores of each of the G
// groups; the group_topk best groups stay allowed. group_scores [G] and allowed [E] are scratch.
template <typename T>
MOEKIT_HD void group_limited_allowed(const T* s, int64_t E, int64_t G, int64_t group_topk, int64_t k, T* group_scores,
                                     uint8_t* allowed) {
    const int64_t per = E / G, m = k / group_topk;
    for (int64_t g = 0; g < G; ++g) {
        T sum = T(0);
        int64_t prev = -1;
        for (int64_t j = 0; j < m; ++j) {
            prev = next_ranked(s + g * per, static_cast<const uint8_t*>(nullptr), per, prev);
            sum += s[g * per + prev];
        }
        group_scores[g] = sum;
    }
    for (int64_t g = 0; g < G; ++g) {
        int64_t rank = 0;
        for (int64_t h = 0; h < G; ++h) rank += ranks_before(group_scores, static_cast<const uint8_t*>(nullptr), h, g);
        for (int64_t e = g * per; e < (g + 1) * per; ++e) allowed[e] = rank < group_topk;
    }
}

// ---- one row of topk_routing_with_score_function ----

struct RouteParams {
    ScoreFunction score = ScoreFunction::softmax;
    bool pre_softmax = false;
    int64_t num_experts = 0, topk = 1;
    int64_t num_groups = 0, group_topk = 0;  // 0 = not group-limited
    double scaling_factor = 0;               // 0 = none (Megatron: `if scaling_factor:`)
};

// Selected experts idx[0..k) of one row. bias [E] (nullable) shifts the selection of
// sigmoid/sqrtsoftplus only. Scratch: keys [E], group_scores [G], allowed [E].
template <typename T>
MOEKIT_HD void select_row(const RouteParams& p, const T* logits, const T* bias, T* keys, T* group_scores,
                          uint8_t* allowed, int64_t* idx) {
    const int64_t E = p.num_experts;
    if (p.score == ScoreFunction::softmax) {
        if (p.pre_softmax) {
            SoftmaxStats<T> st = softmax_stats(logits, E);
            for (int64_t e = 0; e < E; ++e) keys[e] = softmax_at(logits[e], st);
        } else {
            for (int64_t e = 0; e < E; ++e) keys[e] = logits[e];
        }
    } else {
        for (int64_t e = 0; e < E; ++e) keys[e] = elementwise_score(p.score, logits[e]) + (bias ? bias[e] : T(0));
    }
    const uint8_t* allow = nullptr;
    if (p.group_topk > 0) {
        group_limited_allowed(keys, E, p.num_groups, p.group_topk, p.topk, group_scores, allowed);
        allow = allowed;
    }
    topk_ordered(keys, allow, E, p.topk, idx);
}

// probs[0..k) of the selected experts: softmax over the k logits (post), the full softmax
// (pre, not renormalised), or the raw score normalised over the k (+1e-20) when k > 1; then
// times the scaling factor.
template <typename T>
MOEKIT_HD void row_probs(const RouteParams& p, const T* logits, const int64_t* idx, T* probs) {
    const int64_t E = p.num_experts, k = p.topk;
    if (p.score == ScoreFunction::softmax) {
        SoftmaxStats<T> st = p.pre_softmax ? softmax_stats(logits, E) : softmax_stats(logits, k, idx);
        for (int64_t j = 0; j < k; ++j) probs[j] = softmax_at(logits[idx[j]], st);
    } else {
        T sum = T(0);
        for (int64_t j = 0; j < k; ++j) sum += (probs[j] = elementwise_score(p.score, logits[idx[j]]));
        if (k > 1)
            for (int64_t j = 0; j < k; ++j) probs[j] = probs[j] / (sum + T(1e-20));
    }
    if (p.scaling_factor != 0)
        for (int64_t j = 0; j < k; ++j) probs[j] = probs[j] * T(p.scaling_factor);
}

// Backward of row_probs: grad [k] = d loss / d probs[j]; adds d loss / d logits into dlogits [E].
template <typename T>
MOEKIT_HD void row_probs_backward(const RouteParams& p, const T* logits, const int64_t* idx, const T* grad,
                                  T* dlogits) {
    const int64_t E = p.num_experts, k = p.topk;
    const T sf = p.scaling_factor != 0 ? T(p.scaling_factor) : T(1);
    if (p.score == ScoreFunction::softmax) {
        SoftmaxStats<T> st = p.pre_softmax ? softmax_stats(logits, E) : softmax_stats(logits, k, idx);
        T dot = T(0);  // sum_j g_j s_j over the selected entries (g is zero elsewhere)
        for (int64_t j = 0; j < k; ++j) dot += grad[j] * sf * softmax_at(logits[idx[j]], st);
        if (p.pre_softmax) {
            for (int64_t e = 0; e < E; ++e) dlogits[e] -= softmax_at(logits[e], st) * dot;
        } else {
            for (int64_t j = 0; j < k; ++j) dlogits[idx[j]] -= softmax_at(logits[idx[j]], st) * dot;
        }
        for (int64_t j = 0; j < k; ++j) dlogits[idx[j]] += softmax_at(logits[idx[j]], st) * grad[j] * sf;
    } else {
        T sum = T(0), dot = T(0);
        for (int64_t j = 0; j < k; ++j) {
            T v = elementwise_score(p.score, logits[idx[j]]);
            sum += v;
            dot += grad[j] * sf * v;
        }
        const T d = sum + T(1e-20);
        for (int64_t j = 0; j < k; ++j) {
            T gv = grad[j] * sf;
            if (k > 1) gv = gv / d - dot / (d * d);
            dlogits[idx[j]] += gv * elementwise_score_grad(p.score, logits[idx[j]]);
        }
    }
}

// ---- input jitter: x_router = x * U(1-eps, 1+eps), element `index` of the [T, H] input ----
constexpr uint64_t kJitterStream = 0x6a69747465720001ull;  // "jitter", stream 1

MOEKIT_HD double jitter_factor(uint64_t seed, uint64_t index, double eps) {
    return (1.0 - eps) + 2.0 * eps * uniform01(seed, kJitterStream, index);
}

// ---- --moe-router-force-load-balancing (Megatron's RandomSTE, benchmark only): logit `index` (t*E + e)
// of data-parallel rank `rank` is replaced by an N(0, 1) draw; the gradient passes straight through to
// the gating linear. Rank-specific like Megatron's, so ranks with the same seed draw different logits.
constexpr uint64_t kForceBalanceStream = 0x666f7263650000ull;  // "force" << 16: one stream per rank

MOEKIT_HD double force_balance_logit(uint64_t seed, uint64_t rank, uint64_t index) {
    return normal01(seed, kForceBalanceStream + rank, index);
}

}  // namespace moekit
