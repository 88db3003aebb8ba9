// make_cuda_layer_runner (src/cuda/layer_runner.h): the float32 LayerRunner interface as a thin adapter
// over moekit::Layer's CUDA backend (src/cuda/device_layer.cu). Inputs and weights are rounded to bf16 and
// uploaded on every call (correctness over speed at this interface); outputs and gradients come back as float. The layer is rebuilt
// when the token shape changes, carrying the expert-bias counts and the global-aux tracker across
// (Megatron's buffers do not depend on the batch shape). probs()/routing_map() copy the last forward's
// router results to the host (synchronous; between steps only). Twin: cpu::make_cpu_layer_runner.
// Tests: tests/gpu/test_cuda_layer.cu, tests/gpu/test_cuda_cmd_layer.cpp (moekit layer cpu vs cuda).
#include <algorithm>

#include "core/bf16.h"
#include "cpu/router.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/device_layer.h"
#include "cuda/layer_runner.h"
#include "cuda/moe_layer.h"

namespace moekit::cuda {

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no driver/device" error
        return 0;
    }
    return n;
}

namespace {

std::vector<__nv_bfloat16> to_bf16(const float* src, size_t n) {
    std::vector<__nv_bfloat16> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = __nv_bfloat16_raw{float_to_bf16_bits(src[i])};
    return out;
}

using bf16 = __nv_bfloat16;

void upload_bf16(__nv_bfloat16* dst, const Matrix<float>& m) { upload(dst, to_bf16(m.data.data(), m.data.size())); }

void upload_stacked(__nv_bfloat16* dst, const std::vector<Matrix<float>>& ms) {
    size_t offset = 0;
    for (const Matrix<float>& m : ms) {
        upload(dst + offset, to_bf16(m.data.data(), m.data.size()));
        offset += m.data.size();
    }
}

void add_into(Matrix<float>& acc, const std::vector<float>& v, size_t offset = 0) {
    for (size_t i = 0; i < acc.data.size(); ++i) acc.data[i] += v[offset + i];
}

// Device copies of one layer's parameters, gradients and activations, in moekit::Layer's dtypes.
struct RunnerBuffers {
    DeviceBuffer<bf16> router_weight, fc1, fc2, shared_fc1, shared_fc2, shared_gate, hidden, output, grad_output;
    DeviceBuffer<float> expert_bias_f32, grad_router_weight, grad_fc1, grad_fc2, grad_shared_fc1, grad_shared_fc2;
    DeviceBuffer<float> grad_shared_gate, grad_input;
    DeviceBuffer<double> expert_bias_f64;
    DeviceBuffer<uint8_t> padding_mask;
    DeviceBuffer<int64_t> jitter_seed;
};

class CudaLayerRunner final : public LayerRunner {
public:
    explicit CudaLayerRunner(const MoeConfig& config) : config_(config) {
        config_.normalize();
        config_.validate();
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device_));
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    ~CudaLayerRunner() override {
        layer_.reset();
        if (stream_) cudaStreamDestroy(stream_);
    }

