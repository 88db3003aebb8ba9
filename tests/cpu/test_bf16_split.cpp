// split_to_bf16x3 (core/bf16.h): the router's tensor-core backward feeds an fp32 gradient to bf16 GEMMs as three
// bf16 parts, so hi + mid + lo must give back the float exactly (every float whose parts stay normal), each part a bf16,
// and a non-finite float must stay what it was in hi without NaN parts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "core/bf16.h"

namespace {

using moekit::bf16_bits_to_float;
using moekit::Bf16x3;
using moekit::split_to_bf16x3;

double sum_of_parts(const Bf16x3& p) {
    return double(bf16_bits_to_float(p.hi)) + double(bf16_bits_to_float(p.mid)) + double(bf16_bits_to_float(p.lo));
}

TEST(Bf16Split, ThreePartsGiveBackTheFloat) {
    std::mt19937 rng(31);
    int checked = 0;
    for (int i = 0; i < 200000; ++i) {
        uint32_t u = rng();
        float f;
        std::memcpy(&f, &u, 4);
        // Finite floats short of bf16's overflow and far enough above the normal range that lo (~2^-16 of f) is
        // a normal bf16 too (core/bf16.h: below that the split may round).
        if (!std::isfinite(f) || std::fabs(f) >= 3.0e38f || std::fabs(f) < 1.0e-30f) continue;
        const Bf16x3 p = split_to_bf16x3(f);
        ASSERT_EQ(sum_of_parts(p), double(f)) << "f = " << f << " (bits " << std::hex << u << ")";
        // The parts shrink: each is at most half an ulp of bf16 of the one before.
        EXPECT_LE(std::fabs(bf16_bits_to_float(p.mid)), std::fabs(bf16_bits_to_float(p.hi)) / 128.0f) << f;
        ++checked;
    }
    EXPECT_GT(checked, 100000);
}

TEST(Bf16Split, GradientScaleValuesAndExactBf16) {
    // Grad logits: full 24-bit significands over 2^-40 .. 2^40; a bf16 value splits into itself and zeros.
    std::mt19937_64 rng(32);
    std::uniform_real_distribution<double> mant(-1.0, 1.0);
    for (int i = 0; i < 100000; ++i) {
        const float f = std::ldexp(float(mant(rng)), int(rng() % 81) - 40);
        if (f == 0.0f) continue;
        ASSERT_EQ(sum_of_parts(split_to_bf16x3(f)), double(f)) << f;
    }
    for (float f : {1.0f, -0.5f, 3.0f, 0.0f, -0.0f}) {
        const Bf16x3 p = split_to_bf16x3(f);
        EXPECT_EQ(bf16_bits_to_float(p.hi), f);
        EXPECT_EQ(p.mid & 0x7fffu, 0u);
        EXPECT_EQ(p.lo & 0x7fffu, 0u);
    }
}

TEST(Bf16Split, NonFiniteStaysInHiWithZeroParts) {
    for (float f : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
        const Bf16x3 p = split_to_bf16x3(f);
        const float hi = bf16_bits_to_float(p.hi);
        if (std::isnan(f))
            EXPECT_TRUE(std::isnan(hi));
        else
            EXPECT_EQ(hi, f);
        EXPECT_EQ(p.mid, 0u);
        EXPECT_EQ(p.lo, 0u);
    }
}

}  // namespace
