// Permutation helpers shared by the CPU reference (src/cpu/permute.cpp) and the CUDA permute
// kernels: Megatron's row order is expert-major with token index ascending inside an expert, so
// row = offsets[e] + (number of tokens t' < t routed to e). Offsets are an exclusive scan of
// the per-expert counts. Tests: tests/cpu/test_permute.cpp.
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

// offsets[0] = 0, offsets[i + 1] = offsets[i] + counts[i], for i < n (offsets has n + 1 entries).
// Returns the total. Fixed left-to-right order, so identical everywhere.
MOEKIT_HD int64_t exclusive_scan(const int64_t* counts, int64_t n, int64_t* offsets) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        offsets[i] = total;
        total += counts[i];
    }
    offsets[n] = total;
    return total;
}

// Row of the pair (expert e, token t) given how many earlier tokens (t' < t) were routed to e.
MOEKIT_HD int64_t permuted_row(const int64_t* offsets, int64_t expert, int64_t rank_in_expert) {
    return offsets[expert] + rank_in_expert;
}

// Expert that owns permuted row `row`: the e with offsets[e] <= row < offsets[e + 1] (binary
// search; experts with zero rows are skipped because their interval is empty).
MOEKIT_HD int64_t expert_of_row(const int64_t* offsets, int64_t num_experts, int64_t row) {
    int64_t lo = 0, hi = num_experts;  // invariant: offsets[lo] <= row < offsets[hi]
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (offsets[mid] <= row) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

}  // namespace moekit
