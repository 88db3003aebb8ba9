// Expert MLPs, CPU reference (see experts.h): fc1 -> activation (x probs) -> fc2 and the backward
// dW2 += dy^T a_p, da_p = dy W2, dp = sum_f da_p a, da = da_p p, dh = act'(h) da, dW1 += dh^T X,
// dX = dh W1.
#include "cpu/experts.h"

#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "moekit/error.h"

namespace moekit::cpu {

std::string MlpShape::to_string() const {
    return str("MlpShape{hidden=", hidden, ", ffn=", ffn, ", gated=", gated ? "true" : "false",
               ", activation=", activation_name(activation), "}");
}

namespace {
Activation parse_activation(const MoeConfig& config) {
    Activation act;
    MOEKIT_REQUIRE(activation_from_name(config.activation_func.c_str(), &act),
                   "--activation-func=", config.activation_func, ": must be one of gelu, silu, relu, squared_relu");
    return act;
}

template <typename T>
void check_mlp_weights(const MlpShape& shape, const Matrix<T>& fc1, const Matrix<T>& fc2) {
    MOEKIT_CHECK(fc1.rows == shape.fc1_rows() && fc1.cols == shape.hidden, "linear_fc1.weight is [", fc1.rows, ", ",
                 fc1.cols, "], expected [", shape.fc1_rows(), ", ", shape.hidden, "] for ", shape.to_string());
    MOEKIT_CHECK(fc2.rows == shape.hidden && fc2.cols == shape.ffn, "linear_fc2.weight is [", fc2.rows, ", ", fc2.cols,
                 "], expected [", shape.hidden, ", ", shape.ffn, "] for ", shape.to_string());
}

// a_p = a * p (p = 1 without probs), the input of fc2.
template <typename T>
void scale_rows(int64_t rows, int64_t cols, const T* a, const T* probs, T* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const T p = probs ? probs[r] : T(1);
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = a[r * cols + c] * p;
    }
}
}  // namespace

MlpShape expert_mlp_shape(const MoeConfig& config) {
    return MlpShape{config.hidden_size, config.expert_ffn(), config.gated_linear_unit, parse_activation(config)};
}

MlpShape shared_mlp_shape(const MoeConfig& config) {
    return MlpShape{config.hidden_size, config.shared_ffn(), config.gated_linear_unit, parse_activation(config)};
}

template <typename T>
void mlp_forward(const MlpShape& shape, const Matrix<T>& fc1, const Matrix<T>& fc2, const T* x, int64_t rows,
                 const T* probs, T* fc1_out, T* act_out, T* out) {
    check_mlp_weights(shape, fc1, fc2);
    if (rows == 0) return;
    const int64_t hidden = shape.hidden, ffn = shape.ffn, fc1_rows = shape.fc1_rows();
    std::vector<T> w1t(size_t(hidden * fc1_rows)), w2t(size_t(ffn * hidden));
    transpose(fc1_rows, hidden, fc1.data.data(), w1t.data());
    transpose(hidden, ffn, fc2.data.data(), w2t.data());

    std::fill(fc1_out, fc1_out + rows * fc1_rows, T(0));
    gemm_nn_acc(rows, fc1_rows, hidden, x, hidden, w1t.data(), fc1_rows, fc1_out, fc1_rows);

    const Activation act = shape.activation;
    parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* h = fc1_out + r * fc1_rows;
            T* a = act_out + r * ffn;
            for (int64_t f = 0; f < ffn; ++f)
                a[f] = shape.gated ? glu_forward(act, h[f], h[ffn + f]) : activation_forward(act, h[f]);
        }
    });

    std::vector<T> a_p(size_t(rows * ffn));
    scale_rows(rows, ffn, act_out, probs, a_p.data());
    std::fill(out, out + rows * hidden, T(0));
    gemm_nn_acc(rows, hidden, ffn, a_p.data(), ffn, w2t.data(), hidden, out, hidden);
}

