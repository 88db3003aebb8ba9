// CUDA router (Megatron TopKRouter): gating linear in the router dtype R (float or double, cuBLAS),
// input jitter (router copy only), a warp-per-token pass for scores, group limit, expert bias,
// top-k (ties: lower expert index first), normalisation and scaling, Sinkhorn routing (one-CTA
// device loop, no host sync), capacity dropping/padding, and the backward through all of it.
// Loss statistics and values: src/cuda/losses.cuh. Twin: src/cpu/router.cpp. Test:
// tests/gpu/test_cuda_stages.cu.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/router_math.h"
#include "moekit/config.h"

namespace moekit::cuda {

enum class DropPolicy : int { probs = 0, position = 1 };

// Host bounds and switches of the router; every per-step count lives on the device.
struct RouterShape {
    int64_t num_tokens = 0;        // T = S * B
    int64_t seq_length = 0;        // S
    int64_t micro_batch_size = 1;  // B (token t belongs to sequence t % B)
    int64_t num_experts = 0;       // E
    int64_t hidden = 0;            // H
    int64_t topk = 0;              // k
    ScoreFunction score_function = ScoreFunction::softmax;
    bool pre_softmax = false;
    int64_t num_groups = 0;        // 0 = no group limit
    int64_t group_topk = 0;
    bool has_expert_bias = false;
    double scaling_factor = 1.0;
    double capacity_factor = -1;   // < 0 = dropless; capacity = get_capacity(valid tokens * k, E, cf) on device
    bool pad_to_capacity = false;
    DropPolicy drop_policy = DropPolicy::probs;
    double jitter_eps = 0;         // > 0: router input *= jitter_factor(seed, t*H+h, eps) (core/router_math.h)
    // The gating linear of an fp32 router on bf16 tensor cores (router.cu): the forward's operands are bf16 (exact
    // products, fp32 sums), the backward's fp32 gradient enters as three bf16 parts (core/bf16.h split_to_bf16x3).
    // false, jitter (an fp32 input) or an fp64 router: fp32 / fp64 cuBLAS GEMMs on upcast copies.
    bool tensor_core_linear = true;
    // Sinkhorn routing (§2.6): training selects the top-k of the fp32 Sinkhorn matrix; probs are
    // the activation (score_function = sigmoid if k == 1 else softmax, pre_softmax) at the picks;
    // no group limit, bias or scaling in the selection (from_config sets those fields so).
    bool sinkhorn = false;

    static RouterShape from_config(const MoeConfig& config, int64_t seq_length, int64_t micro_batch_size);
    bool dropless() const { return capacity_factor < 0; }
    // Rows the permutation can produce: T*k (dropless, drop) or E*min(capacity(T), T) (pad).
    int64_t max_rows() const;
    // Whether an R-typed router takes the tensor-core gating linear (then t.hidden_r / t.weight_r and the backward's
    // scratch are not used, and t.grad_logits_split / weight3 / grad_weight3 are).
    bool linear_on_tensor_cores(bool fp64) const { return tensor_core_linear && jitter_eps <= 0 && !fp64; }
    void validate() const;
    std::string to_string() const;
};

// Device views of the router's tensors (R = router dtype).
template <typename R>
struct RouterTensors {
    const __nv_bfloat16* hidden = nullptr;  // [T, H] bf16 layer input
    const __nv_bfloat16* weight = nullptr;  // [E, H] bf16 router.weight
    const R* expert_bias = nullptr;         // [E] (null without bias)
    const uint8_t* padding_mask = nullptr;  // [T] 1 = padding
    R* hidden_r = nullptr;                  // [T, H] input upcast to R (kept for dW)
    R* weight_r = nullptr;                  // [E, H] weight upcast to R
    R* logits = nullptr;                    // [T, E]
    int32_t* topk_idx = nullptr;            // [T, k] selected experts, best first (before dropping); -1 on padding
    R* probs = nullptr;                     // [T, E] dense, zero off the routing map (after dropping)
    uint8_t* routing_map = nullptr;         // [T, E] (after dropping / padding)
    const uint64_t* jitter_seed = nullptr;  // [1] seed of this step's jitter draws (device: graph replays read it)
    float* sinkhorn = nullptr;              // [T, E] fp32 Sinkhorn matrix (valid rows; needed with shape.sinkhorn)
    float* sinkhorn_d0 = nullptr;           // [T] row scaling of the Sinkhorn iteration
    // The tensor-core gating linear's backward (RouterShape::linear_on_tensor_cores):
    __nv_bfloat16* grad_logits_split = nullptr;  // [T, 3E] each row's grad logits as hi | mid | lo parts
    __nv_bfloat16* weight3 = nullptr;            // [3E, H] the weight three times (dX = split · weight3)
    float* grad_weight3 = nullptr;               // [3E, H] splitᵀ · x, summed over the three parts into dW
};

// Sinkhorn iteration limit (Megatron loops until converged; the CPU twin caps at the same count)
// and tolerance on mean |d1_old - d1|.
constexpr int kSinkhornMaxIterations = 100000;
constexpr double kSinkhornTolerance = 1e-4;

// logits = x_R · W_Rᵀ (cuBLAS in R; on bf16 tensor cores straight from x and W where
// shape.linear_on_tensor_cores), then scores/top-k/normalise/scale into probs and routing_map,
// then capacity dropping (if shape.capacity >= 0). x_R is jittered first when shape.jitter_eps > 0.
// training: Sinkhorn selection (shape.sinkhorn) runs only in training, as Megatron.
// Dynamic shared memory a block of the route kernel takes (each of its warps stages a token's scores): it grows
// with the expert count, and moe_layer.cu refuses a layer whose kernels would not fit the device.
size_t route_smem_bytes(const RouterShape& shape, bool fp64);

template <typename R>
void router_forward(const RouterShape& shape, const RouterTensors<R>& t, cublasHandle_t cublas, cudaStream_t stream,
                    bool training = true);

// grad_logits [T, E] = d(main loss)/d logits from grad_probs [T, E] (dense, zero off the map)
// through scaling, normalisation and the score function; the loss gradients are added by
// losses_backward (losses.cuh) afterwards.
template <typename R>
void router_backward_probs(const RouterShape& shape, const RouterTensors<R>& t, const R* grad_probs, R* grad_logits,
                           cudaStream_t stream);

// Gating linear backward: grad_weight [E, H] fp32 = grad_logitsᵀ · x_R (overwritten, or += when accumulate);
// grad_input [T, H] fp32 += (grad_logits · W_R) * jitter. scratch: [T, H] R (used when R = double
// or with jitter; may alias t.hidden_r: only dX is written there, after dW has read x_R). R = double:
// t.weight_r holds dW in between and W_R again on return (no GEMM writes a buffer it reads). Where
// shape.linear_on_tensor_cores: both products on bf16 tensor cores through t.grad_logits_split, t.weight3 and
// t.grad_weight3 (scratch, hidden_r and weight_r unused).
template <typename R>
void router_backward_linear(const RouterShape& shape, const RouterTensors<R>& t, const R* grad_logits,
                            float* grad_weight, float* grad_input, R* scratch, cublasHandle_t cublas,
                            cudaStream_t stream, bool accumulate = false);

}  // namespace moekit::cuda
