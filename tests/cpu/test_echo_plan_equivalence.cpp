// The restructured ECHO planner (src/core/echo_plan_math.h, src/echo/planner.cpp; the CUDA kernel runs the
// same helpers) against the planner before the restructuring (tests/cpu/echo_reference_planner.h): the
// plans must be equal byte for byte over seeded random count matrices of every kind (ties, empty experts,
// one hot expert, sums past 2^31 so the walk's int64 path runs), EP in {1, 2, 8, 64}, S in {0, 1, 2, 4},
// both algorithms. This is the net that lets the executors change without changing a plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/rng.h"
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

// The two ways the CUDA kernel computes what the CPU executor does in one loop: an expert's list position
// as the sum of g lanes' partial counts (j = lane, lane + g, ...), and a search round's new bracket as a
// min then a max of per-candidate terms reduced in tree order (the warp shuffles' order), not in sequence.
TEST(EchoPlanEquivalence, KernelSplitsOfPositionsAndSearchUpdate) {
    Rng rng(33000, 0xec40'5b1f);
    for (int trial = 0; trial < 50; ++trial) {
        SCOPED_TRACE("trial " + std::to_string(trial) + " seed 33000");
        const int64_t n = 1 + rng.below(300);
        std::vector<int64_t> key(n);
        for (int64_t& k : key) k = rng.below(4) == 0 ? -1 : rng.below(6);  // many ties and unlisted
        for (int64_t g : {1, 2, 4, 8, 16, 32})
            for (int64_t i = 0; i < n; ++i) {
                int64_t pos = 0;
                for (int64_t lane = 0; lane < g; ++lane) pos += echo_desc_position_part(key.data(), lane, n, g, i);
                ASSERT_EQ(pos, echo_desc_position(key.data(), n, i)) << "g " << g << " i " << i;
            }
        // A round with random feasibility (also non-monotone in the target) over a random bracket.
        const int64_t lo = int64_t(rng.below(1000)) - 1, hi = lo + 2 + rng.below(rng.below(2) ? 100 : 100000);
        std::vector<uint8_t> feasible(kEchoSearchWays);
        std::vector<int64_t> cand(kEchoSearchWays);
        for (int i = 0; i < kEchoSearchWays; ++i)
            feasible[i] = rng.below(3) == 0, cand[i] = echo_search_candidate(lo, hi, i, kEchoSearchWays);
        int64_t seq_lo = lo, seq_hi = hi;
        echo_search_update(&seq_lo, &seq_hi, feasible.data(), kEchoSearchWays);
        auto tree = [](std::vector<int64_t> v, bool take_min) {  // pairwise halving, as a shuffle reduction
            for (size_t w = v.size() / 2; w > 0; w /= 2)
                for (size_t k = 0; k < w; ++k)
                    v[k] = take_min ? std::min(v[k], v[k + w]) : std::max(v[k], v[k + w]);
            return v[0];
        };
        std::vector<int64_t> terms(kEchoSearchWays);
        for (int i = 0; i < kEchoSearchWays; ++i) terms[i] = echo_search_hi_term(cand[i], feasible[i], hi);
        const int64_t new_hi = tree(terms, true);
        for (int i = 0; i < kEchoSearchWays; ++i) terms[i] = echo_search_lo_term(cand[i], feasible[i], new_hi, lo);
        const int64_t new_lo = tree(terms, false);
        EXPECT_EQ(new_hi, seq_hi);
        EXPECT_EQ(new_lo, seq_lo);
        EXPECT_LT(new_lo, new_hi);
    }
}

}  // namespace
}  // namespace moekit
