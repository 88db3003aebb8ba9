// wgrad_walks_along_n (core/tile_order_math.h): which way CUTLASS's group scheduler walks a wgrad's tiles.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/tile_order_math.h"

namespace {

using moekit::wgrad_walks_along_n;

constexpr int64_t kL2 = 50 * 1024 * 1024;  // H100 / H200

TEST(TileOrder, PresetWgradsOnTheirDevice) {
    // (M, N) = the gradient's rows and columns: fc1 [2F, H], fc2 [H, F]; rows a group = T·k / E.
    EXPECT_TRUE(wgrad_walks_along_n(28672, 4096, 2048, kL2));   // mixtral fc1: a group's dH is 117 MB
    EXPECT_FALSE(wgrad_walks_along_n(4096, 14336, 2048, kL2));  // mixtral fc2: M is the narrower
    EXPECT_FALSE(wgrad_walks_along_n(4096, 7168, 1024, kL2));   // dsv3-ep8 fc1
    EXPECT_FALSE(wgrad_walks_along_n(7168, 2048, 1024, kL2));   // dsv3-ep8 fc2: wider, but 14.7 MB fits
    EXPECT_FALSE(wgrad_walks_along_n(7168, 2048, 128, kL2));    // dsv3-e256 fc2
    EXPECT_FALSE(wgrad_walks_along_n(2048, 768, 1024, kL2));    // qwen3-30b fc2: 4 MB
}

TEST(TileOrder, WalksNOnlyWhereTheWiderOperandOverflowsHalfTheL2) {
    const int64_t m = 16384, n = 1024;
    const int64_t fits = kL2 / 2 / (2 * m);  // rows at which a group's [rows, M] bf16 operand is exactly half the L2
    EXPECT_FALSE(wgrad_walks_along_n(m, n, fits, kL2));
    EXPECT_TRUE(wgrad_walks_along_n(m, n, fits + 1, kL2));
    EXPECT_FALSE(wgrad_walks_along_n(m, m, 1 << 20, kL2)) << "square: M is not the wider";
    EXPECT_FALSE(wgrad_walks_along_n(n, m, 1 << 20, kL2)) << "N the wider: walking M re-reads the narrower";
    EXPECT_TRUE(wgrad_walks_along_n(m, n, fits, kL2 / 2)) << "a smaller L2 overflows sooner";
    EXPECT_FALSE(wgrad_walks_along_n(m, n, fits + 1, 2 * kL2)) << "a larger L2 holds more";
    EXPECT_FALSE(wgrad_walks_along_n(m, n, 0, kL2)) << "no rows";
}

}  // namespace
