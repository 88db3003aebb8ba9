// ECHO planner, CPU executor (src/echo/planner.cpp, maths in src/core/echo_plan_math.h): invariants over seeded random
// count matrices for both algorithms (tokens keep their expert, folding clones back reproduces the counts,
// no clone on its home rank, max load never grows, determinism), and hand-checked small plans.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/flags.h"
#include "cpu/echo_test_util.h"
#include "echo/planner.h"
#include "moekit/error.h"

namespace moekit {
namespace {

using test::CountKind;

const EchoDims kDims[] = {
    {1, 5, 2},  {2, 2, 4},   {3, 111, 1}, {7, 91, 2},   {5, 35, 0},
    {8, 64, 2}, {16, 48, 3}, {13, 39, 1}, {64, 256, 2}, {32, 32, 5},
};
const CountKind kKinds[] = {CountKind::uniform, CountKind::zipf, CountKind::sparse, CountKind::zeros,
                            CountKind::one_expert};

// Every count kind and algorithm on dims d: the plan's invariants and its determinism.
void check_invariants_over_random_counts(const EchoDims& d, uint64_t& seed) {
    for (CountKind kind : kKinds)
        for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
            ++seed;
            SCOPED_TRACE(echo::to_string(d) + " " + test::kind_name(kind) + " " + echo::algorithm_name(alg) +
                         " seed " + std::to_string(seed));
            const auto counts = test::random_counts(d, kind, seed);
            if (kind != CountKind::zeros) {
                int64_t total = 0;
                for (int64_t v : counts) total += v;
                ASSERT_GT(total, 0) << "the random counts must not be all zero";
            }
            const echo::EchoPlan p = echo::plan(d, counts, alg);
            test::expect_plan_invariants(d, counts, p);
            if (kind == CountKind::zeros) EXPECT_EQ(p.num_clones, 0);
            // Determinism: a second run on a copy gives the same bytes.
            const std::vector<int64_t> copy = counts;
            EXPECT_EQ(echo::plan_bytes(echo::plan(d, copy, alg)), echo::plan_bytes(p));
        }
}

TEST(EchoPlan, InvariantsOverRandomCounts) {
    uint64_t seed = 9000;
    for (const EchoDims& d : kDims) check_invariants_over_random_counts(d, seed);
}

// Skewed counts are the point of ECHO: with spare slots the busiest rank must actually get lighter.
TEST(EchoPlan, SkewedLoadGetsLighter) {
    uint64_t seed = 9500;
    for (const EchoDims& d : {EchoDims{8, 64, 2}, EchoDims{16, 48, 3}, EchoDims{64, 256, 2}, EchoDims{7, 91, 2}})
        for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
            ++seed;
            SCOPED_TRACE(echo::to_string(d) + " " + echo::algorithm_name(alg) + " seed " + std::to_string(seed));
            const auto counts = test::random_counts(d, CountKind::zipf, seed);
            const echo::EchoPlan p = echo::plan(d, counts, alg);
            ASSERT_GT(p.max_over_mean_before(), 1.2) << "the input is not skewed enough to test anything";
            EXPECT_LT(p.max_after(), p.max_before());
            EXPECT_GT(p.num_clones, 0);
        }
}

// Planning for time (EchoDims::group_floor_rows): the same invariants and determinism on every count kind.
TEST(EchoPlan, GroupFloorKeepsTheInvariants) {
    uint64_t seed = 9700;
    for (const EchoDims& d : {EchoDims{8, 64, 2, 512}, EchoDims{64, 256, 2, 512}, EchoDims{7, 91, 2, 100},
                              EchoDims{3, 111, 1, 1 << 20}, EchoDims{5, 35, 0, 300}})
        check_invariants_over_random_counts(d, seed);
}

