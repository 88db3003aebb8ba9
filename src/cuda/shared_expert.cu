// CUDA shared expert (see shared_expert.cuh). GEMMs go through the expert GEMM backend with a single
// group {0, T}; the gate is a warp-per-token dot product in fp32; every reduction has a fixed order.
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/router_warp.cuh"
#include "cuda/shared_expert.cuh"

namespace moekit::cuda {

using namespace detail;

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void gate_forward_kernel(int64_t T, int64_t H, const __nv_bfloat16* __restrict__ x,
                                    const __nv_bfloat16* __restrict__ g, float* __restrict__ gate) {
    const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (t >= T) return;
    float z = 0.0f;
    for (int64_t h = lane; h < H; h += kWarp) z += __bfloat162float(x[t * H + h]) * __bfloat162float(g[h]);
    z = warp_sum(z);
    if (lane == 0) gate[t] = moekit::sigmoid(z);
}

// grad_out_gated = grad_out * gate; grad_gate_logit = gate (1 - gate) * <grad_out, y>.
__global__ void gate_backward_kernel(int64_t T, int64_t H, const __nv_bfloat16* __restrict__ grad_out,
                                     const __nv_bfloat16* __restrict__ y, const float* __restrict__ gate,
                                     __nv_bfloat16* __restrict__ grad_out_gated, float* __restrict__ grad_logit) {
    const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (t >= T) return;
    const float s = gate[t];
    float dot = 0.0f;
    for (int64_t h = lane; h < H; h += kWarp) {
        const float go = __bfloat162float(grad_out[t * H + h]);
        dot += go * __bfloat162float(y[t * H + h]);
        grad_out_gated[t * H + h] = __float2bfloat16(go * s);
    }
    dot = warp_sum(dot);
    if (lane == 0) grad_logit[t] = s * (1.0f - s) * dot;
}

// Gate weight gradient in two fixed-order passes: partial[c, h] = sum over chunk c of the tokens,
// then grad_gate[h] = sum over c (no atomics, so bitwise reproducible).
__global__ void gate_weight_partial_kernel(int64_t T, int64_t H, const float* __restrict__ grad_logit,
                                           const __nv_bfloat16* __restrict__ x, float* __restrict__ partial) {
    const int64_t h = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, c = blockIdx.y;
    if (h >= H) return;
    float acc = 0.0f;
    for (int64_t t = c * kGateChunk; t < min(T, (c + 1) * kGateChunk); ++t)
        acc += grad_logit[t] * __bfloat162float(x[t * H + h]);
    partial[c * H + h] = acc;
}

__global__ void gate_weight_reduce_kernel(int64_t chunks, int64_t H, const float* __restrict__ partial,
                                          float* __restrict__ grad_gate, bool accumulate) {
    const int64_t h = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (h >= H) return;
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * H + h];
    grad_gate[h] = accumulate ? grad_gate[h] + acc : acc;
}

__global__ void add_input_grad_kernel(int64_t T, int64_t H, const __nv_bfloat16* __restrict__ grad_x,
                                      const float* __restrict__ grad_logit, const __nv_bfloat16* __restrict__ g,
                                      float* __restrict__ grad_input) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H; i += int64_t(gridDim.x) * blockDim.x) {
        float v = __bfloat162float(grad_x[i]);
        if (grad_logit) v += grad_logit[i / H] * __bfloat162float(g[i % H]);
        grad_input[i] += v;
    }
}

}  // namespace

void shared_expert_forward(const SharedExpertShape& s, const SharedExpertTensors& t, const ExpertGemm& gemm,
                           cudaStream_t stream) {
    const int64_t T = s.num_tokens, H = s.hidden, F = s.ffn, F1 = s.fc1_rows();
    gemm.nt(GroupedGemmShape{1, T, F1, H}, t.x, t.fc1, t.fc1_out, t.offsets, stream);
    activation_forward<float>(ActivationShape{T, F, s.gated_linear_unit, s.act}, nullptr, t.fc1_out, nullptr,
                              t.act_out, stream);
    gemm.nt(GroupedGemmShape{1, T, H, F}, t.act_out, t.fc2, t.out, t.offsets, stream);
    if (s.has_gate) {
        gate_forward_kernel<<<int(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * kWarp, 0, stream>>>(T, H, t.x, t.gate,
                                                                                                    t.gate_value);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
}

void shared_expert_backward(const SharedExpertShape& s, const SharedExpertTensors& t, const ExpertGemm& gemm,
                            const __nv_bfloat16* grad_out, float* grad_input, cudaStream_t stream,
                            bool accumulate_grads) {
    const int64_t T = s.num_tokens, H = s.hidden, F = s.ffn, F1 = s.fc1_rows();
    const __nv_bfloat16* gy = grad_out;
    if (s.has_gate) {
        gate_backward_kernel<<<int(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * kWarp, 0, stream>>>(
            T, H, grad_out, t.out, t.gate_value, t.grad_out_gated, t.grad_gate_logit);
        MOEKIT_CUDA_LAUNCH_CHECK();
        const int64_t chunks = ceil_div(T, kGateChunk);
        gate_weight_partial_kernel<<<dim3(unsigned(ceil_div(H, 256)), unsigned(chunks)), 256, 0, stream>>>(
            T, H, t.grad_gate_logit, t.x, t.grad_gate_partial);
        MOEKIT_CUDA_LAUNCH_CHECK();
        gate_weight_reduce_kernel<<<int(ceil_div(H, 256)), 256, 0, stream>>>(chunks, H, t.grad_gate_partial,
                                                                             t.grad_gate, accumulate_grads);
        MOEKIT_CUDA_LAUNCH_CHECK();
        gy = t.grad_out_gated;
    }
    // fc2: d act = gy · W2 [H, F]; dW2 [H, F] = gyᵀ · act.
    gemm.nn(GroupedGemmShape{1, T, F, H}, gy, t.fc2, t.grad_act, t.offsets, stream);
    gemm.tn(GroupedGemmShape{1, T, F, H}, gy, t.act_out, t.grad_fc2, t.offsets, wgrad_write(accumulate_grads),
            stream);
    activation_backward<float>(ActivationShape{T, F, s.gated_linear_unit, s.act}, nullptr, t.fc1_out, nullptr,
                               t.grad_act, t.grad_fc1_out, nullptr, stream);
    // fc1: dx = d fc1_out · W1 [F1, H]; dW1 [F1, H] = d fc1_outᵀ · x.
    gemm.nn(GroupedGemmShape{1, T, H, F1}, t.grad_fc1_out, t.fc1, t.grad_x, t.offsets, stream);
    gemm.tn(GroupedGemmShape{1, T, H, F1}, t.grad_fc1_out, t.x, t.grad_fc1, t.offsets, wgrad_write(accumulate_grads),
            stream);
    const int grid = int(std::min<int64_t>(ceil_div(T * H, 256), 4096));
    add_input_grad_kernel<<<grid, 256, 0, stream>>>(T, H, t.grad_x, s.has_gate ? t.grad_gate_logit : nullptr, t.gate,
                                                    grad_input);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

}  // namespace moekit::cuda
