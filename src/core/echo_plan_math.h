// ECHO planner maths, shared by the CPU executor (src/echo/planner.cpp) and the one-block CUDA
// executor (src/cuda/echo_plan.cu): plain arrays, integers only, fixed orders, so both produce the
// same plan bit for bit. counts [EP, E] int64 (source rank x expert; experts homed in order, E/EP per
// rank); slots [EP*S] (slot j lives on rank j / S). Tests: tests/cpu/test_echo_planner.cpp,
// tests/gpu/test_echo_plan.cu.
#pragma once
#include <cstdint>

#include "core/hd.h"

namespace moekit {

// greedy: MoE Echo's one-shot greedy (target = floor(mean), water-fill of spill onto spare capacity,
// each rank keeps its S largest pieces, the rest stays home). waterfill: the same kind of water-fill
// under a strict S-slot limit, searched for the smallest target max load it can meet.
enum class EchoAlgorithm : int32_t { greedy = 0, waterfill = 1 };

// Candidates tested per search round (one CUDA thread each); fixed so every executor searches alike.
constexpr int kEchoSearchWays = 256;

struct EchoDims {
    int64_t ep = 1;              // EP ranks (also the source ranks of counts)
    int64_t num_experts = 0;     // E, divisible by ep
    int64_t slots_per_rank = 0;  // S spare slots per rank
    int64_t group_floor_rows = 0;  // > 0: plan for time, not tokens (echo_rank_cost)
    MOEKIT_HD int64_t experts_per_rank() const { return num_experts / ep; }
    MOEKIT_HD int64_t num_slots() const { return ep * slots_per_rank; }
    MOEKIT_HD int64_t home_rank(int64_t expert) const { return expert / experts_per_rank(); }
};

// expert_total[e] = sum over source ranks of counts[s, e].
MOEKIT_HD int64_t echo_expert_total(const EchoDims& d, const int64_t* counts, int64_t e) {
    int64_t sum = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 8
#endif
    for (int64_t s = 0; s < d.ep; ++s) sum += counts[s * d.num_experts + e];
    return sum;
}

// Tokens the home experts of rank r receive without ECHO.
MOEKIT_HD int64_t echo_rank_load(const EchoDims& d, const int64_t* expert_total, int64_t r) {
    const int64_t L = d.experts_per_rank();
    int64_t sum = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e) sum += expert_total[e];
    return sum;
}

// What the planner balances: a rank's tokens, or with group_floor_rows > 0 its expert time in tokens' worth. A
// group's weight gradient costs at least as long as group_floor_rows rows' math, because its whole fp32 gradient is
// written whatever its rows (H200, grouped wgrad: about max(rows, 500) a group); the wgrads are a third of an
// expert's FLOPs. So each home expert with tokens below the floor adds a third of its shortfall, and a rank holding
// many cold experts is planned fewer clone tokens (measured: its step time tracks this shortfall, docs/perf.md).
// Clone groups and spilled remainders are not charged: the cost is fixed before the walk.
MOEKIT_HD int64_t echo_rank_cost(const EchoDims& d, const int64_t* expert_total, int64_t r) {
    const int64_t L = d.experts_per_rank();
    int64_t tokens = 0, shortfall = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e) {
        const int64_t t = expert_total[e];
        tokens += t;
        if (t > 0 && t < d.group_floor_rows) shortfall += d.group_floor_rows - t;
    }
    return tokens + shortfall / 3;
}

// True when expert a precedes b in its rank's spill order: larger count first, then lower index.
MOEKIT_HD bool echo_spills_before(const int64_t* expert_total, int64_t a, int64_t b) {
    return expert_total[a] > expert_total[b] || (expert_total[a] == expert_total[b] && a < b);
}

// Sum of the counts of e's home-rank peers that spill before e: e spills only once they are all gone.
MOEKIT_HD int64_t echo_ahead_sum(const EchoDims& d, const int64_t* expert_total, int64_t e) {
    const int64_t L = d.experts_per_rank(), r = d.home_rank(e);
    int64_t sum = 0;
    for (int64_t f = r * L; f < (r + 1) * L; ++f)
        if (f != e && echo_spills_before(expert_total, f, e)) sum += expert_total[f];
    return sum;
}

