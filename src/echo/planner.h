// ECHO planner, CPU executor: global counts [EP, E] (source rank x expert, experts homed in order,
// E/EP per rank) and S spare slots per rank -> which expert each slot clones and how many tokens of
// each source rank go to each clone and to home. The maths is src/core/echo_plan_math.h; the CUDA
// twin is src/cuda/echo_plan.cu (same plan bit for bit). No CUDA here. Tests: tests/cpu/test_echo_planner.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/echo_plan_math.h"

namespace moekit::echo {

// "greedy" | "waterfill" -> the enum; throws UsageError naming `flag` and the accepted names.
EchoAlgorithm parse_algorithm(const std::string& name, const std::string& flag = "--moe-echo-algorithm");
const char* algorithm_name(EchoAlgorithm a);

// Throws UsageError naming the offending field (EP >= 1, E > 0 and divisible by EP, S >= 0).
void validate(const EchoDims& d);
std::string to_string(const EchoDims& d);  // "EP=64 E=256 S=2"

struct EchoPlan {
    EchoDims dims;
    EchoAlgorithm algorithm = EchoAlgorithm::waterfill;
    std::vector<int32_t> slot_expert;       // [EP*S] expert cloned by slot j (on rank j / S), -1 = empty
    std::vector<int64_t> slot_tokens;       // [EP*S] tokens the slot's clone processes
    std::vector<int64_t> clone_tokens;      // [EP (source), EP*S] tokens of source s sent to slot j
    std::vector<int64_t> home_tokens;       // [EP (source), E] tokens of source s kept by the home expert
    std::vector<int64_t> rank_load_before;  // [EP] tokens the rank's experts process without ECHO
    std::vector<int64_t> rank_load_after;   // [EP] with the plan (home remainders + its slots)
    int64_t target = 0;                     // target max load the walk planned for
    int64_t num_clones = 0;                 // slots in use

    int64_t max_before() const;
    int64_t max_after() const;
    int64_t total_tokens() const;
    double max_over_mean_before() const;  // 1 when there are no tokens
    double max_over_mean_after() const;
};

// counts: [EP * E], row-major by source rank. Deterministic: the same input gives the same bytes.
EchoPlan plan(const EchoDims& d, const std::vector<int64_t>& counts, EchoAlgorithm algorithm);

// Forced random cloning (a test hook: paths the planner would not pick): every spare slot clones a
// random expert (maybe one of its own rank's, maybe one with no tokens), and each source rank's tokens of an expert are split at
// random between home and that expert's clones (a clone may get none). A function of (counts, seed)
// only, so every rank draws the same plan. src/echo/random_plan.cpp. Tests: tests/cpu/test_echo_dispatch.cpp.
EchoPlan random_plan(const EchoDims& d, const std::vector<int64_t>& counts, uint64_t seed);

// The plan's loads, clone count and the consistency every dispatch relies on: for every source s and
// expert e, home_tokens[s, e] + sum of clone_tokens[s, j] over the slots j cloning e = counts[s, e],
// slot_tokens[j] = sum over s of clone_tokens[s, j], empty slots carry nothing. Fills rank loads and
// num_clones; throws moekit::Error naming the first broken entry.
void finish_and_check(EchoPlan& p, const std::vector<int64_t>& counts);

// Every array of the plan concatenated (plus target and clones): two plans are identical iff equal.
std::string plan_bytes(const EchoPlan& p);

}  // namespace moekit::echo
