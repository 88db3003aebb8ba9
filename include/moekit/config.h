// moekit::MoeConfig: the MoE fields of Megatron-Core's TransformerConfig that moekit implements,
// with Megatron's names (flag = field with '-' for '_', except --num-experts) and defaults.
// Departures from Megatron are marked [moekit]. Kernels never see this struct: each stage gets
// its own shape struct built from it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moekit {

struct MoeConfig {
    // ---- model shape (a moekit layer needs these; Megatron takes them from the model) ----
    int64_t hidden_size = 0;                      // --hidden-size (H)
    std::optional<int64_t> num_moe_experts;       // --num-experts (E)
    std::optional<int64_t> moe_ffn_hidden_size;   // --moe-ffn-hidden-size (F); None -> ffn_hidden_size
    std::optional<int64_t> ffn_hidden_size;       // --ffn-hidden-size; None -> 4*H
    int64_t num_layers = 1;                       // --num-layers (fc2 init std = std/sqrt(2*num_layers))
    int64_t seq_length = 0;                       // --seq-length (S; layer input is [S, B, H])
    int64_t micro_batch_size = 1;                 // --micro-batch-size (B)
    int64_t expert_model_parallel_size = 1;       // --expert-model-parallel-size (EP)

    // ---- expert MLP ----
    bool gated_linear_unit = false;               // --swiglu / --geglu set it (with the activation)
    std::string activation_func = "gelu";         // gelu | silu | relu | squared_relu
    double init_method_std = 0.02;                // --init-method-std
    bool add_bias_linear = false;                 // [moekit] default False: MoE linears have no bias here
    bool moe_grouped_gemm = false;                // accepted; moekit always runs grouped GEMMs

    // ---- router ----
    std::vector<std::string> moe_router_load_balancing_type = {"aux_loss"};  // aux_loss|seq_aux_loss|global_aux_loss|sinkhorn|none
    int64_t moe_router_topk = 2;
    std::string moe_router_score_function = "softmax";  // softmax | sigmoid | sqrtsoftplus
    bool moe_router_pre_softmax = false;
    std::optional<int64_t> moe_router_num_groups;
    std::optional<int64_t> moe_router_group_topk;
    std::optional<double> moe_router_topk_scaling_factor;
    std::optional<std::string> moe_router_dtype;  // fp32 | fp64 (None = input dtype)
    bool moe_router_enable_expert_bias = false;
    double moe_router_bias_update_rate = 1e-3;
    std::vector<double> moe_aux_loss_coeff = {0.0};  // one per load-balancing type
    std::optional<double> moe_z_loss_coeff;
    std::optional<double> moe_input_jitter_eps;
    // Benchmark only (Megatron's RandomSTE): N(0, 1) logits, gradient straight through. CPU only for now.
    bool moe_router_force_load_balancing = false;

    // ---- dispatch / capacity ----
    std::string moe_token_dispatcher_type = "allgather";  // allgather | alltoall | flex (flex: budgeted only)
    // Per-rank receive budget ceil(T*k*f) rows (aligned), fixed at construction: the budgeted
    // dispatcher (src/cpu/dispatch_budgeted.h) with alltoall or flex; overflow -> the step is re-run.
    std::optional<double> moe_expert_rank_capacity_factor;  // MoE Echo's --moe-received-token-capacity
    std::optional<double> moe_expert_capacity_factor;     // None = dropless
    bool moe_pad_expert_input_to_capacity = false;
    std::string moe_token_drop_policy = "probs";          // probs | position
    bool moe_token_dropping = false;                      // dead flag upstream; must stay False

    // ---- shared expert ----
    std::optional<int64_t> moe_shared_expert_intermediate_size;
    bool moe_shared_expert_gate = false;
    bool moe_shared_expert_overlap = false;

    // ---- ECHO (MoE Echo's flags, megatron-moe.md §7.1; the planner is src/echo, `moekit plan`) ----
    bool moe_enable_echo = false;                       // src/cpu/dispatch_echo.h; cuda: src/cuda/dispatch_echo.cuh
    std::optional<int64_t> moe_num_echo_experts;        // S_TOTAL spare slots over all ranks, divisible by EP
    bool moe_echo_recompute_expert_dispatch = false;    // one spare-slot buffer for all layers
    std::string moe_echo_algorithm = "waterfill";       // waterfill | greedy
    int64_t moe_echo_group_floor_rows = 0;              // [moekit] > 0: plan for time (EchoDims::group_floor_rows)

    // ---- moekit-specific ----
    // Gradient injected for the aux/z losses (Megatron's main_loss_backward_scale, which is
    // loss_scale * cp / num_microbatches there); [moekit] a flag, default 1.
    double moe_loss_backward_scale = 1.0;                  // --moe-loss-backward-scale
    bool deterministic_mode = false;                       // --deterministic-mode
    uint64_t seed = 1234;                                  // --seed

    // Derived values (valid after validate()).
    int64_t num_experts() const { return num_moe_experts.value_or(0); }
    int64_t expert_ffn() const;           // F: moe_ffn_hidden_size, else ffn_hidden_size, else 4H
    int64_t fc1_rows() const { return expert_ffn() * (gated_linear_unit ? 2 : 1); }
    int64_t shared_ffn() const { return moe_shared_expert_intermediate_size.value_or(0); }
    double aux_loss_coeff(const std::string& type) const;  // 0 for types not in the list

    // Bytes one forward+backward of `tokens` tokens needs at least (fp32 weights, gradients and
    // activations), nullopt when it does not fit in int64. validate() refuses more than kMaxLayerBytes.
    std::optional<int64_t> memory_estimate_bytes(int64_t tokens) const;
    static constexpr int64_t kMaxLayerBytes = int64_t(1) << 40;  // 1 TiB: more than any one host has

    // Megatron's __post_init__ rewrites: a negative capacity factor becomes None (dropless).
    void normalize();
    // Every violated rule, each naming the flag, the value and the rule; empty when valid.
    std::vector<std::string> validation_errors() const;
    // Throws UsageError listing all violations.
    void validate() const;

   private:
    void size_errors(std::vector<std::string>& errors) const;  // overflow and memory bounds of the shape
};

}  // namespace moekit
