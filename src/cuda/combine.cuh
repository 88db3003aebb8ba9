// CUDA unpermute/combine: out[t] = sum of the expert rows of token t in ascending row order
// (fp32, one rounding to bf16) + the shared expert's output (times its gate). A gather, never a
// scatter-add, so it is bitwise deterministic. Backward: grad_rows[r] = grad_out[row_token[r]].
// Twin: src/cpu/permute.cpp (unpermute). Test: tests/gpu/test_cuda_stages.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/permute.cuh"

namespace moekit::cuda {

// rows [max_rows, H] bf16 -> out [T, H] bf16. shared_out [T, H] bf16 and shared_gate [T] fp32 are
// optional (null).
template <typename R>
void combine_forward(const RoutingPlan<R>& plan, int64_t hidden, const __nv_bfloat16* rows,
                     const __nv_bfloat16* shared_out, const float* shared_gate, __nv_bfloat16* out,
                     cudaStream_t stream);

// grad_rows [max_rows, H] = grad_out [T, H] gathered by row_token.
template <typename R>
void combine_backward(const RoutingPlan<R>& plan, int64_t hidden, const __nv_bfloat16* grad_out,
                      __nv_bfloat16* grad_rows, cudaStream_t stream);

}  // namespace moekit::cuda
