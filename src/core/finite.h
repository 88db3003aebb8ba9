// Finite checks for values that came from outside (files, flags) or from a step (loss, gradient
// norm): the index of the first NaN/Inf, or -1. Host-side helpers used by `moekit layer`
// (tools/cmd_layer.cpp) before any value reaches the router, and usable by the training loop.
// Tests: tests/cpu/test_router.cpp (FirstNonFinite).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace moekit {

template <typename T>
int64_t first_non_finite(const T* values, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(values[i])) return i;
    return -1;
}

template <typename T>
int64_t first_non_finite(const std::vector<T>& values) {
    return first_non_finite(values.data(), int64_t(values.size()));
}

// "[2, 5]" for flat index 13 of shape [3, 4, ...]: where a bad value sits, for messages.
inline std::vector<int64_t> unflatten_index(int64_t flat, const std::vector<int64_t>& shape) {
    std::vector<int64_t> idx(shape.size(), 0);
    for (size_t d = shape.size(); d-- > 0;) {
        if (shape[d] <= 0) break;
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    return idx;
}

}  // namespace moekit
