// CUDA activation forward/backward (see activation.cuh): one block per row, 16-byte vectors when
// F % 8 == 0, fp32 maths on the
// bf16 fc1 output, the scalar formulas of src/core/activation_math.h; d(prob) is a fixed-order
// block reduction, so it is bitwise reproducible.
#include <algorithm>
#include <cstdlib>

#include "cuda/activation.cuh"
#include "cuda/cuda_check.h"

namespace moekit::cuda {

namespace {

constexpr int kThreads = 256;

// kPer columns per thread: 8, 4 or 2 (16-, 8-, 4-byte vectors, F % kPer == 0) or 1.
template <int kPer>
struct alignas(2 * kPer) Vec {
    __nv_bfloat16 v[kPer];
};

template <int kPer>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float* out) {
    const Vec<kPer> v = *reinterpret_cast<const Vec<kPer>*>(p);
    for (int i = 0; i < kPer; ++i) out[i] = __bfloat162float(v.v[i]);
}
template <int kPer>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float* in) {
    Vec<kPer> v;
    for (int i = 0; i < kPer; ++i) v.v[i] = __float2bfloat16(in[i]);
    *reinterpret_cast<Vec<kPer>*>(p) = v;
}

template <typename R, int kPer>
__global__ void activation_forward_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                          const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                          __nv_bfloat16* __restrict__ out) {
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        const R p = probs ? probs[r] : R(1);
        for (int64_t f = threadIdx.x * kPer; f < F; f += blockDim.x * kPer) {
            float g[kPer], u[kPer], a[kPer];
            load<kPer>(row + f, g);
            if (s.gated) load<kPer>(row + F + f, u);
            for (int i = 0; i < kPer; ++i)
                a[i] = float(R(s.gated ? glu_forward(s.act, g[i], u[i]) : activation_forward(s.act, g[i])) * p);
            store<kPer>(out + r * F + f, a);
        }
    }
}

template <typename R, int kPer>
__global__ void activation_backward_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                           const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                           const __nv_bfloat16* __restrict__ grad_out,
                                           __nv_bfloat16* __restrict__ grad_fc1, R* __restrict__ grad_probs) {
    __shared__ float red[kThreads];
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        __nv_bfloat16* grow = grad_fc1 + r * in_cols;
        const float p = probs ? float(probs[r]) : 1.0f;
        float dp = 0.0f;
        for (int64_t f = threadIdx.x * kPer; f < F; f += blockDim.x * kPer) {
            float go[kPer], g[kPer], u[kPer], dg[kPer], du[kPer];
            load<kPer>(grad_out + r * F + f, go);
            load<kPer>(row + f, g);
            if (s.gated) load<kPer>(row + F + f, u);
            for (int i = 0; i < kPer; ++i) {
                const float da = go[i] * p;
                if (s.gated) {
                    float a;
                    glu_backward_and_value(s.act, g[i], u[i], da, &dg[i], &du[i], &a);
                    dp += a * go[i];
                } else {
                    dg[i] = da * activation_grad(s.act, g[i]);
                    dp += activation_forward(s.act, g[i]) * go[i];
                }
            }
            store<kPer>(grow + f, dg);
            if (s.gated) store<kPer>(grow + F + f, du);
        }
        if (grad_probs) {
            red[threadIdx.x] = dp;
            __syncthreads();
            for (int w = kThreads / 2; w > 0; w >>= 1) {
                if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
                __syncthreads();
            }
            if (threadIdx.x == 0) grad_probs[r] = R(red[0]);
            __syncthreads();
        }
    }
}

}  // namespace