    Matrix<float> forward(const MoeWeights<float>& w, const LayerInput<float>& in) override {
        const int64_t T = in.hidden.rows, H = config_.hidden_size;
        MOEKIT_CHECK(in.hidden.cols == H, "layer input is [", T, ", ", in.hidden.cols, "], expected hidden ", H);
        const int64_t B = std::max<int64_t>(1, in.micro_batch_size);
        const int64_t S = in.seq_length > 0 ? in.seq_length : T / B;
        MOEKIT_CHECK(S * B == T, "seq_length ", S, " x micro_batch_size ", B, " != tokens ", T);
        if (!layer_ || S != bounds_.seq_length || B != bounds_.micro_batch_size) resize(LayerBounds{S, B});
        upload(buf_.jitter_seed.get(), std::vector<int64_t>{int64_t(in.jitter_seed)});
        upload_bf16(buf_.hidden.get(), in.hidden);
        std::vector<uint8_t> mask = in.padding_mask;
        if (mask.empty()) mask.assign(size_t(T), 0);
        MOEKIT_CHECK(int64_t(mask.size()) == T, "padding_mask has ", mask.size(), " entries for ", T, " tokens");
        upload(buf_.padding_mask.get(), mask);
        upload_weights(w);
        ForwardArgs a;
        a.input = view(buf_.hidden, {T, H}), a.output = view(buf_.output, {T, H});
        a.padding_mask = view(buf_.padding_mask, {T}), a.jitter_seed = view(buf_.jitter_seed, {1});
        a.training = in.training;
        layer_->forward(params(), a, Stream{stream_});
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        Matrix<float> out(T, H);
        const std::vector<bf16> o = buf_.output.download();
        for (size_t i = 0; i < o.size(); ++i) out.data[i] = bf16_bits_to_float(__nv_bfloat16_raw(o[i]).x);
        training_ = in.training;
        return out;
    }

    Matrix<float> backward(const MoeWeights<float>& w, const Matrix<float>& grad_output,
                           MoeWeights<float>& grads) override {
        MOEKIT_CHECK(layer_, "backward needs a forward first");
        const int64_t T = bounds_.num_tokens(), H = config_.hidden_size;
        MOEKIT_CHECK(grad_output.rows == T && grad_output.cols == H, "grad_output is [", grad_output.rows, ", ",
                     grad_output.cols, "], expected [", T, ", ", H, "]");
        (void)w;  // the weights uploaded by forward are the ones used
        upload_bf16(buf_.grad_output.get(), grad_output);
        // The layer accumulates into its gradients (main_grad); this interface returns one call's worth.
        for (DeviceBuffer<float>* g : {&buf_.grad_router_weight, &buf_.grad_fc1, &buf_.grad_fc2, &buf_.grad_shared_fc1,
                                       &buf_.grad_shared_fc2, &buf_.grad_shared_gate})
            if (g->size()) MOEKIT_CUDA_CHECK(cudaMemsetAsync(g->get(), 0, g->bytes(), stream_));
        BackwardArgs a;
        a.grad_output = view(buf_.grad_output, {T, H}), a.grad_input = view(buf_.grad_input, {T, H});
        layer_->backward(params(), grad_views(), a, Stream{stream_});
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        add_into(grads.router_weight, buf_.grad_router_weight.download());
        const std::vector<float> g1 = buf_.grad_fc1.download(), g2 = buf_.grad_fc2.download();
        size_t o1 = 0, o2 = 0;
        for (size_t e = 0; e < grads.fc1.size(); ++e) {
            add_into(grads.fc1[e], g1, o1), o1 += grads.fc1[e].data.size();
            add_into(grads.fc2[e], g2, o2), o2 += grads.fc2[e].data.size();
        }
        if (buf_.grad_shared_fc1.size()) {
            add_into(grads.shared_fc1, buf_.grad_shared_fc1.download());
            add_into(grads.shared_fc2, buf_.grad_shared_fc2.download());
            if (!grads.shared_gate.empty()) add_into(grads.shared_gate, buf_.grad_shared_gate.download());
        }
        Matrix<float> grad_input(T, H);
        const std::vector<float> gi = buf_.grad_input.download();
        std::copy(gi.begin(), gi.end(), grad_input.data.begin());
        return grad_input;
    }

    RoutingSummary summary() const override {
        RoutingSummary s;
        if (!layer_) return s;
        s.tokens_per_expert = layer_->inner().read_tokens_per_expert();
        if (training_) s.losses = layer_->inner().read_losses();
        return s;
    }

