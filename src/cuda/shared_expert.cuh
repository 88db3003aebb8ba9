// CUDA shared expert (Megatron SharedExpertMLP): y = fc2(act(fc1(x))) * sigmoid(x · gate) per
// token (gate optional), forward and backward, through the expert GEMM backend with one group.
// x [T, H] bf16; fc1 [Fs*(2 if GLU), H], fc2 [H, Fs], gate [1, H] bf16. Twin: src/cpu/shared_expert.cpp.
// Test: tests/gpu/test_cuda_layer.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/activation.cuh"
#include "cuda/expert_gemm.h"

namespace moekit::cuda {

constexpr int64_t kGateChunk = 128;  // tokens per partial sum of the gate weight gradient

struct SharedExpertShape {
    int64_t num_tokens = 0, hidden = 0, ffn = 0;  // T, H, Fs
    bool gated_linear_unit = false, has_gate = false;
    Activation act = Activation::gelu;
    int64_t fc1_rows() const { return gated_linear_unit ? 2 * ffn : ffn; }
};

struct SharedExpertTensors {
    const int32_t* offsets = nullptr;      // [2] = {0, T} on the device (one group)
    const __nv_bfloat16* x = nullptr;      // [T, H]
    const __nv_bfloat16* fc1 = nullptr;    // [Fs1, H]
    const __nv_bfloat16* fc2 = nullptr;    // [H, Fs]
    const __nv_bfloat16* gate = nullptr;   // [H] (null without gate)
    __nv_bfloat16* fc1_out = nullptr;      // [T, Fs1]
    __nv_bfloat16* act_out = nullptr;      // [T, Fs]
    __nv_bfloat16* out = nullptr;          // [T, H] fc2 output before the gate
    float* gate_value = nullptr;           // [T] sigmoid(x · gate) (null without gate)
    // backward scratch and grads
    __nv_bfloat16* grad_out_gated = nullptr;  // [T, H]
    __nv_bfloat16* grad_act = nullptr;        // [T, Fs]
    __nv_bfloat16* grad_fc1_out = nullptr;    // [T, Fs1]
    __nv_bfloat16* grad_x = nullptr;          // [T, H]
    float* grad_gate_logit = nullptr;         // [T]
    float* grad_gate_partial = nullptr;       // [ceil(T / kGateChunk), H] per-chunk sums of the gate grad
    float* grad_fc1 = nullptr;                // [Fs1, H]
    float* grad_fc2 = nullptr;                // [H, Fs]
    float* grad_gate = nullptr;               // [H]
};

void shared_expert_forward(const SharedExpertShape& shape, const SharedExpertTensors& t, const ExpertGemm& gemm,
                           cudaStream_t stream);

// grad_input [T, H] fp32 += d/dx; parameter grads overwritten (or += when accumulate_grads).
void shared_expert_backward(const SharedExpertShape& shape, const SharedExpertTensors& t, const ExpertGemm& gemm,
                            const __nv_bfloat16* grad_out, float* grad_input, cudaStream_t stream,
                            bool accumulate_grads = false);

}  // namespace moekit::cuda
