// wgrad_split_rows (core/wgrad_split_math.h): how the two CUTLASS wgrad launches share a GEMM's groups.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "core/wgrad_split_math.h"

namespace {

using moekit::wgrad_split_rows;

TEST(WgradSplit, EveryGroupRunsInExactlyOneLaunch) {
    std::mt19937_64 rng(7);
    for (int64_t split : {0, 1, 128, 256, 512}) {
        for (int i = 0; i < 2000; ++i) {
            const int64_t rows = int64_t(rng() % 6000);
            const int64_t coop = wgrad_split_rows(rows, split, true), pp = wgrad_split_rows(rows, split, false);
            EXPECT_EQ(coop + pp, rows) << rows << " rows, split " << split;
            EXPECT_TRUE(coop == 0 || pp == 0) << rows << " rows, split " << split;
        }
    }
}

TEST(WgradSplit, SmallGroupsTakeCooperativeLargeOnesPingpong) {
    EXPECT_EQ(wgrad_split_rows(60, 256, true), 60);    // an ECHO rank's cold expert
    EXPECT_EQ(wgrad_split_rows(60, 256, false), 0);
    EXPECT_EQ(wgrad_split_rows(255, 256, true), 255);  // below the bound is small
    EXPECT_EQ(wgrad_split_rows(256, 256, true), 0);    // the bound itself is not
    EXPECT_EQ(wgrad_split_rows(256, 256, false), 256);
    EXPECT_EQ(wgrad_split_rows(5524, 256, false), 5524);  // a hot expert or its clone
}

TEST(WgradSplit, BoundZeroSendsEveryGroupToPingpong) {
    for (int64_t rows : {0, 1, 100, 4000}) {
        EXPECT_EQ(wgrad_split_rows(rows, 0, false), rows);
        EXPECT_EQ(wgrad_split_rows(rows, 0, true), 0);
    }
}

}  // namespace
