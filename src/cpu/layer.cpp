// cpu::MoeLayer<T> (include/moekit/layer.h), the single-process reference layer: the pipeline of
// src/cpu/moe_pipeline.cpp on a group of one rank (EP = 1: the dispatcher is plain permute/unpermute),
// plus Megatron's router buffers as public members. T = float or double.
// Tests: tests/cpu/test_layer.cpp, test_layer_gradcheck.cpp, test_layer_properties.cpp.
#include "moekit/layer.h"

#include "cpu/layer_context.h"
#include "moekit/error.h"

namespace moekit::cpu {

template <typename T>
MoeLayer<T>::MoeLayer(const MoeConfig& config) : config_(config), ctx_(std::make_unique<LayerContext<T>>()) {
    config_.normalize();  // Megatron's __post_init__ rewrites (negative capacity factor -> dropless)
    config_.validate();
    ctx_->single_rank = comm::make_single_rank();
    ctx_->groups = make_process_groups(*ctx_->single_rank, 1);
    MoeConfig one_rank = config_;
    one_rank.expert_model_parallel_size = 1;  // this layer holds every expert, whatever the config's EP
    ctx_->pipeline = std::make_unique<MoePipeline<T>>(one_rank, *ctx_->groups);
    const size_t num_experts = size_t(config_.num_experts());
    local_tokens_per_expert.assign(num_experts, 0.0);
    global_tokens_per_expert.assign(num_experts, 0.0);
}

template <typename T>
MoeLayer<T>::~MoeLayer() = default;

template <typename T>
MoeLayer<T>::MoeLayer(MoeLayer&&) noexcept = default;

template <typename T>
Matrix<T> MoeLayer<T>::forward(const MoeWeights<T>& w, const LayerInput<T>& in) {
    // The public buffers are the layer's API; the router works on the pipeline's RouterState copy.
    RouterState& state = ctx_->pipeline->router_state();
    state.local_tokens_per_expert = local_tokens_per_expert;
    state.global_tokens_per_expert = global_tokens_per_expert;
    state.ga_steps = ga_steps;
    Matrix<T> out = ctx_->pipeline->forward(w, in);
    local_tokens_per_expert = state.local_tokens_per_expert;
    global_tokens_per_expert = state.global_tokens_per_expert;
    ga_steps = state.ga_steps;
    return out;
}

template <typename T>
Matrix<T> MoeLayer<T>::backward(const MoeWeights<T>& w, const Matrix<T>& grad_output, MoeWeights<T>& grads) {
    return ctx_->pipeline->backward(w, grad_output, grads);
}

template <typename T>
const Matrix<T>& MoeLayer<T>::probs() const {
    return ctx_->pipeline->probs();
}

template <typename T>
const std::vector<uint8_t>& MoeLayer<T>::routing_map() const {
    return ctx_->pipeline->routing_map();
}

template <typename T>
RoutingSummary MoeLayer<T>::summary() const {
    return ctx_->pipeline->summary();
}

template <typename T>
void MoeLayer<T>::update_expert_bias(MoeWeights<T>& w) {
    if (!config_.moe_router_enable_expert_bias) return;
    MOEKIT_CHECK(w.expert_bias.size() == size_t(config_.num_experts()), "router.expert_bias has ", w.expert_bias.size(),
                 " entries, expected ", config_.num_experts());
    RouterState& state = ctx_->pipeline->router_state();
    state.local_tokens_per_expert = local_tokens_per_expert;
    ctx_->pipeline->update_expert_bias(w);  // one rank: the all-reduce is the identity
    local_tokens_per_expert = state.local_tokens_per_expert;
}

template <typename T>
void MoeLayer<T>::reset_global_aux_loss_tracker() {
    std::fill(global_tokens_per_expert.begin(), global_tokens_per_expert.end(), 0.0);
    ga_steps = 0;
    ctx_->pipeline->reset_global_aux_loss_tracker();
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace moekit::cpu
