// The budgeted dispatcher on virtual ranks (no MPI): the shared maths of src/core/dispatch_math.h
// against closed forms, the local transport's one-sided windows, and the checks of
// tests/budget_checks.h (equal to alltoall with a generous factor; overflow detected, told to every
// rank and recovered with a tiny one) for 2 and 4 ranks. MPI twin: tests/mpi/test_ep_mpi.cpp.
#include <gtest/gtest.h>

#include <cstdio>

#include "budget_checks.h"

namespace moekit::test {
namespace {

TEST(DispatchMath, BudgetRows) {
    EXPECT_EQ(budget_rows(10, 2, 1.0), 32);    // 20 -> 32
    EXPECT_EQ(budget_rows(10, 2, 0.05), 16);   // ceil(1.0) = 1 -> 16
    EXPECT_EQ(budget_rows(64, 4, 1.0), 256);   // already aligned
    EXPECT_EQ(budget_rows(64, 4, 1.01), 272);  // ceil(258.56) = 259 -> 272
    EXPECT_EQ(budget_rows(3, 1, 1e-9), 16);    // never zero for f > 0
}

TEST(DispatchMath, ChunkOffsetsAndClipping) {
    // EP = 2, E = 4 (L = 2). counts[s][e]: source 0 = {1, 2, 3, 4}, source 1 = {5, 6, 7, 8}.
    const int64_t counts[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t off[5];
    // Receiver 1 owns experts 2, 3: chunks (l0,s0)=3, (l0,s1)=7, (l1,s0)=4, (l1,s1)=8.
    EXPECT_EQ(recv_chunk_offsets(counts, 2, 4, 2, 1, off), 22);
    const int64_t want1[5] = {0, 3, 10, 14, 22};
    for (int i = 0; i < 5; ++i) EXPECT_EQ(off[i], want1[i]) << i;
    EXPECT_EQ(recv_chunk_offsets(counts, 2, 4, 2, 0, off), 14);  // 1, 5, 2, 6
    const int64_t want0[5] = {0, 1, 6, 8, 14};
    for (int i = 0; i < 5; ++i) EXPECT_EQ(off[i], want0[i]) << i;
    EXPECT_EQ(rows_within_budget(10, 4, 16), 4);
    EXPECT_EQ(rows_within_budget(14, 8, 16), 2);  // stops at the budget
    EXPECT_EQ(rows_within_budget(16, 8, 16), 0);
    EXPECT_EQ(rows_within_budget(20, 8, 16), 0);
}

TEST(DispatchMath, SufficientFactorIsTheSmallest) {
    for (int64_t tokens : {7, 32, 100})
        for (int64_t k : {1, 2, 4})
            for (int64_t rows = 1; rows <= tokens * k * 3; rows += 5) {
                const double f = sufficient_factor(rows, tokens, k);
                const int64_t c = std::llround(f * 100);
                EXPECT_GE(budget_rows(tokens, k, f), rows) << tokens << " " << k << " " << rows;
                EXPECT_LT(budget_rows(tokens, k, double(c - 1) / 100.0), rows) << tokens << " " << k << " " << rows;
            }
    EXPECT_EQ(sufficient_factor(0, 10, 2), 0.0);
}

TEST(LocalComm, WindowsPutAndRefuseOutOfBounds) {
    comm::run_virtual_ranks(3, [](Communicator& world) {
        const int r = world.rank(), n = world.size();
        std::vector<int64_t> buf(size_t(2 * n), -1);  // slot 2p, 2p+1 written by rank p
        auto win = world.create_window(buf.data(), int64_t(buf.size() * 8));
        win->fence();
        for (int p = 0; p < n; ++p) {
            const int64_t vals[2] = {100 * r + p, 7};
            win->put(p, int64_t(2 * r * 8), vals, 16);
        }
        win->fence();
        for (int p = 0; p < n; ++p) {
            EXPECT_EQ(buf[size_t(2 * p)], 100 * p + r);
            EXPECT_EQ(buf[size_t(2 * p + 1)], 7);
        }
        const int64_t x = 1;
        EXPECT_THROW(win->put((r + 1) % n, int64_t(buf.size() * 8) - 4, &x, 8), Error);  // past the peer's end
        win->fence();
        EXPECT_EQ(buf.back(), 7);  // the refused put wrote nothing
    });
}

template <typename T>
void dispatch_cases(int ranks, uint64_t first_seed, int cases) {
    for (int i = 0; i < cases; ++i)
        for (double f : {double(ranks), 0.05}) {
            std::printf("budgeted dispatch on %d virtual ranks, seed %llu f=%g\n", ranks,
                        (unsigned long long)(first_seed + uint64_t(i)), f);
            std::vector<Verdict> verdicts(static_cast<size_t>(ranks));
            comm::run_virtual_ranks(ranks, [&](Communicator& world) {
                verdicts[size_t(world.rank())] = check_budgeted_dispatch<T>(world, first_seed + uint64_t(i), f);
            });
            for (const Verdict& v : verdicts) EXPECT_TRUE(v.failures.empty()) << v.text();
        }
}

TEST(BudgetedVirtual, DispatchTwoRanksFp64) { dispatch_cases<double>(2, 500, 4); }
TEST(BudgetedVirtual, DispatchFourRanksFp32) { dispatch_cases<float>(4, 600, 4); }

template <typename T>
void step_cases(int ranks, int ep, uint64_t first_seed, int cases) {
    for (int i = 0; i < cases; ++i) {
        const uint64_t seed = first_seed + uint64_t(i);
        const bool tiny = i % 3 != 0;
        const EpCase k = budget_case(seed, ranks, tiny);
        const double f = tiny ? 0.05 : double(ep);
        std::printf("budgeted step on %d virtual ranks, EP=%d, f=%g case %s\n", ranks, ep, f, k.describe().c_str());
        std::vector<Verdict> verdicts(static_cast<size_t>(ranks));
        comm::run_virtual_ranks(ranks, [&](Communicator& world) {
            verdicts[size_t(world.rank())] = check_budgeted_pipeline<T>(world, ep, k, f, tiny, false);
        });
        for (const Verdict& v : verdicts) EXPECT_TRUE(v.failures.empty()) << v.text();
    }
}

TEST(BudgetedVirtual, StepTwoRanksFp64) { step_cases<double>(2, 2, 700, 4); }
TEST(BudgetedVirtual, StepFourRanksFp32) { step_cases<float>(4, 4, 800, 4); }
// Two EP groups of 2 (expert-data-parallel 2): the re-run is agreed over the whole world.
TEST(BudgetedVirtual, StepFourRanksTwoEpGroupsFp64) { step_cases<double>(4, 2, 900, 3); }

TEST(BudgetedVirtual, SelectedByConfigOnlyWithTheFactorAndEp) {
    comm::run_virtual_ranks(2, [](Communicator& world) {
        MoeConfig c;
        c.hidden_size = 8, c.num_moe_experts = 4, c.moe_ffn_hidden_size = 4, c.seq_length = 4, c.micro_batch_size = 1;
        c.moe_token_dispatcher_type = "alltoall";
        EXPECT_EQ(dynamic_cast<cpu::BudgetedDispatcher<float>*>(cpu::make_dispatcher<float>(c, world).get()), nullptr);
        c.moe_token_dispatcher_type = "flex";
        c.moe_expert_rank_capacity_factor = 1.5;
        auto d = cpu::make_dispatcher<float>(c, world);
        auto* b = dynamic_cast<cpu::BudgetedDispatcher<float>*>(d.get());
        ASSERT_NE(b, nullptr);
        EXPECT_EQ(b->budget_rows(), 16);  // ceil(4 * 2 * 1.5) = 12 -> 16
        auto single = comm::make_single_rank();  // EP = 1: nothing moves, nothing to budget
        EXPECT_EQ(dynamic_cast<cpu::BudgetedDispatcher<float>*>(cpu::make_dispatcher<float>(c, *single).get()), nullptr);
    });
}

// A caller that runs the layer without the end-of-step check (run_budgeted_step) is refused, never
// left to drop rows unnoticed.
TEST(BudgetedVirtual, LayerOutsideTheStepDriverIsRefused) {
    MoeConfig c;
    c.hidden_size = 8, c.num_moe_experts = 4, c.moe_ffn_hidden_size = 4, c.seq_length = 4, c.micro_batch_size = 1;
    c.expert_model_parallel_size = 2;
    c.moe_token_dispatcher_type = "alltoall";
    c.moe_expert_rank_capacity_factor = 0.05;
    const MoeWeights<float> w = init_weights<float>(c, 5);
    try {
        comm::run_virtual_ranks(2, [&](Communicator& world) {
            auto groups = make_process_groups(world, 2);
            cpu::MoePipeline<float> layer(c, *groups);
            LayerInput<float> in;
            in.hidden = Matrix<float>(4, 8);
            for (size_t i = 0; i < in.hidden.data.size(); ++i) in.hidden.data[i] = float(normal01(5, uint64_t(world.rank()), i));
            in.seq_length = 4;
            (void)layer.forward(w, in);
        });
        ADD_FAILURE() << "no error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("without the end-of-step overflow check"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace moekit::test
