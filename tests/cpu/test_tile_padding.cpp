// padded_columns / wide_pingpong_pads_little / wide_wgrad_tile (core/tile_padding_math.h): the output columns column
// tiles compute past n, rounded to a cluster, and where CUTLASS's ping-pong tiles of 192 pad little.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/tile_padding_math.h"

namespace {

using moekit::padded_columns;
using moekit::wide_pingpong_pads_little;
using moekit::wide_wgrad_tile;
using moekit::WideWgradTile;

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
    // n of the nt / nn GEMMs: fc1 forward 2F, fc2 forward H, fc2 dgrad F, fc1 dgrad H.
    EXPECT_TRUE(wide_pingpong_pads_little(1536));    // qwen3-30b fc1 forward: 8 tiles exactly
    EXPECT_TRUE(wide_pingpong_pads_little(768));     // qwen3-30b fc2 dgrad
    EXPECT_FALSE(wide_pingpong_pads_little(2048));   // qwen3-30b fc2 forward and fc1 dgrad, dsv3-ep8 fc2 dgrad
    EXPECT_TRUE(wide_pingpong_pads_little(7168));    // dsv3-ep8 fc2 forward, fc1 dgrad: 1.8 %
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

TEST(TilePadding, WideWgradTileOnThePresetShapes) {
    // A wgrad's gradient block is [m, n]: fc1 [2F, H], fc2 [H, F].
    EXPECT_EQ(wide_wgrad_tile(1536, 2048), WideWgradTile::kAlongM);  // qwen3-30b fc1: 8 x 16 tiles, exact
    EXPECT_EQ(wide_wgrad_tile(2048, 768), WideWgradTile::kAlongN);   // qwen3-30b fc2: 16 x 4, exact
    EXPECT_EQ(wide_wgrad_tile(4096, 7168), WideWgradTile::kAlongN);  // dsv3-ep8 fc1: 1.8 % along n, 3.1 % along m
    EXPECT_EQ(wide_wgrad_tile(7168, 2048), WideWgradTile::kAlongM);  // dsv3-ep8 fc2: 1.8 %
    EXPECT_EQ(wide_wgrad_tile(28672, 4096), WideWgradTile::kAlongM); // mixtral fc1: 0.4 %
    EXPECT_EQ(wide_wgrad_tile(4096, 14336), WideWgradTile::kAlongN); // mixtral fc2: 1.8 %
    EXPECT_EQ(wide_wgrad_tile(4096, 4096), WideWgradTile::kNone);    // 3.1 % either way
    EXPECT_EQ(wide_wgrad_tile(0, 768), WideWgradTile::kNone);
    EXPECT_EQ(wide_wgrad_tile(768, -1), WideWgradTile::kNone);
}

TEST(TilePadding, WideWgradTileWeighsTheAreaAgainstTheSquareTiles) {
    // m = 200: 192-row tiles compute 384 rows, 128-row tiles 256: far more than 2 % either way along m; along n the
    // 128x192 tile on 768 columns is exact, and the rows pad as the square tiles' do: no more than them.
    EXPECT_EQ(wide_wgrad_tile(200, 768), WideWgradTile::kAlongN);
    // n = 128 x 3: the square tiles round 3 to 4 (512 columns), 192-wide ones 2 exactly (384): fewer than square.
    EXPECT_EQ(wide_wgrad_tile(1000, 384), WideWgradTile::kAlongN);
    // n = 4224 = 22 x 192, a multiple of 128 but 33 tiles of it, rounded to 34 by the cluster: 192 wins.
    EXPECT_EQ(wide_wgrad_tile(4096, 4224), WideWgradTile::kAlongN);
}

}  // namespace
