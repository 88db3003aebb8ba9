// Checks of the views a moekit::Layer is called with (include/moekit/device_layer.h), shared by the CPU and
// CUDA backends so both refuse the same mistakes with the same words, before any work is enqueued.
// Tests: tests/cpu/test_device_layer.cpp (misuse cases).
#pragma once
#include <initializer_list>

#include "moekit/device_layer.h"

namespace moekit {

// What a backend expects of the views.
struct ViewRules {
    Backend backend = Backend::cpu;
    int device = 0;
    DType param = DType::f32, bias = DType::f64, activation = DType::f32, grad_input = DType::f32;
    // Experts fc1/fc2 and their grads hold: 0 = all E; at --expert-model-parallel-size EP > 1 the L = E / EP
    // local experts of the rank.
    int64_t local_experts = 0;
};

// Whether a view must be given, may be given, or must not be (the configuration has no such tensor).
enum class Need { required, optional, absent };
inline Need needed_if(bool condition) { return condition ? Need::required : Need::absent; }

// Throws UsageError "<name>: ..." when the view is null but required, given but absent from the configuration,
// or of another dtype, shape or memory.
void check_view(const char* name, const TensorView& view, DType dtype, std::initializer_list<int64_t> shape,
                const ViewRules& rules, Need need = Need::required);

void check_params(const MoeConfig& config, const LayerParams& p, const ViewRules& rules);
void check_grads(const MoeConfig& config, const LayerGrads& g, const ViewRules& rules);
void check_forward_args(const MoeConfig& config, const LayerBounds& bounds, const ForwardArgs& a,
                        const ViewRules& rules);
void check_backward_args(const MoeConfig& config, const LayerBounds& bounds, const BackwardArgs& a,
                         const ViewRules& rules);

// Calls fn(name, view) for every non-empty view of a call (the CUDA backend checks each pointer's device).
template <typename Fn>
void for_each_view(const LayerParams& p, Fn&& fn) {
    fn("router.weight", p.router_weight), fn("router.expert_bias", p.expert_bias), fn("fc1", p.fc1), fn("fc2", p.fc2);
    fn("shared_experts.linear_fc1", p.shared_fc1), fn("shared_experts.linear_fc2", p.shared_fc2);
    fn("shared_experts.gate_weight", p.shared_gate);
}
template <typename Fn>
void for_each_view(const LayerGrads& g, Fn&& fn) {
    fn("grad router.weight", g.router_weight), fn("grad fc1", g.fc1), fn("grad fc2", g.fc2);
    fn("grad shared_experts.linear_fc1", g.shared_fc1), fn("grad shared_experts.linear_fc2", g.shared_fc2);
    fn("grad shared_experts.gate_weight", g.shared_gate);
}

}  // namespace moekit
