// Finite-difference gradient checks in float64 of the WHOLE CPU layer (src/cpu/layer.cpp):
// loss = sum(out * R) + scale * (attached aux/z losses) for a fixed random R, differentiated
// w.r.t. the input and every parameter, over activations, gating, shared expert (+ gate),
// capacity modes, padding, router score functions and losses.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "layer_test_util.h"
#include "moekit/layer.h"

namespace moekit::cpu {
namespace {

using test::random_matrix;

struct GradCase {
    std::string name;
    std::function<void(MoeConfig&)> edit;
    bool padding = false;
    int64_t micro_batch_size = 1;
};

MoeConfig base_config() {
    MoeConfig c;
    c.hidden_size = 6;
    c.num_moe_experts = 4;
    c.moe_ffn_hidden_size = 5;
    c.moe_router_topk = 2;
    c.init_method_std = 0.4;  // large weights: O(1) activations, so every path carries gradient
    return c;
}

const std::vector<GradCase>& grad_cases() {
    static const std::vector<GradCase> cases = {
        {"gelu", [](MoeConfig& c) { c.activation_func = "gelu"; }},
        {"silu", [](MoeConfig& c) { c.activation_func = "silu"; }},
        {"relu", [](MoeConfig& c) { c.activation_func = "relu"; }},
        {"squared_relu", [](MoeConfig& c) { c.activation_func = "squared_relu"; }},
        {"swiglu", [](MoeConfig& c) { c.gated_linear_unit = true, c.activation_func = "silu"; }},
        {"geglu", [](MoeConfig& c) { c.gated_linear_unit = true, c.activation_func = "gelu"; }},
        {"shared", [](MoeConfig& c) { c.moe_shared_expert_intermediate_size = 4; }},
        {"shared_gate_swiglu",
         [](MoeConfig& c) {
             c.gated_linear_unit = true, c.activation_func = "silu";
             c.moe_shared_expert_intermediate_size = 4, c.moe_shared_expert_gate = true;
         }},
        {"capacity_probs", [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.5; }},
        {"capacity_position",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.5, c.moe_token_drop_policy = "position"; }},
        {"capacity_pad",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.5, c.moe_pad_expert_input_to_capacity = true; }},
        {"padding_mask", [](MoeConfig& c) { c.moe_shared_expert_intermediate_size = 3; }, true},
        {"sigmoid_k1", [](MoeConfig& c) { c.moe_router_score_function = "sigmoid", c.moe_router_topk = 1; }},
        {"softmax_pre_k2", [](MoeConfig& c) { c.moe_router_pre_softmax = true; }},
        {"softmax_pre_k1", [](MoeConfig& c) { c.moe_router_pre_softmax = true, c.moe_router_topk = 1; }},
        {"sigmoid_bias_scaling",
         [](MoeConfig& c) {
             c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
             c.moe_router_topk_scaling_factor = 2.5;
         }},
        {"sqrtsoftplus_grouped",
         [](MoeConfig& c) {
             c.moe_router_score_function = "sqrtsoftplus", c.moe_router_num_groups = 2, c.moe_router_group_topk = 1;
         }},
        {"aux_z_losses",
         [](MoeConfig& c) {
             c.moe_aux_loss_coeff = {0.1}, c.moe_z_loss_coeff = 0.01, c.moe_loss_backward_scale = 0.5;
         }},
        {"seq_global_aux_padded",
         [](MoeConfig& c) {
             c.moe_router_load_balancing_type = {"seq_aux_loss", "global_aux_loss"};
             c.moe_aux_loss_coeff = {0.2, 0.1};
         },
         true, 2},
        {"jitter", [](MoeConfig& c) { c.moe_input_jitter_eps = 0.1; }},
    };
    return cases;
}

class LayerGradCheck : public testing::TestWithParam<size_t> {};

