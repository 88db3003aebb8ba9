// moekit::Layer on the CPU backend (include/moekit/device_layer.h): the view API computes exactly what the
// reference layer computes (forward, backward, router state), gradients accumulate like main_grad, and bad
// views are refused before any work with a message naming the tensor. Implementation: src/cpu/device_layer.cpp,
// checks: src/core/layer_views.cpp. The CUDA twin: tests/gpu/test_cuda_device_layer.cu.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/layer_views.h"
#include "cpu/layer_test_util.h"
#include "moekit/comm.h"
#include "moekit/device_layer.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit {
namespace {

MoeConfig config_with_everything() {
    MoeConfig c;
    c.hidden_size = 24;
    c.num_moe_experts = 6;
    c.moe_ffn_hidden_size = 16;
    c.moe_router_topk = 2;
    c.gated_linear_unit = true;
    c.activation_func = "silu";
    c.seq_length = 10;
    c.micro_batch_size = 2;
    c.moe_router_score_function = "sigmoid";
    c.moe_router_enable_expert_bias = true;
    c.moe_router_load_balancing_type = {"seq_aux_loss"};
    c.moe_aux_loss_coeff = {0.01};
    c.moe_z_loss_coeff = 0.001;
    c.moe_shared_expert_intermediate_size = 12;
    c.moe_shared_expert_gate = true;
    c.normalize();
    c.validate();
    return c;
}

// Flat host copies of a MoeWeights in the API's layouts, with views over them.
struct HostParams {
    std::vector<float> router, fc1, fc2, sfc1, sfc2, gate;
    std::vector<double> bias;
    LayerParams views(const MoeConfig& c) {
        const int64_t E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), F1 = c.fc1_rows();
        const int64_t Fs = c.shared_ffn();
        LayerParams p;
        p.router_weight = host_view(router.data(), {E, H});
        if (!bias.empty()) p.expert_bias = host_view(bias.data(), {E});
        p.fc1 = host_view(fc1.data(), {E, F1, H}), p.fc2 = host_view(fc2.data(), {E, H, F});
        if (!sfc1.empty()) p.shared_fc1 = host_view(sfc1.data(), {int64_t(sfc1.size()) / H, H});
        if (!sfc2.empty()) p.shared_fc2 = host_view(sfc2.data(), {H, Fs});
        if (!gate.empty()) p.shared_gate = host_view(gate.data(), {1, H});
        return p;
    }
    LayerGrads grad_views(const MoeConfig& c) {
        LayerParams p = views(c);
        return LayerGrads{p.router_weight, p.fc1, p.fc2, p.shared_fc1, p.shared_fc2, p.shared_gate};
    }
};

std::vector<float> stacked(const std::vector<Matrix<float>>& ms) {
    std::vector<float> v;
    for (const auto& m : ms) v.insert(v.end(), m.data.begin(), m.data.end());
    return v;
}

HostParams host_params(const MoeWeights<float>& w) {
    HostParams h;
    h.router = w.router_weight.data, h.fc1 = stacked(w.fc1), h.fc2 = stacked(w.fc2);
    h.sfc1 = w.shared_fc1.data, h.sfc2 = w.shared_fc2.data, h.gate = w.shared_gate.data, h.bias = w.expert_bias;
    return h;
}

HostParams zero_grads(const MoeWeights<float>& w) {
    HostParams g = host_params(w);
    for (auto* v : {&g.router, &g.fc1, &g.fc2, &g.sfc1, &g.sfc2, &g.gate}) std::fill(v->begin(), v->end(), 0.0f);
    g.bias.clear();
    return g;
}

