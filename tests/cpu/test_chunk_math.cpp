// chunk_length / chunk_count (core/chunk_math.h), which size the GPU routing plan's and loss statistics' chunks (and
// their scratch buffers): a power of two in [32, max_len], the chunks cover n, ~128 of them where n allows, and the
// length never shrinks as n grows.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/chunk_math.h"

namespace {

using moekit::chunk_count;
using moekit::chunk_length;

TEST(ChunkMath, LengthIsAPowerOfTwoInRangeAndChunksCoverTheItems) {
    for (int64_t max_len : {32, 64, 128, 256})
        for (int64_t n = 0; n <= 70000; n += (n < 600 ? 1 : 97)) {
            const int64_t len = chunk_length(n, max_len), count = chunk_count(n, max_len);
            ASSERT_GE(len, 32) << "n=" << n;
            ASSERT_LE(len, max_len) << "n=" << n;
            ASSERT_EQ(len & (len - 1), 0) << "n=" << n << " len=" << len;
            ASSERT_GE(count * len, n) << "n=" << n;
            ASSERT_LT((count - 1) * len, n > 0 ? n : 1) << "n=" << n;  // no empty chunk
            if (len < max_len) ASSERT_LE(count, 2 * 128) << "n=" << n;  // not pinned at a bound: ~128 chunks
            if (len > 32) ASSERT_GE(count, 128) << "n=" << n;
        }
}

TEST(ChunkMath, PresetSizes) {
    EXPECT_EQ(chunk_length(16384, 128), 128);  // qwen3-30b: 128 chunks
    EXPECT_EQ(chunk_count(16384, 128), 128);
    EXPECT_EQ(chunk_length(4096, 128), 32);  // dsv3-e256: 128 chunks
    EXPECT_EQ(chunk_count(4096, 128), 128);
    EXPECT_EQ(chunk_length(8192, 128), 64);
    EXPECT_EQ(chunk_length(1, 128), 32);
    EXPECT_EQ(chunk_count(0, 128), 0);
    EXPECT_EQ(chunk_length(1 << 20, 128), 128);  // long inputs: more chunks, not longer ones
    EXPECT_EQ(chunk_count(1 << 20, 128), 8192);
}

TEST(ChunkMath, LengthNeverShrinksAsItemsGrow) {
    int64_t prev = 0;
    for (int64_t n = 0; n <= 100000; n += 13) {
        const int64_t len = chunk_length(n, 128);
        ASSERT_GE(len, prev) << "n=" << n;
        prev = len;
    }
}

}  // namespace
