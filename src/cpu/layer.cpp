// cpu::MoeLayer<T> (include/moekit/layer.h), the reference MoE layer (Megatron MoELayer.forward):
// shared expert -> router -> permute -> experts -> unpermute -> + shared output, and the explicit
// backward through the same stages in reverse. T = float or double.
// Tests: tests/cpu/test_layer.cpp, test_layer_gradcheck.cpp, test_layer_properties.cpp.
#include "moekit/layer.h"

#include "cpu/layer_context.h"
#include "moekit/error.h"

namespace moekit::cpu {

namespace {
template <typename T>
void check_weights(const MoeConfig& config, const MlpShape& expert, const MlpShape& shared, const MoeWeights<T>& w,
                   const char* what) {
    const int64_t num_experts = config.num_experts(), hidden = config.hidden_size;
    MOEKIT_CHECK(w.router_weight.rows == num_experts && w.router_weight.cols == hidden, what, ": router.weight is [",
                 w.router_weight.rows, ", ", w.router_weight.cols, "], expected [", num_experts, ", ", hidden, "]");
    MOEKIT_CHECK(int64_t(w.fc1.size()) == num_experts && int64_t(w.fc2.size()) == num_experts, what, ": ", w.fc1.size(),
                 " fc1 and ", w.fc2.size(), " fc2 expert weights, expected ", num_experts);
    for (int64_t e = 0; e < num_experts; ++e) {
        MOEKIT_CHECK(w.fc1[size_t(e)].rows == expert.fc1_rows() && w.fc1[size_t(e)].cols == hidden, what,
                     ": experts.local_experts.", e, ".linear_fc1.weight is [", w.fc1[size_t(e)].rows, ", ",
                     w.fc1[size_t(e)].cols, "], expected [", expert.fc1_rows(), ", ", hidden, "]");
        MOEKIT_CHECK(w.fc2[size_t(e)].rows == hidden && w.fc2[size_t(e)].cols == expert.ffn, what,
                     ": experts.local_experts.", e, ".linear_fc2.weight is [", w.fc2[size_t(e)].rows, ", ",
                     w.fc2[size_t(e)].cols, "], expected [", hidden, ", ", expert.ffn, "]");
    }
    if (shared.ffn > 0) {
        MOEKIT_CHECK(w.shared_fc1.rows == shared.fc1_rows() && w.shared_fc1.cols == hidden, what,
                     ": shared_experts.linear_fc1.weight is [", w.shared_fc1.rows, ", ", w.shared_fc1.cols,
                     "], expected [", shared.fc1_rows(), ", ", hidden, "]");
        MOEKIT_CHECK(w.shared_fc2.rows == hidden && w.shared_fc2.cols == shared.ffn, what,
                     ": shared_experts.linear_fc2.weight is [", w.shared_fc2.rows, ", ", w.shared_fc2.cols,
                     "], expected [", hidden, ", ", shared.ffn, "]");
        const bool gate = !w.shared_gate.empty();
        MOEKIT_CHECK(gate == config.moe_shared_expert_gate, what, ": shared_experts.gate_weight is ",
                     gate ? "present" : "absent", " but --moe-shared-expert-gate is ",
                     config.moe_shared_expert_gate ? "set" : "not set");
    }
}

template <typename T>
void add_into(Matrix<T>& acc, const Matrix<T>& x) {
    for (size_t i = 0; i < acc.data.size(); ++i) acc.data[i] += x.data[i];
}
}  // namespace

template <typename T>
MoeLayer<T>::MoeLayer(const MoeConfig& config) : config_(config), ctx_(std::make_unique<LayerContext<T>>()) {
    config_.normalize();  // Megatron's __post_init__ rewrites (negative capacity factor -> dropless)
    config_.validate();
    ctx_->expert_shape = expert_mlp_shape(config_);
    ctx_->shared_shape = shared_mlp_shape(config_);
    const size_t num_experts = size_t(config_.num_experts());
    local_tokens_per_expert.assign(num_experts, 0.0);
    global_tokens_per_expert.assign(num_experts, 0.0);
    ctx_->router_state.local_tokens_per_expert = local_tokens_per_expert;
    ctx_->router_state.global_tokens_per_expert = global_tokens_per_expert;
}

template <typename T>
MoeLayer<T>::~MoeLayer() = default;

template <typename T>
MoeLayer<T>::MoeLayer(MoeLayer&&) noexcept = default;

template <typename T>
Matrix<T> MoeLayer<T>::forward(const MoeWeights<T>& w, const LayerInput<T>& in) {
    LayerContext<T>& ctx = *ctx_;
    const int64_t num_tokens = in.hidden.rows;
    MOEKIT_CHECK(in.hidden.cols == config_.hidden_size, "layer input is [", in.hidden.rows, ", ", in.hidden.cols,
                 "], expected hidden ", config_.hidden_size);
    MOEKIT_CHECK(in.padding_mask.empty() || int64_t(in.padding_mask.size()) == num_tokens, "padding_mask has ",
                 in.padding_mask.size(), " entries for ", num_tokens, " tokens");
    check_weights(config_, ctx.expert_shape, ctx.shared_shape, w, "weights");
    ctx.has_forward = false;
    ctx.hidden = in.hidden;

    // Shared expert first, on every token (padding included), as MoELayer.forward does.
    Matrix<T> shared_out;
    if (ctx.shared_shape.ffn > 0) shared_out = shared_expert_forward(ctx.shared_shape, w, in.hidden, ctx.shared);

    // The public buffers are the layer's API; the router works on its RouterState copy.
    ctx.router_state.local_tokens_per_expert = local_tokens_per_expert;
    ctx.router_state.global_tokens_per_expert = global_tokens_per_expert;
    ctx.router_state.ga_steps = ga_steps;
    router_forward(config_, w.router_weight, w.expert_bias, in, ctx.router_state, ctx.router);
    local_tokens_per_expert = ctx.router_state.local_tokens_per_expert;
    global_tokens_per_expert = ctx.router_state.global_tokens_per_expert;
    ga_steps = ctx.router_state.ga_steps;

    ctx.plan = build_routing_plan(ctx.router.routing_map, ctx.router.probs, num_tokens, config_.num_experts());
    ctx.permuted = permute(in.hidden, ctx.plan);
    const Matrix<T> expert_out = experts_forward(ctx.expert_shape, w.fc1, w.fc2, ctx.permuted, ctx.plan.offsets,
                                                 ctx.plan.permuted_probs, ctx.experts);
    Matrix<T> out = unpermute(expert_out, ctx.plan);
    if (ctx.shared_shape.ffn > 0) add_into(out, shared_out);
    ctx.has_forward = true;
    return out;
}

template <typename T>
Matrix<T> MoeLayer<T>::backward(const MoeWeights<T>& w, const Matrix<T>& grad_output, MoeWeights<T>& grads) {
    LayerContext<T>& ctx = *ctx_;
    MOEKIT_CHECK(ctx.has_forward, "MoeLayer::backward needs a forward first");
    MOEKIT_CHECK(grad_output.rows == ctx.hidden.rows && grad_output.cols == ctx.hidden.cols, "grad_output is [",
                 grad_output.rows, ", ", grad_output.cols, "], expected [", ctx.hidden.rows, ", ", ctx.hidden.cols,
                 "]");
    check_weights(config_, ctx.expert_shape, ctx.shared_shape, w, "weights");
    check_weights(config_, ctx.expert_shape, ctx.shared_shape, grads, "grads");

    // Routed path: unpermute^T (gather) -> experts^T -> permute^T (scatter-add); probs grads to [T, E].
    const Matrix<T> grad_expert_out = unpermute_backward(grad_output, ctx.plan);
    std::vector<T> grad_permuted_probs;
    const Matrix<T> grad_permuted =
        experts_backward(ctx.expert_shape, w.fc1, w.fc2, ctx.permuted, ctx.plan.offsets, ctx.plan.permuted_probs,
                         ctx.experts, grad_expert_out, grad_permuted_probs, grads.fc1, grads.fc2);
    Matrix<T> grad_hidden = permute_backward(grad_permuted, ctx.plan);
    const Matrix<T> grad_probs = permute_probs_backward(grad_permuted_probs, ctx.plan);

    // Router path (probs -> scores -> logits -> gating linear), including the aux/z-loss grads.
    router_backward(config_, w.router_weight, ctx.router, grad_probs, grad_hidden, grads.router_weight);

    if (ctx.shared_shape.ffn > 0)
        shared_expert_backward(ctx.shared_shape, w, ctx.hidden, ctx.shared, grad_output, grad_hidden, grads);
    return grad_hidden;
}

template <typename T>
const Matrix<T>& MoeLayer<T>::probs() const {
    return ctx_->router.probs;
}

template <typename T>
const std::vector<uint8_t>& MoeLayer<T>::routing_map() const {
    return ctx_->router.routing_map;
}

template <typename T>
RoutingSummary MoeLayer<T>::summary() const {
    RoutingSummary s;
    s.tokens_per_expert = ctx_->plan.tokens_per_expert;
    s.losses = ctx_->router.losses;
    return s;
}

template <typename T>
void MoeLayer<T>::update_expert_bias(MoeWeights<T>& w) {
    if (!config_.moe_router_enable_expert_bias) return;
    MOEKIT_CHECK(w.expert_bias.size() == size_t(config_.num_experts()), "router.expert_bias has ", w.expert_bias.size(),
                 " entries, expected ", config_.num_experts());
    cpu::update_expert_bias(config_.moe_router_bias_update_rate, w.expert_bias, local_tokens_per_expert);
    ctx_->router_state.local_tokens_per_expert = local_tokens_per_expert;
}

template <typename T>
void MoeLayer<T>::reset_global_aux_loss_tracker() {
    std::fill(global_tokens_per_expert.begin(), global_tokens_per_expert.end(), 0.0);
    ga_steps = 0;
    ctx_->router_state.global_tokens_per_expert = global_tokens_per_expert;
    ctx_->router_state.ga_steps = 0;
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace moekit::cpu