template <typename R>
void activation_forward(const ActivationShape& s, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                        const R* probs, __nv_bfloat16* out, cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>(s.max_rows, 1), 16384));
    if (s.ffn % 8 == 0) {
        activation_forward_kernel<R, 8><<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, out);
    } else {
        activation_forward_kernel<R, 1><<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, out);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void activation_backward(const ActivationShape& s, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                         const R* probs, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_fc1, R* grad_probs,
                         cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>(s.max_rows, 1), 16384));
    // Width of the backward's vectors (MOEKIT_ACT_BWD_VEC=1|2|4|8 forces one). H100, interleaved moekit bench:
    // mixtral 1.465 / 1.338 / 1.349 / 2.221 ms, dsv3-ep8 0.490 / 0.425 / 0.436 / 0.704 ms for 1 / 2 / 4 / 8 (scalar
    // loads move half a cache line per warp; 8-wide costs five 8-float arrays of registers per thread). Two or four
    // 2-wide vectors in flight per thread (all loads of a round before the first use) measured slower again: mixtral
    // 1.26 -> 1.68 / 1.63 ms, dsv3-ep8 0.41 -> 0.56 (H100, 2026-11-23, scripts/device_bench_ab.sh). Those ran the
    // GLU backward with three sigmoids an element; with one (glu_backward_and_value) the pass went mixtral 1.40 ->
    // 0.89 ms, dsv3-ep8 0.46 -> 0.30, qwen3-30b 0.75 -> 0.54 (H200, 2026-11-26).
    // With one sigmoid an element the pass leans on memory more: 4-wide where every thread of the row's block still
    // gets a vector (F >= 4 x 256), else 2-wide (H200, 2026-11-26: mixtral F 14336 0.74 / 0.89 / 0.78 ms for 4 / 2 /
    // 8; qwen3-30b F 768 0.53 ms 2-wide, 0.81 8-wide, where 8-wide leaves 160 of 256 threads idle).
    static const int forced = [] {
        const char* env = std::getenv("MOEKIT_ACT_BWD_VEC");
        const int v = env ? std::atoi(env) : 0;
        return v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
    }();
    const int vec = forced ? forced : s.ffn >= 4 * kThreads ? 4 : 2;
    const int width = s.ffn % vec == 0 ? vec : 1;
    auto launch = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, grad_out, grad_fc1, grad_probs);
    };
    if (width == 8) launch(activation_backward_kernel<R, 8>);
    else if (width == 4) launch(activation_backward_kernel<R, 4>);
    else if (width == 2) launch(activation_backward_kernel<R, 2>);
    else launch(activation_backward_kernel<R, 1>);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

namespace {
// One thread a row: the tiles' partials in tile order (fixed, so reproducible).
__global__ void probs_from_partials_kernel(int64_t max_rows, const int32_t* __restrict__ num_rows,
                                           const float* __restrict__ partials, int64_t tiles,
                                           float* __restrict__ grad_probs) {
    const int64_t n = num_rows ? min(int64_t(*num_rows), max_rows) : max_rows;
    for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n; r += int64_t(gridDim.x) * blockDim.x) {
        float s = 0.0f;
        for (int64_t t = 0; t < tiles; ++t) s += partials[r * tiles + t];
        grad_probs[r] = s;
    }
}
}  // namespace

void activation_backward_probs_from_partials(int64_t max_rows, const int32_t* num_rows, const float* partials,
                                             int64_t tiles, float* grad_probs, cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>((max_rows + kThreads - 1) / kThreads, 1), 4096));
    probs_from_partials_kernel<<<grid, kThreads, 0, stream>>>(max_rows, num_rows, partials, tiles, grad_probs);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

#define MOEKIT_INSTANTIATE_ACTIVATION(R)                                                                       \
    template void activation_forward<R>(const ActivationShape&, const int32_t*, const __nv_bfloat16*, const R*, \
                                        __nv_bfloat16*, cudaStream_t);                                         \
    template void activation_backward<R>(const ActivationShape&, const int32_t*, const __nv_bfloat16*, const R*, \
                                         const __nv_bfloat16*, __nv_bfloat16*, R*, cudaStream_t);
MOEKIT_INSTANTIATE_ACTIVATION(float)
MOEKIT_INSTANTIATE_ACTIVATION(double)

}  // namespace moekit::cuda