TEST_P(LayerGradCheck, MatchesFiniteDifferences) {
    const GradCase& gc = grad_cases()[GetParam()];
    const uint64_t seed = 1000 + GetParam();
    SCOPED_TRACE(testing::Message() << gc.name << ", seed " << seed);
    MoeConfig config = base_config();
    gc.edit(config);
    const int64_t num_tokens = 12, hidden = config.hidden_size;
    MoeWeights<double> w = init_weights<double>(config, seed);
    if (!w.expert_bias.empty()) w.expert_bias = {0.3, -0.2, 0.1, 0.0};  // bias changes the selection only
    LayerInput<double> in;
    in.hidden = random_matrix<double>(num_tokens, hidden, seed, 1);
    in.micro_batch_size = gc.micro_batch_size;
    in.seq_length = num_tokens / gc.micro_batch_size;
    in.jitter_seed = seed;
    if (gc.padding) {
        in.padding_mask.assign(size_t(num_tokens), 0);
        for (int64_t t : {2, 3, 7, 11}) in.padding_mask[size_t(t)] = 1;
    }
    const Matrix<double> r = random_matrix<double>(num_tokens, hidden, seed, 2);

    // Loss of a fresh layer (router buffers such as the global-aux tracker start from zero each time).
    auto loss = [&] {
        MoeLayer<double> layer(config);
        const Matrix<double> out = layer.forward(w, in);
        double l = 0;
        for (size_t i = 0; i < out.data.size(); ++i) l += out.data[i] * r.data[i];
        const LossValues lv = layer.summary().losses;
        return l + config.moe_loss_backward_scale * (lv.aux_loss + lv.seq_aux_loss + lv.global_aux_loss + lv.z_loss);
    };

    // relu-type activations: keep every pre-activation away from the kink (the probe moves it ~1e-6).
    if (config.activation_func == "relu" || config.activation_func == "squared_relu") {
        double min_abs = 1e9;
        for (const Matrix<double>& fc1 : w.fc1)
            for (int64_t t = 0; t < num_tokens; ++t)
                for (int64_t f = 0; f < fc1.rows; ++f) {
                    double h = 0;
                    for (int64_t k = 0; k < hidden; ++k) h += in.hidden(t, k) * fc1(f, k);
                    min_abs = std::min(min_abs, std::abs(h));
                }
        ASSERT_GT(min_abs, 1e-4) << "a pre-activation sits on the relu kink; pick another seed";
    }

    MoeLayer<double> layer(config);
    layer.forward(w, in);
    MoeWeights<double> grads = zeros_like(w);
    const Matrix<double> grad_in = layer.backward(w, r, grads);
    const RoutingSummary summary = layer.summary();
    if (config.moe_router_load_balancing_type.size() > 1 || config.moe_aux_loss_coeff[0] > 0)
        EXPECT_GT(summary.losses.aux_loss + summary.losses.seq_aux_loss + summary.losses.global_aux_loss, 0);

    // Central differences: truncation O(h^2 f''') ~ 1e-12, rounding ~ 1e-16 |L| / h ~ 1e-9.
    const double h = 1e-6;
    auto check = [&](const char* what, std::vector<double>& values, const std::vector<double>& analytic) {
        ASSERT_EQ(values.size(), analytic.size()) << what;
        double max_grad = 0;
        for (size_t i = 0; i < values.size(); ++i) {
            const double fd = test::central_difference(loss, values[i], h);
            EXPECT_NEAR(analytic[i], fd, 2e-7 + 1e-6 * std::abs(fd)) << what << " [" << i << "]";
            max_grad = std::max(max_grad, std::abs(fd));
        }
        EXPECT_GT(max_grad, 1e-6) << what << ": the check needs a non-trivial gradient";
    };
    check("input", in.hidden.data, grad_in.data);
    check("router.weight", w.router_weight.data, grads.router_weight.data);
    for (size_t e = 0; e < w.fc1.size(); ++e) {
        if (summary.tokens_per_expert[e] == 0) continue;  // no rows: zero grads, checked in test_layer
        const std::string name = "experts.local_experts." + std::to_string(e);
        check((name + ".linear_fc1.weight").c_str(), w.fc1[e].data, grads.fc1[e].data);
        check((name + ".linear_fc2.weight").c_str(), w.fc2[e].data, grads.fc2[e].data);
    }
    if (!w.shared_fc1.empty()) {
        check("shared_experts.linear_fc1.weight", w.shared_fc1.data, grads.shared_fc1.data);
        check("shared_experts.linear_fc2.weight", w.shared_fc2.data, grads.shared_fc2.data);
    }
    if (!w.shared_gate.empty()) check("shared_experts.gate_weight", w.shared_gate.data, grads.shared_gate.data);
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerGradCheck, testing::Range<size_t>(0, grad_cases().size()),
                         [](const testing::TestParamInfo<size_t>& info) { return grad_cases()[info.param].name; });

}  // namespace
}  // namespace moekit::cpu
