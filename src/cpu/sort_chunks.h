// sort_chunks: Megatron's sort_chunks_by_idxs for the [A, B] -> [B, A] chunk transpose of received
// rows (the alltoall dispatcher's permutation 2, and the ECHO dispatcher's [source][bucket] ->
// [bucket][source]). Used by src/cpu/dispatch_alltoall.cpp, src/cpu/dispatch_echo.cpp.
// Tests: tests/cpu/test_dispatch.cpp, tests/cpu/test_ep_virtual.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace moekit::cpu {

// Rows of `in` [sum(counts), width] in chunks counts[a * B + b] (a-major) -> b-major order
// (inverse: b-major -> a-major).
template <typename T>
std::vector<T> sort_chunks(const std::vector<T>& in, int64_t width, const std::vector<int64_t>& counts, int64_t A,
                           int64_t B, bool inverse) {
    // Start of chunk (a, b) in the a-major layout, and in the b-major one.
    std::vector<int64_t> a_major(size_t(A * B)), b_major(size_t(A * B));
    int64_t off = 0;
    for (int64_t a = 0; a < A; ++a)
        for (int64_t b = 0; b < B; ++b) a_major[size_t(a * B + b)] = off, off += counts[size_t(a * B + b)];
    off = 0;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t a = 0; a < A; ++a) b_major[size_t(a * B + b)] = off, off += counts[size_t(a * B + b)];
    std::vector<T> out(in.size());
    for (int64_t c = 0; c < A * B; ++c) {
        const int64_t from = inverse ? b_major[size_t(c)] : a_major[size_t(c)];
        const int64_t to = inverse ? a_major[size_t(c)] : b_major[size_t(c)];
        std::copy(in.begin() + from * width, in.begin() + (from + counts[size_t(c)]) * width, out.begin() + to * width);
    }
    return out;
}

}  // namespace moekit::cpu
