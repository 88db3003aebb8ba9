// make_cuda_layer_runner (src/cuda/layer_runner.h): the float32 LayerRunner interface over
// CudaMoeLayer. Inputs and weights are rounded to bf16 and uploaded on every call (correctness
// over speed at this interface); outputs and gradients come back as float. The layer is rebuilt
// when the token shape changes, carrying the expert-bias counts and the global-aux tracker across
// (Megatron's buffers do not depend on the batch shape). probs()/routing_map() copy the last forward's
// router results to the host (synchronous; between steps only). Twin: cpu::make_cpu_layer_runner.
// Tests: tests/gpu/test_cuda_layer.cu, tests/gpu/test_cuda_cmd_layer.cpp (moekit layer cpu vs cuda).
#include <algorithm>

#include "core/bf16.h"
#include "cpu/router.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
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

class CudaLayerRunner final : public LayerRunner {
public:
    explicit CudaLayerRunner(const MoeConfig& config) : config_(config) {
        config_.normalize();
        config_.validate();
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
        if (!layer_ || S != seq_length_ || B != micro_batch_size_) {
            std::unique_ptr<CudaMoeLayer> fresh = CudaMoeLayer::create(config_, S, B);
            if (layer_) carry_trackers(*layer_, *fresh);
            layer_ = std::move(fresh);
            seq_length_ = S, micro_batch_size_ = B;
        }
        const LayerBuffers& b = layer_->buffers();
        upload(b.jitter_seed, std::vector<uint64_t>{in.jitter_seed});
        upload_bf16(b.hidden, in.hidden);
        std::vector<uint8_t> mask = in.padding_mask;
        if (mask.empty()) mask.assign(size_t(T), 0);
        MOEKIT_CHECK(int64_t(mask.size()) == T, "padding_mask has ", mask.size(), " entries for ", T, " tokens");
        upload(b.padding_mask, mask);
        upload_weights(w);
        layer_->forward(stream_, in.training);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        Matrix<float> out(T, H);
        const std::vector<__nv_bfloat16> o = download(b.output, T * H);
        for (size_t i = 0; i < o.size(); ++i) out.data[i] = bf16_bits_to_float(__nv_bfloat16_raw(o[i]).x);
        training_ = in.training;
        return out;
    }

    Matrix<float> backward(const MoeWeights<float>& w, const Matrix<float>& grad_output,
                           MoeWeights<float>& grads) override {
        MOEKIT_CHECK(layer_, "backward needs a forward first");
        const LayerBuffers& b = layer_->buffers();
        const int64_t T = seq_length_ * micro_batch_size_, H = config_.hidden_size;
        MOEKIT_CHECK(grad_output.rows == T && grad_output.cols == H, "grad_output is [", grad_output.rows, ", ",
                     grad_output.cols, "], expected [", T, ", ", H, "]");
        (void)w;  // the weights uploaded by forward are the ones used
        upload_bf16(b.grad_output, grad_output);
        layer_->backward(stream_);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        add_into(grads.router_weight, download(b.grad_router_weight, grads.router_weight.size()));
        const std::vector<float> g1 = download(b.grad_fc1, stacked_size(grads.fc1));
        const std::vector<float> g2 = download(b.grad_fc2, stacked_size(grads.fc2));
        size_t o1 = 0, o2 = 0;
        for (size_t e = 0; e < grads.fc1.size(); ++e) {
            add_into(grads.fc1[e], g1, o1), o1 += grads.fc1[e].data.size();
            add_into(grads.fc2[e], g2, o2), o2 += grads.fc2[e].data.size();
        }
        if (layer_->shape().has_shared) {
            add_into(grads.shared_fc1, download(b.grad_shared_fc1, grads.shared_fc1.size()));
            add_into(grads.shared_fc2, download(b.grad_shared_fc2, grads.shared_fc2.size()));
            if (!grads.shared_gate.empty())
                add_into(grads.shared_gate, download(b.grad_shared_gate, grads.shared_gate.size()));
        }
        Matrix<float> grad_input(T, H);
        const std::vector<float> gi = download(b.grad_input, T * H);
        std::copy(gi.begin(), gi.end(), grad_input.data.begin());
        return grad_input;
    }