// Rank 0 holds a hot expert (3000 tokens); ranks 1 and 2 hold 1500 each, rank 1 as three 500-token experts,
// rank 2 as 1400 + 50 + 50. Balancing tokens gives both receivers 500; planning for time with a 300-row floor
// charges rank 2 a third of its cold experts' shortfall (2 x 250 / 3 = 166), so it gets fewer clone tokens:
// costs 3000 | 1500 | 1666, target ceil(6166 / 3) = 2056: rank 0 spills 944, rank 1 (the lower cost) fills to
// the target with 556, rank 2 takes the other 388.
TEST(EchoPlan, GroupFloorPlansFewerTokensForColdHeavyRanks) {
    const std::vector<int64_t> totals = {3000, 0, 0, 500, 500, 500, 1400, 50, 50};
    std::vector<int64_t> counts(3 * 9);
    for (int64_t e = 0; e < 9; ++e)
        for (int64_t s = 0; s < 3; ++s) counts[s * 9 + e] = totals[e] / 3 + (s < totals[e] % 3);
    const echo::EchoPlan rows = echo::plan(EchoDims{3, 9, 1}, counts, EchoAlgorithm::waterfill);
    EXPECT_EQ(rows.rank_load_after, (std::vector<int64_t>{2000, 2000, 2000}));
    const EchoDims d{3, 9, 1, 300};
    const echo::EchoPlan time = echo::plan(d, counts, EchoAlgorithm::waterfill);
    test::expect_plan_invariants(d, counts, time);
    EXPECT_EQ(time.target, 2056);
    EXPECT_EQ(time.rank_load_before, (std::vector<int64_t>{3000, 1500, 1500}));  // tokens, not costs
    EXPECT_EQ(time.rank_load_after, (std::vector<int64_t>{2056, 2056, 1888}));
}

// One expert takes every token: the best plan splits it over all EP ranks (home + EP-1 clones), and the
// search finds exactly ceil(C / EP).
TEST(EchoPlan, OneExpertTakesAllIsSplitEvenly) {
    for (const EchoDims& d : {EchoDims{4, 8, 1}, EchoDims{7, 91, 2}, EchoDims{64, 256, 2}}) {
        const int64_t E = d.num_experts, star = E / 2 + 1, C = 100003;
        std::vector<int64_t> counts(d.ep * E, 0);
        for (int64_t s = 0; s < d.ep; ++s) counts[s * E + star] = C / d.ep + (s < C % d.ep);
        const echo::EchoPlan p = echo::plan(d, counts, EchoAlgorithm::waterfill);
        SCOPED_TRACE(echo::to_string(d));
        test::expect_plan_invariants(d, counts, p);
        EXPECT_EQ(p.max_after(), (C + d.ep - 1) / d.ep);
        EXPECT_EQ(p.num_clones, d.ep - 1);
    }
}

// Loads 100 | 0 with E=4, EP=2, S=1: one clone of expert 0 on rank 1 takes 50 tokens, the source split is
// home first then the clone, in source order.
TEST(EchoPlan, HandCheckedTwoRanks) {
    const EchoDims d{2, 4, 1};
    const std::vector<int64_t> counts = {45, 5, 0, 0,   // source rank 0
                                         45, 5, 0, 0};  // source rank 1
    for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
        SCOPED_TRACE(echo::algorithm_name(alg));
        const echo::EchoPlan p = echo::plan(d, counts, alg);
        EXPECT_EQ(p.slot_expert, (std::vector<int32_t>{-1, 0}));
        EXPECT_EQ(p.slot_tokens, (std::vector<int64_t>{0, 50}));
        EXPECT_EQ(p.home_tokens, (std::vector<int64_t>{40, 5, 0, 0, 0, 5, 0, 0}));
        EXPECT_EQ(p.clone_tokens, (std::vector<int64_t>{0, 5, 0, 45}));  // [source, slot]
        EXPECT_EQ(p.rank_load_before, (std::vector<int64_t>{100, 0}));
        EXPECT_EQ(p.rank_load_after, (std::vector<int64_t>{50, 50}));
        EXPECT_EQ(p.num_clones, 1);
    }
}

// MoE Echo's greedy targets floor(mean) and keeps only each rank's S largest pieces; the rest stays home.
// Loads 45 | 45 | 0 | 30 (E=8, EP=4, S=1), mean 30: both spills (15 of expert 0, 15 of expert 2) land on
// rank 2, which keeps one, so rank 1 stays at 45. The search gives rank 3 the other piece: rank 0 and 1
// give 45 - M each, rank 3 has room M - 30, so M = 38 is the smallest target that fits.
TEST(EchoPlan, GreedyLeavesResidualWhenSlotsRunOut) {
    const EchoDims d{4, 8, 1};
    std::vector<int64_t> counts(4 * 8, 0);
    counts[0] = 45, counts[2] = 45, counts[6] = 30;  // source rank 0; the other sources send nothing
    const echo::EchoPlan g = echo::plan(d, counts, EchoAlgorithm::greedy);
    const echo::EchoPlan w = echo::plan(d, counts, EchoAlgorithm::waterfill);
    test::expect_plan_invariants(d, counts, g);
    test::expect_plan_invariants(d, counts, w);
    EXPECT_EQ(g.target, 30);
    EXPECT_EQ(g.slot_expert, (std::vector<int32_t>{-1, -1, 0, -1}));
    EXPECT_EQ(g.rank_load_after, (std::vector<int64_t>{30, 45, 15, 30}));
    EXPECT_EQ(w.target, 38);
    EXPECT_EQ(w.slot_expert, (std::vector<int32_t>{-1, -1, 0, 2}));
    EXPECT_EQ(w.rank_load_after, (std::vector<int64_t>{38, 38, 7, 37}));
}

