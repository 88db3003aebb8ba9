// Which tile a persistent CTA takes at its i-th step when two lists of tiles are interleaved (the own grouped
// GEMM's wgrad hot/cold order, src/cuda/grouped_gemm_kernels.cuh tn_interleaved_job): each list is dealt
// round-robin (tile j to CTA j % stride), and every CTA alternates between its share of the two lists, starting
// with list 0 when its index is even, until the shorter share runs out, then takes the rest of the longer one.
// Stateless in i, so a kernel's producer and consumers walk the same sequence. Tested on the CPU
// (tests/cpu/test_tile_interleave.cpp: every tile exactly once, shares within one, alternation).
#pragma once
#include <cstdint>

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

// Where item i of list 0 (n0 items) or of list 1 (n1 items) lands when the two lists are merged evenly, each
// keeping its order: item i of a list of n sits at the key (2i+1)/(2n), ties go to list 1 first. So the items of
// the shorter list are spread at even gaps through the longer one (the CUTLASS wgrad's hot/cold problem order,
// src/cuda/cutlass/grouped_gemm_cutlass.cuh fill_tn_pieces). The positions of both lists together are 0..n0+n1-1,
// each once (tests/cpu/test_tile_interleave.cpp).
MOEKIT_HD int64_t merged_position(int list, int64_t i, int64_t n0, int64_t n1) {
    if (list == 0) {  // list-1 items with (2j+1)/n1 <= (2i+1)/n0
        const int64_t before = ((2 * i + 1) * n1 / n0 + 1) / 2;
        return i + (before < n1 ? before : n1);
    }
    const int64_t before = ((2 * i + 1) * n0 + n1 - 1) / n1 / 2;  // list-0 items with (2j+1)/n0 < (2i+1)/n1
    return i + (before < n0 ? before : n0);
}

}  // namespace moekit
