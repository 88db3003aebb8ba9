// The restructured ECHO planner (src/core/echo_plan_math.h, src/echo/planner.cpp; the CUDA kernel runs the
// same helpers) against the planner before the restructuring (tests/cpu/echo_reference_planner.h): the
// plans must be equal byte for byte over seeded random count matrices of every kind (ties, empty experts,
// one hot expert, sums past 2^31 so the walk's int64 path runs), EP in {1, 2, 8, 64}, S in {0, 1, 2, 4},
// both algorithms. This is the net that lets the executors change without changing a plan.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu/echo_reference_planner.h"
#include "cpu/echo_test_util.h"
#include "echo/planner.h"
#include "echo/trace.h"

namespace moekit {
namespace {

void expect_same_as_reference(const EchoDims& d, const std::vector<int64_t>& counts, EchoAlgorithm alg) {
    const echo::EchoPlan now = echo::plan(d, counts, alg);
    const echo::EchoPlan ref = test::echo_ref::reference_plan(d, counts, alg);
    ASSERT_EQ(now.target, ref.target);
    ASSERT_EQ(now.slot_expert, ref.slot_expert);
    ASSERT_EQ(now.slot_tokens, ref.slot_tokens);
    ASSERT_EQ(now.home_tokens, ref.home_tokens);
    ASSERT_EQ(now.clone_tokens, ref.clone_tokens);
    ASSERT_EQ(echo::plan_bytes(now), echo::plan_bytes(ref));
}

TEST(EchoPlanEquivalence, SameBytesAsTheReferencePlanner) {
    uint64_t seed = 31000;
    int64_t plans = 0, with_clones = 0, int64_walks = 0;
    for (int64_t ep : {1, 2, 8, 64})
        for (int64_t per_rank : {1, 3, 4})
            for (int64_t S : {0, 1, 2, 4}) {
                const EchoDims d{ep, ep * per_rank, S};
                for (int kind = 0; kind < 9; ++kind)
                    for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
                        ++seed;
                        const bool extra = kind >= 5;
                        const std::string name =
                            extra ? test::extra_name(test::Extra(kind - 5)) : test::kind_name(test::CountKind(kind));
                        SCOPED_TRACE(echo::to_string(d) + " " + name + " " + echo::algorithm_name(alg) + " seed " +
                                     std::to_string(seed));
                        const auto counts = extra ? test::extra_counts(d, test::Extra(kind - 5), seed)
                                                  : test::random_counts(d, test::CountKind(kind), seed);
                        expect_same_as_reference(d, counts, alg);
                        const echo::EchoPlan p = echo::plan(d, counts, alg);
                        ++plans, with_clones += p.num_clones > 0, int64_walks += !echo_walk_fits_int32(p.total_tokens());
                        if (HasFatalFailure()) return;
                    }
            }
    // The comparison means something only if plans clone and both walk types ran.
    EXPECT_GT(with_clones, plans / 3) << "too few plans clone anything";
    EXPECT_GT(int64_walks, 10) << "the int64 walk barely ran";
}

// The benchmark's shape on Zipf routing, many seeds: the case the GPU timing is about.
TEST(EchoPlanEquivalence, ZipfE256Ep64ManySeeds) {
    const EchoDims d{64, 256, 2};
    for (uint64_t seed = 32000; seed < 32012; ++seed)
        for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
            SCOPED_TRACE(std::string(echo::algorithm_name(alg)) + " seed " + std::to_string(seed));
            expect_same_as_reference(d, test::random_counts(d, test::CountKind::zipf, seed), alg);
            if (HasFatalFailure()) return;
        }
    // bench_echo_plan's input: Zipf 1.2 top-8 routing of 4096 tokens per rank, EP = 8 .. 64.
    for (int64_t ep : {8, 16, 32, 64}) {
        echo::ZipfRouting z;
        z.num_experts = 256, z.topk = 8, z.zipf_s = 1.2, z.seed = 1234;
        const auto trace = echo::synthetic_zipf_trace(z, ep, 4096, 2);
        for (const auto& step : trace.steps)
            for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
                SCOPED_TRACE(std::string(echo::algorithm_name(alg)) + " EP=" + std::to_string(ep) + " seed 1234");
                expect_same_as_reference({ep, 256, 2}, step.counts, alg);
                if (HasFatalFailure()) return;
            }
    }
}

}  // namespace
}  // namespace moekit
