// CUDA expert activation with the router probs (Megatron: act(fc1) * p before fc2, p in the
// router dtype, result cast to bf16) and its backward, which also yields d(prob) per row:
// dp = sum_f act[f] * grad[f]. fc1 rows [N, F*(2 if GLU)] bf16 = [gate | up]; out [N, F] bf16.
// Rows at or past offsets[G] (device) are skipped. Twin: src/cpu/experts.cpp. Test:
// tests/gpu/test_cuda_stages.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/activation_math.h"

namespace moekit::cuda {

struct ActivationShape {
    int64_t max_rows = 0;  // bound on the number of rows
    int64_t ffn = 0;       // F
    bool gated = false;    // GLU: fc1 rows hold [gate (F) | up (F)]
    Activation act = Activation::gelu;
};

// out[r, f] = bf16(act(fc1[r]) [f] * probs[r]) for r < *num_rows (probs null = 1).
template <typename R>
void activation_forward(const ActivationShape& shape, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                        const R* probs, __nv_bfloat16* out, cudaStream_t stream);

// grad_fc1 [N, F*(2 if GLU)] bf16 from grad_out [N, F]; grad_probs[r] = sum_f act * grad_out
// (skipped when grad_probs is null).
template <typename R>
void activation_backward(const ActivationShape& shape, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                         const R* probs, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_fc1, R* grad_probs,
                         cudaStream_t stream);

// grad_probs[r] = sum over t of partials[r * tiles + t], in t order, for r < *num_rows: the d(prob) of the fused
// dgrad + activation backward (grouped_gemm_nn_glu_backward), whose epilogue leaves one partial a column tile.
void activation_backward_probs_from_partials(int64_t max_rows, const int32_t* num_rows, const float* partials,
                                             int64_t tiles, float* grad_probs, cudaStream_t stream);

}  // namespace moekit::cuda