    RoutingSummary summary() const override {
        RoutingSummary s;
        if (!layer_) return s;
        s.tokens_per_expert = layer_->read_tokens_per_expert();
        if (training_) s.losses = layer_->read_losses();
        return s;
    }

    // Host copies of the last forward's router results. These are synchronous D2H copies, which is
    // fine here: they run between steps (the interface's contract), never inside the sync-free step.
    Matrix<float> probs() const override {
        if (!layer_) return {};
        const int64_t T = seq_length_ * micro_batch_size_, E = layer_->shape().router.num_experts;
        const LayerBuffers& b = layer_->buffers();
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the copies below run on the legacy stream
        Matrix<float> p(T, E);
        if (layer_->shape().router_fp64) {
            const std::vector<double> v = download(static_cast<const double*>(b.probs), T * E);
            std::transform(v.begin(), v.end(), p.data.begin(), [](double x) { return float(x); });
        } else {
            const std::vector<float> v = download(static_cast<const float*>(b.probs), T * E);
            std::copy(v.begin(), v.end(), p.data.begin());
        }
        return p;
    }
    std::vector<uint8_t> routing_map() const override {
        if (!layer_) return {};
        const int64_t T = seq_length_ * micro_batch_size_, E = layer_->shape().router.num_experts;
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return download(static_cast<const uint8_t*>(layer_->buffers().routing_map), T * E);
    }

    void update_expert_bias(MoeWeights<float>& w) override {
        if (!config_.moe_router_enable_expert_bias || !layer_) return;
        std::vector<double> counts = layer_->read_local_tokens_per_expert();
        cpu::update_expert_bias(config_.moe_router_bias_update_rate, w.expert_bias, counts);
        layer_->reset_local_tokens_per_expert();
    }
    void reset_global_aux_loss_tracker() override {
        if (layer_) layer_->reset_global_aux_loss_tracker();
    }

private:
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
    static int64_t stacked_size(const std::vector<Matrix<float>>& ms) {
        int64_t n = 0;
        for (const Matrix<float>& m : ms) n += m.size();
        return n;
    }
    void upload_weights(const MoeWeights<float>& w) {
        const LayerBuffers& b = layer_->buffers();
        const CudaLayerShape& s = layer_->shape();
        upload_bf16(b.router_weight, w.router_weight);
        upload_stacked(b.fc1, w.fc1);
        upload_stacked(b.fc2, w.fc2);
        if (s.router.has_expert_bias) {
            MOEKIT_CHECK(int64_t(w.expert_bias.size()) == s.router.num_experts, "router.expert_bias has ",
                         w.expert_bias.size(), " entries, expected ", s.router.num_experts);
            if (s.router_fp64) {
                upload(static_cast<double*>(b.expert_bias), w.expert_bias);
            } else {
                upload(static_cast<float*>(b.expert_bias),
                       std::vector<float>(w.expert_bias.begin(), w.expert_bias.end()));
            }
        }
        if (s.has_shared) {
            upload_bf16(b.shared_fc1, w.shared_fc1);
            upload_bf16(b.shared_fc2, w.shared_fc2);
            if (s.shared.has_gate) upload_bf16(b.shared_gate, w.shared_gate);
        }
    }

    MoeConfig config_;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<CudaMoeLayer> layer_;
    int64_t seq_length_ = 0, micro_batch_size_ = 0;
    bool training_ = true;
};

}  // namespace

std::unique_ptr<LayerRunner> make_cuda_layer_runner(const MoeConfig& config) {
    return std::make_unique<CudaLayerRunner>(config);
}

}  // namespace moekit::cuda
