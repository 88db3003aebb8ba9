// Shared expert (Megatron SharedExpertMLP), CPU reference: the expert MLP with shared weights on
// every token (padding included, as upstream), probs = 1, and the optional gate
// out[t] *= sigmoid(x[t] . gate_weight^T). Input x [T, H], output [T, H].
// Twin: the CUDA shared-expert path. Tests: tests/cpu/test_experts.cpp, tests/cpu/test_layer*.cpp.
#pragma once
#include <vector>

#include "cpu/experts.h"
#include "moekit/tensor.h"
#include "moekit/weights.h"

namespace moekit::cpu {

template <typename T>
struct SharedExpertContext {
    MlpContext<T> mlp;    // fc1_out [T, fc1_rows], act_out [T, Fs]
    Matrix<T> mlp_out;    // [T, H] MLP output before the gate (only kept with a gate)
    std::vector<T> gate;  // [T] sigmoid(x . g) (empty without a gate)
};

// Returns the shared expert output [T, H]; uses w.shared_fc1, w.shared_fc2 and, when not empty,
// w.shared_gate [1, H].
template <typename T>
Matrix<T> shared_expert_forward(const MlpShape& shape, const MoeWeights<T>& w, const Matrix<T>& x,
                                SharedExpertContext<T>& ctx);

// Accumulates (+=) d loss / d x into grad_x [T, H] and the grads of shared_fc1, shared_fc2 and
// shared_gate into `grads`.
template <typename T>
void shared_expert_backward(const MlpShape& shape, const MoeWeights<T>& w, const Matrix<T>& x,
                            const SharedExpertContext<T>& ctx, const Matrix<T>& grad_out, Matrix<T>& grad_x,
                            MoeWeights<T>& grads);

}  // namespace moekit::cpu
