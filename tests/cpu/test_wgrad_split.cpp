// wgrad_split_rows (core/wgrad_split_math.h): how the two CUTLASS wgrad launches share a GEMM's groups.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "core/wgrad_split_math.h"

namespace {

using moekit::WgradSplit;
using moekit::wgrad_split_rows;

TEST(WgradSplit, EveryGroupRunsInExactlyOneLaunch) {
    std::mt19937_64 rng(7);
    for (WgradSplit split : {WgradSplit{0, 0}, WgradSplit{1, 0}, WgradSplit{256, 0}, WgradSplit{512, 0},
                             WgradSplit{256, 1536}, WgradSplit{0, 4096}, WgradSplit{300, 200}}) {
        for (int i = 0; i < 2000; ++i) {
            const int64_t rows = int64_t(rng() % 6000);
            const int64_t coop = wgrad_split_rows(rows, split, true), pp = wgrad_split_rows(rows, split, false);
            EXPECT_EQ(coop + pp, rows) << rows << " rows, split " << split.small_below << "/" << split.large_from;
            EXPECT_TRUE(coop == 0 || pp == 0) << rows << " rows, split " << split.small_below << "/" << split.large_from;
        }
    }
}

TEST(WgradSplit, SmallGroupsTakeCooperativeMidSizedOnesPingpong) {
    const WgradSplit split{256, 0};
    EXPECT_EQ(wgrad_split_rows(60, split, true), 60);  // an ECHO rank's cold expert
    EXPECT_EQ(wgrad_split_rows(60, split, false), 0);
    EXPECT_EQ(wgrad_split_rows(255, split, true), 255);  // below the bound is small
    EXPECT_EQ(wgrad_split_rows(256, split, true), 0);    // the bound itself is not
    EXPECT_EQ(wgrad_split_rows(256, split, false), 256);
    EXPECT_EQ(wgrad_split_rows(19900, split, false), 19900);  // no large bound: a hot expert stays ping-pong
}

TEST(WgradSplit, LargeGroupsTakeCooperativeFromTheirBound) {
    const WgradSplit split{256, 1536};
    EXPECT_EQ(wgrad_split_rows(1535, split, false), 1535);
    EXPECT_EQ(wgrad_split_rows(1536, split, true), 1536);
    EXPECT_EQ(wgrad_split_rows(19900, split, true), 19900);
    EXPECT_EQ(wgrad_split_rows(19900, split, false), 0);
    EXPECT_EQ(wgrad_split_rows(100, split, true), 100);
}

TEST(WgradSplit, ZeroBoundsSendEveryGroupToPingpong) {
    for (int64_t rows : {0, 1, 100, 4000}) {
        EXPECT_EQ(wgrad_split_rows(rows, WgradSplit{0, 0}, false), rows);
        EXPECT_EQ(wgrad_split_rows(rows, WgradSplit{0, 0}, true), 0);
    }
}

}  // namespace
