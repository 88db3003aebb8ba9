// moekit::Layer on the CPU backend (include/moekit/device_layer.h): host views in, the float32 reference
// layer cpu::MoeLayer<float> inside. Views are copied into the reference's matrices on each call (O(params),
// small next to the O(tokens x params) compute), results are kept for results(). Synchronous; the stream
// is ignored. Twin: src/cuda/device_layer.cu. Tests: tests/cpu/test_device_layer.cpp.
#include <algorithm>
#include <cstring>

#include "core/layer_views.h"
#include "cpu/device_layer.h"
#include "moekit/error.h"
#include "moekit/layer.h"

namespace moekit::cpu {
namespace {

Matrix<float> matrix_of(const TensorView& v, int64_t rows, int64_t cols, int64_t offset = 0) {
    Matrix<float> m(rows, cols);
    std::memcpy(m.data.data(), v.as<const float>() + offset, size_t(rows * cols) * sizeof(float));
    return m;
}

std::vector<Matrix<float>> stacked_of(const TensorView& v) {
    const int64_t E = v.shape[0], rows = v.shape[1], cols = v.shape[2];
    std::vector<Matrix<float>> out;
    for (int64_t e = 0; e < E; ++e) out.push_back(matrix_of(v, rows, cols, e * rows * cols));
    return out;
}

void add_to(const TensorView& v, const Matrix<float>& m, int64_t offset = 0) {
    float* dst = v.as<float>() + offset;
    for (size_t i = 0; i < m.data.size(); ++i) dst[i] += m.data[i];
}

class CpuLayer final : public Layer {
public:
    CpuLayer(const MoeConfig& config, const LayerBounds& bounds) : layer_(config), bounds_(bounds) {
        config_ = layer_.config();
        MOEKIT_REQUIRE(bounds.seq_length > 0 && bounds.micro_batch_size > 0, "layer bounds: seq_length=",
                       bounds.seq_length, " and micro_batch_size=", bounds.micro_batch_size, " must be positive");
        const int64_t E = config_.num_experts(), T = bounds.num_tokens();
        counts_.assign(size_t(E), 0), losses_.assign(4, 0.0);
        probs_ = Matrix<float>(T, E), map_.assign(size_t(T * E), 0);
    }

    Backend backend() const override { return Backend::cpu; }
    int device() const override { return 0; }
    const MoeConfig& config() const override { return config_; }
    const LayerBounds& bounds() const override { return bounds_; }
    DType param_dtype() const override { return DType::f32; }
    DType activation_dtype() const override { return DType::f32; }
    DType router_dtype() const override { return DType::f64; }
    int64_t local_experts() const override { return config_.num_experts(); }

    void forward(const LayerParams& p, const ForwardArgs& a, Stream) override {
        check_params(config_, p, rules());
        check_forward_args(config_, bounds_, a, rules());
        const int64_t T = bounds_.num_tokens(), H = config_.hidden_size;
        LayerInput<float> in;
        in.hidden = matrix_of(a.input, T, H);
        in.seq_length = bounds_.seq_length, in.micro_batch_size = bounds_.micro_batch_size;
        if (!a.padding_mask.empty()) in.padding_mask.assign(a.padding_mask.as<uint8_t>(), a.padding_mask.as<uint8_t>() + T);
        in.training = a.training;
        in.jitter_seed = a.jitter_seed.empty() ? 0 : uint64_t(*a.jitter_seed.as<int64_t>());
        const Matrix<float> out = layer_.forward(weights_of(p), in);
        std::memcpy(a.output.data, out.data.data(), out.data.size() * sizeof(float));
        const RoutingSummary s = layer_.summary();
        std::transform(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), counts_.begin(),
                       [](int64_t c) { return int32_t(c); });
        losses_ = {s.losses.aux_loss, s.losses.seq_aux_loss, s.losses.global_aux_loss, s.losses.z_loss};
        probs_ = layer_.probs();
        map_ = layer_.routing_map();
        forwarded_ = true;
    }

