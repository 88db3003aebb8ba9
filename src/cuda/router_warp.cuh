// Warp-level helpers of the CUDA router and loss kernels (one warp per token): reductions,
// the top-k order (value descending, ties: lower expert index first, NaN last, as the CPU reference) and
// the score functions. Internal to src/cuda/router.cu and src/cuda/losses.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

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
