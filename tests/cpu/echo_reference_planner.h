// The ECHO planner as it was before the executors were restructured for speed (commit 695b969): the old
// helpers of src/core/echo_plan_math.h and the old CPU executor, verbatim but renamed, kept as the oracle
// that the new executors must match byte for byte (same plan, only faster). Used by
// tests/cpu/test_echo_plan_equivalence.cpp. Shapes as src/echo/planner.h.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "echo/planner.h"
#include "moekit/error.h"

namespace moekit::test::echo_ref {

// expert_total[e] = sum over source ranks of counts[s, e].
inline int64_t ref_echo_expert_total(const EchoDims& d, const int64_t* counts, int64_t e) {
    int64_t sum = 0;
    for (int64_t s = 0; s < d.ep; ++s) sum += counts[s * d.num_experts + e];
    return sum;
}

// Tokens the home experts of rank r receive without ECHO.
inline int64_t ref_echo_rank_load(const EchoDims& d, const int64_t* expert_total, int64_t r) {
    const int64_t L = d.experts_per_rank();
    int64_t sum = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e) sum += expert_total[e];
    return sum;
}

// True when expert a precedes b in its rank's spill order: larger count first, then lower index.
inline bool ref_echo_spills_before(const int64_t* expert_total, int64_t a, int64_t b) {
    return expert_total[a] > expert_total[b] || (expert_total[a] == expert_total[b] && a < b);
}

// Sum of the counts of e's home-rank peers that spill before e: e spills only once they are all gone.
inline int64_t ref_echo_ahead_sum(const EchoDims& d, const int64_t* expert_total, int64_t e) {
    const int64_t L = d.experts_per_rank(), r = d.home_rank(e);
    int64_t sum = 0;
    for (int64_t f = r * L; f < (r + 1) * L; ++f)
        if (f != e && ref_echo_spills_before(expert_total, f, e)) sum += expert_total[f];
    return sum;
}

// Tokens expert e must give away so that its rank's load falls to `target`: the largest experts of
// an overloaded rank carry its excess (MoE Echo's rule).
inline int64_t ref_echo_spill(const EchoDims& d, const int64_t* expert_total, const int64_t* rank_load,
                             const int64_t* ahead_sum, int64_t e, int64_t target) {
    const int64_t excess = rank_load[d.home_rank(e)] - target - ahead_sum[e];
    if (excess <= 0) return 0;
    return excess < expert_total[e] ? excess : expert_total[e];
}

// Position of item i when items are sorted by key descending, ties by lower index: the number of
// items that precede it. Each executor fills order[position(i)] = i (a permutation, no sort needed).
inline int64_t ref_echo_desc_position(const int64_t* key, int64_t n, int64_t i) {
    int64_t pos = 0;
    for (int64_t j = 0; j < n; ++j) pos += key[j] > key[i] || (key[j] == key[i] && j < i);
    return pos;
}
// The same ascending (ties by lower index).
inline int64_t ref_echo_asc_position(const int64_t* key, int64_t n, int64_t i) {
    int64_t pos = 0;
    for (int64_t j = 0; j < n; ++j) pos += key[j] < key[i] || (key[j] == key[i] && j < i);
    return pos;
}

// Key of the expert walk order. waterfill: the rank load still above the target when e starts to
// spill (rank_load - ahead_sum), so for any target the walk meets the experts of the most overloaded
// ranks first, each rank's largest first. greedy: MoE Echo's order, spill at the mean, descending.
inline int64_t ref_echo_walk_key(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* expert_total,
                                const int64_t* rank_load, const int64_t* ahead_sum, int64_t e, int64_t mean_floor) {
    if (algorithm == EchoAlgorithm::greedy) return ref_echo_spill(d, expert_total, rank_load, ahead_sum, e, mean_floor);
    return rank_load[d.home_rank(e)] - ahead_sum[e];
}

