// ECHO exactness under mpirun -np 2 and -np 4 (ctest: test_echo_mpi_np2, _np4; CMakeLists.txt): on
// random cases (seeds printed), ECHO on equals off at EP = N (and EP = 2 of 4 ranks), planned and with
// forced random cloning, with and without a receive budget, fp64 and fp32 (tests/echo_checks.h), and the same ECHO job on N virtual ranks
// gives this rank's bits. Every rank checks; main() all-reduces the verdicts into every exit status.
// Twin without MPI: tests/cpu/test_echo_virtual.cpp.
#include <gtest/gtest.h>

#include <cstdio>

#include "echo_checks.h"

namespace moekit::test {
namespace {

bool quiet_rank() { return comm::mpi_world().rank() != 0; }

template <typename T>
void run_cases(uint64_t first_seed, int cases, bool forced, int ep, double budget_factor = 0) {
    Communicator& world = comm::mpi_world();
    if (world.size() % ep != 0) GTEST_SKIP() << "EP=" << ep << " does not divide " << world.size() << " ranks";
    for (int i = 0; i < cases; ++i) {
        const EpCase k = echo_case(first_seed + uint64_t(i), world.size());
        EchoOptions o;
        o.forced = forced;
        o.slots_per_rank = 1 + i % 2;
        o.recompute = i % 3 == 2;
        o.algorithm = i % 4 == 3 ? "greedy" : "waterfill";
        o.budget_factor = budget_factor;
        if (!quiet_rank()) std::printf("echo case %s EP=%d %s\n", k.describe().c_str(), ep, o.describe().c_str());
        Verdict v = check_echo_case<T>(world, k, ep, o);
        // Virtual ranks run the same ECHO job in this process: the MPI rank's bits.
        const EpInputs<T> in = make_ep_inputs<T>(k, world.size());
        const RankRun<T> mine = run_echo_rank<T>(world, k, in, ep, o, nullptr);
        std::vector<RankRun<T>> twins(static_cast<size_t>(world.size()));
        comm::run_virtual_ranks(world.size(), [&](Communicator& vworld) {
            twins[size_t(vworld.rank())] = run_echo_rank<T>(vworld, k, in, ep, o, nullptr);
        });
        v.context += " (virtual vs MPI ranks)";
        compare_bitwise(v, twins[size_t(world.rank())], mine);
        EXPECT_TRUE(v.failures.empty()) << v.text();
    }
}

TEST(EchoMpi, PlannedFp64) { run_cases<double>(12000, 12, false, comm::mpi_world().size()); }
TEST(EchoMpi, ForcedRandomFp32) { run_cases<float>(12100, 12, true, comm::mpi_world().size()); }
TEST(EchoMpi, ForcedRandomEp2Fp64) { run_cases<double>(12200, 6, true, 2); }
// The budgeted ECHO dispatch over MPI one-sided windows: generous (no overflow) and tiny (overflow on
// some rank, re-run by all) factors both equal ECHO off.
TEST(EchoMpi, BudgetedGenerousFp64) { run_cases<double>(12300, 6, true, comm::mpi_world().size(), 4.0); }
TEST(EchoMpi, BudgetedTinyFp32) { run_cases<float>(12400, 6, true, comm::mpi_world().size(), 0.01); }

}  // namespace
}  // namespace moekit::test

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    moekit::Communicator& world = moekit::comm::mpi_world();
    const int rc = RUN_ALL_TESTS();
    int64_t failed = rc != 0 ? 1 : 0, failed_here = failed;  // one rank's failure fails every rank
    world.all_reduce(&failed, 1, moekit::ReduceOp::max);
    std::printf("test_echo_mpi: rank %d of %d: %s here, %s overall\n", world.rank(), world.size(),
                failed_here ? "FAILED" : "passed", failed ? "FAILED" : "passed");
    return failed ? 1 : 0;
}
