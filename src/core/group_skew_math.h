// Whether a grouped GEMM's wgrad should take the cooperative schedule instead of ping-pong (src/cuda/cutlass: both
// are launched, the device decides from the offsets, the other finds no tiles): when most of its non-empty groups
// are small, as on an ECHO rank (~60 cold experts of 60-260 rows beside a few hot ones of 1600-5500). A small group's
// wgrad tiles are a few reduction steps and a whole fp32 tile store each, so per-tile fixed costs dominate and the
// cooperative 128x256 tiles, half as many as ping-pong's 128x128, win; with larger groups ping-pong's overlap of one
// warpgroup's stores with the other's math wins, skewed or not. Measured on an H200 (docs/perf.md): ECHO's fc1 wgrad
// 1.11-1.12 x the sampled forced-balance rank's with this rule vs 1.14-1.17 with ping-pong; dsv3-ep8 under zipf 1.2
// (272..4037 rows) and qwen3-30b under zipf 1.2 (139..15515) are faster with ping-pong (fc1 wgrad 3.34 vs 3.65 ms).
// Tested on the CPU (tests/cpu/test_group_skew.cpp).
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

// A group is small below this many rows (the per-shape choice's kSmallGroupRows, grouped_gemm_cutlass.h).
constexpr int64_t kSmallGroupRowsForSkew = 256;

MOEKIT_HD bool is_small_group(int64_t rows) { return rows > 0 && rows < kSmallGroupRowsForSkew; }

// At least three quarters of the non-empty groups are small.
MOEKIT_HD bool groups_mostly_small(int64_t small_groups, int64_t nonempty_groups) {
    return nonempty_groups > 0 && 4 * small_groups >= 3 * nonempty_groups;
}

}  // namespace moekit
