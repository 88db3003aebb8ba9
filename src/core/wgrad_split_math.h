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

// Which groups take the cooperative launch: those below small_below rows, and those from large_from rows on (0:
// none), where its 128x256 tiles' math outruns ping-pong's 128x128; the rest take ping-pong. small_below = 384:
// bench_echo_balance (zipf 1.2, R = 512, H200, 2026-11-27, four runs each), ECHO's busiest rank / sampled forced
// balance EP=8 1.039-1.042 vs 1.048-1.057 at 256, EP=4 1.013-1.020 vs 1.018-1.037.
struct WgradSplit {
    int64_t small_below = 384, large_from = 0;
};

MOEKIT_HD bool wgrad_group_cooperative(int64_t rows, WgradSplit split) {
    return rows < split.small_below || (split.large_from > 0 && rows >= split.large_from);
}

// The rows the cooperative (cooperative = true) or the ping-pong launch gives a group of `rows` rows: all of them in
// exactly one of the two, none in the other.
MOEKIT_HD int64_t wgrad_split_rows(int64_t rows, WgradSplit split, bool cooperative) {
    return wgrad_group_cooperative(rows, split) == cooperative ? rows : 0;
}

}  // namespace moekit
