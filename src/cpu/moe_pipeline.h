// cpu::MoePipeline<T>: the MoE layer as a pipeline over process groups (megatron-moe.md §1.1):
// shared expert -> Router -> Dispatcher (permute + communicate) -> local Experts -> Dispatcher back
// (communicate + unpermute) -> + shared output, and the backward in reverse. One rank per call; all
// ranks of the groups call it together. EP = 1 is cpu::MoeLayer<T> (src/cpu/layer.cpp).
// Tests: tests/mpi/test_ep_mpi.cpp (EP = N vs EP = 1), tests/cpu/test_layer*.cpp (EP = 1).
#pragma once
#include <memory>

#include "cpu/dispatcher.h"
#include "cpu/echo_experts.h"
#include "cpu/experts.h"
#include "cpu/router.h"
#include "cpu/shared_expert.h"
#include "moekit/comm.h"
#include "moekit/layer.h"

namespace moekit::cpu {

// Everything forward saves for backward, stage by stage.
template <typename T>
struct PipelineContext {
    bool has_forward = false;       // backward needs a forward first
    Matrix<T> hidden;               // [T, H] layer input
    RouterContext<T> router;        // probs, routing_map, losses and the router's saved tensors
    DispatchedRows<T> dispatched;   // [N_local, H] rows of the local experts, their probs and offsets
    MlpContext<T> experts;          // [N_local, fc1_rows] pre-activation, [N_local, F] activation
    SharedExpertContext<T> shared;  // shared expert activations and gate values
};

// Megatron's finalize_model_grads over the process groups: router, shared-expert and gate grads summed
// over dp, the local experts' grads (those `layout` gives this rank) over expert_dp. Shared by every
// backend's EP path (MoePipeline::reduce_gradients, the CUDA rank step of tools/layer_ep.cpp).
template <typename T>
void reduce_layer_gradients(const ProcessGroups& groups, const EpLayout& layout, MoeWeights<T>& grads);

template <typename T>
class MoePipeline {
public:
    // config.expert_model_parallel_size must equal groups.ep->size(); `groups` must outlive the pipeline.
    MoePipeline(const MoeConfig& config, const ProcessGroups& groups);

    // Weights: router and shared tensors in full; of the experts, only this rank's local ones
    // (w.fc1/fc2 still hold E entries; the others may be empty and are never read).
    Matrix<T> forward(const MoeWeights<T>& w, const LayerInput<T>& in);
    // d loss / d input of this rank's tokens; parameter grads accumulate locally into `grads` (the
    // local experts' entries only). Call reduce_gradients after the last micro-batch.
    Matrix<T> backward(const MoeWeights<T>& w, const Matrix<T>& grad_output, MoeWeights<T>& grads);
    // Megatron's finalize_model_grads: router, shared-expert and gate grads summed over dp, the
    // local experts' grads over expert_dp (nothing to do when EP = world).
    void reduce_gradients(MoeWeights<T>& grads);
    // Per global batch: expert-bias counts summed over dp, then bias += rate * sign(mean - c).
    void update_expert_bias(MoeWeights<T>& w);
    void reset_global_aux_loss_tracker();

    const Matrix<T>& probs() const { return ctx_.router.probs; }                     // [T, E]
    const std::vector<uint8_t>& routing_map() const { return ctx_.router.routing_map; }  // [T, E]
    RoutingSummary summary() const;  // tokens_per_expert [E]: this rank's tokens routed to each expert
    RouterState& router_state() { return state_; }
    const EpLayout& layout() const { return dispatcher_->layout(); }
    Dispatcher<T>& dispatcher() { return *dispatcher_; }  // the budgeted one's step protocol: budget_step.h
    const MoeConfig& config() const { return config_; }
    // --moe-enable-echo: the ECHO dispatcher (plan, stats, test hook) and the clone traffic; null otherwise.
    EchoDispatcher<T>* echo_dispatcher() { return echo_dispatcher_; }
    const EchoExperts<T>* echo_experts() const { return echo_.get(); }

private:
    MoeConfig config_;
    const ProcessGroups& groups_;
    MlpShape expert_shape_, shared_shape_;
    std::unique_ptr<Dispatcher<T>> dispatcher_;
    EchoDispatcher<T>* echo_dispatcher_ = nullptr;  // = dispatcher_ with ECHO
    std::unique_ptr<EchoExperts<T>> echo_;         // clone weights and gradients (src/cpu/echo_experts.h)
    RouterState state_;
    PipelineContext<T> ctx_;
};

}  // namespace moekit::cpu
