// Forced random ECHO plans (a test hook: paths the planner would not pick), drawn identically by the CPU
// (src/echo/random_plan.cpp) and by one GPU thread (src/cuda/dispatch_echo.cu): every slot clones a random
// expert (its own rank's, an empty one, one cloned twice), and each source rank's tokens of an expert are cut
// at random among home and that expert's clones in slot order (a clone may get none). A function of (counts,
// seed) only, so every rank draws the same plan. Tests: tests/cpu/test_echo_dispatch.cpp, test_cuda_echo.cu.
#pragma once
#include <cstdint>

#include "core/echo_plan_math.h"
#include "core/rng.h"

namespace moekit {

// counts [EP, E]; writes slot_expert [EP*S], slot_tokens [EP*S], home_tokens [EP, E], clone_tokens [EP, EP*S].
MOEKIT_HD void echo_random_plan_draw(const EchoDims& d, const int64_t* counts, uint64_t seed, int32_t* slot_expert,
                                     int64_t* slot_tokens, int64_t* home_tokens, int64_t* clone_tokens) {
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots();
    // The stream mixes in the counts, so successive steps (layers) of one run draw different plans.
    uint64_t stream = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < EP * E; ++i) stream = (stream ^ uint64_t(counts[i])) * 0x100000001b3ull;
    Rng rng(seed, stream);
    for (int64_t j = 0; j < slots; ++j) slot_expert[j] = int32_t(rng.below(E)), slot_tokens[j] = 0;
    for (int64_t i = 0; i < EP * slots; ++i) clone_tokens[i] = 0;
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            int64_t left = counts[s * E + e];
            for (int64_t j = 0; j < slots; ++j) {
                if (slot_expert[j] != e) continue;
                const int64_t take = rng.below(3) == 0 ? 0 : rng.below(left + 1);
                clone_tokens[s * slots + j] = take;
                slot_tokens[j] += take;
                left -= take;
            }
            home_tokens[s * E + e] = left;
        }
}

}  // namespace moekit
