// Which tile a persistent CTA takes at its i-th step when two lists of tiles are interleaved (the own grouped
// GEMM's wgrad hot/cold order, src/cuda/grouped_gemm_kernels.cuh tn_interleaved_job): each list is dealt
// round-robin (tile j to CTA j % stride), and every CTA alternates between its share of the two lists, starting
// with list 0 when its index is even, until the shorter share runs out, then takes the rest of the longer one.
// Stateless in i, so a kernel's producer and consumers walk the same sequence. Tested on the CPU
// (tests/cpu/test_tile_interleave.cpp: every tile exactly once, shares within one, alternation).
#pragma once
#include "core/hd.h"

namespace moekit {

struct InterleavedSlot {
    bool valid;  // false: past this CTA's last tile
    int list;    // 0 or 1
    int tile;    // index into that list
};

// CTA `first` of `stride`, step i, lists of n0 and n1 tiles.
MOEKIT_HD InterleavedSlot interleaved_slot(int first, int stride, int i, int n0, int n1) {
    const int share0 = first < n0 ? (n0 - first + stride - 1) / stride : 0;
    const int share1 = first < n1 ? (n1 - first + stride - 1) / stride : 0;
    const int both = share0 < share1 ? share0 : share1;
    if (i < 0 || i >= share0 + share1) return {false, 0, 0};
    int list, idx;
    if (i < 2 * both) {
        list = ((i + first) & 1) == 0 ? 0 : 1;
        idx = i / 2;
    } else {
        list = share0 > share1 ? 0 : 1;
        idx = both + (i - 2 * both);
    }
    return {true, list, first + idx * stride};
}

}  // namespace moekit