    // Host copies of the last forward's router results. These are synchronous D2H copies, which is
    // fine here: they run between steps (the interface's contract), never inside the sync-free step.
    Matrix<float> probs() const override {
        if (!layer_) return {};
        const TensorView v = layer_->results().probs;
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the copies below run on the legacy stream
        Matrix<float> p(v.shape[0], v.shape[1]);
        if (v.dtype == DType::f64) {
            const std::vector<double> d = download(v.as<const double>(), v.numel());
            std::transform(d.begin(), d.end(), p.data.begin(), [](double x) { return float(x); });
        } else {
            const std::vector<float> d = download(v.as<const float>(), v.numel());
            std::copy(d.begin(), d.end(), p.data.begin());
        }
        return p;
    }
    std::vector<uint8_t> routing_map() const override {
        if (!layer_) return {};
        const TensorView v = layer_->results().routing_map;
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return download(v.as<const uint8_t>(), v.numel());
    }

    void update_expert_bias(MoeWeights<float>& w) override {
        if (!config_.moe_router_enable_expert_bias || !layer_) return;
        std::vector<double> counts = layer_->inner().read_local_tokens_per_expert();
        cpu::update_expert_bias(config_.moe_router_bias_update_rate, w.expert_bias, counts);
        layer_->inner().reset_local_tokens_per_expert();
    }
    void reset_global_aux_loss_tracker() override {
        if (layer_) layer_->reset_global_aux_loss_tracker(Stream{stream_});
    }

private:
    // A new layer and buffers for another token shape, carrying the router trackers across.
    void resize(const LayerBounds& bounds) {
        std::unique_ptr<CudaLayer> fresh = make_cuda_layer(config_, bounds, device_);
        if (layer_) carry_trackers(layer_->inner(), fresh->inner());
        layer_ = std::move(fresh);
        bounds_ = bounds;
        const int64_t T = bounds.num_tokens(), H = config_.hidden_size, E = config_.num_experts();
        const int64_t F = config_.expert_ffn(), F1 = config_.fc1_rows(), Fs = config_.shared_ffn();
        const int64_t Fs1 = Fs * (config_.gated_linear_unit ? 2 : 1);
        buf_.hidden.resize(T * H), buf_.output.resize(T * H), buf_.grad_output.resize(T * H);
        buf_.grad_input.resize(T * H), buf_.padding_mask.resize(T), buf_.jitter_seed.resize(1);
        buf_.router_weight.resize(E * H), buf_.fc1.resize(E * F1 * H), buf_.fc2.resize(E * H * F);
        buf_.grad_router_weight.resize(E * H), buf_.grad_fc1.resize(E * F1 * H), buf_.grad_fc2.resize(E * H * F);
        if (config_.moe_router_enable_expert_bias) {
            (layer_->router_dtype() == DType::f64 ? buf_.expert_bias_f64.resize(E) : buf_.expert_bias_f32.resize(E));
        }
        buf_.shared_fc1.resize(Fs1 * H), buf_.shared_fc2.resize(H * Fs);
        buf_.grad_shared_fc1.resize(Fs1 * H), buf_.grad_shared_fc2.resize(H * Fs);
        const bool gate = Fs > 0 && config_.moe_shared_expert_gate;
        buf_.shared_gate.resize(gate ? H : 0), buf_.grad_shared_gate.resize(gate ? H : 0);
    }

