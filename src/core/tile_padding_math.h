// Output columns a grouped GEMM's column tiles compute past n (and, last, the rows its row tiles compute), and where
// CUTLASS's 128x192 ping-pong (kPingpongWide, src/cuda/cutlass; an nt / nn's n, a wgrad's gradient n) is worth its
// wider tiles. CUTLASS's group scheduler gives a cluster whole tiles: a group's column tiles are rounded up to the
// cluster's CTAs along N, so on a 1x2 cluster n = 2048 takes 12 tiles of 192 (2304 columns, 12.5 % padding) where
// 128-column tiles fit exactly.
// Measured per GEMM on an H200 (docs/perf.md, 2026-11-28, five rounds against the 128x128 ping-pong): up to 5 %
// faster where the 192-column tiles pad under 2 % of n (qwen3-30b fc1 forward and fc2 dgrad, n = 1536 / 768;
// dsv3-ep8 fc1 dgrad, n = 7168), 6-11 % slower at n = 2048. The wgrads' ping-pong takes the same rule (in the layer
// 1.6-1.8 % faster on qwen3-30b and dsv3-ep8, the same on mixtral). Plain C++ (tests/cpu/test_tile_padding.cpp).
#pragma once
#include <cstdint>
#include <span>

#include "core/hd.h"

namespace moekit {

// Columns past n that tiles of tile_n columns compute, their count rounded up to cluster_n CTAs.
inline int64_t padded_columns(int64_t n, int64_t tile_n, int64_t cluster_n) {
    if (n <= 0 || tile_n <= 0 || cluster_n <= 0) return 0;
    const int64_t tiles = (n + tile_n - 1) / tile_n;
    const int64_t clustered = (tiles + cluster_n - 1) / cluster_n * cluster_n;
    return clustered * tile_n - n;
}

// Whether the 128x192 ping-pong on a 1x2 cluster computes padding columns for at most `percent` % of an output n
// wide.
inline bool wide_pingpong_pads_under(int64_t n, int64_t percent) {
    return n > 0 && percent >= 0 && padded_columns(n, 192, 2) * 100 <= n * percent;
}
// The wgrads' rule (their gradient's n, or m where computed transposed): at most 2 %.
inline bool wide_pingpong_pads_little(int64_t n) { return wide_pingpong_pads_under(n, 2); }
// The nt / nn rule (their output's n): at most 4 %. Per GEMM on an H200 (2026-11-28, bench_grouped_gemm, three
// rounds, 1365-1500 MHz): 128x192 against 128x128 took 0.966 of the time at n = 4096 (3.1 % padding: dsv3-ep8 fc1
// forward, 3.032 vs 3.138 ms), 0.974-0.988 at n = 7168 (1.8 %), 0.93 / 0.915 at n = 1536 / 768 (none); 1.00-1.13 at
// n = 2048 (12.5 %).
inline bool wide_pingpong_pays_nt(int64_t n) { return wide_pingpong_pads_under(n, 4); }
// The longest reduction an nt / nn of mid-sized or large groups runs on CUTLASS's ping-pong (128x128, 128x192 or
// transposed); a longer one takes the cooperative 128x256. On an H100 (2026-12-07, bench_grouped_gemm, three rounds)
// the ping-pong the choice took ran 1.16-1.58x the cooperative's time at k = 4096 and 7168 (dsv3-ep8 fc1 forward
// 4.721 ms on 128x192 against 3.111 cooperative, dense cuBLAS 2.883; fc2 dgrad 2.511 / 1.591; fc1 dgrad 4.152 /
// 3.126; mixtral fc1 forward 6.969 / 5.995, fc2 dgrad 3.604 / 2.920) and the same or less at k <= 2048 (dsv3-ep8 fc2
// forward 1.669 / 1.718; qwen3-30b's GEMMs); on an H200 the two were within 5 % either way.
inline constexpr int64_t kPingpongMaxReduction = 2048;
inline bool pingpong_pays_reduction(int64_t k) { return k <= kPingpongMaxReduction; }

// Where the nt / nn rule above says no, the product computed transposed on ping-pong's 128 weight rows x 192 token
// rows (CUTLASS kSwapPingpong, n along the 128-row side of a 2x1 cluster) where that side pads nothing and the
// reduction is short (pingpong_pays_reduction): each k step then loads 128 + 192 rows for a 128x192 tile instead of
// 256 for 128x128, which pays where the tile's main loop is short. The layer step with it on / off on an H200
// (2026-11-28, `moekit bench --variant pingpong-swapped`): qwen3-30b (fc2 forward k = 768, fc1 dgrad k = 1536)
// 0.985, 0.991, 0.996; at k = 7168 (dsv3-ep8's fc2 dgrad) 1.011, its GEMM 7 % slower.
inline bool swapped_pingpong_pays_nt(int64_t n, int64_t k) {
    return n > 0 && !wide_pingpong_pays_nt(n) && padded_columns(n, 128, 2) == 0 && pingpong_pays_reduction(k);
}

// Rows that row tiles of tile_rows compute for groups of counts[g] rows, each group's last tile padded to a whole
// one: over the routed rows, the share of a grouped GEMM's math spent on padding. dsv3-ep8's routing (973..1090
// rows a group) on 128-row tiles: ~1.06 (docs/perf.md, 2026-12-02), which bounds its fc1 forward against dense cuBLAS.
inline int64_t rows_on_row_tiles(std::span<const int32_t> counts, int64_t tile_rows) {
    int64_t rows = 0;
    if (tile_rows <= 0) return 0;
    for (const int32_t c : counts)
        if (c > 0) rows += align_up(c, tile_rows);
    return rows;
}

}  // namespace moekit
