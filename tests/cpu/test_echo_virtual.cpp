// ECHO exactness on virtual ranks (issue 9, deliver 4): ECHO on equals off (tests/echo_checks.h) at
// EP = 2 and 4 (and EP = 2 of 4 ranks, EP = 1), planned (waterfill, greedy, recompute) and with forced
// random cloning, fp64 and fp32, over random cases (seeds printed); the dispatch rule's maths
// (src/core/echo_dispatch_math.h) and the random plans' consistency; config rules of the flags.
// The same checks under mpirun: tests/mpi/test_echo_mpi.cpp.
#include <gtest/gtest.h>

#include <cstdio>

#include "core/echo_dispatch_math.h"
#include "echo_checks.h"

namespace moekit::test {
namespace {

template <typename T>
void run_echo_cases(int ranks, int ep, uint64_t first_seed, int cases, EchoOptions o) {
    int64_t clones = 0;  // over all cases: the planner must have cloned somewhere, or nothing was tested
    double worst = 0;    // largest relative expert-grad difference seen (printed)
    for (int i = 0; i < cases; ++i) {
        const EpCase k = echo_case(first_seed + uint64_t(i), ranks);
        EchoOptions oi = o;
        oi.slots_per_rank = 1 + int64_t(i % 3);
        std::printf("echo case %s EP=%d %s\n", k.describe().c_str(), ep, oi.describe().c_str());
        std::vector<Verdict> verdicts(static_cast<size_t>(ranks));
        comm::run_virtual_ranks(ranks, [&](Communicator& world) {
            int64_t c = 0;
            double w = 0;
            verdicts[size_t(world.rank())] = check_echo_case<T>(world, k, ep, oi, &c, &w);
            if (world.rank() == 0) clones += c, worst = std::max(worst, w);
        });
        for (const Verdict& v : verdicts) EXPECT_TRUE(v.failures.empty()) << v.text();
    }
    std::printf("%lld clones over %d cases; rank 0's largest expert-grad difference %.3g of the tensor's largest value\n",
                (long long)clones, cases, worst);
    EXPECT_GT(clones, cases / 2);
}

EchoOptions planned(const char* algorithm = "waterfill", bool recompute = false) {
    EchoOptions o;
    o.algorithm = algorithm;
    o.recompute = recompute;
    return o;
}
EchoOptions forced() {
    EchoOptions o;
    o.forced = true;
    return o;
}

TEST(EchoVirtual, TwoRanksPlannedFp64) { run_echo_cases<double>(2, 2, 11000, 24, planned()); }
TEST(EchoVirtual, TwoRanksForcedFp32) { run_echo_cases<float>(2, 2, 11100, 24, forced()); }
TEST(EchoVirtual, FourRanksPlannedFp32) { run_echo_cases<float>(4, 4, 11200, 16, planned()); }
TEST(EchoVirtual, FourRanksGreedyRecomputeFp64) { run_echo_cases<double>(4, 4, 11300, 6, planned("greedy", true)); }
TEST(EchoVirtual, FourRanksForcedFp64) { run_echo_cases<double>(4, 4, 11400, 16, forced()); }
TEST(EchoVirtual, TwoOfFourRanksForcedFp32) { run_echo_cases<float>(4, 2, 11500, 6, forced()); }
TEST(EchoVirtual, OneRankForcedFp64) { run_echo_cases<double>(1, 1, 11600, 4, forced()); }

// The budgeted ECHO dispatch (one-sided puts into fixed buffers): a generous factor never overflows and
// equals ECHO off; a tiny one overflows on some rank, every rank re-runs the step, and the result still
// equals ECHO off (checked inside check_echo_case).
template <typename T>
void run_budget_cases(int ranks, uint64_t first_seed, int cases, bool forced_plans, double factor, bool want_overflow) {
    int overflowed_cases = 0;  // tiny factor: the 16-row alignment lets small cases fit, so "some", not "all"
    for (int i = 0; i < cases; ++i) {
        const EpCase k = echo_case(first_seed + uint64_t(i), ranks);
        EchoOptions o;
        o.forced = forced_plans;
        o.slots_per_rank = 1 + i % 2;
        o.budget_factor = factor;
        std::printf("echo case %s EP=%d %s\n", k.describe().c_str(), ranks, o.describe().c_str());
        std::vector<Verdict> verdicts(static_cast<size_t>(ranks));
        std::vector<int> overflow(static_cast<size_t>(ranks), 0);
        comm::run_virtual_ranks(ranks, [&](Communicator& world) {
            bool of = false;
            verdicts[size_t(world.rank())] = check_echo_case<T>(world, k, ranks, o, nullptr, nullptr, &of);
            overflow[size_t(world.rank())] = of;
        });
        for (const Verdict& v : verdicts) EXPECT_TRUE(v.failures.empty()) << v.text();
        for (int r = 1; r < ranks; ++r) EXPECT_EQ(overflow[size_t(r)], overflow[0]) << "every rank learns it, rank " << r;
        overflowed_cases += overflow[0];
    }
    if (want_overflow) EXPECT_GT(overflowed_cases, 0);
    else EXPECT_EQ(overflowed_cases, 0);
}

TEST(EchoVirtual, BudgetedGenerousFactorFp64) { run_budget_cases<double>(4, 11700, 8, false, 4.0, false); }
TEST(EchoVirtual, BudgetedForcedGenerousFactorFp32) { run_budget_cases<float>(2, 11800, 8, true, 2.0, false); }
TEST(EchoVirtual, BudgetedTinyFactorOverflowsAndReRunsFp64) { run_budget_cases<double>(4, 11900, 8, true, 0.01, true); }

// The dispatch rule on one source: home first, then the clones in slot order.
TEST(EchoDispatchMath, SegmentsFollowHomeThenSlotOrder) {
    const EchoDims d{2, 4, 2};                      // EP=2, E=4, S=2: slots 0,1 on rank 0, 2,3 on rank 1
    const int32_t slot_expert[4] = {3, -1, 1, 3};   // expert 3 cloned twice, expert 1 once
    const int64_t home_row[4] = {5, 2, 0, 1};       // this source's tokens kept home per expert
    const int64_t clone_row[4] = {2, 0, 4, 3};      // its tokens per slot
    EXPECT_EQ(echo_segment_begin(d, slot_expert, home_row, clone_row, 0), 1);  // after 1 home token of 3
    EXPECT_EQ(echo_segment_begin(d, slot_expert, home_row, clone_row, 3), 3);  // after home + slot 0
    EXPECT_EQ(echo_segment_begin(d, slot_expert, home_row, clone_row, 2), 2);
    const int64_t want3[6] = {-1, 0, 0, 3, 3, 3};
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(echo_row_slot(d, slot_expert, home_row, clone_row, 3, i), want3[i]) << i;
    EXPECT_EQ(echo_row_slot(d, slot_expert, home_row, clone_row, 3, 6), -2);
    EXPECT_EQ(echo_bucket_expert(d, slot_expert, 1, 0), 2);
    EXPECT_EQ(echo_bucket_expert(d, slot_expert, 1, 3), 3);
    EXPECT_EQ(echo_bucket_expert(d, slot_expert, 0, 3), -1);
}

// Random plans are consistent (finish_and_check passes), deterministic, fill every slot, and cover clones
// on the expert's own rank and several clones of one expert.
TEST(EchoDispatchMath, RandomPlansAreConsistentAndVaried) {
    const EchoDims d{4, 8, 3};
    bool own_rank = false, twice = false;
    for (uint64_t seed = 1; seed <= 40; ++seed) {
        std::vector<int64_t> counts(32);
        for (size_t i = 0; i < counts.size(); ++i) counts[i] = int64_t(uniform01(seed, 5, i) * 9);
        const echo::EchoPlan p = echo::random_plan(d, counts, seed);
        EXPECT_EQ(echo::plan_bytes(p), echo::plan_bytes(echo::random_plan(d, counts, seed))) << seed;
        int64_t total_after = 0;
        for (int64_t x : p.rank_load_after) total_after += x;
        EXPECT_EQ(total_after, p.total_tokens()) << seed;
        for (int64_t j = 0; j < d.num_slots(); ++j) {
            const int32_t e = p.slot_expert[size_t(j)];
            EXPECT_GE(e, 0) << "forced random plans fill every slot";
            own_rank = own_rank || (e >= 0 && d.home_rank(e) == j / d.slots_per_rank);
            for (int64_t i = j + 1; i < d.num_slots(); ++i) twice = twice || (e >= 0 && p.slot_expert[size_t(i)] == e);
        }
        // A broken plan is refused: one token moved from home to nowhere.
        echo::EchoPlan bad = p;
        for (size_t i = 0; i < bad.home_tokens.size(); ++i)
            if (bad.home_tokens[i] > 0) {
                --bad.home_tokens[i];
                break;
            }
        EXPECT_THROW(echo::finish_and_check(bad, counts), Error) << seed;
    }
    EXPECT_TRUE(own_rank && twice);
}

TEST(EchoConfig, FlagsAreCheckedWithClearErrors) {
    MoeConfig c;
    c.hidden_size = 8;
    c.num_moe_experts = 8;
    c.expert_model_parallel_size = 2;
    c.moe_token_dispatcher_type = "alltoall";
    c.moe_enable_echo = true;
    c.moe_num_echo_experts = 4;
    EXPECT_TRUE(c.validation_errors().empty()) << c.validation_errors()[0];
    auto error_of = [](const MoeConfig& x) {
        const auto e = x.validation_errors();
        return e.empty() ? std::string() : e[0];
    };
    MoeConfig a = c;
    a.moe_num_echo_experts = 3;
    EXPECT_NE(error_of(a).find("--moe-num-echo-experts=3 must be divisible by --expert-model-parallel-size=2"),
              std::string::npos) << error_of(a);
    a = c;
    a.moe_token_dispatcher_type = "allgather";
    EXPECT_NE(error_of(a).find("--moe-enable-echo requires --moe-token-dispatcher-type=alltoall"), std::string::npos);
    a = c;
    a.moe_expert_capacity_factor = 1.0;
    EXPECT_NE(error_of(a).find("dropless"), std::string::npos);
    a = c;
    a.moe_expert_rank_capacity_factor = 2.0;  // the budgeted ECHO dispatch, alltoall or flex
    EXPECT_EQ(error_of(a), "");
    a.moe_token_dispatcher_type = "flex";
    EXPECT_EQ(error_of(a), "");
    a = c;
    a.moe_num_echo_experts.reset();
    EXPECT_NE(error_of(a).find("requires --moe-num-echo-experts"), std::string::npos);
    a = c;
    a.moe_enable_echo = false;
    a.moe_echo_recompute_expert_dispatch = true;
    EXPECT_NE(error_of(a).find("requires --moe-enable-echo"), std::string::npos);
    EXPECT_THROW((void)make_layer_runner(c, "cuda"), UsageError);  // EP = 1: no other rank to clone to
    try {
        (void)make_layer_runner(c, "cuda");
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("--moe-enable-echo: not supported yet on --device cuda"),
                  std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace moekit::test
