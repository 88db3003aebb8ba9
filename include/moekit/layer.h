// One MoE layer, forward and backward: Router -> permute -> experts (grouped MLP) -> unpermute,
// plus the shared expert beside it. cpu::MoeLayer is the reference (oracle) backend; other
// backends implement LayerRunner and are checked against it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/config.h"
#include "moekit/tensor.h"
#include "moekit/weights.h"

namespace moekit {

// Loss values as attached to the graph (coefficients included), Megatron §2.
struct LossValues {
    double aux_loss = 0;
    double seq_aux_loss = 0;
    double global_aux_loss = 0;
    double z_loss = 0;
};

template <typename T>
struct LayerInput {
    Matrix<T> hidden;                   // [S*B, H], row s*B + b (Megatron's [S, B, H] flattened)
    int64_t seq_length = 0;             // S
    int64_t micro_batch_size = 1;       // B
    std::vector<uint8_t> padding_mask;  // [S*B], 1 = padding (Megatron's [B, S] mask transposed); empty = none
    bool training = true;               // losses and expert-bias counts only when training
    uint64_t jitter_seed = 0;           // draws of --moe-input-jitter-eps for this call
};

// What a step's routing looked like (device-independent summary).
struct RoutingSummary {
    std::vector<int64_t> tokens_per_expert;  // [E] rows each expert processed (post-drop, incl. pad rows)
    LossValues losses;
};

// A layer on some device; float32 at the interface.
class LayerRunner {
public:
    virtual ~LayerRunner() = default;
    virtual Matrix<float> forward(const MoeWeights<float>& w, const LayerInput<float>& in) = 0;
    // grads accumulate (+=) into `grads`, which must have the shapes of `w` (zeros_like).
    virtual Matrix<float> backward(const MoeWeights<float>& w, const Matrix<float>& grad_output,
                                   MoeWeights<float>& grads) = 0;
    virtual RoutingSummary summary() const = 0;
    // Results of the last forward, copied to the host (for a GPU runner a synchronous copy: call
    // between steps, never inside one): router probs [T, E] dense (zero outside the map) and the
    // routing map [T, E] (1 = token routed to expert, after capacity drops). Empty before a forward.
    virtual Matrix<float> probs() const = 0;
    virtual std::vector<uint8_t> routing_map() const = 0;
    // Megatron's per-global-batch updates.
    virtual void update_expert_bias(MoeWeights<float>& w) = 0;
    virtual void reset_global_aux_loss_tracker() = 0;
};

// device: "cpu" or "cuda" (the latter only in CUDA builds; throws UsageError otherwise).
std::unique_ptr<LayerRunner> make_layer_runner(const MoeConfig& config, const std::string& device);
bool cuda_device_available();  // a CUDA build and at least one GPU

namespace cpu {

template <typename T>
struct LayerContext;  // everything forward saves for backward (src/cpu/layer_context.h)

// Reference layer in T = float or double. Holds Megatron's router buffers across steps.
template <typename T>
class MoeLayer {
public:
    explicit MoeLayer(const MoeConfig& config);
    ~MoeLayer();
    MoeLayer(MoeLayer&&) noexcept;

    Matrix<T> forward(const MoeWeights<T>& w, const LayerInput<T>& in);
    // Returns d(loss)/d(input) = routed + router + shared paths; parameter grads accumulate
    // into `grads`. The aux/z-loss gradients are injected with moe_loss_backward_scale.
    Matrix<T> backward(const MoeWeights<T>& w, const Matrix<T>& grad_output, MoeWeights<T>& grads);

    // Results of the last forward.
    const Matrix<T>& probs() const;                    // [T, E] dense, zero outside the map
    const std::vector<uint8_t>& routing_map() const;   // [T, E]
    RoutingSummary summary() const;

    // Router buffers (Megatron names).
    std::vector<double> local_tokens_per_expert;   // [E], accumulated for the expert-bias update
    std::vector<double> global_tokens_per_expert;  // [E], global_aux_loss tracker
    int64_t ga_steps = 0;
    void update_expert_bias(MoeWeights<T>& w);  // bias += rate * sign(mean(c) - c); counts reset
    void reset_global_aux_loss_tracker();

    const MoeConfig& config() const { return config_; }

private:
    MoeConfig config_;
    std::unique_ptr<LayerContext<T>> ctx_;
};

}  // namespace cpu
}  // namespace moekit