template <typename T>
void mlp_backward(const MlpShape& shape, const Matrix<T>& fc1, const Matrix<T>& fc2, const T* x, int64_t rows,
                  const T* probs, const T* fc1_out, const T* act_out, const T* grad_out, T* grad_x, T* grad_probs,
                  Matrix<T>& grad_fc1, Matrix<T>& grad_fc2) {
    check_mlp_weights(shape, fc1, fc2);
    check_mlp_weights(shape, grad_fc1, grad_fc2);
    MOEKIT_CHECK(grad_probs == nullptr || probs != nullptr, "grad_probs needs probs");
    if (rows == 0) return;
    const int64_t hidden = shape.hidden, ffn = shape.ffn, fc1_rows = shape.fc1_rows();

    // fc2: dW2 [H, F] += dy^T a_p; da_p [rows, F] = dy W2.
    std::vector<T> a_p(size_t(rows * ffn));
    scale_rows(rows, ffn, act_out, probs, a_p.data());
    gemm_tn_acc(rows, ffn, hidden, grad_out, hidden, a_p.data(), ffn, grad_fc2.data.data(), ffn);
    std::vector<T> grad_a_p(size_t(rows * ffn), T(0));
    gemm_nn_acc(rows, ffn, hidden, grad_out, hidden, fc2.data.data(), ffn, grad_a_p.data(), ffn);

    // probs and activation: dp = sum_f da_p a; da = da_p p; dh = act'(h) da (GLU: gate and up halves).
    std::vector<T> grad_h(size_t(rows * fc1_rows));
    const Activation act = shape.activation;
    parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* h = fc1_out + r * fc1_rows;
            const T* a = act_out + r * ffn;
            const T* dap = grad_a_p.data() + r * ffn;
            T* dh = grad_h.data() + r * fc1_rows;
            if (grad_probs) {
                T dp = T(0);
                for (int64_t f = 0; f < ffn; ++f) dp += dap[f] * a[f];
                grad_probs[r] = dp;
            }
            const T p = probs ? probs[r] : T(1);
            for (int64_t f = 0; f < ffn; ++f) {
                const T da = dap[f] * p;
                if (shape.gated) {
                    glu_backward(act, h[f], h[ffn + f], da, &dh[f], &dh[ffn + f]);
                } else {
                    dh[f] = da * activation_grad(act, h[f]);
                }
            }
        }
    });

    // fc1: dW1 [fc1_rows, H] += dh^T X; dX [rows, H] = dh W1.
    gemm_tn_acc(rows, hidden, fc1_rows, grad_h.data(), fc1_rows, x, hidden, grad_fc1.data.data(), hidden);
    std::fill(grad_x, grad_x + rows * hidden, T(0));
    gemm_nn_acc(rows, hidden, fc1_rows, grad_h.data(), fc1_rows, fc1.data.data(), hidden, grad_x, hidden);
}

namespace {
template <typename T>
void check_grouped(const MlpShape& shape, size_t num_experts, const Matrix<T>& x, const std::vector<int64_t>& offsets,
                   const std::vector<T>& probs) {
    MOEKIT_CHECK(offsets.size() == num_experts + 1, "offsets has ", offsets.size(), " entries for ", num_experts,
                 " experts");
    MOEKIT_CHECK(offsets.front() == 0 && offsets.back() == x.rows, "offsets span [", offsets.front(), ", ",
                 offsets.back(), "), expected [0, ", x.rows, ")");
    for (size_t e = 0; e < num_experts; ++e)
        MOEKIT_CHECK(offsets[e] <= offsets[e + 1], "offsets must not decrease (expert ", e, ")");
    MOEKIT_CHECK(x.cols == shape.hidden, "expert input has ", x.cols, " columns, expected hidden ", shape.hidden);
    MOEKIT_CHECK(int64_t(probs.size()) == x.rows, "permuted_probs has ", probs.size(), " entries for ", x.rows,
                 " rows");
}
}  // namespace

template <typename T>
Matrix<T> experts_forward(const MlpShape& shape, const Matrix<T>* fc1, const Matrix<T>* fc2, size_t num_experts,
                          const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                          MlpContext<T>& ctx) {
    check_grouped(shape, num_experts, x, offsets, probs);
    const int64_t n = x.rows;
    ctx.fc1_out = Matrix<T>(n, shape.fc1_rows());
    ctx.act_out = Matrix<T>(n, shape.ffn);
    Matrix<T> y(n, shape.hidden);
    for (size_t e = 0; e < num_experts; ++e) {
        const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        mlp_forward(shape, fc1[e], fc2[e], x.row(begin), rows, probs.data() + begin, ctx.fc1_out.row(begin),
                    ctx.act_out.row(begin), y.row(begin));
    }
    return y;
}

template <typename T>
Matrix<T> experts_forward(const MlpShape& shape, const std::vector<Matrix<T>>& fc1, const std::vector<Matrix<T>>& fc2,
                          const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                          MlpContext<T>& ctx) {
    MOEKIT_CHECK(fc1.size() == fc2.size(), "fc1 has ", fc1.size(), " experts, fc2 ", fc2.size());
    return experts_forward(shape, fc1.data(), fc2.data(), fc1.size(), x, offsets, probs, ctx);
}

