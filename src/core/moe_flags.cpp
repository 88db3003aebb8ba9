// THE table of MoeConfig flags: Megatron's spellings, field names and defaults (megatron-moe.md §5),
// moekit-only flags marked [moekit], and the Megatron MoE flags moekit refuses ("not supported yet").
// to_json()/print_config() are derived from the same table, so every field is printed and accepted by
// --config. Parser: src/core/flags.cpp. Validation: src/core/config.cpp. Tests: tests/cpu/test_config.cpp.
#include <cctype>
#include <memory>

#include "core/flags.h"
#include "moekit/error.h"

namespace moekit {

void add_moe_flags(FlagParser& p, MoeConfig& c) {
    p.section("model shape");
    p.add("--hidden-size", &c.hidden_size, "H, the layer's hidden size (input [S, B, H])");
    p.add("--num-experts", &c.num_moe_experts, "E, number of experts (Megatron's num_moe_experts)")
        .with_field("num_moe_experts");
    p.add("--moe-ffn-hidden-size", &c.moe_ffn_hidden_size, "F, the experts' FFN size; None -> --ffn-hidden-size");
    p.add("--ffn-hidden-size", &c.ffn_hidden_size, "dense FFN size; None -> 4*H");
    p.add("--num-layers", &c.num_layers, "number of layers (fc2 init std = std/sqrt(2*num_layers))");
    p.add("--seq-length", &c.seq_length, "S, tokens per sequence (0: taken from the input)");
    p.add("--micro-batch-size", &c.micro_batch_size, "B, sequences per micro-batch");
    p.add("--expert-model-parallel-size", &c.expert_model_parallel_size, "EP, ranks the experts are split over");

    p.section("expert MLP");
    // The activation flags set two fields at once; giving two different ones is a mistake, as in Megatron.
    auto chosen = std::make_shared<std::string>();
    auto activation = [&c, chosen](const char* flag, bool gated, const char* func) {
        return [&c, chosen, flag, gated, func] {
            MOEKIT_REQUIRE(chosen->empty() || *chosen == flag, flag, " cannot be combined with ", *chosen);
            *chosen = flag;
            c.gated_linear_unit = gated;
            c.activation_func = func;
        };
    };
    p.add_action("--swiglu", activation("--swiglu", true, "silu"), "SwiGLU experts: gated, silu(gate) * up");
    p.add_action("--geglu", activation("--geglu", true, "gelu"), "GEGLU experts: gated, gelu(gate) * up");
    p.add_action("--squared-relu", activation("--squared-relu", false, "squared_relu"), "squared-ReLU experts");
    p.add("--gated-linear-unit", &c.gated_linear_unit, "[moekit] gated experts (fc1 = [gate; up], 2F rows)");
    p.add("--activation-func", &c.activation_func, "[moekit] gelu | silu | relu | squared_relu");
    // --swiglu --activation-func relu would run whichever came last; when both come from the same place
    // (the command line, or one --config file) and disagree, that is a mistake: refuse naming both.
    p.add_rule([](const FlagParser& parser) {
        const struct {
            const char* flag;
            bool gated;
            const char* func;
        } actions[] = {{"--swiglu", true, "silu"}, {"--geglu", true, "gelu"}, {"--squared-relu", false, "squared_relu"}};
        for (const auto& a : actions) {
            if (!parser.was_set(a.flag)) continue;
            const std::string where = parser.where_set(a.flag);
            if (const auto* f = parser.given("--activation-func");
                f && parser.where_set("--activation-func") == where && f->at(0) != a.func)
                throw UsageError(str(a.flag, " conflicts with --activation-func=", f->at(0), " (", a.flag,
                                     " means --activation-func=", a.func, "): give one of them"));
            if (const auto* g = parser.given("--gated-linear-unit");
                g && parser.where_set("--gated-linear-unit") == where) {
                const std::string v = g->at(0);
                std::string low = v;
                for (auto& ch : low) ch = char(std::tolower(static_cast<unsigned char>(ch)));
                const bool on = low == "true" || low == "1" || low == "yes" || low == "on";
                if (on != a.gated)
                    throw UsageError(str(a.flag, " conflicts with --gated-linear-unit=", v, " (", a.flag, " means ",
                                         a.gated ? "gated" : "not gated", " experts): give one of them"));
            }
        }
    });
    p.add("--init-method-std", &c.init_method_std, "std of the normal init (fc2: std/sqrt(2*num_layers))");
    p.add_action(
        "--disable-bias-linear", [&c] { c.add_bias_linear = false; },
        "linears without bias (moekit's default already)");
    p.add("--moe-grouped-gemm", &c.moe_grouped_gemm, "accepted; moekit always runs grouped GEMMs");

    p.section("router");
    p.add("--moe-router-load-balancing-type", &c.moe_router_load_balancing_type,
          "aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none, or a list of aux types");
    p.add("--moe-router-topk", &c.moe_router_topk, "k, experts per token");
    p.add("--moe-router-score-function", &c.moe_router_score_function, "softmax | sigmoid | sqrtsoftplus");
    p.add("--moe-router-pre-softmax", &c.moe_router_pre_softmax,
          "softmax over all experts before top-k (required for k=1 with softmax)");
    p.add("--moe-router-num-groups", &c.moe_router_num_groups, "expert groups for group-limited routing");
    p.add("--moe-router-group-topk", &c.moe_router_group_topk, "groups kept per token (group-limited routing)");
    p.add("--moe-router-topk-scaling-factor", &c.moe_router_topk_scaling_factor, "multiply the top-k probs");
    p.add("--moe-router-dtype", &c.moe_router_dtype, "fp32 | fp64 for logits and probs (None: input dtype)");
    p.add("--moe-router-enable-expert-bias", &c.moe_router_enable_expert_bias,
          "aux-loss-free balancing bias (sigmoid / sqrtsoftplus only)");
    p.add("--moe-router-bias-update-rate", &c.moe_router_bias_update_rate, "expert-bias step per global batch");
    p.add("--moe-aux-loss-coeff", &c.moe_aux_loss_coeff, "aux-loss coefficient(s), one per load-balancing type");
    p.add("--moe-z-loss-coeff", &c.moe_z_loss_coeff, "z-loss coefficient");
    p.add("--moe-input-jitter-eps", &c.moe_input_jitter_eps, "router input *= U(1-eps, 1+eps)");
    p.add("--moe-router-force-load-balancing", &c.moe_router_force_load_balancing,
          "benchmark only: random N(0, 1) router logits (balanced routing), gradient straight through (CPU only)");

    p.section("dispatch and capacity");
    p.add("--moe-token-dispatcher-type", &c.moe_token_dispatcher_type,
          "allgather | alltoall | flex (flex needs --moe-expert-rank-capacity-factor)");
    p.add("--moe-expert-rank-capacity-factor", &c.moe_expert_rank_capacity_factor,
          "receive budget per EP rank = ceil(T*k*f) rows (aligned to 16): the budgeted dispatcher "
          "(alltoall or flex); an overflow re-runs the step through alltoall");
    p.add("--moe-received-token-capacity", &c.moe_expert_rank_capacity_factor,
          "MoE Echo's name for --moe-expert-rank-capacity-factor")
        .with_field("moe_expert_rank_capacity_factor");
    p.add_rule([](const FlagParser& f) {
        if (f.was_set("--moe-expert-rank-capacity-factor") && f.was_set("--moe-received-token-capacity"))
            throw UsageError(
                "--moe-expert-rank-capacity-factor and --moe-received-token-capacity are the same setting: give one");
    });
    p.add("--moe-expert-capacity-factor", &c.moe_expert_capacity_factor,
          "capacity = ceil(T*k/E*cf) per expert; None or < 0: dropless");
    p.add("--moe-pad-expert-input-to-capacity", &c.moe_pad_expert_input_to_capacity,
          "pad every expert to its capacity (needs a capacity factor)");
    p.add("--moe-token-drop-policy", &c.moe_token_drop_policy, "probs | position (first tokens by index are kept)");

    p.section("shared expert");
    p.add("--moe-shared-expert-intermediate-size", &c.moe_shared_expert_intermediate_size,
          "FFN size of the shared expert (None: no shared expert)");
    p.add("--moe-shared-expert-gate", &c.moe_shared_expert_gate, "sigmoid gate on the shared expert's output");

    p.section("ECHO (elastic cloning of hot experts)");
    p.add("--moe-enable-echo", &c.moe_enable_echo, "clone hot experts into spare slots every step (EP > 1, alltoall dispatcher; cuda: moekit layer and bench)");
    p.add("--moe-num-echo-experts", &c.moe_num_echo_experts, "S_TOTAL spare expert slots over all EP ranks");
    p.add("--moe-echo-recompute-expert-dispatch", &c.moe_echo_recompute_expert_dispatch,
          "one set of spare-slot buffers for all layers; clone weights sent again in backward (CPU: dropped between forward and backward)");
    p.add("--moe-echo-algorithm", &c.moe_echo_algorithm, "ECHO planner: waterfill | greedy (MoE Echo's)");
    p.add("--moe-echo-group-floor-rows", &c.moe_echo_group_floor_rows,
          "[moekit] ECHO planner balances expert time, not tokens: an expert's weight gradient costs at least this "
          "many rows (0 = tokens; 512 on an H200, docs/perf.md)");

    p.section("moekit");
    p.add("--moe-loss-backward-scale", &c.moe_loss_backward_scale,
          "[moekit] gradient injected for the aux/z losses (Megatron's main_loss_backward_scale)");
    p.add("--deterministic-mode", &c.deterministic_mode,
          "bitwise-reproducible runs across processes: the CUDA layer's grouped GEMMs take the per-shape rule, not "
          "a configuration measured in this process (every path already has fixed-order sums, no float atomics)");
    p.add("--seed", &c.seed, "random seed (weights init, jitter, random inputs)");

    // Megatron MoE flags that moekit does not implement: refused, never silently ignored.
    p.add_unsupported("--add-bias-linear", "MoE linears have no bias in moekit");
    p.add_unsupported("--moe-token-dropping", "a dead flag upstream; use --moe-expert-capacity-factor");
    p.add_unsupported("--moe-shared-expert-overlap", "the shared expert runs without overlap; same numbers without it");
    for (const char* name : {
             "--moe-router-padding-for-quantization",
             "--moe-router-padding-for-fp8",
             "--moe-permute-fusion",
             "--moe-router-fusion",
             "--moe-layer-recompute",
             "--moe-use-grouped-tensor",
             "--moe-latent-size",
             "--moe-enable-routing-replay",
             "--moe-router-force-biased",
             "--moe-flex-dispatcher-backend",
             "--moe-enable-deepep",
             "--moe-paged-stash",
             "--moe-apply-probs-on-input",
             "--expert-tensor-parallel-size",
             "--moe-router-topk-limited-devices",
             "--moe-mlp-glu-interleave-size",
             "--glu-linear-offset",
             "--activation-func-clamp-value",
             "--moe-per-layer-logging",
             "--moe-layer-freq",
             "--moe-router-quantile-balancing-ema",
             "--moe-permute-fusion-into-hybridep",
             "--moe-flex-dispatcher-num-sms",
             "--moe-deepep-num-sms",
             "--moe-hybridep-num-sms",
             "--moe-shared-expert-glu-interleave-size",
             "--use-grouped-gemm-for-shared-expert",
             "--moe-single-grouped-weight",
             "--moe-single-grouped-bias",
             "--use-transformer-engine-op-fuser",
             "--overlap-moe-expert-parallel-comm",
             "--delay-wgrad-compute",
             "--moe-pad-experts-for-cuda-graph-inference",
             "--moe-ncclep-zero-copy",
             "--moe-dispatch-fwd-dtype",
             "--moe-combine-bwd-dtype",
             "--quick-geglu",
             "--calculate-per-token-loss",
             "--moe-upcycling-granularity",
             "--moe-use-upcycling",
         })
        p.add_unsupported(name);
}

nlohmann::json to_json(const MoeConfig& config) {
    MoeConfig copy = config;
    FlagParser p;
    add_moe_flags(p, copy);
    nlohmann::json j = p.values();
    // Fields whose flags are refused or actions: written too, and read back by --config at these values.
    j["add_bias_linear"] = config.add_bias_linear;
    j["moe_token_dropping"] = config.moe_token_dropping;
    j["moe_shared_expert_overlap"] = config.moe_shared_expert_overlap;
    return j;
}

void print_config(const MoeConfig& config, std::FILE* out) {
    std::fprintf(out, "config:\n");
    const nlohmann::json j = to_json(config);  // named: items() does not extend a temporary's life
    for (const auto& [key, value] : j.items()) std::fprintf(out, "  %-40s %s\n", key.c_str(), value.dump().c_str());
}

MoeConfig parse_moe_config(const std::vector<std::string>& args) {
    MoeConfig config;
    FlagParser p("moekit [MoE flags]");
    add_moe_flags(p, config);
    p.parse(args);
    config.normalize();
    config.validate();
    return config;
}

}  // namespace moekit