// Tokens expert e must give away so that its rank's cost (echo_rank_cost) falls to `target`: the largest experts of
// an overloaded rank carry its excess (MoE Echo's rule). base = rank_load[home] - ahead_sum[e], the rank
// load still above the target when e starts to spill (echo_walk_base).
MOEKIT_HD int64_t echo_spill_of(int64_t base, int64_t total, int64_t target) {
    const int64_t excess = base - target;
    if (excess <= 0) return 0;
    return excess < total ? excess : total;
}
MOEKIT_HD int64_t echo_walk_base(const EchoDims& d, const int64_t* expert_total, const int64_t* rank_load, int64_t e) {
    return rank_load[d.home_rank(e)] - echo_ahead_sum(d, expert_total, e);
}

// Position of item i when items are sorted by key descending, ties by lower index: the number of
// items that precede it. Each executor fills order[position(i)] = i (a permutation, no sort needed).
// [begin, end) counts only part of the items (the GPU splits one count over a few lanes).
MOEKIT_HD int64_t echo_desc_position_part(const int64_t* key, int64_t begin, int64_t end, int64_t step, int64_t i) {
    const int64_t ki = key[i];
    int64_t pos = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
    for (int64_t j = begin; j < end; j += step) pos += key[j] > ki || (key[j] == ki && j < i);
    return pos;
}
MOEKIT_HD int64_t echo_desc_position(const int64_t* key, int64_t n, int64_t i) {
    return echo_desc_position_part(key, 0, n, 1, i);
}
// The same ascending (ties by lower index).
MOEKIT_HD int64_t echo_asc_position(const int64_t* key, int64_t n, int64_t i) {
    const int64_t ki = key[i];
    int64_t pos = 0;
    for (int64_t j = 0; j < n; ++j) pos += key[j] < ki || (key[j] == ki && j < i);
    return pos;
}

// The walk list. The water-fill visits experts in a fixed order and gives each its spill over the target.
// waterfill order: by base descending (for any target the walk meets the experts of the most overloaded
// ranks first, each rank's largest first); greedy: MoE Echo's order, by the spill at floor(mean)
// descending. Ties by lower index. Only experts that can give a piece are listed: waterfill, those with
// tokens (the walk at target T visits the list's prefix with base > T: base is descending); greedy, those
// spilling at the mean (the walk visits them all). An expert left out would only be stepped over.
// echo_list_key: the sort key of expert e, or -1 when it is not listed (every listed key is >= 1).
MOEKIT_HD int64_t echo_list_key(EchoAlgorithm algorithm, int64_t base, int64_t total, int64_t mean_floor) {
    if (algorithm == EchoAlgorithm::greedy) {
        const int64_t spill = echo_spill_of(base, total, mean_floor);
        return spill > 0 ? spill : -1;
    }
    return total > 0 ? base : -1;
}

// Records a piece (expert, tokens) on receiver rank r. strict: the next free slot (the caller checked
// one is free). Otherwise (greedy) the rank keeps its S largest pieces: a piece larger than the smallest
// kept one replaces it (ties keep the earlier piece); the dropped tokens stay home.
MOEKIT_HD void echo_record_piece(const EchoDims& d, int64_t r, int64_t used, int64_t expert, int64_t tokens,
                                 int32_t* slot_expert, int64_t* slot_tokens) {
    const int64_t base = r * d.slots_per_rank;
    if (used < d.slots_per_rank) {
        slot_expert[base + used] = int32_t(expert);
        slot_tokens[base + used] = tokens;
        return;
    }
    int64_t smallest = base;
    for (int64_t j = base + 1; j < base + d.slots_per_rank; ++j)
        if (slot_tokens[j] <= slot_tokens[smallest]) smallest = j;  // <=: the later of equal pieces goes
    if (tokens > slot_tokens[smallest]) {
        slot_expert[smallest] = int32_t(expert);
        slot_tokens[smallest] = tokens;
    }
}