template <typename T>
Matrix<T> experts_backward(const MlpShape& shape, const Matrix<T>* fc1, const Matrix<T>* fc2, size_t num_experts,
                           const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                           const MlpContext<T>& ctx, const Matrix<T>& grad_out, std::vector<T>& grad_probs,
                           Matrix<T>* grad_fc1, Matrix<T>* grad_fc2) {
    check_grouped(shape, num_experts, x, offsets, probs);
    MOEKIT_CHECK(grad_out.rows == x.rows && grad_out.cols == shape.hidden, "grad of expert output is [", grad_out.rows,
                 ", ", grad_out.cols, "], expected [", x.rows, ", ", shape.hidden, "]");
    const int64_t n = x.rows;
    Matrix<T> grad_x(n, shape.hidden);
    grad_probs.assign(size_t(n), T(0));
    for (size_t e = 0; e < num_experts; ++e) {
        const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        mlp_backward(shape, fc1[e], fc2[e], x.row(begin), rows, probs.data() + begin, ctx.fc1_out.row(begin),
                     ctx.act_out.row(begin), grad_out.row(begin), grad_x.row(begin), grad_probs.data() + begin,
                     grad_fc1[e], grad_fc2[e]);
    }
    return grad_x;
}

template <typename T>
Matrix<T> experts_backward(const MlpShape& shape, const std::vector<Matrix<T>>& fc1, const std::vector<Matrix<T>>& fc2,
                           const Matrix<T>& x, const std::vector<int64_t>& offsets, const std::vector<T>& probs,
                           const MlpContext<T>& ctx, const Matrix<T>& grad_out, std::vector<T>& grad_probs,
                           std::vector<Matrix<T>>& grad_fc1, std::vector<Matrix<T>>& grad_fc2) {
    MOEKIT_CHECK(fc1.size() == fc2.size() && grad_fc1.size() == fc1.size() && grad_fc2.size() == fc1.size(),
                 "expert weight/grad lists differ in length");
    return experts_backward(shape, fc1.data(), fc2.data(), fc1.size(), x, offsets, probs, ctx, grad_out, grad_probs,
                            grad_fc1.data(), grad_fc2.data());
}

#define MOEKIT_INSTANTIATE_EXPERTS(T)                                                                                  \
    template void mlp_forward<T>(const MlpShape&, const Matrix<T>&, const Matrix<T>&, const T*, int64_t, const T*, T*, \
                                 T*, T*);                                                                              \
    template void mlp_backward<T>(const MlpShape&, const Matrix<T>&, const Matrix<T>&, const T*, int64_t, const T*,    \
                                  const T*, const T*, const T*, T*, T*, Matrix<T>&, Matrix<T>&);                       \
    template Matrix<T> experts_forward<T>(const MlpShape&, const Matrix<T>*, const Matrix<T>*, size_t,                \
                                          const Matrix<T>&, const std::vector<int64_t>&, const std::vector<T>&,        \
                                          MlpContext<T>&);                                                             \
    template Matrix<T> experts_backward<T>(const MlpShape&, const Matrix<T>*, const Matrix<T>*, size_t,               \
                                           const Matrix<T>&, const std::vector<int64_t>&, const std::vector<T>&,       \
                                           const MlpContext<T>&, const Matrix<T>&, std::vector<T>&, Matrix<T>*,        \
                                           Matrix<T>*);                                                                \
    template Matrix<T> experts_forward<T>(const MlpShape&, const std::vector<Matrix<T>>&,                              \
                                          const std::vector<Matrix<T>>&, const Matrix<T>&,                             \
                                          const std::vector<int64_t>&, const std::vector<T>&, MlpContext<T>&);         \
    template Matrix<T> experts_backward<T>(                                                                            \
        const MlpShape&, const std::vector<Matrix<T>>&, const std::vector<Matrix<T>>&, const Matrix<T>&,               \
        const std::vector<int64_t>&, const std::vector<T>&, const MlpContext<T>&, const Matrix<T>&, std::vector<T>&,   \
        std::vector<Matrix<T>>&, std::vector<Matrix<T>>&);
MOEKIT_INSTANTIATE_EXPERTS(float)
MOEKIT_INSTANTIATE_EXPERTS(double)
#undef MOEKIT_INSTANTIATE_EXPERTS

}  // namespace moekit::cpu
