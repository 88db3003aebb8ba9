// Shared expert, CPU reference (see shared_expert.h). With the gate g_t = sigmoid(z_t),
// z_t = x_t . gate_weight: out_t = g_t m_t, so dm_t = g_t dout_t and
// dz_t = (dout_t . m_t) g_t (1 - g_t); d gate_weight += sum_t dz_t x_t, dx_t += dz_t gate_weight.
#include "cpu/shared_expert.h"

#include "core/activation_math.h"
#include "moekit/error.h"

namespace moekit::cpu {

namespace {
template <typename T>
bool has_gate(const MoeWeights<T>& w, int64_t hidden) {
    if (w.shared_gate.empty()) return false;
    MOEKIT_CHECK(w.shared_gate.rows == 1 && w.shared_gate.cols == hidden, "shared_experts.gate_weight is [",
                 w.shared_gate.rows, ", ", w.shared_gate.cols, "], expected [1, ", hidden, "]");
    return true;
}
}  // namespace

template <typename T>
Matrix<T> shared_expert_forward(const MlpShape& shape, const MoeWeights<T>& w, const Matrix<T>& x,
                                SharedExpertContext<T>& ctx) {
    MOEKIT_CHECK(x.cols == shape.hidden, "shared expert input has ", x.cols, " columns, expected ", shape.hidden);
    const int64_t num_tokens = x.rows, hidden = shape.hidden;
    ctx.mlp.fc1_out = Matrix<T>(num_tokens, shape.fc1_rows());
    ctx.mlp.act_out = Matrix<T>(num_tokens, shape.ffn);
    Matrix<T> out(num_tokens, hidden);
    mlp_forward(shape, w.shared_fc1, w.shared_fc2, x.data.data(), num_tokens, static_cast<const T*>(nullptr),
                ctx.mlp.fc1_out.data.data(), ctx.mlp.act_out.data.data(), out.data.data());
    ctx.gate.clear();
    ctx.mlp_out = Matrix<T>();
    if (!has_gate(w, hidden)) return out;

    ctx.mlp_out = out;
    ctx.gate.assign(size_t(num_tokens), T(0));
    const T* g = w.shared_gate.row(0);
    for (int64_t t = 0; t < num_tokens; ++t) {
        T z = T(0);
        for (int64_t h = 0; h < hidden; ++h) z += x(t, h) * g[h];
        const T s = sigmoid(z);
        ctx.gate[size_t(t)] = s;
        for (int64_t h = 0; h < hidden; ++h) out(t, h) *= s;
    }
    return out;
}

template <typename T>
void shared_expert_backward(const MlpShape& shape, const MoeWeights<T>& w, const Matrix<T>& x,
                            const SharedExpertContext<T>& ctx, const Matrix<T>& grad_out, Matrix<T>& grad_x,
                            MoeWeights<T>& grads) {
    const int64_t num_tokens = x.rows, hidden = shape.hidden;
    MOEKIT_CHECK(grad_out.rows == num_tokens && grad_out.cols == hidden, "shared expert grad_out is [", grad_out.rows,
                 ", ", grad_out.cols, "], expected [", num_tokens, ", ", hidden, "]");
    MOEKIT_CHECK(grad_x.rows == num_tokens && grad_x.cols == hidden, "shared expert grad_x has the wrong shape");
    const Matrix<T>* grad_mlp = &grad_out;
    Matrix<T> gated_grad;
    if (has_gate(w, hidden)) {
        MOEKIT_CHECK(grads.shared_gate.rows == 1 && grads.shared_gate.cols == hidden,
                     "grad of gate_weight must be [1, ", hidden, "]");
        MOEKIT_CHECK(int64_t(ctx.gate.size()) == num_tokens, "shared expert context has no gate values");
        gated_grad = Matrix<T>(num_tokens, hidden);
        const T* g = w.shared_gate.row(0);
        T* grad_g = grads.shared_gate.row(0);
        for (int64_t t = 0; t < num_tokens; ++t) {
            const T s = ctx.gate[size_t(t)];
            T dgate = T(0);
            for (int64_t h = 0; h < hidden; ++h) {
                dgate += grad_out(t, h) * ctx.mlp_out(t, h);
                gated_grad(t, h) = grad_out(t, h) * s;
            }
            const T dz = dgate * s * (T(1) - s);
            for (int64_t h = 0; h < hidden; ++h) {
                grad_g[h] += dz * x(t, h);
                grad_x(t, h) += dz * g[h];
            }
        }
        grad_mlp = &gated_grad;
    }
    Matrix<T> grad_x_mlp(num_tokens, hidden);
    mlp_backward(shape, w.shared_fc1, w.shared_fc2, x.data.data(), num_tokens, static_cast<const T*>(nullptr),
                 ctx.mlp.fc1_out.data.data(), ctx.mlp.act_out.data.data(), grad_mlp->data.data(),
                 grad_x_mlp.data.data(), static_cast<T*>(nullptr), grads.shared_fc1, grads.shared_fc2);
    for (size_t i = 0; i < grad_x.data.size(); ++i) grad_x.data[i] += grad_x_mlp.data[i];
}

#define MOEKIT_INSTANTIATE_SHARED(T)                                                                     \
    template Matrix<T> shared_expert_forward<T>(const MlpShape&, const MoeWeights<T>&, const Matrix<T>&, \
                                                SharedExpertContext<T>&);                                \
    template void shared_expert_backward<T>(const MlpShape&, const MoeWeights<T>&, const Matrix<T>&,     \
                                            const SharedExpertContext<T>&, const Matrix<T>&, Matrix<T>&, \
                                            MoeWeights<T>&);
MOEKIT_INSTANTIATE_SHARED(float)
MOEKIT_INSTANTIATE_SHARED(double)
#undef MOEKIT_INSTANTIATE_SHARED

}  // namespace moekit::cpu