// The water-fill at `target`: the listed experts (list_base / list_cap = base / tokens, list_expert = id,
// in walk order, then a sentinel base -1) give their spill; receivers (recv_load = loads of the ranks in
// rank_order, ascending, so largest spare capacity first, then two sentinels >= every target) take
// pieces up to the target in a two-pointer walk, one piece per step. strict (waterfill): at most S pieces
// per rank; returns false if some spill is left. Not strict (greedy): unlimited pieces, each rank keeps
// its S largest (echo_record_piece). kRecord: slot_expert/slot_tokens must hold -1 / 0 on entry.
// I: the arithmetic type; int32_t is exact when the total token count fits (echo_walk picks it), and
// halves the latency of the one serial chain of the planner.
template <class I, bool kStrict, bool kRecord>
MOEKIT_HD bool echo_walk_typed(const EchoDims& d, int64_t target, const int64_t* list_base, const int64_t* list_cap,
                               const int32_t* list_expert, const int64_t* recv_load, const int32_t* rank_order,
                               int32_t* slot_expert, int64_t* slot_tokens) {
    const I T = I(target);
    const I first = I(list_base[0]);
    if (first <= T) return true;                // nothing spills
    if (d.slots_per_rank == 0) return false;  // spill and no slot
    I left = first - T < I(list_cap[0]) ? first - T : I(list_cap[0]);
    I room = T - I(recv_load[0]);
    // The next expert's and receiver's values are loaded one step ahead, off the serial chain.
    I next_base = I(list_base[1]), next_cap = I(list_cap[1]), next_load = I(recv_load[1]);
    int64_t i = 0, k = 0, used = 0;
    for (;;) {
        if (room <= 0) return false;  // ascending loads: no later receiver has room either
        const I take = left < room ? left : room;
        if (kRecord) echo_record_piece(d, rank_order[k], used, list_expert[i], int64_t(take), slot_expert, slot_tokens);
        left -= take, room -= take, ++used;
        if (left == 0) {
            ++i;
            if (next_base <= T) return true;  // the rest of the list is at or under the target
            left = next_base - T < next_cap ? next_base - T : next_cap;
            next_base = I(list_base[i + 1]), next_cap = I(list_cap[i + 1]);
        }
        if (room == 0 || (kStrict && used == d.slots_per_rank)) {
            ++k, used = 0;
            room = T - next_load;
            next_load = I(recv_load[k + 1]);
        }
    }
}

// int32 arithmetic is exact when every quantity of the walk (loads, targets, spills, rooms, all within
// [-total, total]) fits.
MOEKIT_HD bool echo_walk_fits_int32(int64_t total) { return total <= int64_t(0x7fffffff); }

template <bool kStrict, bool kRecord>
MOEKIT_HD bool echo_walk(const EchoDims& d, int64_t total, int64_t target, const int64_t* list_base,
                         const int64_t* list_cap, const int32_t* list_expert, const int64_t* recv_load,
                         const int32_t* rank_order, int32_t* slot_expert, int64_t* slot_tokens) {
    if (echo_walk_fits_int32(total))
        return echo_walk_typed<int32_t, kStrict, kRecord>(d, target, list_base, list_cap, list_expert, recv_load,
                                                          rank_order, slot_expert, slot_tokens);
    return echo_walk_typed<int64_t, kStrict, kRecord>(d, target, list_base, list_cap, list_expert, recv_load,
                                                      rank_order, slot_expert, slot_tokens);
}

// Search round: candidate i (< ways) strictly between lo (infeasible) and hi (feasible); -1 if unused.
MOEKIT_HD int64_t echo_search_candidate(int64_t lo, int64_t hi, int64_t i, int64_t ways) {
    const int64_t gap = hi - lo;
    if (gap <= 1) return -1;
    if (gap - 1 <= ways) return i < gap - 1 ? lo + 1 + i : -1;
    return lo + gap * (i + 1) / (ways + 1);
}

