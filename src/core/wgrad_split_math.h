// Which of CUTLASS's two wgrad schedules computes a group (src/cuda/cutlass, kSplitBySize: both are launched and
// each gives the other's groups no tiles, from the offsets on the device). A small group's wgrad tiles are a few
// reduction steps and a whole fp32 tile store each, so the stores dominate; the cooperative schedule stores a
// 128x256 tile with both consumer warpgroups at once, where ping-pong's hand-over serialises the two. A larger
// group's tiles are math-bound and ping-pong hides one warpgroup's stores under the other's main loop. An ECHO rank
// holds both kinds (~60 cold experts of 60-260 rows beside a few hot ones and clones of 1600-5500), so the choice is
// made per group, not per GEMM. Tested on the CPU (tests/cpu/test_wgrad_split.cpp).
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

// Default bound: groups with fewer rows take the cooperative launch (MOEKIT_WGRAD_SPLIT_ROWS overrides it; 0 = every
// group ping-pong, the choice before 2026-11-26).
constexpr int64_t kWgradSplitRows = 256;

// The rows the cooperative (small = true) or the ping-pong (small = false) launch gives a group of `rows` rows:
// all of them in exactly one of the two, none in the other.
MOEKIT_HD int64_t wgrad_split_rows(int64_t rows, int64_t split_rows, bool small) {
    const bool is_small = rows < split_rows;
    return is_small == small ? rows : 0;
}

}  // namespace moekit
