// row_tail_share (core/row_tail_math.h): how the body and tail launches of kRowTail share a group's rows.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/row_tail_math.h"

namespace {

using moekit::padding_rows_128;
using moekit::padding_rows_with_tail;
using moekit::row_tail;
using moekit::row_tail_share;

TEST(RowTail, BodyAndTailCoverEveryRowOnceInOrder) {
    for (int64_t rows = 0; rows <= 5000; ++rows) {
        const auto body = row_tail_share(rows, false), tail = row_tail_share(rows, true);
        EXPECT_EQ(body.first, 0);
        EXPECT_EQ(tail.first, body.rows) << rows;  // the tail starts where the body ends
        EXPECT_EQ(body.rows + tail.rows, rows) << rows;
        EXPECT_EQ(body.rows % 128 == 0 || tail.rows == 0, true) << rows;  // a body with a tail fills its tiles
        EXPECT_LE(tail.rows, 64) << rows;
        EXPECT_GE(tail.rows, 0) << rows;
    }
}

TEST(RowTail, TailTakesOnlyALastTileOfAtMost64Rows) {
    EXPECT_EQ(row_tail(0), 0);
    EXPECT_EQ(row_tail(1), 1);  // a one-row group: a 64-row tile instead of a 128-row one
    EXPECT_EQ(row_tail(64), 64);
    EXPECT_EQ(row_tail(65), 0);  // 63 padding rows either way: no second launch
    EXPECT_EQ(row_tail(128), 0);
    EXPECT_EQ(row_tail(1000), 0);  // 1000 = 7 * 128 + 104
    EXPECT_EQ(row_tail(1030), 6);  // 1030 = 8 * 128 + 6
    EXPECT_EQ(row_tail(1024 + 64), 64);
}

TEST(RowTail, NeverPadsMoreAndPadsUnder64Rows) {
    for (int64_t rows = 1; rows <= 5000; ++rows) {
        EXPECT_LE(padding_rows_with_tail(rows), padding_rows_128(rows)) << rows;
        EXPECT_LT(padding_rows_with_tail(rows), 64) << rows;
    }
}

}  // namespace