// Records a piece (expert, tokens) on receiver rank r. strict: the next free slot (the caller checked
// one is free). Otherwise (greedy) the rank keeps its S largest pieces: a piece larger than the smallest
// kept one replaces it (ties keep the earlier piece); the dropped tokens stay home.
inline void ref_echo_record_piece(const EchoDims& d, int64_t r, int64_t used, int64_t expert, int64_t tokens,
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

// The water-fill: experts in expert_order give their spill over `target`; receivers (ranks in
// rank_order = load ascending, so largest spare capacity first) take pieces up to `target` in a
// two-pointer walk. strict (waterfill): at most S pieces per rank; returns false if some spill is left.
// Not strict (greedy): unlimited pieces, each rank keeps its S largest (echo_record_piece).
// slot_expert/slot_tokens may be null (a feasibility test); else they must hold -1 / 0 on entry.
inline bool ref_echo_walk(const EchoDims& d, bool strict, int64_t target, const int64_t* expert_total,
                         const int64_t* rank_load, const int64_t* ahead_sum, const int32_t* expert_order,
                         const int32_t* rank_order, int32_t* slot_expert, int64_t* slot_tokens) {
    int64_t recv = 0, used = 0, room = d.ep > 0 ? target - rank_load[rank_order[0]] : 0;
    for (int64_t i = 0; i < d.num_experts; ++i) {
        const int64_t e = expert_order[i];
        int64_t left = ref_echo_spill(d, expert_total, rank_load, ahead_sum, e, target);
        // Both walk orders put every expert that spills before the first one whose rank is already at
        // or under the target without it, so the walk can stop there (it visits only the spilling ones).
        if (left == 0 && rank_load[d.home_rank(e)] - ahead_sum[e] <= target) break;
        while (left > 0) {
            if (recv >= d.ep || room <= 0 || d.slots_per_rank == 0) return false;  // ascending loads: none later
            const int64_t take = left < room ? left : room;
            const int64_t r = rank_order[recv];
            if (slot_expert) ref_echo_record_piece(d, r, used, e, take, slot_expert, slot_tokens);
            left -= take, room -= take, ++used;
            if (room == 0 || (strict && used == d.slots_per_rank)) {
                ++recv, used = 0;
                room = recv < d.ep ? target - rank_load[rank_order[recv]] : 0;
            }
        }
    }
    return true;
}

// Search round: candidate i (< ways) strictly between lo (infeasible) and hi (feasible); -1 if unused.
inline int64_t ref_echo_search_candidate(int64_t lo, int64_t hi, int64_t i, int64_t ways) {
    const int64_t gap = hi - lo;
    if (gap <= 1) return -1;
    if (gap - 1 <= ways) return i < gap - 1 ? lo + 1 + i : -1;
    return lo + gap * (i + 1) / (ways + 1);
}

// After a round (feasible[i] for each candidate): hi = smallest feasible candidate, lo = largest
// infeasible candidate below it. Returns false when the bracket did not change (cannot happen for
// gap > 1, kept as a guard against an endless loop).
inline bool ref_echo_search_update(int64_t* lo, int64_t* hi, const uint8_t* feasible, int64_t ways) {
    const int64_t old_lo = *lo, old_hi = *hi;
    int64_t new_hi = old_hi;
    for (int64_t i = 0; i < ways; ++i) {
        const int64_t c = ref_echo_search_candidate(old_lo, old_hi, i, ways);
        if (c >= 0 && feasible[i] && c < new_hi) new_hi = c;
    }
    int64_t new_lo = old_lo;
    for (int64_t i = 0; i < ways; ++i) {
        const int64_t c = ref_echo_search_candidate(old_lo, old_hi, i, ways);
        if (c >= 0 && !feasible[i] && c < new_hi && c > new_lo) new_lo = c;
    }
    *lo = new_lo, *hi = new_hi;
    return new_lo != old_lo || new_hi != old_hi;
}

// Tokens of expert e that stay home: its total minus what its clones take.
inline int64_t ref_echo_home_tokens(const EchoDims& d, const int64_t* expert_total, const int32_t* slot_expert,
                                   const int64_t* slot_tokens, int64_t e) {
    int64_t moved = 0;
    for (int64_t j = 0; j < d.num_slots(); ++j)
        if (slot_expert[j] == e) moved += slot_tokens[j];
    return expert_total[e] - moved;
}

// Source split: the tokens of expert e, concatenated in source-rank order, are cut into consecutive
// intervals: home first, then its clones in slot order, so each source rank sends to few destinations.
// out[s * stride] = overlap of source s's tokens of e with [lo, hi), for every source s.
inline void ref_echo_fill_interval(const EchoDims& d, const int64_t* counts, int64_t e, int64_t lo, int64_t hi,
                                  int64_t* out, int64_t stride) {
    int64_t begin = 0;
    for (int64_t s = 0; s < d.ep; ++s) {
        const int64_t end = begin + counts[s * d.num_experts + e];
        const int64_t a = begin > lo ? begin : lo, b = end < hi ? end : hi;
        out[s * stride] = b > a ? b - a : 0;
        begin = end;
    }
}

// Start of slot j's interval among its expert's tokens (home tokens first, then earlier slots).
inline int64_t ref_echo_slot_begin(const EchoDims& d, const int64_t* expert_total, const int32_t* slot_expert,
                                  const int64_t* slot_tokens, int64_t j) {
    const int64_t e = slot_expert[j];
    int64_t begin = ref_echo_home_tokens(d, expert_total, slot_expert, slot_tokens, e);
    for (int64_t i = 0; i < j; ++i)
        if (slot_expert[i] == e) begin += slot_tokens[i];
    return begin;
}

// Load of rank r with the plan: its home experts' remaining tokens plus its slots' tokens.
inline int64_t ref_echo_rank_load_after(const EchoDims& d, const int64_t* expert_total, const int32_t* slot_expert,
                                       const int64_t* slot_tokens, int64_t r) {
    const int64_t L = d.experts_per_rank();
    int64_t load = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e)
        load += ref_echo_home_tokens(d, expert_total, slot_expert, slot_tokens, e);
    for (int64_t j = r * d.slots_per_rank; j < (r + 1) * d.slots_per_rank; ++j) load += slot_tokens[j];
    return load;
}

