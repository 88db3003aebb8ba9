// groups_skewed (core/group_skew_math.h): the device-side choice between the CUTLASS wgrad schedules.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/group_skew_math.h"

namespace {

bool skewed(const std::vector<int64_t>& rows) {
    int64_t largest = 0, total = 0;
    for (int64_t r : rows) largest = r > largest ? r : largest, total += r;
    return moekit::groups_skewed(largest, total, int64_t(rows.size()));
}

TEST(GroupSkew, EvenGroupsAreNotSkewed) {
    EXPECT_FALSE(skewed({512, 512, 512, 512}));
    EXPECT_FALSE(skewed({560, 500, 620, 540, 610}));   // sampled forced balance
    EXPECT_FALSE(skewed({973, 1090, 1000, 1024}));     // dsv3-ep8 without skew
}

TEST(GroupSkew, OneLargeGroupAmongSmallOnesIsSkewed) {
    EXPECT_TRUE(skewed({5524, 60, 80, 120, 260, 90, 70, 100}));  // an ECHO rank's home experts
    EXPECT_TRUE(skewed({0, 0, 0, 400}));                          // one expert takes all
}

TEST(GroupSkew, ThresholdIsTwiceTheMean) {
    EXPECT_TRUE(skewed({200, 50, 50, 100}));   // largest 200 = 2 x mean 100
    EXPECT_FALSE(skewed({199, 51, 50, 100}));  // largest 199 < 2 x mean 100
}

TEST(GroupSkew, NothingToRunIsNotSkewed) {
    EXPECT_FALSE(skewed({}));
    EXPECT_FALSE(skewed({0, 0, 0}));
}

}  // namespace
