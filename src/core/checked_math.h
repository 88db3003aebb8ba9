// Checked 64-bit size arithmetic: products and sums of sizes (tokens x hidden, experts x rows x cols,
// numel x element size) that report overflow instead of wrapping. Every size that reaches an
// allocation goes through these first (src/core/config.cpp, src/io/safetensors.cpp).
// Tests: tests/cpu/test_config.cpp (CheckedMath*).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <optional>

namespace moekit {

// a * b, or nullopt when it overflows int64 (or an operand is negative: sizes are never negative).
inline std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
    int64_t out = 0;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) return std::nullopt;
    return out;
}

inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
    int64_t out = 0;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &out)) return std::nullopt;
    return out;
}

// Product of all factors, nullopt on overflow (or on a nullopt factor, so results chain).
inline std::optional<int64_t> checked_product(std::initializer_list<std::optional<int64_t>> factors) {
    std::optional<int64_t> acc = 1;
    for (const auto& f : factors) {
        if (!acc || !f) return std::nullopt;
        acc = checked_mul(*acc, *f);
    }
    return acc;
}

inline std::optional<int64_t> checked_sum(std::initializer_list<std::optional<int64_t>> terms) {
    std::optional<int64_t> acc = 0;
    for (const auto& t : terms) {
        if (!acc || !t) return std::nullopt;
        acc = checked_add(*acc, *t);
    }
    return acc;
}

}  // namespace moekit
