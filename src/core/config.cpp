// MoeConfig's derived values and validation: every rule of Megatron's TransformerConfig.__post_init__
// (megatron-moe.md §5.7) that applies to what moekit implements, plus moekit's own range checks.
// All violations are collected and reported at once, each naming the flag, the value and the rule.
// Flags and --config parsing: src/core/flags.cpp. Tests: tests/cpu/test_config.cpp.
#include "moekit/config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/checked_math.h"
#include "moekit/error.h"

namespace moekit {

namespace {

// Short decimal form of a double for messages: 0.01, 1e-20, 2.
std::string num(double v) { return str(v); }

std::string join(const std::vector<std::string>& items, const char* sep) {
    std::string s;
    for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
    return s;
}

std::string join(const std::vector<double>& items, const char* sep) {
    std::string s;
    for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + num(items[i]);
    return s;
}

bool one_of(const std::string& v, std::initializer_list<const char*> set) {
    return std::any_of(set.begin(), set.end(), [&](const char* s) { return v == s; });
}

const char* const kLoadBalancingTypes = "aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none";

}  // namespace

int64_t MoeConfig::expert_ffn() const {
    if (moe_ffn_hidden_size) return *moe_ffn_hidden_size;
    if (ffn_hidden_size) return *ffn_hidden_size;
    // 4H saturates instead of wrapping: validation then reports the expert weights as too large.
    return checked_mul(4, hidden_size).value_or(INT64_MAX);
}

double MoeConfig::aux_loss_coeff(const std::string& type) const {
    for (size_t i = 0; i < moe_router_load_balancing_type.size() && i < moe_aux_loss_coeff.size(); ++i)
        if (moe_router_load_balancing_type[i] == type) return moe_aux_loss_coeff[i];
    return 0.0;
}

std::optional<int64_t> MoeConfig::memory_estimate_bytes(int64_t tokens) const {
    // fp32 values a forward+backward holds at least: weights and their gradients, and per token the
    // input/output and their gradients [T, H], router logits/probs/map [T, E] and the k expert rows
    // (fc1 out, activation, fc2 in/out and their gradients). A lower bound: fp64 doubles it.
    const int64_t H = hidden_size, E = num_experts(), F = expert_ffn(), k = moe_router_topk;
    const int64_t glu = gated_linear_unit ? 2 : 1, Fs = shared_ffn();
    const auto fc1 = checked_mul(glu, F), shared_fc1 = checked_mul(glu, Fs);
    const auto per_expert = checked_sum({checked_product({fc1, H}), checked_product({H, F}), 128 / 4});
    const auto weights = checked_sum({checked_product({E, H}), checked_product({E, per_expert}),
                                      checked_product({shared_fc1, H}), checked_product({H, Fs}), H});
    const auto per_token =
        checked_sum({checked_product({4, H}), checked_product({3, E}),
                     checked_product({k, checked_sum({checked_product({2, fc1}), checked_product({2, F}),
                                                      checked_product({2, H})})}),
                     checked_product({2, checked_sum({shared_fc1, Fs})})});
    return checked_product({4, checked_sum({checked_product({2, weights}), checked_product({tokens, per_token})})});
}

void MoeConfig::size_errors(std::vector<std::string>& errors) const {
    auto fail = [&](auto&&... parts) { errors.push_back(str(parts...)); };
    const int64_t H = hidden_size, E = num_experts(), F = expert_ffn(), Fs = shared_ffn();
    // Only when every size is itself valid (the rules above name the bad ones).
    if (H <= 0 || E <= 0 || F <= 0 || Fs < 0 || seq_length < 0 || micro_batch_size < 1 || moe_router_topk < 1) return;
    const std::string e_flag = str("--num-experts=", E), h_flag = str("--hidden-size=", H);
    const std::string f_flag = moe_ffn_hidden_size ? str("--moe-ffn-hidden-size=", F)
                               : ffn_hidden_size   ? str("--ffn-hidden-size=", F)
                                                   : str("the expert FFN size 4*H=", F);
    const int64_t glu = gated_linear_unit ? 2 : 1;
    int64_t tokens = 0;
    if (seq_length > 0) {
        const auto t = checked_product({seq_length, micro_batch_size, H});
        if (!t) {
            fail("--seq-length=", seq_length, " x --micro-batch-size=", micro_batch_size, " x ", h_flag,
                 " overflows 64-bit sizes: the input [S, B, H] cannot be held");
            return;
        }
        tokens = seq_length * micro_batch_size;
    }
    if (!checked_product({glu, F, H}) || !checked_product({E, glu, F, H}))
        fail(e_flag, " x ", f_flag, " x ", h_flag, " overflows 64-bit sizes: the expert weights cannot be held");
    if (Fs > 0 && !checked_product({glu, Fs, H}))
        fail("--moe-shared-expert-intermediate-size=", Fs, " x ", h_flag,
             " overflows 64-bit sizes: the shared expert's weights cannot be held");
    if (!errors.empty()) return;
    const auto bytes = memory_estimate_bytes(tokens);
    if (!bytes || *bytes > kMaxLayerBytes) {
        const std::string need = bytes ? str(*bytes / (int64_t(1) << 30), " GiB") : std::string("more than 2^63 bytes");
        fail("the layer (", e_flag, ", ", h_flag, ", ", f_flag,
             Fs > 0 ? str(", --moe-shared-expert-intermediate-size=", Fs) : std::string(),
             tokens > 0 ? str(", ", tokens, " tokens") : std::string(), ") needs at least ", need,
             " for one forward+backward in fp32; moekit refuses layers over ", kMaxLayerBytes >> 30, " GiB");
    }
}

void MoeConfig::normalize() {
    // Megatron turns a negative capacity factor into None (dropless) instead of failing.
    if (moe_expert_capacity_factor && *moe_expert_capacity_factor < 0) moe_expert_capacity_factor.reset();
}

std::vector<std::string> MoeConfig::validation_errors() const {
    std::vector<std::string> errors;
    auto fail = [&](auto&&... parts) { errors.push_back(str(parts...)); };

    // ---- shape and parallel layout (rules 1, 2) ----
    if (hidden_size <= 0) fail("--hidden-size=", hidden_size, " must be > 0");
    const int64_t ep = expert_model_parallel_size;
    if (ep < 1) fail("--expert-model-parallel-size=", ep, " must be >= 1");
    if (!num_moe_experts) {
        fail("--num-experts is required: a MoE layer needs a number of experts",
             ep > 1 ? str(" (--expert-model-parallel-size=", ep, " requires it)") : "");
    } else if (*num_moe_experts <= 0) {
        fail("--num-experts=", *num_moe_experts, " must be > 0");
    } else if (ep >= 1 && *num_moe_experts % ep != 0) {
        fail("--num-experts=", *num_moe_experts, " must be divisible by --expert-model-parallel-size=", ep);
    }
    const int64_t num_experts_ = num_moe_experts.value_or(0);
    if (moe_ffn_hidden_size && *moe_ffn_hidden_size <= 0)
        fail("--moe-ffn-hidden-size=", *moe_ffn_hidden_size, " must be > 0");
    if (ffn_hidden_size && *ffn_hidden_size <= 0) fail("--ffn-hidden-size=", *ffn_hidden_size, " must be > 0");
    if (num_layers < 1) fail("--num-layers=", num_layers, " must be >= 1 (it scales the fc2 init std)");
    if (seq_length < 0) fail("--seq-length=", seq_length, " must be >= 0 (0 = taken from the input)");
    if (micro_batch_size < 1) fail("--micro-batch-size=", micro_batch_size, " must be >= 1");

    // ---- sizes: every product that sizes an allocation, in checked 64-bit arithmetic ----
    size_errors(errors);

    // ---- expert MLP ----
    if (!one_of(activation_func, {"gelu", "silu", "relu", "squared_relu"}))
        fail("--activation-func=", activation_func, " must be one of gelu, silu, relu, squared_relu");
    if (!(init_method_std > 0) || !std::isfinite(init_method_std))
        fail("--init-method-std=", num(init_method_std), " must be a finite number > 0");
    if (add_bias_linear)
        fail(
            "--add-bias-linear: not supported yet by moekit (MoE linears have no bias; Megatron MoE configs use "
            "--disable-bias-linear)");

    // ---- load balancing (rules 6, 19) ----
    const auto& types = moe_router_load_balancing_type;
    const auto& coeffs = moe_aux_loss_coeff;
    const std::string types_s = join(types, " "), coeffs_s = join(coeffs, " ");
    if (types.empty()) fail("--moe-router-load-balancing-type must name at least one type (", kLoadBalancingTypes, ")");
    std::set<std::string> seen;
    for (const auto& t : types) {
        if (t == "quantile_balancing")
            fail("--moe-router-load-balancing-type=quantile_balancing: not supported yet by moekit");
        else if (!one_of(t, {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"}))
            fail("--moe-router-load-balancing-type=", t, " is not a known type (", kLoadBalancingTypes, ")");
        if (!seen.insert(t).second) fail("--moe-router-load-balancing-type=", types_s, " lists '", t, "' twice");
    }
    const bool sinkhorn = std::find(types.begin(), types.end(), "sinkhorn") != types.end();
    if (types.size() > 1)
        for (const char* alone : {"sinkhorn", "none"})
            if (seen.count(alone))
                fail("--moe-router-load-balancing-type=", types_s, ": '", alone,
                     "' cannot be combined with other types (a list is a list of aux-loss types)");
    if (coeffs.size() != types.size())
        fail("--moe-aux-loss-coeff=", coeffs_s, " has ", coeffs.size(),
             " value(s) but --moe-router-load-balancing-type=", types_s, " has ", types.size(),
             ": give one coefficient per type");
    for (double c : coeffs)
        if (!(c >= 0) || !std::isfinite(c)) fail("--moe-aux-loss-coeff=", num(c), " must be a finite number >= 0");
    if (sinkhorn)
        for (double c : coeffs)
            if (c != 0)
                fail("--moe-aux-loss-coeff=", coeffs_s, " must be 0 with --moe-router-load-balancing-type=sinkhorn");
    if (moe_z_loss_coeff && (!(*moe_z_loss_coeff >= 0) || !std::isfinite(*moe_z_loss_coeff)))
        fail("--moe-z-loss-coeff=", num(*moe_z_loss_coeff), " must be a finite number >= 0");
    if (!std::isfinite(moe_loss_backward_scale))
        fail("--moe-loss-backward-scale=", num(moe_loss_backward_scale), " must be finite");

    // ---- router (rules 10, 13, 14) ----
    const int64_t k = moe_router_topk;
    if (k < 1)
        fail("--moe-router-topk=", k, " must be >= 1");
    else if (num_experts_ > 0 && k > num_experts_)
        fail("--moe-router-topk=", k, " must not exceed --num-experts=", num_experts_);
    const std::string& score = moe_router_score_function;
    if (!one_of(score, {"softmax", "sigmoid", "sqrtsoftplus"}))
        fail("--moe-router-score-function=", score, " must be one of softmax, sigmoid, sqrtsoftplus");
    if (k == 1 && score == "softmax" && !moe_router_pre_softmax && !sinkhorn)
        fail(
            "--moe-router-topk=1 with --moe-router-score-function=softmax requires --moe-router-pre-softmax "
            "(a softmax over one selected logit is constant 1, so the router would get no gradient)");
    if (moe_router_enable_expert_bias && score == "softmax")
        fail("--moe-router-enable-expert-bias requires --moe-router-score-function=sigmoid or sqrtsoftplus (got ",
             score, ")");
    if (!(moe_router_bias_update_rate >= 0) || !std::isfinite(moe_router_bias_update_rate))
        fail("--moe-router-bias-update-rate=", num(moe_router_bias_update_rate), " must be a finite number >= 0");
    if (moe_router_topk_scaling_factor &&
        (!(*moe_router_topk_scaling_factor > 0) || !std::isfinite(*moe_router_topk_scaling_factor)))
        fail("--moe-router-topk-scaling-factor=", num(*moe_router_topk_scaling_factor), " must be a finite number > 0");
    if (moe_router_dtype && !one_of(*moe_router_dtype, {"fp32", "fp64"}))
        fail("--moe-router-dtype=", *moe_router_dtype, " must be fp32 or fp64 (or unset: the input dtype)");
    if (moe_input_jitter_eps && !(*moe_input_jitter_eps > 0 && *moe_input_jitter_eps < 1))
        fail("--moe-input-jitter-eps=", num(*moe_input_jitter_eps), " must be in (0, 1)");

    const auto& groups = moe_router_num_groups;
    const auto& group_topk = moe_router_group_topk;
    if (group_topk && !groups) fail("--moe-router-group-topk=", *group_topk, " requires --moe-router-num-groups");
    if (groups && !group_topk)
        fail("--moe-router-num-groups=", *groups,
             " requires --moe-router-group-topk (group-limited routing needs both)");
    if (groups && *groups <= 0) fail("--moe-router-num-groups=", *groups, " must be > 0");
    if (group_topk && *group_topk <= 0) fail("--moe-router-group-topk=", *group_topk, " must be > 0");
    if (groups && group_topk && *groups > 0 && *group_topk > 0) {
        const int64_t g = *groups, gk = *group_topk;
        if (num_experts_ > 0 && num_experts_ % g != 0)
            fail("--num-experts=", num_experts_, " must be divisible by --moe-router-num-groups=", g);
        if (gk > g) fail("--moe-router-group-topk=", gk, " must not exceed --moe-router-num-groups=", g);
        // Group score = sum of the top k/group_topk scores of a group, so each group needs that many.
        if (k >= 1 && k < gk)
            fail("--moe-router-topk=", k, " must be >= --moe-router-group-topk=", gk,
                 " (each group is scored by the sum of its top topk/group_topk experts)");
        if (num_experts_ > 0 && num_experts_ % g == 0 && gk <= g) {
            const int64_t per_group = num_experts_ / g;
            if (k >= gk && k / gk > per_group)
                fail("--moe-router-topk=", k, " / --moe-router-group-topk=", gk, " = ", k / gk, " exceeds the ",
                     per_group, " experts per group (--num-experts=", num_experts_, " / --moe-router-num-groups=", g,
                     ")");
            if (k > gk * per_group)
                fail("--moe-router-topk=", k, " exceeds the ", gk * per_group,
                     " experts of the --moe-router-group-topk=", gk, " selected groups");
        }
    }

    // ---- dispatch and capacity (rules 5, 7) ----
    if (moe_token_dispatcher_type == "flex" && !moe_expert_rank_capacity_factor)
        fail("--moe-token-dispatcher-type=flex: not supported yet by moekit without "
             "--moe-expert-rank-capacity-factor (flex here is the budgeted dispatcher; or use allgather or alltoall)");
    else if (!one_of(moe_token_dispatcher_type, {"allgather", "alltoall", "flex"}))
        fail("--moe-token-dispatcher-type=", moe_token_dispatcher_type, " must be one of allgather, alltoall, flex");
    if (const auto& f = moe_expert_rank_capacity_factor) {
        if (!(*f > 0) || !std::isfinite(*f))
            fail("--moe-expert-rank-capacity-factor=", num(*f), " must be > 0 and finite (the receive budget per rank "
                 "is ceil(T*k*f) rows)");
        if (moe_token_dispatcher_type == "allgather")
            fail("--moe-expert-rank-capacity-factor requires --moe-token-dispatcher-type=alltoall or flex (got "
                 "allgather, which receives every token and has no budget)");
        if (moe_pad_expert_input_to_capacity)
            fail("--moe-expert-rank-capacity-factor cannot be combined with --moe-pad-expert-input-to-capacity "
                 "(padding to capacity already gives static shapes; use the alltoall dispatcher without the factor)");
    }
    if (const auto& cf = moe_expert_capacity_factor) {
        // A negative factor means None (normalize()); validation accepts it for callers that skip normalize().
        if (*cf == 0 || !std::isfinite(*cf))
            fail("--moe-expert-capacity-factor=", num(*cf), " must be > 0 (a negative value means dropless)");
        if (*cf > 0)
            for (const auto& t : types)
                if (!one_of(t, {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}))
                    fail("--moe-expert-capacity-factor=", num(*cf),
                         " requires --moe-router-load-balancing-type in "
                         "{aux_loss, seq_aux_loss, global_aux_loss, none} (got ",
                         t, ")");
    }
    const bool has_cf = moe_expert_capacity_factor && *moe_expert_capacity_factor > 0;
    if (moe_pad_expert_input_to_capacity && !has_cf)
        fail("--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor");
    if (!one_of(moe_token_drop_policy, {"probs", "position"}))
        fail("--moe-token-drop-policy=", moe_token_drop_policy, " must be probs or position");
    if (moe_token_dropping)
        fail("--moe-token-dropping: not supported (a dead flag upstream; use --moe-expert-capacity-factor)");

    // ---- shared expert (rule 5) ----
    if (moe_shared_expert_intermediate_size && *moe_shared_expert_intermediate_size <= 0)
        fail("--moe-shared-expert-intermediate-size=", *moe_shared_expert_intermediate_size, " must be > 0");
    if (moe_shared_expert_gate && !moe_shared_expert_intermediate_size)
        fail("--moe-shared-expert-gate requires --moe-shared-expert-intermediate-size");
    if (moe_shared_expert_overlap) {
        if (moe_token_dispatcher_type != "alltoall")
            fail("--moe-shared-expert-overlap requires --moe-token-dispatcher-type=alltoall or flex (got ",
                 moe_token_dispatcher_type, ")");
        fail(
            "--moe-shared-expert-overlap: not supported yet by moekit (the shared expert runs without overlap; "
            "the numbers are the same without the flag)");
    }
    // ---- ECHO (MoE Echo's rules, megatron-moe.md §7.1) ----
    if (moe_num_echo_experts && *moe_num_echo_experts < 0)
        fail("--moe-num-echo-experts=", *moe_num_echo_experts, " must be >= 0");
    else if (moe_num_echo_experts && ep >= 1 && *moe_num_echo_experts % ep != 0)
        fail("--moe-num-echo-experts=", *moe_num_echo_experts, " must be divisible by --expert-model-parallel-size=",
             ep, " (S_TOTAL / EP spare slots per rank)");
    if (!one_of(moe_echo_algorithm, {"waterfill", "greedy"}))
        fail("--moe-echo-algorithm=", moe_echo_algorithm, " must be waterfill or greedy");
    if (moe_echo_group_floor_rows < 0 || moe_echo_group_floor_rows > (int64_t(1) << 20))
        fail("--moe-echo-group-floor-rows=", moe_echo_group_floor_rows, " must be in [0, 1048576]");
    if (moe_echo_recompute_expert_dispatch && !moe_enable_echo)
        fail("--moe-echo-recompute-expert-dispatch requires --moe-enable-echo");
    if (moe_enable_echo) {
        if (!moe_num_echo_experts) fail("--moe-enable-echo requires --moe-num-echo-experts (spare slots over all ranks)");
        // The CPU ECHO dispatch is the alltoall dispatcher with spare slots; ECHO is dropless (MoE Echo).
        if (moe_token_dispatcher_type != "alltoall" && !(moe_token_dispatcher_type == "flex" && moe_expert_rank_capacity_factor))
            fail("--moe-enable-echo requires --moe-token-dispatcher-type=alltoall (got ", moe_token_dispatcher_type,
                 ": ECHO re-routes the alltoall dispatcher's rows to spare slots; flex with "
                 "--moe-expert-rank-capacity-factor is its budgeted form)");
        if (moe_expert_capacity_factor && *moe_expert_capacity_factor > 0)
            fail("--moe-enable-echo is dropless: it cannot be combined with --moe-expert-capacity-factor=",
                 num(*moe_expert_capacity_factor));
    }
    return errors;
}

void MoeConfig::validate() const {
    const auto errors = validation_errors();
    if (errors.empty()) return;
    std::string message = errors.size() == 1 ? errors[0] : str(errors.size(), " configuration errors:");
    if (errors.size() > 1)
        for (const auto& e : errors) message += "\n  " + e;
    throw UsageError(message);
}

}  // namespace moekit
