// balanced_order (bench/lib/balanced_order.h): each round is a permutation, and over a full design every ordered
// pair of measurements is adjacent equally often (the dense floor no longer always follows the sync baseline).
#include <gtest/gtest.h>

#include <map>
#include <utility>

#include "lib/balanced_order.h"

namespace moekit::bench {
namespace {

TEST(BalancedOrder, EveryMeasurementFollowsEveryOtherEquallyOften) {
    for (int n : {1, 2, 3, 4, 5, 8, 13, 14}) {
        const int rounds = n % 2 == 0 ? n : 2 * n;
        std::map<std::pair<int, int>, int> follows;
        for (int r = 0; r < rounds; ++r) {
            const std::vector<int> row = balanced_order(n, r);
            ASSERT_EQ(int(row.size()), n);
            std::vector<int> seen(n, 0);
            for (int x : row) {
                ASSERT_TRUE(x >= 0 && x < n) << "n=" << n << " round " << r;
                ++seen[x];
            }
            for (int x = 0; x < n; ++x) EXPECT_EQ(seen[x], 1) << "n=" << n << " round " << r << ": not a permutation";
            for (int j = 1; j < n; ++j) ++follows[{row[j - 1], row[j]}];
        }
        const int want = n % 2 == 0 ? 1 : 2;
        EXPECT_EQ(int(follows.size()), n * (n - 1)) << "n=" << n;
        for (auto& [pair, count] : follows)
            EXPECT_EQ(count, want) << "n=" << n << ": " << pair.second << " after " << pair.first;
    }
}

TEST(BalancedOrder, FourMeasurementsTheLayerBenchmarkRuns) {
    EXPECT_EQ(balanced_order(4, 0), (std::vector<int>{0, 1, 3, 2}));
    EXPECT_EQ(balanced_order(4, 1), (std::vector<int>{1, 2, 0, 3}));
    EXPECT_EQ(balanced_order(4, 5), balanced_order(4, 1));
}

}  // namespace
}  // namespace moekit::bench
