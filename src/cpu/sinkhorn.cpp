// Megatron's sinkhorn() (§2.6) on the CPU: the doubly-normalised matrix diag(d0) exp(L) diag(d1)
// whose top-k picks the experts in Sinkhorn training routing. Input/output [T, E], T = float or
// double. Declared in src/cpu/losses.h; tested in tests/cpu/test_losses.cpp (L10).
#include <cmath>

#include "cpu/losses.h"

namespace moekit::cpu {

template <typename T>
Matrix<T> sinkhorn(const Matrix<T>& logits, double tol) {
    const int64_t rows = logits.rows, E = logits.cols;
    Matrix<T> cost(rows, E);
    for (int64_t i = 0; i < cost.size(); ++i) cost.data[size_t(i)] = std::exp(logits.data[size_t(i)]);
    std::vector<T> d0(size_t(rows), T(1)), d1(size_t(E), T(1)), d1_old = d1;
    const T eps = T(1e-8);
    // Megatron loops until converged; the cap only guards against a non-converging input.
    constexpr int kMaxIterations = 100000;
    double error = 1e9;
    for (int it = 0; it < kMaxIterations && error > tol; ++it) {
        for (int64_t t = 0; t < rows; ++t) {
            T s = T(0);
            for (int64_t e = 0; e < E; ++e) s += d1[size_t(e)] * cost(t, e);
            d0[size_t(t)] = (T(1) / T(rows)) * T(1) / (s + eps);
        }
        for (int64_t e = 0; e < E; ++e) {
            T s = T(0);
            for (int64_t t = 0; t < rows; ++t) s += d0[size_t(t)] * cost(t, e);
            d1[size_t(e)] = (T(1) / T(E)) * T(1) / (s + eps);
        }
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += std::fabs(double(d1_old[size_t(e)] - d1[size_t(e)]));
        error = sum / double(E);
        d1_old = d1;
    }
    Matrix<T> out(rows, E);
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t e = 0; e < E; ++e) out(t, e) = d1[size_t(e)] * cost(t, e) * d0[size_t(t)];
    return out;
}

template Matrix<float> sinkhorn<float>(const Matrix<float>&, double);
template Matrix<double> sinkhorn<double>(const Matrix<double>&, double);

}  // namespace moekit::cpu
