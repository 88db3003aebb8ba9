// CUDA combine (see combine.cuh): block per token, bf16x2 loads, fp32 sums in ascending row order.
#include "cuda/combine.cuh"
#include "cuda/cuda_check.h"

namespace moekit::cuda {

namespace {

__global__ void combine_kernel(const int32_t* __restrict__ token_offsets, const int32_t* __restrict__ token_rows,
                               int64_t H, const __nv_bfloat16* __restrict__ rows,
                               const __nv_bfloat16* __restrict__ shared_out, const float* __restrict__ shared_gate,
                               __nv_bfloat16* __restrict__ out) {
    const int64_t t = blockIdx.x;
    const int32_t lo = token_offsets[t], hi = token_offsets[t + 1];
    const float gate = shared_gate ? shared_gate[t] : 1.0f;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int32_t j = lo; j < hi; ++j) acc += __bfloat162float(rows[int64_t(token_rows[j]) * H + h]);
        if (shared_out) acc += __bfloat162float(shared_out[t * H + h]) * gate;
        out[t * H + h] = __float2bfloat16(acc);
    }
}

}  // namespace

template <typename R>
void combine_forward(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* rows, const __nv_bfloat16* shared_out,
                     const float* shared_gate, __nv_bfloat16* out, cudaStream_t stream) {
    combine_kernel<<<int(p.num_tokens), 256, 0, stream>>>(p.token_offsets, p.token_rows, H, rows, shared_out,
                                                           shared_gate, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void combine_backward(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_rows,
                      cudaStream_t stream) {
    permute_rows(p, H, grad_out, grad_rows, stream);
}

template void combine_forward<float>(const RoutingPlan<float>&, int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                                     const float*, __nv_bfloat16*, cudaStream_t);
template void combine_forward<double>(const RoutingPlan<double>&, int64_t, const __nv_bfloat16*,
                                      const __nv_bfloat16*, const float*, __nv_bfloat16*, cudaStream_t);
template void combine_backward<float>(const RoutingPlan<float>&, int64_t, const __nv_bfloat16*, __nv_bfloat16*,
                                      cudaStream_t);
template void combine_backward<double>(const RoutingPlan<double>&, int64_t, const __nv_bfloat16*, __nv_bfloat16*,
                                       cudaStream_t);

}  // namespace moekit::cuda