// After a round: hi = the smallest feasible candidate (min over the candidates of echo_search_hi_term),
// then lo = the largest infeasible candidate below it (max of echo_search_lo_term). Executors reduce the
// terms in any order (min and max): a loop on the CPU, warp shuffles on the GPU.
MOEKIT_HD int64_t echo_search_hi_term(int64_t cand, bool feasible, int64_t old_hi) {
    return cand >= 0 && feasible && cand < old_hi ? cand : old_hi;
}
MOEKIT_HD int64_t echo_search_lo_term(int64_t cand, bool feasible, int64_t new_hi, int64_t old_lo) {
    return cand >= 0 && !feasible && cand < new_hi && cand > old_lo ? cand : old_lo;
}

// The round's update, sequentially. Returns false when the bracket did not change (cannot happen for
// gap > 1, kept as a guard against an endless loop).
MOEKIT_HD bool echo_search_update(int64_t* lo, int64_t* hi, const uint8_t* feasible, int64_t ways) {
    const int64_t old_lo = *lo, old_hi = *hi;
    int64_t new_hi = old_hi;
    for (int64_t i = 0; i < ways; ++i) {
        const int64_t t = echo_search_hi_term(echo_search_candidate(old_lo, old_hi, i, ways), feasible[i], old_hi);
        new_hi = t < new_hi ? t : new_hi;
    }
    int64_t new_lo = old_lo;
    for (int64_t i = 0; i < ways; ++i) {
        const int64_t t =
            echo_search_lo_term(echo_search_candidate(old_lo, old_hi, i, ways), feasible[i], new_hi, old_lo);
        new_lo = t > new_lo ? t : new_lo;
    }
    *lo = new_lo, *hi = new_hi;
    return new_lo != old_lo || new_hi != old_hi;
}

// Tokens of each expert that stay home: home[e] = total[e] minus the tokens of every slot cloning e
// (executors subtract the slots in any order: integer sums).

// Source split: the tokens of expert e, concatenated in source-rank order, are cut into consecutive
// intervals: home first, then its clones in slot order, so each source rank sends to few destinations.
// out[s * stride] = overlap of source s's tokens of e with [lo, hi), for every source s.
MOEKIT_HD void echo_fill_interval(const EchoDims& d, const int64_t* counts, int64_t e, int64_t lo, int64_t hi,
                                  int64_t* out, int64_t stride) {
    // In chunks: the chunk's counts are all loaded before any store (the compiler cannot move loads past
    // stores it cannot prove apart), so a GPU thread waits for one memory latency per chunk, not per source.
    constexpr int64_t kChunk = 8;
    int64_t begin = 0;
    for (int64_t s0 = 0; s0 < d.ep; s0 += kChunk) {
        int64_t c[kChunk];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int64_t u = 0; u < kChunk; ++u) c[u] = s0 + u < d.ep ? counts[(s0 + u) * d.num_experts + e] : 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int64_t u = 0; u < kChunk; ++u) {
            if (s0 + u >= d.ep) break;
            const int64_t end = begin + c[u];
            const int64_t a = begin > lo ? begin : lo, b = end < hi ? end : hi;
            out[(s0 + u) * stride] = b > a ? b - a : 0;
            begin = end;
        }
    }
}

// Start of slot j's interval among its expert's tokens (home tokens first, then earlier slots).
MOEKIT_HD int64_t echo_slot_begin(const int64_t* home, const int32_t* slot_expert, const int64_t* slot_tokens,
                                  int64_t j) {
    const int32_t e = slot_expert[j];
    int64_t begin = home[e];
    for (int64_t i = 0; i < j; ++i)
        if (slot_expert[i] == e) begin += slot_tokens[i];
    return begin;
}

// Load of rank r with the plan: its home experts' remaining tokens plus its slots' tokens.
MOEKIT_HD int64_t echo_rank_load_after(const EchoDims& d, const int64_t* home, const int64_t* slot_tokens, int64_t r) {
    const int64_t L = d.experts_per_rank();
    int64_t load = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e) load += home[e];
    for (int64_t j = r * d.slots_per_rank; j < (r + 1) * d.slots_per_rank; ++j) load += slot_tokens[j];
    return load;
}

// Lower end of the search: no plan beats ceil(total / EP) (total: of the rank costs), so ceil(total / EP) - 1 is
// infeasible.
MOEKIT_HD int64_t echo_search_floor(const EchoDims& d, int64_t total) { return ceil_div(total, d.ep) - 1; }

}  // namespace moekit
