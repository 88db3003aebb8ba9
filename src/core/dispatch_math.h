// Budgeted (sync-free) expert-parallel dispatch maths, shared by the CPU twin
// (src/cpu/dispatch_budgeted.cpp) and the CUDA kernels (src/cuda/dispatch_budgeted.cu): the receive budget of a rank, and the
// offsets every rank derives from the all-gathered [EP, E] count matrix by one scan. A receiver's
// buffer is ordered [local expert l][source rank s] (Megatron's order after sort_chunks), so the
// grouped GEMM reads it in place. Tests: tests/cpu/test_dispatch_budgeted.cpp.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/hd.h"

namespace moekit {

// Receive budgets are rounded up to this many rows: the row alignment the grouped GEMM's tiles and
// Megatron's pad_multiple (16, fp8/TMA) use, so a budget never splits an aligned block.
constexpr int64_t kBudgetRowAlign = 16;

// Rows a rank can receive: ceil(T * k * f) rounded up to kBudgetRowAlign (f > 0, finite).
MOEKIT_HD int64_t budget_rows(int64_t tokens, int64_t topk, double factor) {
    const double rows = ceil(double(tokens * topk) * factor);
    return align_up(int64_t(rows), kBudgetRowAlign);
}

// Visits every chunk (l, s) of `receiver`'s buffer in buffer order, fn(l, s, start_row, rows), from counts
// [ep, num_experts] (row s = source rank s's rows per global expert; any integer type); the receiver's
// local experts are [receiver * L, receiver * L + L). Returns the total the receiver would get. Fixed
// left-to-right order: every rank derives the same offsets (CPU twin and CUDA kernels alike).
template <typename C, typename Fn>
MOEKIT_HD int64_t for_each_recv_chunk(const C* counts, int64_t ep, int64_t num_experts, int64_t num_local,
                                      int64_t receiver, Fn&& fn) {
    int64_t total = 0;
    for (int64_t l = 0; l < num_local; ++l)
        for (int64_t s = 0; s < ep; ++s) {
            const int64_t n = int64_t(counts[s * num_experts + receiver * num_local + l]);
            fn(l, s, total, n);
            total += n;
        }
    return total;
}

// Start rows of every chunk (l, s) in `receiver`'s buffer, chunk index l * ep + s (chunk_offsets has
// L * ep + 1 entries; the last is the total, which is also returned).
MOEKIT_HD int64_t recv_chunk_offsets(const int64_t* counts, int64_t ep, int64_t num_experts, int64_t num_local,
                                     int64_t receiver, int64_t* chunk_offsets) {
    const int64_t total = for_each_recv_chunk(counts, ep, num_experts, num_local, receiver,
                                              [&](int64_t l, int64_t s, int64_t start, int64_t) {
                                                  chunk_offsets[l * ep + s] = start;
                                              });
    chunk_offsets[num_local * ep] = total;
    return total;
}

// Rows of a chunk starting at `offset` with `count` rows that fit a buffer of `budget` rows: the
// sender writes these and not one row more.
MOEKIT_HD int64_t rows_within_budget(int64_t offset, int64_t count, int64_t budget) {
    const int64_t room = budget - offset;
    return room <= 0 ? 0 : (count < room ? count : room);
}

// The smallest factor, in steps of 0.01, whose (aligned) budget holds `rows`: what the overflow log
// reports. Counts hundredths in integers so the answer does not drift.
MOEKIT_HD double sufficient_factor(int64_t rows, int64_t tokens, int64_t topk) {
    if (rows <= 0 || tokens * topk <= 0) return 0.0;
    // Below c0 / 100 the unaligned rows T*k*f stay under align_up(rows) - kBudgetRowAlign + 1.
    const int64_t need = align_up(rows, kBudgetRowAlign) - kBudgetRowAlign + 1;
    int64_t c = int64_t(floor(double(need - 1) * 100.0 / double(tokens * topk))) - 1;
    if (c < 0) c = 0;
    while (budget_rows(tokens, topk, double(c) / 100.0) < rows) ++c;
    return double(c) / 100.0;
}

}  // namespace moekit
