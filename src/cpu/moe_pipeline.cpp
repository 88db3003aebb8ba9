// cpu::MoePipeline<T> (src/cpu/moe_pipeline.h): Megatron's MoELayer.forward on one rank of an EP
// group, shared expert -> router -> dispatch -> local experts -> combine -> + shared output, and the
// explicit backward through the same stages in reverse; gradient and expert-bias reductions over
// the process groups. T = float or double. Tests: tests/mpi/test_ep_mpi.cpp, tests/cpu/test_layer*.cpp.
#include "cpu/moe_pipeline.h"

#include "moekit/error.h"

namespace moekit::cpu {

namespace {
// Router and shared tensors in full; experts: E entries, the local block [first, first + L) shaped.
template <typename T>
void check_weights(const MoeConfig& config, const EpLayout& layout, const MlpShape& expert, const MlpShape& shared,
                   const MoeWeights<T>& w, const char* what) {
    const int64_t num_experts = config.num_experts(), hidden = config.hidden_size;
    MOEKIT_CHECK(w.router_weight.rows == num_experts && w.router_weight.cols == hidden, what, ": router.weight is [",
                 w.router_weight.rows, ", ", w.router_weight.cols, "], expected [", num_experts, ", ", hidden, "]");
    MOEKIT_CHECK(int64_t(w.fc1.size()) == num_experts && int64_t(w.fc2.size()) == num_experts, what, ": ", w.fc1.size(),
                 " fc1 and ", w.fc2.size(), " fc2 expert weights, expected ", num_experts);
    const int64_t first = layout.first_local_expert();
    for (int64_t e = first; e < first + layout.num_local_experts; ++e) {
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

template <typename T>
void all_reduce(Communicator& c, Matrix<T>& m) {
    c.all_reduce(m.data.data(), m.size());
}
}  // namespace

template <typename T>
MoePipeline<T>::MoePipeline(const MoeConfig& config, const ProcessGroups& groups) : config_(config), groups_(groups) {
    config_.normalize();  // Megatron's __post_init__ rewrites (negative capacity factor -> dropless)
    config_.validate();
    MOEKIT_CHECK(groups.ep && groups.expert_dp && groups.dp, "process groups are incomplete");
    MOEKIT_REQUIRE(config_.expert_model_parallel_size == groups.ep->size(), "--expert-model-parallel-size=",
                   config_.expert_model_parallel_size, " but the EP group has ", groups.ep->size(), " ranks");
    expert_shape_ = expert_mlp_shape(config_);
    shared_shape_ = shared_mlp_shape(config_);
    dispatcher_ = make_dispatcher<T>(config_, *groups.ep);
    if ((echo_dispatcher_ = dynamic_cast<EchoDispatcher<T>*>(dispatcher_.get())))
        echo_ = std::make_unique<EchoExperts<T>>(*echo_dispatcher_, *groups.ep, config_.moe_echo_recompute_expert_dispatch);
    state_.local_tokens_per_expert.assign(size_t(config_.num_experts()), 0.0);
    state_.global_tokens_per_expert.assign(size_t(config_.num_experts()), 0.0);
}

template <typename T>
Matrix<T> MoePipeline<T>::forward(const MoeWeights<T>& w, const LayerInput<T>& in) {
    PipelineContext<T>& ctx = ctx_;
    const EpLayout& ep = layout();
    const int64_t num_tokens = in.hidden.rows;
    MOEKIT_CHECK(in.hidden.cols == config_.hidden_size, "layer input is [", in.hidden.rows, ", ", in.hidden.cols,
                 "], expected hidden ", config_.hidden_size);
    MOEKIT_CHECK(in.padding_mask.empty() || int64_t(in.padding_mask.size()) == num_tokens, "padding_mask has ",
                 in.padding_mask.size(), " entries for ", num_tokens, " tokens");
    check_weights(config_, ep, expert_shape_, shared_shape_, w, "weights");
    ctx.has_forward = false;
    ctx.hidden = in.hidden;

    // Shared expert first, on every token (padding included), as MoELayer.forward does.
    Matrix<T> shared_out;
    if (shared_shape_.ffn > 0) shared_out = shared_expert_forward(shared_shape_, w, in.hidden, ctx.shared);

    router_forward(config_, w.router_weight, w.expert_bias, in, state_, ctx.router, groups_.dp);
    ctx.dispatched = dispatcher_->dispatch(in.hidden, ctx.router.probs, ctx.router.routing_map);
    const size_t first = size_t(ep.first_local_expert()), L = size_t(ep.num_local_experts);
    if (echo_) echo_->fetch_weights(w);  // ECHO: L home experts + S clones (their weights from home)
    const Matrix<T> expert_out =
        echo_ ? experts_forward(expert_shape_, echo_->fc1(), echo_->fc2(), echo_->count(), ctx.dispatched.rows,
                                ctx.dispatched.offsets, ctx.dispatched.probs, ctx.experts)
              : experts_forward(expert_shape_, w.fc1.data() + first, w.fc2.data() + first, L, ctx.dispatched.rows,
                                ctx.dispatched.offsets, ctx.dispatched.probs, ctx.experts);
    if (echo_) echo_->forward_done();
    Matrix<T> out = dispatcher_->combine(expert_out);
    if (shared_shape_.ffn > 0) add_into(out, shared_out);
    ctx.has_forward = true;
    return out;
}

template <typename T>
Matrix<T> MoePipeline<T>::backward(const MoeWeights<T>& w, const Matrix<T>& grad_output, MoeWeights<T>& grads) {
    PipelineContext<T>& ctx = ctx_;
    const EpLayout& ep = layout();
    MOEKIT_CHECK(ctx.has_forward, "MoeLayer::backward needs a forward first");
    MOEKIT_CHECK(grad_output.rows == ctx.hidden.rows && grad_output.cols == ctx.hidden.cols, "grad_output is [",
                 grad_output.rows, ", ", grad_output.cols, "], expected [", ctx.hidden.rows, ", ", ctx.hidden.cols,
                 "]");
    check_weights(config_, ep, expert_shape_, shared_shape_, w, "weights");
    check_weights(config_, ep, expert_shape_, shared_shape_, grads, "grads");

    // Routed path: combine^T -> experts^T -> dispatch^T; probs grads back to [T, E].
    const Matrix<T> grad_expert_out = dispatcher_->combine_backward(grad_output);
    std::vector<T> grad_row_probs;
    const size_t first = size_t(ep.first_local_expert()), L = size_t(ep.num_local_experts);
    if (echo_ && echo_->needs_fetch()) echo_->fetch_weights(w);  // --moe-echo-recompute-expert-dispatch
    if (echo_) echo_->begin_grads(grads);
    const Matrix<T> grad_rows =
        echo_ ? experts_backward(expert_shape_, echo_->fc1(), echo_->fc2(), echo_->count(), ctx.dispatched.rows,
                                 ctx.dispatched.offsets, ctx.dispatched.probs, ctx.experts, grad_expert_out,
                                 grad_row_probs, echo_->grad_fc1(), echo_->grad_fc2())
              : experts_backward(expert_shape_, w.fc1.data() + first, w.fc2.data() + first, L, ctx.dispatched.rows,
                                 ctx.dispatched.offsets, ctx.dispatched.probs, ctx.experts, grad_expert_out,
                                 grad_row_probs, grads.fc1.data() + first, grads.fc2.data() + first);
    if (echo_) echo_->finish_grads(grads);  // clone grads added into their home experts' grads
    Matrix<T> grad_hidden, grad_probs;
    dispatcher_->dispatch_backward(grad_rows, grad_row_probs, grad_hidden, grad_probs);

    // Router path (probs -> scores -> logits -> gating linear), including the aux/z-loss grads.
    router_backward(config_, w.router_weight, ctx.router, grad_probs, grad_hidden, grads.router_weight);

    if (shared_shape_.ffn > 0)
        shared_expert_backward(shared_shape_, w, ctx.hidden, ctx.shared, grad_output, grad_hidden, grads);
    return grad_hidden;
}

template <typename T>
void reduce_layer_gradients(const ProcessGroups& groups, const EpLayout& layout, MoeWeights<T>& grads) {
    Communicator& dp = *groups.dp;
    all_reduce(dp, grads.router_weight);
    if (!grads.shared_fc1.empty()) {
        all_reduce(dp, grads.shared_fc1);
        all_reduce(dp, grads.shared_fc2);
        if (!grads.shared_gate.empty()) all_reduce(dp, grads.shared_gate);
    }
    for (int64_t e = layout.first_local_expert(); e < layout.first_local_expert() + layout.num_local_experts; ++e) {
        all_reduce(*groups.expert_dp, grads.fc1[size_t(e)]);
        all_reduce(*groups.expert_dp, grads.fc2[size_t(e)]);
    }
}
template void reduce_layer_gradients<float>(const ProcessGroups&, const EpLayout&, MoeWeights<float>&);
template void reduce_layer_gradients<double>(const ProcessGroups&, const EpLayout&, MoeWeights<double>&);

template <typename T>
void MoePipeline<T>::reduce_gradients(MoeWeights<T>& grads) {
    reduce_layer_gradients(groups_, layout(), grads);
}

template <typename T>
void MoePipeline<T>::update_expert_bias(MoeWeights<T>& w) {
    if (!config_.moe_router_enable_expert_bias) return;
    MOEKIT_CHECK(w.expert_bias.size() == size_t(config_.num_experts()), "router.expert_bias has ", w.expert_bias.size(),
                 " entries, expected ", config_.num_experts());
    // finalize_model_grads._update_router_expert_bias: counts all-reduced over tp_dp_cp.
    groups_.dp->all_reduce(state_.local_tokens_per_expert.data(), int64_t(state_.local_tokens_per_expert.size()));
    cpu::update_expert_bias(config_.moe_router_bias_update_rate, w.expert_bias, state_.local_tokens_per_expert);
}

template <typename T>
void MoePipeline<T>::reset_global_aux_loss_tracker() {
    std::fill(state_.global_tokens_per_expert.begin(), state_.global_tokens_per_expert.end(), 0.0);
    state_.ga_steps = 0;
}

template <typename T>
RoutingSummary MoePipeline<T>::summary() const {
    RoutingSummary s;
    s.tokens_per_expert = ctx_.router.tokens_per_expert;
    s.losses = ctx_.router.losses;
    return s;
}

template class MoePipeline<float>;
template class MoePipeline<double>;

}  // namespace moekit::cpu
