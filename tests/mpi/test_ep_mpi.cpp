// Multi-rank test of expert parallelism on CPU ranks, run by ctest as `mpirun -np 2` and `-np 4`
// (CMakeLists.txt): on random configurations (seeds printed), EP = N equals N independent EP = 1 runs
// and EP = 1 over the same data-parallel ranks, allgather equals alltoall, and virtual ranks equal
// MPI ranks bit for bit (tests/ep_harness.h); the budgeted dispatcher over MPI windows equals alltoall,
// and its overflow is detected, told to every rank and recovered (tests/budget_checks.h). Every rank checks; main() all-reduces the verdicts
// into every rank's exit status. Twin without MPI: tests/cpu/test_ep_virtual.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "budget_checks.h"

namespace moekit::test {
namespace {

constexpr int kCases = 32;

bool quiet_rank() { return comm::mpi_world().rank() != 0; }

template <typename T>
void run_cases(uint64_t first_seed) {
    Communicator& world = comm::mpi_world();
    for (int i = 0; i < kCases; ++i) {
        const EpCase k = random_ep_case(first_seed + uint64_t(i), world.size());
        if (!quiet_rank()) std::printf("case %s\n", k.describe().c_str());
        const Verdict v = check_ep_case<T>(world, k, /*virtual_twin=*/true);
        EXPECT_TRUE(v.failures.empty()) << v.text();
    }
}

TEST(EpMpi, RandomConfigsFp64) { run_cases<double>(7000); }
TEST(EpMpi, RandomConfigsFp32) { run_cases<float>(8000); }

// Budgeted dispatcher over MPI one-sided windows: generous factor = alltoall bit for bit (rows, source
// rows, counts, slack untouched, combine and both backward passes); tiny factor = overflow on the ranks
// that receive most, nothing written past the budget.
template <typename T>
void run_budget_dispatch(uint64_t first_seed, int cases) {
    Communicator& world = comm::mpi_world();
    for (int i = 0; i < cases; ++i)
        for (double f : {double(world.size()), 0.05}) {
            if (!quiet_rank()) std::printf("budgeted dispatch seed %llu f=%g\n", (unsigned long long)(first_seed + i), f);
            const Verdict v = check_budgeted_dispatch<T>(world, first_seed + uint64_t(i), f);
            EXPECT_TRUE(v.failures.empty()) << v.text();
        }
}

TEST(EpMpi, BudgetedDispatchFp64) { run_budget_dispatch<double>(9000, 4); }
TEST(EpMpi, BudgetedDispatchFp32) { run_budget_dispatch<float>(9100, 4); }

// The whole step: generous factor equals alltoall; a tiny factor overflows, every rank learns it, the
// re-run equals the dropless step; virtual ranks give the same bits.
TEST(EpMpi, BudgetedStepRecoversFromOverflow) {
    Communicator& world = comm::mpi_world();
    for (uint64_t seed = 9200; seed < 9206; ++seed) {
        const bool tiny = seed % 3 != 0;
        const EpCase k = budget_case(seed, world.size(), tiny);
        const double f = tiny ? 0.05 : double(world.size());
        if (!quiet_rank()) std::printf("budgeted step f=%g case %s\n", f, k.describe().c_str());
        const Verdict v = seed % 2 ? check_budgeted_pipeline<double>(world, world.size(), k, f, tiny, true)
                                   : check_budgeted_pipeline<float>(world, world.size(), k, f, tiny, true);
        EXPECT_TRUE(v.failures.empty()) << v.text();
    }
    if (world.size() == 4) {  // two EP groups of 2: the re-run is agreed over the world
        const EpCase k = budget_case(9210, 4, true);
        if (!quiet_rank()) std::printf("budgeted step EP=2 f=0.05 case %s\n", k.describe().c_str());
        const Verdict v = check_budgeted_pipeline<double>(world, 2, k, 0.05, true, false);
        EXPECT_TRUE(v.failures.empty()) << v.text();
    }
}

// Collectives of the mpi transport against closed forms (rank-dependent values, exact).
TEST(EpMpi, Collectives) {
    Communicator& world = comm::mpi_world();
    const int n = world.size(), r = world.rank();
    double d[2] = {double(r) + 0.5, -double(r)};
    world.all_reduce(d, 2);
    EXPECT_EQ(d[0], n * (n - 1) / 2.0 + 0.5 * n);
    int64_t m = 10 * r;
    world.all_reduce(&m, 1, ReduceOp::max);
    EXPECT_EQ(m, 10 * (n - 1));
    // all_to_all_v: rank r sends p + 1 copies of r to rank p.
    const size_t un = static_cast<size_t>(n);
    std::vector<int64_t> send, sc(un), rc(un);
    for (int p = 0; p < n; ++p) {
        sc[size_t(p)] = p + 1;
        rc[size_t(p)] = r + 1;
        for (int i = 0; i <= p; ++i) send.push_back(r);
    }
    std::vector<int64_t> recv(size_t(n * (r + 1)));
    world.all_to_all_v(send.data(), sc, recv.data(), rc);
    for (int p = 0; p < n; ++p)
        for (int i = 0; i <= r; ++i) EXPECT_EQ(recv[size_t(p * (r + 1) + i)], p);
    const auto groups = make_process_groups(world, n > 1 ? n / 2 : 1);
    EXPECT_EQ(groups->ep->size() * groups->expert_dp->size(), n);
    EXPECT_EQ(groups->expert_dp->rank(), r / groups->ep->size());
}

// MOEKIT_TEST_FAIL_ON_RANK=r makes rank r alone fail here: shows that one rank's failure fails
// every rank's exit status (ctest test_ep_mpi_one_rank_fails, tests/mpi/one_rank_fails.sh; unset otherwise).
TEST(EpMpi, FailureInjectionHook) {
    const char* env = std::getenv("MOEKIT_TEST_FAIL_ON_RANK");
    if (env && std::atoi(env) == comm::mpi_world().rank()) ADD_FAILURE() << "injected failure on this rank";
}

}  // namespace
}  // namespace moekit::test

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    moekit::Communicator& world = moekit::comm::mpi_world();
    const int rc = RUN_ALL_TESTS();
    // A failure on any rank fails every rank's exit status.
    int64_t failed = rc != 0 ? 1 : 0, failed_here = failed;
    world.all_reduce(&failed, 1, moekit::ReduceOp::max);
    std::printf("test_ep_mpi: rank %d of %d: %s here, %s overall\n", world.rank(), world.size(),
                failed_here ? "FAILED" : "passed", failed ? "FAILED" : "passed");
    return failed ? 1 : 0;
}
