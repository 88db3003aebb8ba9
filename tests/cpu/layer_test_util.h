// Helpers for the layer-stage tests (test_permute, test_experts, test_layer*): seeded random
// matrices and routing maps, a reference dense MLP, and finite differences in float64.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "core/rng.h"
#include "moekit/tensor.h"

namespace moekit::test {

// Entries N(0, std^2) from (seed, stream); never all zero for non-empty shapes.
template <typename T>
Matrix<T> random_matrix(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream = 0, double std = 1.0) {
    Matrix<T> m(rows, cols);
    for (int64_t i = 0; i < m.size(); ++i) m.data[size_t(i)] = T(std * normal01(seed, stream, uint64_t(i)));
    return m;
}

template <typename T>
std::vector<T> random_vector(int64_t n, uint64_t seed, uint64_t stream, double lo, double hi) {
    std::vector<T> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = T(lo + (hi - lo) * uniform01(seed, stream, uint64_t(i)));
    return v;
}

// A [T, E] map with exactly k distinct experts per token (uniformly random), seeded.
inline std::vector<uint8_t> random_topk_map(int64_t num_tokens, int64_t num_experts, int64_t k, uint64_t seed) {
    std::vector<uint8_t> map(size_t(num_tokens * num_experts), 0);
    Rng rng(seed, 77);
    std::vector<int64_t> ids(static_cast<size_t>(num_experts));
    for (int64_t t = 0; t < num_tokens; ++t) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int64_t i = 0; i < k; ++i) {  // partial Fisher-Yates
            const int64_t j = i + rng.below(num_experts - i);
            std::swap(ids[size_t(i)], ids[size_t(j)]);
            map[size_t(t * num_experts + ids[size_t(i)])] = 1;
        }
    }
    return map;
}

template <typename T>
double max_abs_diff(const Matrix<T>& a, const Matrix<T>& b) {
    double m = 0;
    for (size_t i = 0; i < a.data.size(); ++i) m = std::max(m, std::abs(double(a.data[i]) - double(b.data[i])));
    return m;
}

template <typename T>
double max_abs(const Matrix<T>& a) {
    double m = 0;
    for (T v : a.data) m = std::max(m, std::abs(double(v)));
    return m;
}

// Central difference d f / d x[i] with step h (float64).
inline double central_difference(const std::function<double()>& f, double& x, double h) {
    const double saved = x;
    x = saved + h;
    const double up = f();
    x = saved - h;
    const double down = f();
    x = saved;
    return (up - down) / (2 * h);
}

}  // namespace moekit::test