// Lower end of the search: no plan beats ceil(total / EP), so ceil(total / EP) - 1 is infeasible.
inline int64_t ref_echo_search_floor(const EchoDims& d, int64_t total) { return ceil_div(total, d.ep) - 1; }


inline echo::EchoPlan reference_plan(const EchoDims& d, const std::vector<int64_t>& counts, EchoAlgorithm algorithm) {
    echo::validate(d);
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots();
    MOEKIT_CHECK(int64_t(counts.size()) == EP * E, "counts has ", counts.size(), " entries, expected EP*E = ", EP * E);
    for (size_t i = 0; i < counts.size(); ++i)
        MOEKIT_REQUIRE(counts[i] >= 0, "ECHO planner: counts[", int64_t(i) / E, "][", int64_t(i) % E, "]=", counts[i],
                       " must be >= 0");
    const int64_t* c = counts.data();

    // Statistics and the two walk orders (the kernel computes each entry in its own thread).
    std::vector<int64_t> total(E), load(EP), ahead(E), key(E);
    for (int64_t e = 0; e < E; ++e) total[e] = ref_echo_expert_total(d, c, e);
    int64_t all = 0;
    for (int64_t r = 0; r < EP; ++r) all += load[r] = ref_echo_rank_load(d, total.data(), r);
    for (int64_t e = 0; e < E; ++e) ahead[e] = ref_echo_ahead_sum(d, total.data(), e);
    const int64_t mean_floor = all / EP;
    for (int64_t e = 0; e < E; ++e)
        key[e] = ref_echo_walk_key(d, algorithm, total.data(), load.data(), ahead.data(), e, mean_floor);
    std::vector<int32_t> expert_order(E), rank_order(EP);
    for (int64_t e = 0; e < E; ++e) expert_order[ref_echo_desc_position(key.data(), E, e)] = int32_t(e);
    for (int64_t r = 0; r < EP; ++r) rank_order[ref_echo_asc_position(load.data(), EP, r)] = int32_t(r);
    const int64_t max_before = *std::max_element(load.begin(), load.end());

    echo::EchoPlan p;
    p.dims = d;
    p.algorithm = algorithm;
    p.slot_expert.assign(slots, -1);
    p.slot_tokens.assign(slots, 0);
    auto walk = [&](bool strict, int64_t target, bool record) {
        return ref_echo_walk(d, strict, target, total.data(), load.data(), ahead.data(), expert_order.data(),
                         rank_order.data(), record ? p.slot_expert.data() : nullptr,
                         record ? p.slot_tokens.data() : nullptr);
    };
    if (algorithm == EchoAlgorithm::greedy) {
        p.target = mean_floor;
        walk(false, mean_floor, true);  // spill that finds no room stays home
    } else {
        int64_t lo = ref_echo_search_floor(d, all), hi = max_before;
        std::vector<uint8_t> feasible(kEchoSearchWays);
        while (hi - lo > 1) {
            for (int64_t i = 0; i < kEchoSearchWays; ++i) {
                const int64_t cand = ref_echo_search_candidate(lo, hi, i, kEchoSearchWays);
                feasible[i] = cand >= 0 && walk(true, cand, false);
            }
            if (!ref_echo_search_update(&lo, &hi, feasible.data(), kEchoSearchWays)) break;
        }
        p.target = hi;
        const bool ok = walk(true, hi, true);
        MOEKIT_CHECK(ok, "the water-fill failed at a target it met during the search (", hi, ")");
    }

    // Source split and loads after.
    p.home_tokens.assign(EP * E, 0);
    p.clone_tokens.assign(EP * slots, 0);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t h = ref_echo_home_tokens(d, total.data(), p.slot_expert.data(), p.slot_tokens.data(), e);
        ref_echo_fill_interval(d, c, e, 0, h, p.home_tokens.data() + e, E);
    }
    for (int64_t j = 0; j < slots; ++j) {
        if (p.slot_expert[j] < 0) continue;  // the column stays zero
        const int64_t b = ref_echo_slot_begin(d, total.data(), p.slot_expert.data(), p.slot_tokens.data(), j);
        ref_echo_fill_interval(d, c, p.slot_expert[j], b, b + p.slot_tokens[j], p.clone_tokens.data() + j, slots);
    }
    p.rank_load_before = load;
    p.rank_load_after.resize(EP);
    for (int64_t r = 0; r < EP; ++r)
        p.rank_load_after[r] = ref_echo_rank_load_after(d, total.data(), p.slot_expert.data(), p.slot_tokens.data(), r);
    p.num_clones = std::count_if(p.slot_expert.begin(), p.slot_expert.end(), [](int32_t e) { return e >= 0; });
    return p;
}

}  // namespace moekit::test::echo_ref