TEST(LayerApiCpu, MatchesTheReferenceLayerExactly) {
    const uint64_t seed = 4242;
    const MoeConfig c = config_with_everything();
    const int64_t T = c.seq_length * c.micro_batch_size, H = c.hidden_size;
    MoeWeights<float> w = init_weights<float>(c, seed);
    for (size_t e = 0; e < w.expert_bias.size(); ++e) w.expert_bias[e] = 0.01 * double(e % 3);
    const Matrix<float> x = test::random_matrix<float>(T, H, seed, 1), gy = test::random_matrix<float>(T, H, seed, 2);

    cpu::MoeLayer<float> ref(c);
    LayerInput<float> in;
    in.hidden = x, in.seq_length = c.seq_length, in.micro_batch_size = c.micro_batch_size;
    std::vector<uint8_t> mask(size_t(T), 0);
    mask[3] = mask[17] = 1;  // two padding tokens: the optional mask view must be taken and honoured
    in.padding_mask = mask;
    const Matrix<float> ref_out = ref.forward(w, in);
    MoeWeights<float> ref_grads = zeros_like(w);
    const Matrix<float> ref_gx = ref.backward(w, gy, ref_grads);

    auto layer = Layer::create(c, LayerBounds{c.seq_length, c.micro_batch_size}, Backend::cpu);
    HostParams p = host_params(w), g = zero_grads(w);
    std::vector<float> xin = x.data, out(size_t(T * H)), go = gy.data, gx(size_t(T * H), 7.0f);
    ForwardArgs fa;
    fa.input = host_view(xin.data(), {T, H}), fa.output = host_view(out.data(), {T, H});
    fa.padding_mask = host_view(mask.data(), {T});
    int64_t jitter_seed = 0;
    fa.jitter_seed = TensorView(&jitter_seed, DType::i64, {1});
    layer->forward(p.views(c), fa, Stream{});
    EXPECT_EQ(out, ref_out.data);
    BackwardArgs ba;
    ba.grad_output = host_view(go.data(), {T, H}), ba.grad_input = host_view(gx.data(), {T, H});
    layer->backward(p.views(c), g.grad_views(c), ba, Stream{});
    EXPECT_EQ(gx, ref_gx.data) << "grad_input is overwritten (the 7s are gone)";
    EXPECT_EQ(g.router, ref_grads.router_weight.data);
    EXPECT_EQ(g.fc1, stacked(ref_grads.fc1));
    EXPECT_EQ(g.fc2, stacked(ref_grads.fc2));
    EXPECT_EQ(g.sfc1, ref_grads.shared_fc1.data);
    EXPECT_EQ(g.gate, ref_grads.shared_gate.data);
    EXPECT_GT(test::max_abs(ref_grads.router_weight), 0.0);

    // A second backward accumulates (main_grad), and with accumulate_grad_input the input grad too.
    ba.accumulate_grad_input = true;
    layer->backward(p.views(c), g.grad_views(c), ba, Stream{});
    for (size_t i = 0; i < g.fc1.size(); ++i) ASSERT_EQ(g.fc1[i], 2.0f * stacked(ref_grads.fc1)[i]) << i;
    for (size_t i = 0; i < gx.size(); ++i) ASSERT_EQ(gx[i], 2.0f * ref_gx.data[i]) << i;

    // Results and the router update match the reference's.
    const LayerResults r = layer->results();
    ASSERT_EQ(r.tokens_per_expert.dtype, DType::i32);
    const RoutingSummary s = ref.summary();
    for (int64_t e = 0; e < c.num_experts(); ++e)
        EXPECT_EQ(r.tokens_per_expert.as<int32_t>()[e], s.tokens_per_expert[size_t(e)]) << "expert " << e;
    EXPECT_EQ(r.losses.as<double>()[1], s.losses.seq_aux_loss);
    EXPECT_GT(s.losses.seq_aux_loss, 0.0);
    MoeWeights<float> w_ref = w;
    ref.update_expert_bias(w_ref);
    layer->update_expert_bias(p.views(c).expert_bias, Stream{});
    EXPECT_EQ(p.bias, w_ref.expert_bias);
    EXPECT_NE(p.bias, w.expert_bias);
}

// Each misuse is refused before any work, naming the tensor; the output is untouched.
// Layer::create's EP form: a group of one rank is the plain layer; the CPU backend refuses a larger group, and a
// group whose size is not --expert-model-parallel-size is refused naming the flag (the CUDA form:
// tests/gpu/test_cuda_train_ep.cu). The view checks know the local experts (L = E / EP).
TEST(LayerApiCpu, EpGroupFormOfCreate) {
    MoeConfig c = config_with_everything();
    const LayerBounds bounds{c.seq_length, c.micro_batch_size};
    auto one = comm::make_single_rank();
    auto layer = Layer::create(c, bounds, Backend::cpu, *one);
    EXPECT_EQ(layer->local_experts(), c.num_experts());
    comm::run_virtual_ranks(2, [&](Communicator& world) {
        MoeConfig c2 = c;
        c2.expert_model_parallel_size = 2;
        try {
            Layer::create(c2, bounds, Backend::cpu, world);
            ADD_FAILURE() << "the CPU backend took an EP group of 2";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("the CPU backend's Layer runs one rank"), std::string::npos) << e.what();
        }
        try {
            Layer::create(c, bounds, Backend::cuda, world);  // EP = 1 in the config, 2 ranks in the group
            ADD_FAILURE() << "an EP group of 2 was taken for --expert-model-parallel-size=1";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("--expert-model-parallel-size=1 but the EP group has 2 rank(s)"),
                      std::string::npos) << e.what();
        }
    });
    // The shared view rules at EP = 3 (6 experts, 2 local): [2, F1, H] is right, [6, F1, H] is refused.
    const int64_t H = c.hidden_size, F1 = c.fc1_rows(), F = c.expert_ffn();
    std::vector<float> mem(size_t(6 * F1 * H + 6 * H * F + 6 * H), 0.25f);
    ViewRules rules;
    rules.local_experts = 2;
    TensorView fc1 = host_view(mem.data(), {2, F1, H});
    EXPECT_NO_THROW(check_view("fc1", fc1, DType::f32, {rules.local_experts, F1, H}, rules));
    LayerParams p;
    p.router_weight = host_view(mem.data(), {6, H});
    std::vector<double> bias(6, 0.0);
    p.expert_bias = host_view(bias.data(), {6});
    p.fc1 = host_view(mem.data(), {6, F1, H});
    try {
        check_params(c, p, rules);
        ADD_FAILURE() << "fc1 of all 6 experts was taken where 2 are local";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(str("expected F32[2, ", F1, ", ", H, "]")), std::string::npos) << e.what();
    }
}

