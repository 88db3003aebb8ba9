// Expert MLPs (Megatron experts.py), CPU reference, forward and backward. Per expert e with rows
// X_e [n_e, H] and per-row probs p: h = X_e W1^T [n_e, F or 2F]; a = act(h) (GLU: act(gate) * up,
// gate rows first); y = (a * p) W2^T [n_e, H]. Probs are applied after the activation, before fc2.
// Shared maths: src/core/activation_math.h. Twin: src/cuda grouped GEMM + activation kernels.
// Test: tests/cpu/test_experts.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/activation_math.h"
#include "moekit/config.h"
#include "moekit/tensor.h"

namespace moekit::cpu {

// Shape of one MLP (routed expert or shared expert).
struct MlpShape {
    int64_t hidden = 0;  // H
    int64_t ffn = 0;     // F (fc1 has 2F rows when gated)
    bool gated = false;
    Activation activation = Activation::gelu;

    int64_t fc1_rows() const { return gated ? 2 * ffn : ffn; }
    std::string to_string() const;
};

// From the config: routed experts use F = expert_ffn(); the shared expert F = shared_ffn().
// Throws UsageError for an unknown --activation-func.
MlpShape expert_mlp_shape(const MoeConfig& config);
MlpShape shared_mlp_shape(const MoeConfig& config);

// What one MLP forward saves for backward; `rows` rows.
template <typename T>
struct MlpContext {
    Matrix<T> fc1_out;  // [rows, fc1_rows] h (pre-activation)
    Matrix<T> act_out;  // [rows, F] a (before probs)
};

// One MLP over `rows` rows of x [rows, H]; probs [rows] or nullptr (= all ones). Writes out [rows, H]
// (overwrites) and fills ctx rows [0, rows) (ctx must already have the shapes).
template <typename T>
void mlp_forward(const MlpShape& shape, const Matrix<T>& fc1, const Matrix<T>& fc2, const T* x, int64_t rows,
                 const T* probs, T* fc1_out, T* act_out, T* out);

// Backward of mlp_forward. Writes grad_x [rows, H] (overwrites) and grad_probs [rows] (if not
// nullptr; needs probs); accumulates grad_fc1 [fc1_rows, H] and grad_fc2 [H, F].
template <typename T>
void mlp_backward(const MlpShape& shape, const Matrix<T>& fc1, const Matrix<T>& fc2, const T* x, int64_t rows,
                  const T* probs, const T* fc1_out, const T* act_out, const T* grad_out, T* grad_x, T* grad_probs,
                  Matrix<T>& grad_fc1, Matrix<T>& grad_fc2);

// All local experts over the permuted rows x [N, H], grouped by expert with offsets [E + 1] and
// per-row probs [N]. Returns y [N, H]. Experts with zero rows do no work and output nothing.
template <typename T>
Matrix<T> experts_forward(const MlpShape& shape, const std::vector<Matrix<T>>& fc1, const std::vector<Matrix<T>>& fc2,
                          const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                          MlpContext<T>& ctx);

// The same over a block of `num_experts` experts (fc1[0 .. num_experts), e.g. a rank's local experts);
// offsets [num_experts + 1] index x's rows.
template <typename T>
Matrix<T> experts_forward(const MlpShape& shape, const Matrix<T>* fc1, const Matrix<T>* fc2, size_t num_experts,
                          const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                          MlpContext<T>& ctx);

// Returns grad_x [N, H]; writes grad_probs [N]; accumulates grad_fc1[e], grad_fc2[e] (zero-row
// experts get nothing added, i.e. defined zero grads).
template <typename T>
Matrix<T> experts_backward(const MlpShape& shape, const std::vector<Matrix<T>>& fc1, const std::vector<Matrix<T>>& fc2,
                           const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                           const MlpContext<T>& ctx, const Matrix<T>& grad_out, std::vector<T>& grad_probs,
                           std::vector<Matrix<T>>& grad_fc1, std::vector<Matrix<T>>& grad_fc2);

template <typename T>
Matrix<T> experts_backward(const MlpShape& shape, const Matrix<T>* fc1, const Matrix<T>* fc2, size_t num_experts,
                           const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                           const MlpContext<T>& ctx, const Matrix<T>& grad_out, std::vector<T>& grad_probs,
                           Matrix<T>* grad_fc1, Matrix<T>* grad_fc2);

}  // namespace moekit::cpu