    template <typename T>
    TensorView view(DeviceBuffer<T>& b, std::initializer_list<int64_t> dims) const {
        DType d = DType::f32;
        if constexpr (std::is_same_v<T, bf16>) d = DType::bf16;
        if constexpr (std::is_same_v<T, double>) d = DType::f64;
        if constexpr (std::is_same_v<T, uint8_t>) d = DType::u8;
        if constexpr (std::is_same_v<T, int64_t>) d = DType::i64;
        return b.size() ? TensorView(b.get(), d, dims, Backend::cuda, device_) : TensorView();
    }
    LayerParams params() {
        const int64_t H = config_.hidden_size, E = config_.num_experts(), F = config_.expert_ffn();
        const int64_t F1 = config_.fc1_rows(), Fs = config_.shared_ffn(), Fs1 = buf_.shared_fc1.size() / std::max<int64_t>(H, 1);
        LayerParams p;
        p.router_weight = view(buf_.router_weight, {E, H});
        p.expert_bias = buf_.expert_bias_f64.size() ? view(buf_.expert_bias_f64, {E}) : view(buf_.expert_bias_f32, {E});
        p.fc1 = view(buf_.fc1, {E, F1, H}), p.fc2 = view(buf_.fc2, {E, H, F});
        p.shared_fc1 = view(buf_.shared_fc1, {Fs1, H}), p.shared_fc2 = view(buf_.shared_fc2, {H, Fs});
        p.shared_gate = view(buf_.shared_gate, {1, H});
        return p;
    }
    LayerGrads grad_views() {
        const int64_t H = config_.hidden_size, E = config_.num_experts(), F = config_.expert_ffn();
        const int64_t F1 = config_.fc1_rows(), Fs = config_.shared_ffn(), Fs1 = buf_.shared_fc1.size() / std::max<int64_t>(H, 1);
        LayerGrads g;
        g.router_weight = view(buf_.grad_router_weight, {E, H});
        g.fc1 = view(buf_.grad_fc1, {E, F1, H}), g.fc2 = view(buf_.grad_fc2, {E, H, F});
        g.shared_fc1 = view(buf_.grad_shared_fc1, {Fs1, H}), g.shared_fc2 = view(buf_.grad_shared_fc2, {H, Fs});
        g.shared_gate = view(buf_.grad_shared_gate, {1, H});
        return g;
    }
    // Copies the [E] expert-bias counts, the [E] global_aux_loss running sum and its step count
    // from the old layer into its replacement (same E; between steps, on the runner's stream).
    void carry_trackers(const CudaMoeLayer& from, const CudaMoeLayer& to) {
        const LayerBuffers &a = from.buffers(), &b = to.buffers();
        const size_t E = size_t(from.shape().router.num_experts);
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b.local_tokens_per_expert, a.local_tokens_per_expert, E * sizeof(double),
                                          cudaMemcpyDeviceToDevice, stream_));
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b.global_tokens_per_expert, a.global_tokens_per_expert, E * sizeof(double),
                                          cudaMemcpyDeviceToDevice, stream_));
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b.ga_steps, a.ga_steps, sizeof(int32_t), cudaMemcpyDeviceToDevice, stream_));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the old layer's buffers are freed
    }
    void upload_weights(const MoeWeights<float>& w) {
        upload_bf16(buf_.router_weight.get(), w.router_weight);
        upload_stacked(buf_.fc1.get(), w.fc1);
        upload_stacked(buf_.fc2.get(), w.fc2);
        if (config_.moe_router_enable_expert_bias) {
            const int64_t E = config_.num_experts();
            MOEKIT_CHECK(int64_t(w.expert_bias.size()) == E, "router.expert_bias has ", w.expert_bias.size(),
                         " entries, expected ", E);
            if (buf_.expert_bias_f64.size()) {
                buf_.expert_bias_f64.upload(w.expert_bias);
            } else {
                buf_.expert_bias_f32.upload(std::vector<float>(w.expert_bias.begin(), w.expert_bias.end()));
            }
        }
        if (buf_.shared_fc1.size()) {
            upload_bf16(buf_.shared_fc1.get(), w.shared_fc1);
            upload_bf16(buf_.shared_fc2.get(), w.shared_fc2);
            if (buf_.shared_gate.size()) upload_bf16(buf_.shared_gate.get(), w.shared_gate);
        }
    }

    MoeConfig config_;
    int device_ = 0;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<CudaLayer> layer_;
    LayerBounds bounds_{0, 0};
    RunnerBuffers buf_;
    bool training_ = true;
};

}  // namespace

std::unique_ptr<LayerRunner> make_cuda_layer_runner(const MoeConfig& config) {
    return std::make_unique<CudaLayerRunner>(config);
}

}  // namespace moekit::cuda
