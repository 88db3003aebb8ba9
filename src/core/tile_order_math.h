// Which way CUTLASS's group scheduler walks a wgrad's tiles (src/cuda/cutlass, CutlassRaster::kAuto). Walking M,
// the scheduler holds one N tile of a group while it visits the group's M tiles, so the group's [rows, M] operand is
// read again for every N step and must stay in L2; walking N, the same holds for the [rows, N] operand. nt / nn
// (M = a group's token rows) always walk M: the token rows are the small operand and one weight tile serves them
// back to back. A wgrad's M and N are both weight dimensions and its reduction runs over the group's rows: it walks
// N when a mean group's [rows, M] operand is the wider and overflows half the L2. Mixtral's fc1 wgrad (M = 2F =
// 28672, N = H = 4096, ~2048 rows a group: 117 MB against 16.8 MB) walking M read its gradient rows from DRAM once
// for every N step: H200, 2026-11-27 (docs/perf.md), along N 6.44 vs 6.76 ms cooperative and 6.08-6.13 ping-pong,
// which along M took 8.2-9.2; wgrads whose operands fit (qwen3-30b, dsv3-ep8, mixtral's fc2) were as fast or
// faster along M (mixtral fc2 3.06 vs 3.63 ms). Plain C++ (tests/cpu/test_tile_order.cpp).
#pragma once
#include <cstdint>

namespace moekit {

inline bool wgrad_walks_along_n(int64_t m, int64_t n, int64_t rows_per_group, int64_t l2_bytes) {
    const int64_t m_operand_bytes = rows_per_group * m * 2;  // bf16
    return m > n && m_operand_bytes > l2_bytes / 2;
}

}  // namespace moekit
