// make_cpu_layer_runner (src/cpu/layer_runner.h): the LayerRunner interface over the float32
// reference layer cpu::MoeLayer<float>, used by `moekit train/layer --device cpu` and as the
// oracle the CUDA runner is compared against.
#include "cpu/layer_runner.h"

namespace moekit::cpu {

namespace {
class CpuLayerRunner final : public LayerRunner {
   public:
    explicit CpuLayerRunner(const MoeConfig& config) : layer_(config) {}

    Matrix<float> forward(const MoeWeights<float>& w, const LayerInput<float>& in) override {
        Matrix<float> out = layer_.forward(w, in);
        forwarded_ = true;  // MoeLayer's probs()/routing_map() need a forward's context
        return out;
    }
    Matrix<float> backward(const MoeWeights<float>& w, const Matrix<float>& grad_output,
                           MoeWeights<float>& grads) override {
        return layer_.backward(w, grad_output, grads);
    }
    RoutingSummary summary() const override { return layer_.summary(); }
    Matrix<float> probs() const override { return forwarded_ ? layer_.probs() : Matrix<float>(); }
    std::vector<uint8_t> routing_map() const override {
        return forwarded_ ? layer_.routing_map() : std::vector<uint8_t>();
    }
    void update_expert_bias(MoeWeights<float>& w) override { layer_.update_expert_bias(w); }
    void reset_global_aux_loss_tracker() override { layer_.reset_global_aux_loss_tracker(); }

   private:
    MoeLayer<float> layer_;
    bool forwarded_ = false;
};
}  // namespace

std::unique_ptr<LayerRunner> make_cpu_layer_runner(const MoeConfig& config) {
    return std::make_unique<CpuLayerRunner>(config);
}

}  // namespace moekit::cpu
