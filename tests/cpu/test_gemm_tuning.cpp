// pick_tuned / tuning_median (core/gemm_tuning_math.h): which measured configuration the per-shape tuning keeps.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/gemm_tuning_math.h"

namespace {

using moekit::pick_tuned;
using moekit::tuning_median;
const double kNan = std::nan(""), kInf = std::numeric_limits<double>::infinity();

TEST(GemmTuning, MedianOfRounds) {
    EXPECT_DOUBLE_EQ(tuning_median({3.0, 1.0, 2.0}), 2.0);
    EXPECT_DOUBLE_EQ(tuning_median({4.0, 1.0, 3.0, 2.0}), 3.0);
    EXPECT_DOUBLE_EQ(tuning_median({5.0}), 5.0);
    EXPECT_TRUE(std::isnan(tuning_median({})));
}

TEST(GemmTuning, RuleKeptWithinTheMargin) {
    // 1.5 % faster is noise on a power-capped card: the rule stays; 2.5 % faster replaces it.
    EXPECT_EQ(pick_tuned({3.000, 2.955, 3.100}), 0);
    EXPECT_EQ(pick_tuned({3.000, 2.925, 3.100}), 1);
    EXPECT_EQ(pick_tuned({3.000, 3.200, 2.700, 2.800}), 2);
    // Exactly at the margin is not faster than it.
    EXPECT_EQ(pick_tuned({1.0, 0.98}, 0, 0.02), 0);
    // The rule need not be candidate 0.
    EXPECT_EQ(pick_tuned({2.95, 3.0, 3.3}, 1), 1);
    EXPECT_EQ(pick_tuned({2.8, 3.0, 3.3}, 1), 0);
    // A zero margin keeps the strictly fastest.
    EXPECT_EQ(pick_tuned({1.0, 0.999}, 0, 0.0), 1);
}

TEST(GemmTuning, FailedCandidatesNeverKept) {
    EXPECT_EQ(pick_tuned({kNan, 3.0, 2.0}), 2);   // the rule failed: the fastest that ran
    EXPECT_EQ(pick_tuned({3.0, kInf, kNan}), 0);  // only the rule ran
    EXPECT_EQ(pick_tuned({kNan, kInf}), -1);      // nothing ran
    EXPECT_EQ(pick_tuned({}), -1);
    EXPECT_EQ(pick_tuned({3.0, 1.0}, 5), 1);      // a rule index past the candidates: the fastest
}

TEST(GemmTuning, KeptCandidateIsFastestOrTheRule) {
    std::mt19937_64 rng(31);
    std::uniform_real_distribution<double> ms(0.5, 5.0);
    for (int trial = 0; trial < 5000; ++trial) {
        std::vector<double> t(size_t(1 + rng() % 7));
        for (double& x : t) x = rng() % 9 == 0 ? kNan : ms(rng);
        const int rule = int(rng() % t.size());
        const double margin = (rng() % 5) * 0.01;
        const int k = pick_tuned(t, rule, margin);
        double best = kInf;
        for (double x : t)
            if (std::isfinite(x)) best = std::min(best, x);
        if (!std::isfinite(best)) {
            EXPECT_EQ(k, -1);
            continue;
        }
        ASSERT_GE(k, 0);
        ASSERT_TRUE(std::isfinite(t[size_t(k)]));
        if (k != rule) {
            EXPECT_EQ(t[size_t(k)], best);
            if (std::isfinite(t[size_t(rule)])) EXPECT_LT(t[size_t(k)], (1 - margin) * t[size_t(rule)]);
        } else {
            EXPECT_FALSE(best < (1 - margin) * t[size_t(rule)]);
        }
    }
}

}  // namespace