TEST(LayerApiCpu, BadViewsAreClearErrorsBeforeAnyWork) {
    const MoeConfig c = config_with_everything();
    const int64_t T = c.seq_length * c.micro_batch_size, H = c.hidden_size, E = c.num_experts();
    const MoeWeights<float> w = init_weights<float>(c, 5);
    auto layer = Layer::create(c, LayerBounds{c.seq_length, c.micro_batch_size}, Backend::cpu);
    HostParams p = host_params(w), g = zero_grads(w);
    std::vector<float> x(size_t(T * H), 0.5f), out(size_t(T * H), -3.0f);
    std::vector<uint16_t> half(size_t(T * H));
    auto expect_refused = [&](const std::string& what, const std::string& name, auto&& call) {
        try {
            call();
            ADD_FAILURE() << what << ": accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << what << ": " << e.what();
        }
        EXPECT_EQ(out[0], -3.0f) << what << ": the output was written";
    };
    ForwardArgs ok;
    ok.input = host_view(x.data(), {T, H}), ok.output = host_view(out.data(), {T, H});
    BackwardArgs bok;
    bok.grad_output = host_view(x.data(), {T, H}), bok.grad_input = host_view(out.data(), {T, H});
    expect_refused("backward before forward", "forward", [&] { layer->backward(p.views(c), g.grad_views(c), bok, {}); });
    expect_refused("input of the wrong shape", "input", [&] {
        ForwardArgs a = ok;
        a.input = host_view(x.data(), {T - 1, H});
        layer->forward(p.views(c), a, {});
    });
    expect_refused("bf16 input on the CPU", "input", [&] {
        ForwardArgs a = ok;
        a.input = TensorView(half.data(), DType::bf16, {T, H});
        layer->forward(p.views(c), a, {});
    });
    expect_refused("fc1 of the wrong shape", "fc1", [&] {
        LayerParams v = p.views(c);
        v.fc1 = host_view(p.fc1.data(), {E - 1, c.fc1_rows(), H});
        layer->forward(v, ok, {});
    });
    expect_refused("missing expert bias", "expert_bias", [&] {
        LayerParams v = p.views(c);
        v.expert_bias = TensorView();
        layer->forward(v, ok, {});
    });
    expect_refused("a CUDA view on the CPU backend", "router.weight", [&] {
        LayerParams v = p.views(c);
        v.router_weight.backend = Backend::cuda;
        layer->forward(v, ok, {});
    });
    expect_refused("output aliasing input", "output", [&] {
        ForwardArgs a = ok;
        a.output = a.input;
        layer->forward(p.views(c), a, {});
    });
    layer->forward(p.views(c), ok, {});
    out.assign(out.size(), -3.0f);
    expect_refused("a null gradient buffer", "grad fc2", [&] {
        LayerGrads gv = g.grad_views(c);
        gv.fc2 = TensorView();
        layer->backward(p.views(c), gv, bok, {});
    });
    expect_refused("a gradient in bf16", "grad router.weight", [&] {
        LayerGrads gv = g.grad_views(c);
        gv.router_weight.dtype = DType::bf16;
        layer->backward(p.views(c), gv, bok, {});
    });
    EXPECT_THROW(Layer::create(c, LayerBounds{0, 2}, Backend::cpu), UsageError);
}

}  // namespace
}  // namespace moekit
