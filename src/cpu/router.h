// CPU reference router (Megatron TopKRouter + losses + capacity dropping), forward and backward.
// Input hidden [T, H]; outputs dense probs [T, E] and routing_map [T, E]. Twin: src/cuda/router.cu.
// Tests: tests/cpu/test_router.cpp, tests/cpu/test_losses.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/comm.h"
#include "moekit/config.h"
#include "moekit/layer.h"
#include "moekit/tensor.h"

namespace moekit::cpu {

// Router buffers that persist across steps (Megatron names).
struct RouterState {
    std::vector<double> local_tokens_per_expert;   // [E] expert-bias counts (valid tokens, post-drop map)
    std::vector<double> global_tokens_per_expert;  // [E] global_aux_loss running sum
    int64_t ga_steps = 0;
};

// Forward outputs plus everything the backward needs.
template <typename T>
struct RouterContext {
    // ---- outputs ----
    Matrix<T> probs;                         // [T, E] dense, zero outside routing_map
    std::vector<uint8_t> routing_map;        // [T, E]
    std::vector<int64_t> tokens_per_expert;  // [E] = routing_map.sum(0)
    LossValues losses;                       // attached values (coefficients included)
    // ---- saved for backward (owned by router.cpp) ----
    Matrix<T> router_input;                  // [T, H] jittered copy of hidden (or hidden)
    Matrix<T> jitter;                        // [T, H] multiplicative noise (empty without jitter)
    Matrix<T> logits;                        // [T, E]
    std::vector<uint8_t> padding_mask;       // [T] (empty = none)
    int64_t seq_length = 0, micro_batch_size = 1;
    bool training = true;
    std::vector<int64_t> topk_idx;           // [T, k] selected experts, before dropping
    std::vector<uint8_t> keep_mask;          // [T, E] capacity mask (empty when dropless)
    std::vector<double> global_avg_tokens;   // [E] avg used by global_aux_loss in this forward
    std::vector<double> aux_score_grad;      // [B*E] d(aux losses)/d aux scores[s*B+b, e] (empty = none)
    double z_loss_weight = 0;                // d z-loss / d lse(row)^2 = coeff / valid rows (0 = none)
    int64_t valid_tokens = 0;                // rows with padding_mask 0
    int64_t capacity = -1;                   // expert capacity (-1 when dropless)
    // Valid rows whose logits hold a NaN or +-inf (overflowing input or weights): they are still routed
    // to k valid experts (NaN ranks last, core/router_math.h), but their probs are not numbers.
    int64_t non_finite_rows = 0;
};

// Megatron TopKRouter.forward: jitter, gating linear, z-loss, score function + top-k (or
// sinkhorn), capacity dropping, aux losses, expert-bias counts (into `state`).
// [moekit] choices (router.cpp): all maths in T (moe_router_dtype is the caller's choice of T);
// top-k ties go to the lower expert index; jitter element t*H+h is jitter_factor(jitter_seed,
// t*H+h, eps) (core/router_math.h); padded rows get no experts and no gradient, and capacity,
// Sinkhorn, losses and counts see only the valid rows, so a masked run equals a run on the valid
// rows alone; capacity policy "position" keeps the first routed tokens by index, and pad-to-capacity
// fills with the lowest-index unrouted valid tokens (prob 0).
// `dp`: the data-parallel group global_aux_loss reduces its token counts over (nullptr = one rank).
template <typename T>
void router_forward(const MoeConfig& config, const Matrix<T>& router_weight, const std::vector<double>& expert_bias,
                    const LayerInput<T>& input, RouterState& state, RouterContext<T>& ctx, Communicator* dp = nullptr);

// Backward from grad_probs [T, E] (d main loss / d dense probs). Adds the aux/z-loss gradients
// scaled by config.moe_loss_backward_scale. Accumulates into grad_hidden [T, H] and
// grad_router_weight [E, H].
template <typename T>
void router_backward(const MoeConfig& config, const Matrix<T>& router_weight, const RouterContext<T>& ctx,
                     const Matrix<T>& grad_probs, Matrix<T>& grad_hidden, Matrix<T>& grad_router_weight);

// Megatron get_updated_expert_bias: bias_i += rate * sign(mean(c) - c_i); then c = 0.
void update_expert_bias(double rate, std::vector<double>& expert_bias, std::vector<double>& local_tokens_per_expert);

// get_capacity(num_tokens, num_experts, cf, min_capacity) = max(ceil(num_tokens / E * cf), min_capacity).
int64_t get_capacity(int64_t num_tokens, int64_t num_experts, double capacity_factor, int64_t min_capacity = 0);

}  // namespace moekit::cpu
