// How CUTLASS's ping-pong nt / nn share a group's rows between 128-row tiles (the body) and one 64-row tile (the
// tail; src/cuda/cutlass, kRowTail): a group of 1000 rows on 128-row tiles computes 24 padding rows, one of 1030
// computes 122. Where a group's last 128-row tile would hold 1..64 rows, those rows go to a second launch on 64x256
// tiles (at most 63 padding rows); otherwise the body takes them all (a last tile of 65..127 rows pads under 64).
// Plain C++ and device code (tests/cpu/test_row_tail.cpp).
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

constexpr int64_t kBodyTileRows = 128, kTailTileRows = 64;

// The rows of a group of `rows` rows that the tail launch computes: its last rows % 128 where that is 1..64, else 0.
MOEKIT_HD int64_t row_tail(int64_t rows) {
    const int64_t last = rows > 0 ? rows % kBodyTileRows : 0;
    return last <= kTailTileRows ? last : 0;
}

// The first row (within the group) and the number of rows the body (tail = false) or the tail launch computes.
struct RowRange {
    int64_t first, rows;
};
MOEKIT_HD RowRange row_tail_share(int64_t rows, bool tail) {
    const int64_t t = row_tail(rows);
    return tail ? RowRange{rows - t, t} : RowRange{0, rows - t};
}

// Padding rows a group's tiles compute: one launch on 128-row tiles, or the body / tail pair.
inline int64_t padding_rows_128(int64_t rows) { return ceil_div(rows, kBodyTileRows) * kBodyTileRows - rows; }
inline int64_t padding_rows_with_tail(int64_t rows) {
    const RowRange body = row_tail_share(rows, false), tail = row_tail_share(rows, true);
    return padding_rows_128(body.rows) + (ceil_div(tail.rows, kTailTileRows) * kTailTileRows - tail.rows);
}

}  // namespace moekit
