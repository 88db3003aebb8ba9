// cpu::LayerContext<T>: everything cpu::MoeLayer<T>::forward saves for its backward, stage by
// stage (router, routing plan, permuted rows, expert and shared-expert activations), plus the
// router buffers that persist across steps. Owned by src/cpu/layer.cpp.
#pragma once
#include "cpu/experts.h"
#include "cpu/permute.h"
#include "cpu/router.h"
#include "cpu/shared_expert.h"
#include "moekit/tensor.h"

namespace moekit::cpu {

template <typename T>
struct LayerContext {
    MlpShape expert_shape;     // routed experts: H, F, gating, activation
    MlpShape shared_shape;     // shared expert (ffn = 0 when absent)
    RouterState router_state;  // expert-bias counts, global-aux tracker
    bool has_forward = false;  // backward needs a forward first

    Matrix<T> hidden;               // [T, H] layer input
    RouterContext<T> router;        // probs, routing_map, losses and the router's saved tensors
    RoutingPlan<T> plan;            // expert-major rows: counts, offsets, row -> token, permuted probs
    Matrix<T> permuted;             // [N, H] expert input rows
    MlpContext<T> experts;          // [N, fc1_rows] pre-activation, [N, F] activation
    SharedExpertContext<T> shared;  // shared expert activations and gate values
};

}  // namespace moekit::cpu
