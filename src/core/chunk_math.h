// Chunks of a one-block-a-chunk pass over n items (the GPU's routing plan and loss statistics): the chunk length is
// n / 128 rounded down to a power of two and clamped to [32, max_len], so there are ~128 blocks where n allows, and
// neither a chunk's walk nor the walk down the chunks that folds them gets long. Test: tests/cpu/test_chunk_math.cpp.
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

constexpr int64_t kChunkMinLength = 32, kChunkTargetCount = 128;

MOEKIT_HD constexpr int64_t chunk_length(int64_t n, int64_t max_len) {
    int64_t c = kChunkMinLength;
    while (c < max_len && c * 2 * kChunkTargetCount <= n) c *= 2;
    return c;
}
MOEKIT_HD constexpr int64_t chunk_count(int64_t n, int64_t max_len) { return ceil_div(n, chunk_length(n, max_len)); }

}  // namespace moekit
