// Property tests of the CPU layer over 50 seeded random configurations (experts, top-k, score
// function, capacity mode, padding, gating, activation, shared expert): routed entries per row,
// probs on the map, counts = map.sum(0), capacity bounds, every (token, expert) pair processed
// exactly once (output == per-token reference), round trip through the plan, float == double.
#include <gtest/gtest.h>

#include "core/activation_math.h"
#include "cpu/experts.h"
#include "cpu/permute.h"
#include "cpu/router.h"
#include "cpu/shared_expert.h"
#include "layer_test_util.h"
#include "moekit/error.h"
#include "moekit/layer.h"

namespace moekit::cpu {
namespace {

using test::random_matrix;

struct RandomCase {
    MoeConfig config;
    int64_t num_tokens = 0;
    std::vector<uint8_t> padding_mask;
    std::string to_string() const {
        const MoeConfig& c = config;
        return str("T=", num_tokens, " H=", c.hidden_size, " E=", c.num_experts(), " k=", c.moe_router_topk,
                   " F=", c.expert_ffn(), " score=", c.moe_router_score_function, " pre=", c.moe_router_pre_softmax,
                   " act=", c.activation_func, " glu=", c.gated_linear_unit,
                   " cf=", c.moe_expert_capacity_factor.value_or(-1), " pad=", c.moe_pad_expert_input_to_capacity,
                   " policy=", c.moe_token_drop_policy, " shared=", c.shared_ffn(), " gate=", c.moe_shared_expert_gate,
                   " padding=", !padding_mask.empty());
    }
};

RandomCase random_case(uint64_t seed) {
    Rng rng(seed, 5);
    RandomCase rc;
    MoeConfig& c = rc.config;
    c.hidden_size = 2 + rng.below(10);
    c.num_moe_experts = 1 + rng.below(9);
    c.moe_ffn_hidden_size = 1 + rng.below(12);
    c.moe_router_topk = 1 + rng.below(c.num_experts());
    c.init_method_std = 0.3;
    const char* scores[] = {"softmax", "sigmoid", "sqrtsoftplus"};
    c.moe_router_score_function = scores[rng.below(3)];
    if (c.moe_router_score_function == "softmax")
        c.moe_router_pre_softmax = c.moe_router_topk == 1 || rng.below(2) == 1;
    const char* acts[] = {"gelu", "silu", "relu", "squared_relu"};
    c.activation_func = acts[rng.below(4)];
    c.gated_linear_unit = rng.below(2) == 1;
    switch (rng.below(4)) {  // dropless, drop (probs/position), drop-and-pad
        case 0:
            break;
        case 1:
            c.moe_expert_capacity_factor = 0.3 + rng.uniform(), c.moe_token_drop_policy = "probs";
            break;
        case 2:
            c.moe_expert_capacity_factor = 0.3 + rng.uniform(), c.moe_token_drop_policy = "position";
            break;
        case 3:
            c.moe_expert_capacity_factor = 0.3 + rng.uniform(), c.moe_pad_expert_input_to_capacity = true;
            break;
    }
    if (rng.below(3) == 0) {
        c.moe_shared_expert_intermediate_size = 1 + rng.below(6);
        c.moe_shared_expert_gate = rng.below(2) == 1;
    }
    rc.num_tokens = 1 + rng.below(40);
    if (rng.below(3) == 0) {
        rc.padding_mask.assign(size_t(rc.num_tokens), 0);
        for (auto& m : rc.padding_mask) m = uint8_t(rng.below(4) == 0);
    }
    return rc;
}

TEST(LayerProperties, RandomConfigurations) {
    int64_t dropped_cases = 0, padded_cases = 0;
    for (uint64_t seed = 1; seed <= 50; ++seed) {
        const RandomCase rc = random_case(seed);
        const MoeConfig& c = rc.config;
        SCOPED_TRACE(testing::Message() << "seed " << seed << ": " << rc.to_string());
        const int64_t T = rc.num_tokens, E = c.num_experts(), k = c.moe_router_topk, H = c.hidden_size;
        const MoeWeights<double> w = init_weights<double>(c, seed);
        LayerInput<double> in;
        in.hidden = random_matrix<double>(T, H, seed, 1);
        in.seq_length = T;
        in.padding_mask = rc.padding_mask;
        MoeLayer<double> layer(c);
        const Matrix<double> out = layer.forward(w, in);
        const std::vector<uint8_t>& map = layer.routing_map();
        const Matrix<double>& probs = layer.probs();
        const bool capacity = c.moe_expert_capacity_factor.has_value(), pad = c.moe_pad_expert_input_to_capacity;

        int64_t valid = 0, total = 0;
        std::vector<int64_t> col_sum(size_t(E), 0);
        for (int64_t t = 0; t < T; ++t) {
            const bool padded = !rc.padding_mask.empty() && rc.padding_mask[size_t(t)];
            valid += !padded;
            int64_t row = 0;
            for (int64_t e = 0; e < E; ++e) {
                const bool on = map[size_t(t * E + e)] != 0;
                row += on;
                col_sum[size_t(e)] += on;
                if (pad) {
                    if (probs(t, e) != 0) EXPECT_TRUE(on) << "prob off the map at (" << t << ", " << e << ")";
                } else {
                    EXPECT_EQ(on, probs(t, e) != 0)
                        << "probs must be non-zero exactly on the map (" << t << ", " << e << ")";
                }
            }
            total += row;
            if (padded)
                EXPECT_EQ(row, 0) << "padded token " << t << " was routed";
            else if (!capacity)
                EXPECT_EQ(row, k) << "token " << t;
            else if (!pad)
                EXPECT_LE(row, k) << "token " << t;
        }
        const RoutingSummary s = layer.summary();
        EXPECT_EQ(s.tokens_per_expert, col_sum);
        if (capacity) {
            const int64_t cap = get_capacity(valid * k, E, *c.moe_expert_capacity_factor);
            for (int64_t e = 0; e < E; ++e) {
                if (pad)
                    EXPECT_EQ(col_sum[size_t(e)], std::min(cap, valid)) << "expert " << e;
                else
                    EXPECT_LE(col_sum[size_t(e)], cap) << "expert " << e;
            }
            dropped_cases += !pad && total < valid * k;
            padded_cases += pad;
        }

        // Each (token, expert) pair on the map is processed exactly once: out == per-token reference.
        const MlpShape shape = expert_mlp_shape(c);
        Matrix<double> reference(T, H);
        if (c.shared_ffn() > 0) {
            SharedExpertContext<double> sctx;
            reference = shared_expert_forward(shared_mlp_shape(c), w, in.hidden, sctx);
        }
        for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e) {
                if (!map[size_t(t * E + e)]) continue;
                Matrix<double> fc1_out(1, shape.fc1_rows()), act_out(1, shape.ffn), y(1, H);
                const double p = probs(t, e);
                mlp_forward(shape, w.fc1[size_t(e)], w.fc2[size_t(e)], in.hidden.row(t), 1, &p, fc1_out.data.data(),
                            act_out.data.data(), y.data.data());
                for (int64_t h = 0; h < H; ++h) reference(t, h) += y(0, h);
            }
        EXPECT_LE(test::max_abs_diff(out, reference), 1e-12);

        // Round trip through the plan: unpermute(permute(x) * p) = x * (sum of the token's probs).
        const RoutingPlan<double> plan = build_routing_plan(map, probs, T, E);
        Matrix<double> rows = permute(in.hidden, plan);
        for (int64_t r = 0; r < rows.rows; ++r)
            for (int64_t h = 0; h < H; ++h) rows(r, h) *= plan.permuted_probs[size_t(r)];
        const Matrix<double> back = unpermute(rows, plan);
        for (int64_t t = 0; t < T; ++t) {
            double psum = 0;
            for (int64_t e = 0; e < E; ++e) psum += probs(t, e);
            for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(back(t, h), in.hidden(t, h) * psum, 1e-14);
        }

        // Backward runs, is finite, and padded tokens only get the shared path's gradient.
        MoeWeights<double> grads = zeros_like(w);
        const Matrix<double> grad_out = random_matrix<double>(T, H, seed, 2);
        const Matrix<double> grad_in = layer.backward(w, grad_out, grads);
        for (double g : grad_in.data) ASSERT_TRUE(std::isfinite(g));
        if (c.shared_ffn() == 0 && !rc.padding_mask.empty())
            for (int64_t t = 0; t < T; ++t)
                if (rc.padding_mask[size_t(t)])
                    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(grad_in(t, h), 0.0);

        // float32 agrees with float64 whenever it routes the same way.
        MoeLayer<float> layer_f(c);
        LayerInput<float> in_f;
        in_f.hidden = in.hidden.cast<float>();
        in_f.seq_length = T;
        in_f.padding_mask = rc.padding_mask;
        const Matrix<float> out_f = layer_f.forward(init_weights<float>(c, seed), in_f);
        if (layer_f.routing_map() == map) EXPECT_LE(test::max_abs_diff(out_f.cast<double>(), out), 1e-5);
    }
    EXPECT_GT(dropped_cases, 3) << "the random cases must exercise dropping";
    EXPECT_GT(padded_cases, 3) << "the random cases must exercise padding to capacity";
}

}  // namespace
}  // namespace moekit::cpu
