// padded_columns / wide_pingpong_pads_little (core/tile_padding_math.h): the output columns column tiles compute
// past n, rounded to a cluster, where CUTLASS's 128x192 ping-pong pads little, and the reductions ping-pong takes.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/tile_padding_math.h"

namespace {

using moekit::padded_columns;
using moekit::wide_pingpong_pads_little;
using moekit::wide_pingpong_pads_under;
using moekit::wide_pingpong_pays_nt;
using moekit::rows_on_row_tiles;
using moekit::swapped_pingpong_pays_nt;
using moekit::pingpong_pays_reduction;

TEST(TilePadding, ColumnsPastTheEndRoundedToTheCluster) {
    EXPECT_EQ(padded_columns(2048, 128, 2), 0);
    EXPECT_EQ(padded_columns(2048, 192, 1), 64);   // 11 tiles of 192
    EXPECT_EQ(padded_columns(2048, 192, 2), 256);  // 11 tiles rounded to 12
    EXPECT_EQ(padded_columns(1536, 192, 2), 0);
    EXPECT_EQ(padded_columns(7168, 192, 2), 128);  // 37.3 tiles: 38, already even
    EXPECT_EQ(padded_columns(4096, 192, 2), 128);  // 21.3 tiles: 22
    EXPECT_EQ(padded_columns(192, 192, 2), 192) << "one tile, a cluster of two: a whole tile of padding";
    EXPECT_EQ(padded_columns(1, 64, 1), 63);
    EXPECT_EQ(padded_columns(0, 192, 2), 0) << "no columns, no tiles";
    EXPECT_EQ(padded_columns(100, 0, 2), 0) << "a degenerate tile computes nothing";
}

TEST(TilePadding, WidePingpongOnThePresetShapes) {
    // n of the nt / nn GEMMs: fc1 forward 2F, fc2 forward H, fc2 dgrad F, fc1 dgrad H; of the wgrads (gradient
    // [m, n]): fc1 H, fc2 F.
    EXPECT_TRUE(wide_pingpong_pads_little(1536));    // qwen3-30b fc1 forward: 8 tiles exactly
    EXPECT_TRUE(wide_pingpong_pads_little(768));     // qwen3-30b fc2 dgrad and wgrad
    EXPECT_FALSE(wide_pingpong_pads_little(2048));   // qwen3-30b fc2 fwd, fc1 dgrad / wgrad; dsv3-ep8 fc2 dgrad / wgrad
    EXPECT_TRUE(wide_pingpong_pads_little(7168));    // dsv3-ep8 fc2 forward, fc1 dgrad / wgrad: 1.8 %
    EXPECT_FALSE(wide_pingpong_pads_little(4096));   // dsv3-ep8 fc1 forward, mixtral H: 3.1 %
    EXPECT_TRUE(wide_pingpong_pads_little(28672));   // mixtral fc1 forward: 0.4 %
    EXPECT_TRUE(wide_pingpong_pads_little(14336));   // mixtral fc2 dgrad: 1.8 %
}

TEST(TilePadding, TwoPercentIsTheBound) {
    // 34 tiles of 192 = 6528 columns: n = 6400 pads 128 columns, exactly 2 %.
    EXPECT_EQ(padded_columns(6400, 192, 2), 128);
    EXPECT_TRUE(wide_pingpong_pads_little(6400));
    EXPECT_TRUE(wide_pingpong_pads_little(6401));   // 127 columns, 1.98 %
    EXPECT_FALSE(wide_pingpong_pads_little(6399));  // 129 columns, 2.02 %
    EXPECT_FALSE(wide_pingpong_pads_little(17 * 192 - 64)) << "17 tiles round to 18: 256 columns, not 64";
    EXPECT_FALSE(wide_pingpong_pads_little(0));
    EXPECT_FALSE(wide_pingpong_pads_little(-5));
}

TEST(TilePadding, NtNnTakeTheWideTileUnderFourPercent) {
    EXPECT_TRUE(wide_pingpong_pays_nt(4096));    // dsv3-ep8 fc1 forward: 3.1 %
    EXPECT_TRUE(wide_pingpong_pays_nt(7168));    // 1.8 %
    EXPECT_TRUE(wide_pingpong_pays_nt(1536));    // none
    EXPECT_TRUE(wide_pingpong_pays_nt(768));     // none
    EXPECT_FALSE(wide_pingpong_pays_nt(2048));   // 12.5 %
    EXPECT_FALSE(wide_pingpong_pays_nt(192));    // one tile rounded to a cluster of two: 100 %
    // 25 tiles round to 26 = 4992 columns: n = 4800 pads 192, exactly 4 %; 4801 pads 191, 4799 pads 193.
    EXPECT_EQ(padded_columns(4800, 192, 2), 192);
    EXPECT_TRUE(wide_pingpong_pays_nt(4800));
    EXPECT_TRUE(wide_pingpong_pays_nt(4801));
    EXPECT_FALSE(wide_pingpong_pays_nt(4799));
    EXPECT_FALSE(wide_pingpong_pads_under(4096, 3));  // the bound is the caller's
    EXPECT_FALSE(wide_pingpong_pads_under(4096, -1));
}

TEST(TilePadding, SwappedPingpongWhereWideTilesPadAndTheReductionIsShort) {
    EXPECT_TRUE(swapped_pingpong_pays_nt(2048, 768));    // qwen3-30b fc2 forward
    EXPECT_TRUE(swapped_pingpong_pays_nt(2048, 1536));   // qwen3-30b fc1 dgrad
    EXPECT_TRUE(swapped_pingpong_pays_nt(2048, 2048)) << "the bound itself";
    EXPECT_FALSE(swapped_pingpong_pays_nt(2048, 2049));
    EXPECT_FALSE(swapped_pingpong_pays_nt(2048, 7168)) << "dsv3-ep8 fc2 dgrad: a long reduction";
    EXPECT_FALSE(swapped_pingpong_pays_nt(1536, 768)) << "128x192 pays there (no padding)";
    EXPECT_FALSE(swapped_pingpong_pays_nt(4096, 1024)) << "3.1 % padding: 128x192 pays";
    EXPECT_FALSE(swapped_pingpong_pays_nt(2176, 1024)) << "17 weight tiles of 128 pad the 2x1 cluster";
    EXPECT_TRUE(swapped_pingpong_pays_nt(2304 + 256, 1024)) << "20 weight tiles; 192-column tiles pad 5 %";
    EXPECT_FALSE(swapped_pingpong_pays_nt(0, 768));
}

TEST(TilePadding, PingpongOnlyForShortReductions) {
    EXPECT_TRUE(pingpong_pays_reduction(2048)) << "dsv3-ep8 fc2 forward: ping-pong at least as fast on an H100";
    EXPECT_TRUE(pingpong_pays_reduction(768));    // qwen3-30b fc2 forward
    EXPECT_TRUE(pingpong_pays_reduction(1536));   // qwen3-30b fc1 dgrad
    EXPECT_FALSE(pingpong_pays_reduction(2049));
    EXPECT_FALSE(pingpong_pays_reduction(4096)) << "mixtral fc1 forward, dsv3-ep8 fc1 dgrad";
    EXPECT_FALSE(pingpong_pays_reduction(7168)) << "dsv3-ep8 fc1 forward and fc2 dgrad";
    // The transposed ping-pong shares the bound: wherever it is taken, a ping-pong pays for the reduction.
    for (int64_t k : {512, 2048, 2049, 4096, 7168})
        for (int64_t n : {768, 2048, 2560, 4096})
            if (swapped_pingpong_pays_nt(n, k)) EXPECT_TRUE(pingpong_pays_reduction(k)) << n << " x " << k;
}

TEST(TilePadding, RowsOnRowTilesPadEachGroupsLastTile) {
    const std::vector<int32_t> counts{0, 1, 128, 129, 1030, 1024};
    // 0 + 128 + 128 + 256 + 1152 + 1024
    EXPECT_EQ(rows_on_row_tiles(counts, 128), 2688);
    EXPECT_EQ(rows_on_row_tiles(counts, 64), 0 + 64 + 128 + 192 + 1088 + 1024);
    EXPECT_EQ(rows_on_row_tiles(counts, 1), 1 + 128 + 129 + 1030 + 1024);
    EXPECT_EQ(rows_on_row_tiles({}, 128), 0);
    EXPECT_EQ(rows_on_row_tiles(counts, 0), 0);
}

}  // namespace
