// Warp-level helpers of the CUDA router and loss kernels (one warp per token): reductions,
// the top-k order (value descending, ties: lower expert index first, NaN last, as the CPU reference) and
// the score functions. Internal to src/cuda/router.cu and src/cuda/losses.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/router_math.h"

namespace moekit::cuda::detail {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

template <typename R>
__device__ __forceinline__ R neg_inf() {
    return -R(INFINITY);
}

template <typename R>
__device__ __forceinline__ R warp_sum(R v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
    return v;
}
template <typename R>
__device__ __forceinline__ R warp_max(R v) {
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, off));
    return v;
}

// (v, i) precedes (w, j) in top-k order: the CPU's value_ranks_before (core/router_math.h), where a NaN
// ranks after every number, so a row holding NaNs still yields k valid, distinct experts.
template <typename R>
__device__ __forceinline__ bool before(R v, int i, R w, int j) {
    return value_ranks_before(v, i, w, j);
}

// The "nothing yet" candidate of a search: ranks after every real entry, NaNs included (a NaN with
// index INT32_MAX), so a row of NaNs still picks its lowest free index, never INT32_MAX.
template <typename R>
__device__ __forceinline__ R no_value() {
    return R(NAN);
}

// Warp-wide best (v, i) in top-k order; every lane gets the winner.
template <typename R>
__device__ __forceinline__ void warp_best(R& v, int& i) {
    for (int off = 16; off > 0; off >>= 1) {
        const R ov = __shfl_xor_sync(kFullMask, v, off);
        const int oi = __shfl_xor_sync(kFullMask, i, off);
        if (before(ov, oi, v, i)) v = ov, i = oi;
    }
}

// Best not-yet-taken entry of vals[0, n) (shared memory), marks it taken; returns its index (in
// [0, n) while an entry is free: callers take at most as many as are free).
template <typename R>
__device__ __forceinline__ int warp_take_best(const R* vals, uint8_t* taken, int n, int lane) {
    R best_v = no_value<R>();
    int best_i = INT32_MAX;
    for (int e = lane; e < n; e += kWarp)
        if (!taken[e] && before(vals[e], e, best_v, best_i)) best_v = vals[e], best_i = e;
    warp_best(best_v, best_i);
    __syncwarp();
    if (lane == 0 && best_i < n) taken[best_i] = 1;
    __syncwarp();
    return best_i;
}

// Top-k of vals[0, n) (shared memory, fp32, n <= 32 * kPer) in value_ranks_before's order, leaving out the entries
// flagged in `skip` (shared memory; null: none); lane j < k gets the j-th pick, the others -1. Each lane keeps its
// kPer entries' order keys (topk_order_key) in registers; a pick is the warp's largest key (one redux.sync) and
// the lowest index holding it (another), and the lane holding it clears it. The callers take at most as many
// picks as there are entries not skipped. The shared-memory walk (warp_take_best, k passes of shuffled
// comparisons) took 56 us of qwen3-30b's router forward (16384 tokens, 128 experts, k 8; ncu, H200, 2026-11-27).
template <int kPer>
__device__ __forceinline__ int warp_topk_fp32(const float* vals, const uint8_t* skip, int n, int k, int lane) {
    uint32_t key[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
        const int e = lane + q * kWarp;
        key[q] = e < n && !(skip && skip[e]) ? topk_order_key(vals[e]) : 0u;
    }
    int mine = -1;
    for (int j = 0; j < k; ++j) {
        uint32_t best = 0;
        int best_q = 0;
#pragma unroll
        for (int q = 0; q < kPer; ++q)
            if (key[q] > best) best = key[q], best_q = q;  // strict: the lowest index among equal keys
        const uint32_t top = __reduce_max_sync(kFullMask, best);
        const uint32_t pick = __reduce_min_sync(kFullMask, best == top ? uint32_t(lane + best_q * kWarp) : ~0u);
        if (lane == j) mine = int(pick);
#pragma unroll
        for (int q = 0; q < kPer; ++q)
            if (uint32_t(lane + q * kWarp) == pick) key[q] = 0u;
    }
    return mine;
}

// warp_topk_fp32 where it applies (fp32, at most 256 entries), else k passes of warp_take_best (marking `taken`,
// which must then be writable and start with the skipped entries flagged). Same picks either way.
template <typename R>
__device__ __forceinline__ int warp_topk(const R* vals, uint8_t* taken, int n, int k, int lane) {
    if constexpr (std::is_same_v<R, float>) {
        if (n <= 4 * kWarp) return warp_topk_fp32<4>(vals, taken, n, k, lane);
        if (n <= 8 * kWarp) return warp_topk_fp32<8>(vals, taken, n, k, lane);
    }
    int mine = -1;
    for (int j = 0; j < k; ++j) {
        const int i = warp_take_best(vals, taken, n, lane);
        if (lane == j) mine = i;
    }
    return mine;
}

// Row-wise log-sum-exp of l[0, n) (shared memory).
template <typename R>
__device__ __forceinline__ R warp_logsumexp(const R* l, int n, int lane) {
    R m = neg_inf<R>();
    for (int e = lane; e < n; e += kWarp) m = max(m, l[e]);
    m = warp_max(m);
    R s = 0;
    for (int e = lane; e < n; e += kWarp) s += exp(l[e] - m);
    return m + log(warp_sum(s));
}

// Score of one logit (fn = int(ScoreFunction)); softmax needs the row's log-sum-exp.
template <typename R>
__device__ __forceinline__ R score_of(int fn, R logit, R lse) {
    return fn == int(ScoreFunction::softmax) ? exp(logit - lse) : elementwise_score(ScoreFunction(fn), logit);
}
// d score / d logit for the elementwise score functions (sigmoid, sqrtsoftplus).
template <typename R>
__device__ __forceinline__ R score_grad(int fn, R logit) {
    return elementwise_score_grad(ScoreFunction(fn), logit);
}

}  // namespace moekit::cuda::detail