    void backward(const LayerParams& p, const LayerGrads& g, const BackwardArgs& a, Stream) override {
        MOEKIT_REQUIRE(forwarded_, "Layer::backward: no forward to differentiate (call forward first)");
        check_params(config_, p, rules());
        check_grads(config_, g, rules());
        check_backward_args(config_, bounds_, a, rules());
        const int64_t T = bounds_.num_tokens(), H = config_.hidden_size;
        const MoeWeights<float> w = weights_of(p);
        MoeWeights<float> grads = zeros_like(w);
        const Matrix<float> grad_input = layer_.backward(w, matrix_of(a.grad_output, T, H), grads);
        if (a.accumulate_grad_input) {
            add_to(a.grad_input, grad_input);
        } else {
            std::memcpy(a.grad_input.data, grad_input.data.data(), grad_input.data.size() * sizeof(float));
        }
        add_to(g.router_weight, grads.router_weight);
        for (size_t e = 0; e < grads.fc1.size(); ++e) {
            add_to(g.fc1, grads.fc1[e], int64_t(e) * grads.fc1[e].size());
            add_to(g.fc2, grads.fc2[e], int64_t(e) * grads.fc2[e].size());
        }
        if (!g.shared_fc1.empty()) add_to(g.shared_fc1, grads.shared_fc1), add_to(g.shared_fc2, grads.shared_fc2);
        if (!g.shared_gate.empty()) add_to(g.shared_gate, grads.shared_gate);
    }

    void update_expert_bias(const TensorView& expert_bias, Stream) override {
        if (!config_.moe_router_enable_expert_bias) return;
        check_view("router.expert_bias", expert_bias, DType::f64, {config_.num_experts()}, rules());
        MoeWeights<float> w;
        w.expert_bias.assign(expert_bias.as<double>(), expert_bias.as<double>() + config_.num_experts());
        layer_.update_expert_bias(w);
        std::copy(w.expert_bias.begin(), w.expert_bias.end(), expert_bias.as<double>());
    }
    void reset_global_aux_loss_tracker(Stream) override { layer_.reset_global_aux_loss_tracker(); }

    LayerResults results() const override {
        const int64_t T = bounds_.num_tokens(), E = config_.num_experts();
        LayerResults r;
        r.tokens_per_expert = TensorView(const_cast<int32_t*>(counts_.data()), DType::i32, {E});
        r.losses = TensorView(const_cast<double*>(losses_.data()), DType::f64, {4});
        r.probs = TensorView(const_cast<float*>(probs_.data.data()), DType::f32, {T, E});
        r.routing_map = TensorView(const_cast<uint8_t*>(map_.data()), DType::u8, {T, E});
        return r;
    }
    LayerMemory memory() const override {
        LayerMemory m;
        m.num_tokens = bounds_.num_tokens();
        return m;  // the reference allocates per call; its memory is not the engine's claim
    }

    // The reference layer itself (the host LayerRunner reads its summary).
    const MoeLayer<float>& reference() const { return layer_; }

private:
    ViewRules rules() const { return ViewRules{Backend::cpu, 0, DType::f32, DType::f64, DType::f32, DType::f32}; }

    MoeWeights<float> weights_of(const LayerParams& p) const {
        MoeWeights<float> w;
        const int64_t E = config_.num_experts(), H = config_.hidden_size;
        w.router_weight = matrix_of(p.router_weight, E, H);
        if (!p.expert_bias.empty()) w.expert_bias.assign(p.expert_bias.as<double>(), p.expert_bias.as<double>() + E);
        w.fc1 = stacked_of(p.fc1);
        w.fc2 = stacked_of(p.fc2);
        if (!p.shared_fc1.empty()) {
            w.shared_fc1 = matrix_of(p.shared_fc1, p.shared_fc1.shape[0], H);
            w.shared_fc2 = matrix_of(p.shared_fc2, H, p.shared_fc2.shape[1]);
        }
        if (!p.shared_gate.empty()) w.shared_gate = matrix_of(p.shared_gate, 1, H);
        return w;
    }

    MoeLayer<float> layer_;
    MoeConfig config_;
    LayerBounds bounds_;
    std::vector<int32_t> counts_;
    std::vector<double> losses_;
    Matrix<float> probs_;
    std::vector<uint8_t> map_;
    bool forwarded_ = false;
};

}  // namespace

std::unique_ptr<Layer> make_cpu_layer(const MoeConfig& config, const LayerBounds& bounds) {
    return std::make_unique<CpuLayer>(config, bounds);
}

}  // namespace moekit::cpu
