// ECHO dispatch maths: which of a source rank's tokens of an expert go home and which to each clone,
// shared by sender and receiver (src/cpu/dispatch_echo.cpp; a GPU dispatch can reuse it). The rule:
// source s's tokens of expert e, in token order (permutation 1's order), are cut into consecutive
// segments: the first home[s, e] go to the home expert, then clone[s, j] to each slot j cloning e, in
// ascending slot order. Plans come from src/echo/planner.h. Tests: tests/cpu/test_echo_dispatch.cpp.
#pragma once
#include <cstdint>

#include "core/echo_plan_math.h"

namespace moekit {

// Start of slot j's segment among source s's tokens of expert slot_expert[j]. home_row: [E] tokens of
// source s kept home (a row of the plan's home_tokens); clone_row: [EP*S] tokens of s per slot.
MOEKIT_HD int64_t echo_segment_begin(const EchoDims& d, const int32_t* slot_expert, const int64_t* home_row,
                                     const int64_t* clone_row, int64_t j) {
    const int64_t e = slot_expert[j];
    int64_t begin = home_row[e];
    for (int64_t i = 0; i < j; ++i)
        if (slot_expert[i] == e) begin += clone_row[i];
    (void)d;  // the dims are not needed here; kept so every helper takes them first
    return begin;
}

// Destination of the i-th of source s's tokens of expert e: -1 = the home expert, else the slot.
// i must be below source s's count of e (= home_row[e] + its clones' shares).
MOEKIT_HD int64_t echo_row_slot(const EchoDims& d, const int32_t* slot_expert, const int64_t* home_row,
                                const int64_t* clone_row, int64_t e, int64_t i) {
    int64_t end = home_row[e];
    if (i < end) return -1;
    for (int64_t j = 0; j < d.num_slots(); ++j)
        if (slot_expert[j] == e) {
            end += clone_row[j];
            if (i < end) return j;
        }
    return -2;  // past the source's tokens of e: a caller error
}

// Whether slot j's clone gradient goes home: the slot holds a clone and it was given tokens. A clone with no tokens
// adds nothing, so both executors skip it (the CUDA layer does not even write that slot's gradient block:
// grouped_gemm_tn's overwrite_nonempty).
MOEKIT_HD bool echo_clone_adds(const int32_t* slot_expert, const int64_t* slot_tokens, int64_t j) {
    return slot_expert[j] >= 0 && slot_tokens[j] > 0;
}

// The expert a local bucket of rank r computes: buckets [0, L) are its home experts, [L, L + S) its
// slots (the cloned expert, -1 for an empty slot).
MOEKIT_HD int64_t echo_bucket_expert(const EchoDims& d, const int32_t* slot_expert, int64_t r, int64_t bucket) {
    const int64_t L = d.experts_per_rank();
    return bucket < L ? r * L + bucket : slot_expert[r * d.slots_per_rank + (bucket - L)];
}

// Rows of source `src` in bucket `bucket` of receiver rank r: home_tokens [EP, E], clone_tokens [EP, EP*S].
MOEKIT_HD int64_t echo_chunk_rows(const EchoDims& d, const int32_t* slot_expert, const int64_t* home_tokens,
                                  const int64_t* clone_tokens, int64_t r, int64_t bucket, int64_t src) {
    const int64_t L = d.experts_per_rank(), e = echo_bucket_expert(d, slot_expert, r, bucket);
    if (e < 0) return 0;
    return bucket < L ? home_tokens[src * d.num_experts + e]
                      : clone_tokens[src * d.num_slots() + r * d.slots_per_rank + (bucket - L)];
}

// The budgeted ECHO dispatch's receive layout (the scan of dispatch_math.h's recv_chunk_offsets over
// buckets): start row of chunk (bucket b, source s) in receiver r's buffer at index b * EP + s, bucket
// major, L + S buckets; chunk_offsets has (L + S) * EP + 1 entries; returns r's total.
MOEKIT_HD int64_t echo_recv_chunk_offsets(const EchoDims& d, const int32_t* slot_expert, const int64_t* home_tokens,
                                          const int64_t* clone_tokens, int64_t r, int64_t* chunk_offsets) {
    const int64_t B = d.experts_per_rank() + d.slots_per_rank;
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < d.ep; ++s) {
            chunk_offsets[b * d.ep + s] = total;
            total += echo_chunk_rows(d, slot_expert, home_tokens, clone_tokens, r, b, s);
        }
    chunk_offsets[B * d.ep] = total;
    return total;
}

}  // namespace moekit
