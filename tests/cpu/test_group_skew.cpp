// groups_mostly_small (core/group_skew_math.h): the device-side choice between the CUTLASS wgrad schedules.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/group_skew_math.h"

namespace {

bool mostly_small(const std::vector<int64_t>& rows) {
    int64_t small = 0, nonempty = 0;
    for (int64_t r : rows) small += moekit::is_small_group(r), nonempty += r > 0;
    return moekit::groups_mostly_small(small, nonempty);
}

TEST(GroupSkew, EvenOrLargeGroupsTakePingpong) {
    EXPECT_FALSE(mostly_small({512, 512, 512, 512}));
    EXPECT_FALSE(mostly_small({560, 500, 620, 540, 610}));       // sampled forced balance
    EXPECT_FALSE(mostly_small({272, 4037, 900, 1500, 300}));     // dsv3-ep8 under zipf 1.2: skewed, none small
    EXPECT_FALSE(mostly_small({139, 15515, 240, 300, 700, 90}));  // half small
}

TEST(GroupSkew, MostlySmallGroupsTakeCooperative) {
    EXPECT_TRUE(mostly_small({5524, 60, 80, 120, 260, 90, 70, 100, 200}));  // an ECHO rank's home experts
    EXPECT_TRUE(mostly_small({0, 0, 0, 100}));                              // one small group, the rest empty
}

TEST(GroupSkew, ThresholdIsThreeQuartersOfTheNonEmptyGroups) {
    EXPECT_TRUE(mostly_small({1000, 10, 20, 30, 0, 0}));      // 3 of 4 non-empty groups small
    EXPECT_FALSE(mostly_small({1000, 900, 20, 30, 40, 0}));   // 3 of 5
    EXPECT_TRUE(mostly_small({255, 1, 0}));                   // below 256 rows is small
    EXPECT_FALSE(mostly_small({256, 256, 1, 0}));             // 256 is not
}

TEST(GroupSkew, NothingToRunTakesPingpong) {
    EXPECT_FALSE(mostly_small({}));
    EXPECT_FALSE(mostly_small({0, 0, 0}));
}

}  // namespace
