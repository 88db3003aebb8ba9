// CUDA activation forward/backward (see activation.cuh): one block per row, fp32 maths on the
// bf16 fc1 output, the scalar formulas of src/core/activation_math.h; d(prob) is a fixed-order
// block reduction, so it is bitwise reproducible.
#include <algorithm>

#include "cuda/activation.cuh"
#include "cuda/cuda_check.h"

namespace moekit::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float act_value(Activation a, bool gated, const __nv_bfloat16* row, int64_t F, int64_t f) {
    const float g = __bfloat162float(row[f]);
    return gated ? glu_forward(a, g, __bfloat162float(row[F + f])) : activation_forward(a, g);
}

template <typename R>
__global__ void activation_forward_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                          const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                          __nv_bfloat16* __restrict__ out) {
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        const R p = probs ? probs[r] : R(1);
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x)
            out[r * F + f] = __float2bfloat16(float(R(act_value(s.act, s.gated, row, F, f)) * p));
    }
}

template <typename R>
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
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
            const float go = __bfloat162float(grad_out[r * F + f]);
            const float g = __bfloat162float(row[f]);
            const float da = go * p;
            if (s.gated) {
                const float u = __bfloat162float(row[F + f]);
                float dg, du;
                glu_backward(s.act, g, u, da, &dg, &du);
                grow[f] = __float2bfloat16(dg);
                grow[F + f] = __float2bfloat16(du);
                dp += glu_forward(s.act, g, u) * go;
            } else {
                grow[f] = __float2bfloat16(da * activation_grad(s.act, g));
                dp += activation_forward(s.act, g) * go;
            }
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
    activation_forward_kernel<R><<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void activation_backward(const ActivationShape& s, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                         const R* probs, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_fc1, R* grad_probs,
                         cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>(s.max_rows, 1), 16384));
    activation_backward_kernel<R><<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, grad_out, grad_fc1,
                                                                 grad_probs);
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
