// Tests of the whole CPU reference layer (src/cpu/layer.cpp, weights.cpp, layer_runner.cpp):
// parameter counts (C12), Megatron init, the layer against a per-token reference built from its
// own probs/map, padding tokens, drop-and-pad == drop (C5, layer level), zero-token experts (C9),
// router buffers kept in sync, determinism, and the LayerRunner wrapper.
#include <gtest/gtest.h>

#include "core/activation_math.h"
#include "cpu/layer_runner.h"
#include "layer_test_util.h"
#include "moekit/error.h"
#include "moekit/layer.h"

namespace moekit::cpu {
namespace {

using test::random_matrix;

MoeConfig small_config() {
    MoeConfig c;
    c.hidden_size = 12;
    c.num_moe_experts = 4;
    c.moe_ffn_hidden_size = 16;
    c.moe_router_topk = 2;
    return c;
}

template <typename T>
LayerInput<T> make_input(int64_t num_tokens, int64_t hidden, uint64_t seed) {
    LayerInput<T> in;
    in.hidden = random_matrix<T>(num_tokens, hidden, seed, 0);
    in.seq_length = num_tokens;
    in.micro_batch_size = 1;
    return in;
}

TEST(LayerWeights, ParameterCountC12) {
    MoeConfig c;
    c.hidden_size = 12;
    c.num_moe_experts = 2;
    c.ffn_hidden_size = 48;  // F = 4H, as upstream's test_sequential_mlp
    c.gated_linear_unit = true;
    c.activation_func = "silu";
    EXPECT_EQ(parameter_count(c), 3480);  // router 24 + 2 * (96*12 + 12*48)
    const MoeWeights<float> w = init_weights<float>(c, 7);
    int64_t n = w.router_weight.size();
    for (size_t e = 0; e < w.fc1.size(); ++e) n += w.fc1[e].size() + w.fc2[e].size();
    EXPECT_EQ(n, 3480);

    c.moe_shared_expert_intermediate_size = 20;
    c.moe_shared_expert_gate = true;
    EXPECT_EQ(parameter_count(c), 3480 + 40 * 12 + 12 * 20 + 12);
    const MoeWeights<float> ws = init_weights<float>(c, 7);
    EXPECT_EQ(ws.shared_fc1.rows, 40);
    EXPECT_EQ(ws.shared_fc2.cols, 20);
    EXPECT_EQ(ws.shared_gate.size(), 12);
}

TEST(LayerWeights, MegatronInitStatisticsAndDeterminism) {
    MoeConfig c = small_config();
    c.hidden_size = 64;
    c.moe_ffn_hidden_size = 128;
    c.num_layers = 8;
    c.moe_router_enable_expert_bias = true;
    c.moe_router_score_function = "sigmoid";
    const MoeWeights<double> w = init_weights<double>(c, 42);
    auto stddev = [](const Matrix<double>& m) {
        double s = 0;
        for (double v : m.data) s += v * v;
        return std::sqrt(s / double(m.size()));
    };
    // 8192 draws per tensor: the sample std is within ~1.5% of the true one (4 sigma).
    EXPECT_NEAR(stddev(w.fc1[0]), 0.02, 0.02 * 0.06);
    EXPECT_NEAR(stddev(w.fc2[3]), 0.02 / 4.0, 0.005 * 0.06);  // std / sqrt(2 * num_layers)
    EXPECT_EQ(w.expert_bias, std::vector<double>(4, 0.0));
    EXPECT_NE(w.fc1[0].data, w.fc1[1].data) << "each tensor draws from its own stream";
    const MoeWeights<double> again = init_weights<double>(c, 42);
    EXPECT_EQ(again.fc2[2].data, w.fc2[2].data);
    const MoeWeights<float> wf = init_weights<float>(c, 42);
    EXPECT_EQ(wf.router_weight.data[5], float(w.router_weight.data[5]));
    EXPECT_NE(init_weights<double>(c, 43).router_weight.data, w.router_weight.data);
    const MoeWeights<double> z = zeros_like(w);
    EXPECT_EQ(z.fc1[2].rows, w.fc1[2].rows);
    EXPECT_EQ(test::max_abs(z.fc1[2]), 0.0);
    EXPECT_TRUE(z.expert_bias.empty());
}

// out[t] = sum over the map of p[t, e] * MLP_e(x[t]) (+ shared): recomputed token by token in
// double from the layer's own probs and map, so this checks permute, experts and unpermute together.
TEST(Layer, MatchesPerTokenReference) {
    for (bool gated : {false, true}) {
        MoeConfig c = small_config();
        c.gated_linear_unit = gated;
        c.activation_func = gated ? "silu" : "gelu";
        const uint64_t seed = gated ? 11 : 12;
        SCOPED_TRACE(testing::Message() << "gated " << gated << ", seed " << seed);
        const MoeWeights<float> w = init_weights<float>(c, seed);
        const LayerInput<float> in = make_input<float>(40, c.hidden_size, seed);
        MoeLayer<float> layer(c);
        const Matrix<float> out = layer.forward(w, in);
        const Activation act = gated ? Activation::silu : Activation::gelu;
        const int64_t F = 16, H = 12, E = 4;
        for (int64_t t = 0; t < in.hidden.rows; ++t) {
            std::vector<double> ref(size_t(H), 0.0);
            int64_t routed = 0;
            for (int64_t e = 0; e < E; ++e) {
                if (!layer.routing_map()[size_t(t * E + e)]) continue;
                ++routed;
                const double p = layer.probs()(t, e);
                std::vector<double> h(size_t(w.fc1[size_t(e)].rows), 0.0);
                for (size_t f = 0; f < h.size(); ++f)
                    for (int64_t k = 0; k < H; ++k) h[f] += double(in.hidden(t, k)) * w.fc1[size_t(e)](int64_t(f), k);
                for (int64_t o = 0; o < H; ++o)
                    for (int64_t f = 0; f < F; ++f) {
                        const double a = gated ? glu_forward(act, h[size_t(f)], h[size_t(F + f)])
                                               : activation_forward(act, h[size_t(f)]);
                        ref[size_t(o)] += p * a * w.fc2[size_t(e)](o, f);
                    }
            }
            EXPECT_EQ(routed, 2);
            for (int64_t o = 0; o < H; ++o) EXPECT_NEAR(out(t, o), ref[size_t(o)], 1e-6) << t << ", " << o;
        }
        EXPECT_GT(test::max_abs(out), 1e-4);
    }
}

// Padded tokens are not routed: their output is exactly the shared expert's (zero without one),
// and the valid tokens' outputs equal those of a run on the valid tokens only.
TEST(Layer, PaddingTokensGetOnlySharedOutput) {
    for (bool shared : {false, true}) {
        MoeConfig c = small_config();
        if (shared) c.moe_shared_expert_intermediate_size = 8;
        const uint64_t seed = shared ? 21 : 22;
        SCOPED_TRACE(testing::Message() << "shared " << shared << ", seed " << seed);
        const MoeWeights<double> w = init_weights<double>(c, seed);
        LayerInput<double> in = make_input<double>(10, c.hidden_size, seed);
        in.padding_mask = {0, 1, 0, 0, 1, 1, 0, 0, 0, 1};
        MoeLayer<double> layer(c);
        const Matrix<double> out = layer.forward(w, in);
        LayerInput<double> valid;
        for (int64_t t = 0; t < 10; ++t)
            if (!in.padding_mask[size_t(t)])
                valid.hidden.data.insert(valid.hidden.data.end(), in.hidden.row(t), in.hidden.row(t) + 12);
        valid.hidden.rows = 6, valid.hidden.cols = 12, valid.seq_length = 6;
        MoeLayer<double> valid_layer(c);
        const Matrix<double> valid_out = valid_layer.forward(w, valid);
        int64_t v = 0;
        for (int64_t t = 0; t < 10; ++t) {
            if (in.padding_mask[size_t(t)]) {
                for (int64_t e = 0; e < 4; ++e) EXPECT_FALSE(layer.routing_map()[size_t(t * 4 + e)]);
                if (!shared)
                    for (int64_t h = 0; h < 12; ++h) EXPECT_EQ(out(t, h), 0.0);
            } else {
                for (int64_t h = 0; h < 12; ++h) EXPECT_NEAR(out(t, h), valid_out(v, h), 1e-14);
                ++v;
            }
        }
        const RoutingSummary s = layer.summary();
        int64_t rows = 0;
        for (int64_t n : s.tokens_per_expert) rows += n;
        EXPECT_EQ(rows, 6 * 2);
        Matrix<double> grad_out = random_matrix<double>(10, 12, seed, 9);
        MoeWeights<double> grads = zeros_like(w);
        const Matrix<double> grad_in = layer.backward(w, grad_out, grads);
        if (!shared)
            for (int64_t t : {1, 4, 5, 9})
                for (int64_t h = 0; h < 12; ++h) EXPECT_EQ(grad_in(t, h), 0.0) << "padded token " << t;
    }
}

// C5 at layer level: pad-to-capacity only adds rows of prob 0, so outputs and all gradients equal
// the dropping run's, while every expert processes exactly `capacity` rows.
TEST(Layer, DropAndPadEqualsDrop) {
    for (const char* policy : {"probs", "position"}) {
        MoeConfig c = small_config();
        c.moe_expert_capacity_factor = 0.6;
        c.moe_token_drop_policy = policy;
        MoeConfig c_pad = c;
        c_pad.moe_pad_expert_input_to_capacity = true;
        const uint64_t seed = 31;
        SCOPED_TRACE(testing::Message() << "policy " << policy << ", seed " << seed);
        const MoeWeights<double> w = init_weights<double>(c, seed);
        const LayerInput<double> in = make_input<double>(16, c.hidden_size, seed);
        MoeLayer<double> drop(c), pad(c_pad);
        const Matrix<double> out_drop = drop.forward(w, in), out_pad = pad.forward(w, in);
        const int64_t capacity = 5;  // ceil(16 * 2 / 4 * 0.6)
        int64_t total = 0;
        for (int64_t n : drop.summary().tokens_per_expert) {
            EXPECT_LE(n, capacity);
            total += n;
        }
        EXPECT_LT(total, 32) << "the case must drop tokens";
        for (int64_t n : pad.summary().tokens_per_expert) EXPECT_EQ(n, capacity);
        EXPECT_LE(test::max_abs_diff(out_drop, out_pad), 1e-15);
        const Matrix<double> grad_out = random_matrix<double>(16, 12, seed, 9);
        MoeWeights<double> g_drop = zeros_like(w), g_pad = zeros_like(w);
        const Matrix<double> gi_drop = drop.backward(w, grad_out, g_drop), gi_pad = pad.backward(w, grad_out, g_pad);
        EXPECT_LE(test::max_abs_diff(gi_drop, gi_pad), 1e-15);
        EXPECT_LE(test::max_abs_diff(g_drop.router_weight, g_pad.router_weight), 1e-15);
        for (size_t e = 0; e < 4; ++e) {
            EXPECT_LE(test::max_abs_diff(g_drop.fc1[e], g_pad.fc1[e]), 1e-15);
            EXPECT_LE(test::max_abs_diff(g_drop.fc2[e], g_pad.fc2[e]), 1e-15);
        }
    }
}

// C9 at layer level: an expert no token picks (its router row strongly negative) gets zero
// output rows and exactly zero, well-shaped weight grads.
TEST(Layer, ZeroTokenExpertHasZeroGrads) {
    MoeConfig c = small_config();
    MoeWeights<float> w = init_weights<float>(c, 41);
    LayerInput<float> in = make_input<float>(24, c.hidden_size, 41);
    for (int64_t h = 0; h < 12; ++h) w.router_weight(2, h) = 0;  // logit of expert 2 is always 0 ...
    for (int64_t t = 0; t < 24; ++t) in.hidden(t, 0) = 1;
    w.router_weight(2, 0) = -50;  // ... made -50 through a constant input feature
    MoeLayer<float> layer(c);
    layer.forward(w, in);
    EXPECT_EQ(layer.summary().tokens_per_expert[2], 0);
    MoeWeights<float> grads = zeros_like(w);
    layer.backward(w, random_matrix<float>(24, 12, 41, 5), grads);
    EXPECT_EQ(grads.fc1[2].rows, w.fc1[2].rows);
    EXPECT_EQ(test::max_abs(grads.fc1[2]), 0.0);
    EXPECT_EQ(test::max_abs(grads.fc2[2]), 0.0);
    EXPECT_GT(test::max_abs(grads.fc1[0]) + test::max_abs(grads.fc1[1]), 0.0);
}

TEST(Layer, DeterministicAndRunnerMatchesLayer) {
    MoeConfig c = small_config();
    c.moe_shared_expert_intermediate_size = 8;
    c.moe_shared_expert_gate = true;
    const MoeWeights<float> w = init_weights<float>(c, 51);
    const LayerInput<float> in = make_input<float>(300, c.hidden_size, 51);
    const Matrix<float> grad_out = random_matrix<float>(300, 12, 51, 3);
    MoeLayer<float> a(c), b(c);
    const Matrix<float> out_a = a.forward(w, in), out_b = b.forward(w, in);
    EXPECT_EQ(out_a.data, out_b.data);
    MoeWeights<float> ga = zeros_like(w), gb = zeros_like(w);
    EXPECT_EQ(a.backward(w, grad_out, ga).data, b.backward(w, grad_out, gb).data);
    EXPECT_EQ(ga.shared_gate.data, gb.shared_gate.data);
    EXPECT_GT(test::max_abs(ga.shared_gate), 0.0);

    auto runner = make_layer_runner(c, "cpu");
    EXPECT_EQ(runner->forward(w, in).data, out_a.data);
    MoeWeights<float> gr = zeros_like(w);
    EXPECT_EQ(runner->backward(w, grad_out, gr).data, a.backward(w, grad_out, ga).data);
    for (size_t e = 0; e < 4; ++e) EXPECT_EQ(gr.fc1[e].data, gb.fc1[e].data);  // ga got a second, accumulated pass
    EXPECT_EQ(runner->summary().tokens_per_expert, a.summary().tokens_per_expert);
}

// Edge sizes: one token, and no tokens at all (every stage must cope with empty tensors).
TEST(Layer, OneAndZeroTokens) {
    MoeConfig c = small_config();
    c.moe_shared_expert_intermediate_size = 4;
    const MoeWeights<double> w = init_weights<double>(c, 91);
    for (int64_t num_tokens : {1, 0}) {
        SCOPED_TRACE(testing::Message() << "tokens " << num_tokens);
        MoeLayer<double> layer(c);
        const Matrix<double> out = layer.forward(w, make_input<double>(num_tokens, 12, 91));
        EXPECT_EQ(out.rows, num_tokens);
        EXPECT_EQ(out.cols, 12);
        int64_t rows = 0;
        for (int64_t n : layer.summary().tokens_per_expert) rows += n;
        EXPECT_EQ(rows, 2 * num_tokens);
        MoeWeights<double> grads = zeros_like(w);
        const Matrix<double> grad_in = layer.backward(w, Matrix<double>(num_tokens, 12, 1.0), grads);
        EXPECT_EQ(grad_in.rows, num_tokens);
        if (num_tokens == 0) EXPECT_EQ(test::max_abs(grads.fc1[0]) + test::max_abs(grads.router_weight), 0.0);
    }
}

TEST(Layer, BackwardAccumulatesIntoGrads) {
    MoeConfig c = small_config();
    const MoeWeights<double> w = init_weights<double>(c, 61);
    const LayerInput<double> in = make_input<double>(12, 12, 61);
    MoeLayer<double> layer(c);
    layer.forward(w, in);
    const Matrix<double> grad_out = random_matrix<double>(12, 12, 61, 2);
    MoeWeights<double> once = zeros_like(w), twice = zeros_like(w);
    layer.backward(w, grad_out, once);
    layer.backward(w, grad_out, twice);
    layer.backward(w, grad_out, twice);
    for (size_t i = 0; i < once.router_weight.data.size(); ++i)
        EXPECT_NEAR(twice.router_weight.data[i], 2 * once.router_weight.data[i], 1e-15);
    EXPECT_NEAR(twice.fc2[1].data[3], 2 * once.fc2[1].data[3], 1e-15);
}

// The public router buffers follow the RouterState: expert-bias counts (valid tokens x k),
// the bias update, and the global-aux tracker with its reset.
TEST(Layer, RouterBuffersStayInSync) {
    MoeConfig c = small_config();
    c.moe_router_score_function = "sigmoid";
    c.moe_router_enable_expert_bias = true;
    c.moe_router_bias_update_rate = 0.1;
    c.moe_router_load_balancing_type = {"global_aux_loss"};
    c.moe_aux_loss_coeff = {0.01};
    MoeWeights<float> w = init_weights<float>(c, 71);
    LayerInput<float> in = make_input<float>(20, 12, 71);
    in.padding_mask.assign(20, 0);
    in.padding_mask[3] = 1;
    MoeLayer<float> layer(c);
    layer.forward(w, in);
    layer.forward(w, in);
    double counted = 0, tracked = 0;
    for (double v : layer.local_tokens_per_expert) counted += v;
    for (double v : layer.global_tokens_per_expert) tracked += v;
    EXPECT_EQ(counted, 2 * 19 * 2);  // two forwards x valid tokens x k
    EXPECT_EQ(layer.ga_steps, 2);
    EXPECT_GT(tracked, 0);
    const std::vector<double> counts = layer.local_tokens_per_expert;
    layer.update_expert_bias(w);
    double mean = counted / 4;
    for (size_t e = 0; e < 4; ++e) {
        const double expected = counts[e] < mean ? 0.1 : (counts[e] > mean ? -0.1 : 0.0);
        EXPECT_NEAR(w.expert_bias[e], expected, 1e-12) << "expert " << e;
        EXPECT_EQ(layer.local_tokens_per_expert[e], 0.0);
    }
    layer.reset_global_aux_loss_tracker();
    EXPECT_EQ(layer.ga_steps, 0);
    EXPECT_EQ(layer.global_tokens_per_expert, std::vector<double>(4, 0.0));
    layer.forward(w, in);  // the router sees the reset tracker: first step again
    EXPECT_EQ(layer.ga_steps, 1);
}

TEST(Layer, RejectsBadShapes) {
    MoeConfig c = small_config();
    const MoeWeights<float> w = init_weights<float>(c, 81);
    MoeLayer<float> layer(c);
    EXPECT_THROW(layer.forward(w, make_input<float>(4, 11, 81)), Error);
    MoeWeights<float> grads = zeros_like(w);
    EXPECT_THROW(layer.backward(w, Matrix<float>(4, 12), grads), Error);  // no forward yet
    MoeWeights<float> wrong = w;
    wrong.fc2.pop_back();
    EXPECT_THROW(layer.forward(wrong, make_input<float>(4, 12, 81)), Error);
    MoeConfig bad = c;
    bad.activation_func = "swish";
    EXPECT_THROW(MoeLayer<float>{bad}, UsageError);
}

}  // namespace
}  // namespace moekit::cpu
