// Whether a grouped GEMM's groups are uneven enough that its wgrad should take the cooperative schedule instead of
// ping-pong (src/cuda/cutlass: both are launched, the device decides from the offsets, the other finds no tiles).
// Measured on an H200 (docs/perf.md): with ~560-row groups of nearly equal size (forced balance) ping-pong's wgrad is
// 5-10 % faster; on an ECHO rank (a few groups of 1600-5500 rows among ~60 of 60-260) or under Zipf routing the
// cooperative 128x256 tiles are faster for every rank. The rule: the largest group holds at least kSkewFactor
// times the mean. Tested on the CPU (tests/cpu/test_group_skew.cpp).
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

constexpr int64_t kGroupSkewFactor = 2;

MOEKIT_HD bool groups_skewed(int64_t largest_rows, int64_t total_rows, int64_t groups) {
    return groups > 0 && total_rows > 0 && largest_rows * groups >= kGroupSkewFactor * total_rows;
}

}  // namespace moekit