TEST(EchoPlan, RejectsBadShapesAndCounts) {
    EXPECT_THROW(echo::plan({0, 4, 1}, {}, EchoAlgorithm::waterfill), UsageError);
    EXPECT_THROW(echo::plan({3, 4, 1}, std::vector<int64_t>(12, 1), EchoAlgorithm::waterfill), UsageError);
    EXPECT_THROW(echo::plan({2, 4, -1}, std::vector<int64_t>(8, 1), EchoAlgorithm::waterfill), UsageError);
    std::vector<int64_t> negative(8, 1);
    negative[5] = -3;
    try {
        echo::plan({2, 4, 1}, negative, EchoAlgorithm::greedy);
        FAIL() << "negative count accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("counts[1][1]=-3"), std::string::npos) << e.what();
    }
    EXPECT_THROW(echo::parse_algorithm("ilp"), UsageError);
    EXPECT_EQ(echo::parse_algorithm("greedy"), EchoAlgorithm::greedy);
}

// The ECHO flags in the MoE flag table and their rules (S_TOTAL divisible by EP; --moe-enable-echo
// needs the alltoall dispatcher; more rules in tests/cpu/test_echo_virtual.cpp).
TEST(EchoConfig, FlagsAndRules) {
    const std::vector<std::string> base = {
        "--hidden-size", "8", "--num-experts", "8", "--expert-model-parallel-size", "4"};
    auto with = [&](std::vector<std::string> extra) {
        auto a = base;
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    const MoeConfig ok = parse_moe_config(with({"--moe-num-echo-experts", "8", "--moe-echo-algorithm", "greedy"}));
    EXPECT_EQ(ok.moe_num_echo_experts, 8);
    EXPECT_EQ(ok.moe_echo_algorithm, "greedy");
    EXPECT_EQ(MoeConfig{}.moe_echo_algorithm, "waterfill");
    auto error_of = [&](std::vector<std::string> extra) -> std::string {
        try {
            parse_moe_config(with(extra));
        } catch (const UsageError& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_NE(error_of({"--moe-num-echo-experts", "6"})
                  .find("--moe-num-echo-experts=6 must be divisible by "
                        "--expert-model-parallel-size=4"),
              std::string::npos);
    EXPECT_NE(error_of({"--moe-echo-algorithm", "ilp"}).find("--moe-echo-algorithm=ilp"), std::string::npos);
    EXPECT_EQ(parse_moe_config(with({"--moe-echo-group-floor-rows", "512"})).moe_echo_group_floor_rows, 512);
    EXPECT_EQ(MoeConfig{}.moe_echo_group_floor_rows, 0);
    EXPECT_NE(error_of({"--moe-echo-group-floor-rows", "-1"}).find("--moe-echo-group-floor-rows=-1 must be in"),
              std::string::npos);
    EXPECT_NE(error_of({"--moe-enable-echo"}).find("--moe-enable-echo requires --moe-num-echo-experts"),
              std::string::npos);
    EXPECT_NE(error_of({"--moe-enable-echo", "--moe-num-echo-experts", "8"})
                  .find("--moe-enable-echo requires --moe-token-dispatcher-type=alltoall (got allgather"),
              std::string::npos);
    EXPECT_EQ(error_of({"--moe-enable-echo", "--moe-num-echo-experts", "8", "--moe-token-dispatcher-type", "alltoall",
                        "--moe-echo-recompute-expert-dispatch"}),
              "");
    EXPECT_NE(error_of({"--moe-echo-recompute-expert-dispatch"}).find("requires --moe-enable-echo"), std::string::npos);
}

}  // namespace
}  // namespace moekit
