// grid_sms_leaving (core/sm_share_math.h): the SMs a persistent grouped GEMM takes when some are left to kernels
// running beside it.
#include <gtest/gtest.h>

#include "core/sm_share_math.h"

namespace {

using moekit::grid_sms_leaving;

TEST(SmShare, LeavesTheAskedSmsInWholeClusters) {
    EXPECT_EQ(grid_sms_leaving(132, 16, 2), 116);
    EXPECT_EQ(grid_sms_leaving(132, 15, 2), 116) << "117 is not a whole number of 2-CTA clusters";
    EXPECT_EQ(grid_sms_leaving(132, 15, 1), 117);
    EXPECT_EQ(grid_sms_leaving(132, 24, 4), 108);
    EXPECT_EQ(grid_sms_leaving(114, 16, 2), 98) << "an H100 PCIe's 114 SMs";
}

TEST(SmShare, TakesTheWholeDeviceWhereNothingIsLeftOrTooMuchIsAsked) {
    EXPECT_EQ(grid_sms_leaving(132, 0, 2), 132);
    EXPECT_EQ(grid_sms_leaving(132, -3, 2), 132);
    EXPECT_EQ(grid_sms_leaving(132, 66, 2), 66) << "half the device may be left";
    EXPECT_EQ(grid_sms_leaving(132, 67, 2), 132) << "more than half: the GEMM would lose more than the rest gains";
    EXPECT_EQ(grid_sms_leaving(2, 1, 2), 2) << "no whole cluster would remain";
    EXPECT_EQ(grid_sms_leaving(132, 16, 0), 116) << "a cluster size below one counts as one";
    EXPECT_EQ(grid_sms_leaving(0, 16, 2), 0);
}

}  // namespace
