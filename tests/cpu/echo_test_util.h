// Helpers of the ECHO planner tests (tests/cpu/test_echo_planner.cpp, tests/gpu/test_echo_plan.cu): seeded
// count matrices of several kinds (and extra kinds for the planner equivalence tests), and an independent
// check of every plan invariant.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "echo/planner.h"

namespace moekit::test {

enum class CountKind { uniform, zipf, sparse, zeros, one_expert };
inline const char* kind_name(CountKind k) {
    switch (k) {
        case CountKind::uniform:
            return "uniform";
        case CountKind::zipf:
            return "zipf";
        case CountKind::sparse:
            return "sparse";
        case CountKind::zeros:
            return "zeros";
        case CountKind::one_expert:
            return "one_expert";
    }
    return "?";
}

// counts [EP, E]: uniform in [0, 200]; zipf-weighted over a random expert order (one expert far above
// the mean); sparse (80% zeros); all zeros; one expert takes every token.
inline std::vector<int64_t> random_counts(const EchoDims& d, CountKind kind, uint64_t seed) {
    Rng rng(seed, 0xec40'7e57);
    const int64_t EP = d.ep, E = d.num_experts;
    std::vector<int64_t> c(EP * E, 0);
    std::vector<int64_t> perm(E);
    for (int64_t e = 0; e < E; ++e) perm[e] = e;
    for (int64_t i = E - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    const int64_t star = rng.below(E);
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            int64_t& v = c[s * E + e];
            switch (kind) {
                case CountKind::uniform:
                    v = rng.below(201);
                    break;
                case CountKind::zipf:
                    v = int64_t(4000.0 * rng.uniform() / std::pow(double(perm[e] + 1), 1.2));
                    break;
                case CountKind::sparse:
                    v = rng.uniform() < 0.8 ? 0 : rng.below(1000);
                    break;
                case CountKind::zeros:
                    v = 0;
                    break;
                case CountKind::one_expert:
                    v = e == star ? 1 + rng.below(5000) : 0;
                    break;
            }
        }
    if (kind == CountKind::sparse) c[rng.below(EP * E)] += 1 + rng.below(1000);  // never all zero
    return c;
}

// Kinds beyond echo_test_util's: many equal counts (ties everywhere), whole experts empty, a few ranks
// far over the others, and counts so large the total passes 2^31.
enum class Extra { ties, empty_experts, hot_ranks, huge };
inline const char* extra_name(Extra k) {
    switch (k) {
        case Extra::ties:
            return "ties";
        case Extra::empty_experts:
            return "empty_experts";
        case Extra::hot_ranks:
            return "hot_ranks";
        case Extra::huge:
            return "huge";
    }
    return "?";
}

inline std::vector<int64_t> extra_counts(const EchoDims& d, Extra kind, uint64_t seed) {
    Rng rng(seed, 0xec40'e9a1);
    const int64_t EP = d.ep, E = d.num_experts, L = E / EP;
    std::vector<int64_t> c(EP * E, 0);
    std::vector<uint8_t> empty(E, 0);
    for (int64_t e = 0; e < E; ++e) empty[e] = rng.uniform() < 0.4;
    const int64_t hot = rng.below(EP);
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            int64_t& v = c[s * E + e];
            switch (kind) {
                case Extra::ties:
                    v = 4 * rng.below(3);  // 0, 4, 8: equal totals, loads and bases all over
                    break;
                case Extra::empty_experts:
                    v = empty[e] ? 0 : rng.below(300);
                    break;
                case Extra::hot_ranks:
                    v = (e / L == hot || e / L == (hot + 1) % EP) ? 200 + rng.below(800) : rng.below(50);
                    break;
                case Extra::huge:
                    v = int64_t(rng.below(1 << 20)) << 14;  // up to 2^34 per entry
                    break;
            }
        }
    c[rng.below(EP * E)] += 1 + rng.below(100);  // never all zero
    return c;
}

// Every invariant of a plan, computed here from the counts and the plan's token arrays alone.
inline void expect_plan_invariants(const EchoDims& d, const std::vector<int64_t>& counts, const echo::EchoPlan& p) {
    const int64_t EP = d.ep, E = d.num_experts, S = d.slots_per_rank, slots = EP * S, L = E / EP;
    ASSERT_EQ(int64_t(p.slot_expert.size()), slots);
    ASSERT_EQ(int64_t(p.slot_tokens.size()), slots);
    ASSERT_EQ(int64_t(p.clone_tokens.size()), EP * slots);
    ASSERT_EQ(int64_t(p.home_tokens.size()), EP * E);
    ASSERT_EQ(int64_t(p.rank_load_before.size()), EP);
    ASSERT_EQ(int64_t(p.rank_load_after.size()), EP);
    int64_t clones = 0;
    for (int64_t j = 0; j < slots; ++j) {
        const int64_t e = p.slot_expert[j], r = j / S;
        int64_t column = 0;
        for (int64_t s = 0; s < EP; ++s) {
            EXPECT_GE(p.clone_tokens[s * slots + j], 0) << "slot " << j << " source " << s;
            column += p.clone_tokens[s * slots + j];
        }
        EXPECT_EQ(column, p.slot_tokens[j]) << "slot " << j;
        if (e < 0) {
            EXPECT_EQ(e, -1) << "slot " << j;
            EXPECT_EQ(p.slot_tokens[j], 0) << "empty slot " << j;
            continue;
        }
        ++clones;
        ASSERT_LT(e, E) << "slot " << j;
        EXPECT_NE(e / L, r) << "slot " << j << " on rank " << r << " clones expert " << e << " homed there";
        EXPECT_GT(p.slot_tokens[j], 0) << "slot " << j << " clones expert " << e << " for no tokens";
        for (int64_t i = r * S; i < j; ++i)
            EXPECT_NE(p.slot_expert[i], e) << "rank " << r << " clones " << e << " twice";
    }
    EXPECT_EQ(p.num_clones, clones);
    // Folding every clone column back into its home expert reproduces the counts exactly.
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            int64_t folded = p.home_tokens[s * E + e];
            EXPECT_GE(p.home_tokens[s * E + e], 0);
            for (int64_t j = 0; j < slots; ++j)
                if (p.slot_expert[j] == e) folded += p.clone_tokens[s * slots + j];
            EXPECT_EQ(folded, counts[s * E + e]) << "source " << s << " expert " << e;
        }
    // Loads before and after, from the counts and the token arrays.
    int64_t total = 0, max_before = 0, max_after = 0;
    for (int64_t r = 0; r < EP; ++r) {
        int64_t before = 0, after = 0;
        for (int64_t s = 0; s < EP; ++s) {
            for (int64_t e = r * L; e < (r + 1) * L; ++e)
                before += counts[s * E + e], after += p.home_tokens[s * E + e];
            for (int64_t j = r * S; j < (r + 1) * S; ++j) after += p.clone_tokens[s * slots + j];
        }
        EXPECT_EQ(p.rank_load_before[r], before) << "rank " << r;
        EXPECT_EQ(p.rank_load_after[r], after) << "rank " << r;
        total += before, max_before = std::max(max_before, before), max_after = std::max(max_after, after);
    }
    // Planning for time (group_floor_rows > 0) balances costs, so a rank's tokens may end above the old maximum.
    if (d.group_floor_rows == 0) EXPECT_LE(max_after, max_before);
    EXPECT_GE(max_after, (total + EP - 1) / EP);
    EXPECT_EQ(p.max_before(), max_before);
    EXPECT_EQ(p.max_after(), max_after);
}

}  // namespace moekit::test
