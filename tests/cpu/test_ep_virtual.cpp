// Expert parallelism on virtual ranks (no MPI needed): on random configurations, EP = N equals N
// independent EP = 1 runs and EP = 1 over the same ranks, and allgather equals alltoall
// (tests/ep_harness.h), for N = 2 and 3; plus the local transport's failure behaviour.
// The same checks over MPI ranks: tests/mpi/test_ep_mpi.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "ep_checks.h"

namespace moekit::test {
namespace {

bool quiet_rank() { return false; }

template <typename T>
void run_virtual_cases(int ranks, uint64_t first_seed, int cases) {
    for (int i = 0; i < cases; ++i) {
        const EpCase k = random_ep_case(first_seed + uint64_t(i), ranks);
        if (!quiet_rank()) std::printf("case %s\n", k.describe().c_str());
        std::vector<Verdict> verdicts(static_cast<size_t>(ranks));
        comm::run_virtual_ranks(ranks, [&](Communicator& world) {
            verdicts[size_t(world.rank())] = check_ep_case<T>(world, k, /*virtual_twin=*/false);
        });
        for (const Verdict& v : verdicts) EXPECT_TRUE(v.failures.empty()) << v.text();
    }
}

TEST(EpVirtual, TwoRanksFp64) { run_virtual_cases<double>(2, 100, 16); }
TEST(EpVirtual, ThreeRanksFp32) { run_virtual_cases<float>(3, 200, 12); }

TEST(EpVirtual, SingleRankPipelineIsMoeLayer) {
    // EP = 1 on one rank through the pipeline is cpu::MoeLayer itself (the same code): bit for bit.
    const EpCase k = random_ep_case(300, 1);
    const EpInputs<double> in = make_ep_inputs<double>(k, 1);
    const RankRun<double> a = run_single(k, in, 0);
    RankRun<double> b;
    comm::run_virtual_ranks(1, [&](Communicator& w) { b = run_ep_rank(w, k, in, 1, k.config.moe_token_dispatcher_type); });
    b.expert_bias = a.expert_bias;  // run_single does not update the bias
    Verdict v;
    compare_bitwise(v, a, b);
    EXPECT_TRUE(v.failures.empty()) << k.describe() << "\n" << v.text();
}

TEST(LocalComm, CollectivesAndGroups) {
    comm::run_virtual_ranks(4, [](Communicator& world) {
        const int r = world.rank();
        float f[1] = {float(r + 1)};
        world.all_reduce(f, 1);
        EXPECT_EQ(f[0], 10.0f);
        // reduce_scatter: block p (3 values) of every rank goes to rank p, summed: sum_r (10 r + p).
        std::vector<double> send(4 * 3), got(3);
        for (int p = 0; p < 4; ++p)
            for (int i = 0; i < 3; ++i) send[size_t(p * 3 + i)] = 10.0 * r + p + 100 * i;
        world.reduce_scatter(send.data(), 3, got.data());
        for (int i = 0; i < 3; ++i) EXPECT_EQ(got[size_t(i)], 60.0 + 4 * r + 400 * i);
        const auto v = world.all_gather_v(std::vector<int>(size_t(r), r));  // rank r gives r copies of r
        for (int p = 0; p < 4; ++p) EXPECT_EQ(v[size_t(p)], std::vector<int>(size_t(p), p));
        const auto groups = make_process_groups(world, 2);
        EXPECT_EQ(groups->ep->size(), 2);
        EXPECT_EQ(groups->ep->rank(), r % 2);
        EXPECT_EQ(groups->expert_dp->size(), 2);
        EXPECT_EQ(groups->expert_dp->rank(), r / 2);
        int64_t x = r;
        groups->expert_dp->all_reduce(&x, 1);  // ranks {0, 2} and {1, 3}
        EXPECT_EQ(x, r % 2 == 0 ? 2 : 4);
    });
}

TEST(LocalComm, AFailingRankEndsTheJobNamingIt) {
    // Rank 2 throws before a collective the others wait in: they are woken, the error names rank 2.
    const auto t0 = std::chrono::steady_clock::now();
    try {
        comm::run_virtual_ranks(4, [](Communicator& world) {
            if (world.rank() == 2) throw UsageError("bad value on this rank");
            world.barrier();
            world.barrier();
        });
        ADD_FAILURE() << "no error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("virtual rank 2: bad value on this rank"), std::string::npos) << e.what();
    }
    // An explicit abort() from rank 1 inside a sub-group wakes ranks waiting in the world group.
    try {
        comm::run_virtual_ranks(4, [](Communicator& world) {
            auto pair = world.split(world.rank() / 2, world.rank());
            if (world.rank() == 1) pair->abort("expert weights disagree");
            world.barrier();
        });
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("virtual rank 1"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("expert weights disagree"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(LocalComm, MismatchedCollectiveIsAnErrorNotAHang) {
    EXPECT_THROW(comm::run_virtual_ranks(2,
                                         [](Communicator& world) {
                                             std::vector<int> mine(size_t(world.rank() + 1), 1);
                                             (void)world.all_gather(mine);  // 4 bytes vs 8 bytes
                                         }),
                 Error);
    const auto groups_ok = [](int ep) {
        comm::run_virtual_ranks(3, [ep](Communicator& world) { (void)make_process_groups(world, ep); });
    };
    EXPECT_THROW(groups_ok(2), UsageError);  // 2 does not divide 3
}

}  // namespace
}  // namespace moekit::test
