// The interleaved tile order of the own grouped GEMM's wgrad (core/tile_interleave_math.h; the kernel:
// tn_interleaved_job in src/cuda/grouped_gemm_kernels.cuh): over all CTAs every tile of both lists is taken exactly
// once, every CTA's share of each list is within one of every other's, and a CTA alternates while it has both.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/rng.h"
#include "core/tile_interleave_math.h"

namespace moekit {
namespace {

void check(int stride, int n0, int n1) {
    SCOPED_TRACE(::testing::Message() << "stride " << stride << " lists " << n0 << " + " << n1);
    std::vector<int> seen0(size_t(n0), 0), seen1(size_t(n1), 0);
    int min0 = 1 << 30, max0 = 0, min1 = 1 << 30, max1 = 0;
    for (int c = 0; c < stride; ++c) {
        int count0 = 0, count1 = 0, last_list = -1, switches = 0;
        for (int i = 0;; ++i) {
            const InterleavedSlot s = interleaved_slot(c, stride, i, n0, n1);
            if (!s.valid) {
                // past the end it stays past the end
                EXPECT_FALSE(interleaved_slot(c, stride, i + 1, n0, n1).valid);
                break;
            }
            ASSERT_TRUE(s.list == 0 || s.list == 1);
            ASSERT_GE(s.tile, 0);
            ASSERT_LT(s.tile, s.list == 0 ? n0 : n1);
            EXPECT_EQ(s.tile % stride, c) << "tile dealt to another CTA";  // round-robin deal
            ++(s.list == 0 ? seen0 : seen1)[size_t(s.tile)];
            ++(s.list == 0 ? count0 : count1);
            if (last_list >= 0 && s.list != last_list) ++switches;
            last_list = s.list;
        }
        // alternation: while both shares last, the list changes at every step
        const int both = std::min(count0, count1);
        EXPECT_GE(switches, 2 * both - 1 > 0 ? 2 * both - 1 : 0);
        EXPECT_LE(switches, 2 * both);
        min0 = std::min(min0, count0), max0 = std::max(max0, count0);
        min1 = std::min(min1, count1), max1 = std::max(max1, count1);
    }
    for (int t = 0; t < n0; ++t) ASSERT_EQ(seen0[size_t(t)], 1) << "list 0 tile " << t;
    for (int t = 0; t < n1; ++t) ASSERT_EQ(seen1[size_t(t)], 1) << "list 1 tile " << t;
    EXPECT_LE(max0 - min0, 1);
    EXPECT_LE(max1 - min1, 1);
}

TEST(TileInterleave, EveryTileOnceSharesEvenAlternating) {
    check(132, 0, 0);
    check(132, 896 * 4, 896 * 62);  // an ECHO rank's fc1 wgrad: 4 hot and 62 cold groups of 896 tiles
    check(66, 448 * 4, 0);          // one list only: the groups in order
    check(66, 0, 448 * 9);
    check(1, 5, 3);
    check(7, 3, 40);  // fewer tiles of one list than CTAs
    Rng rng(2026);
    for (int trial = 0; trial < 200; ++trial)
        check(1 + int(rng.uniform() * 140), int(rng.uniform() * 3000), int(rng.uniform() * 3000));
}

TEST(TileInterleave, StartsWithTheListOfItsParity) {
    // CTA c starts with list 0 when c is even, list 1 when odd (when it has tiles of both).
    for (int c = 0; c < 10; ++c) {
        const InterleavedSlot s = interleaved_slot(c, 10, 0, 100, 100);
        ASSERT_TRUE(s.valid);
        EXPECT_EQ(s.list, c % 2);
        EXPECT_EQ(s.tile, c);
        const InterleavedSlot t = interleaved_slot(c, 10, 1, 100, 100);
        EXPECT_EQ(t.list, 1 - c % 2);
        EXPECT_EQ(t.tile, c);
    }
}

}  // namespace
}  // namespace moekit
