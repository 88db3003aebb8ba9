// Forced random ECHO plans (planner.h: random_plan) and the plan consistency check shared with the
// dispatch (finish_and_check). Random plans exercise what the planner would not choose: clones on the
// expert's own rank, several clones of one expert, clones of empty experts, empty shares.
// Tests: tests/cpu/test_echo_dispatch.cpp, the ECHO exactness tests (tests/echo_checks.h).
#include <algorithm>

#include "core/echo_random_plan_math.h"
#include "echo/planner.h"
#include "moekit/error.h"

namespace moekit::echo {

void finish_and_check(EchoPlan& p, const std::vector<int64_t>& counts) {
    const EchoDims& d = p.dims;
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots();
    MOEKIT_CHECK(int64_t(counts.size()) == EP * E && int64_t(p.slot_expert.size()) == slots &&
                     int64_t(p.slot_tokens.size()) == slots && int64_t(p.home_tokens.size()) == EP * E &&
                     int64_t(p.clone_tokens.size()) == EP * slots,
                 "ECHO plan arrays do not match ", to_string(d));
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            int64_t sum = p.home_tokens[size_t(s * E + e)];
            for (int64_t j = 0; j < slots; ++j)
                if (p.slot_expert[size_t(j)] == e) sum += p.clone_tokens[size_t(s * slots + j)];
            MOEKIT_CHECK(sum == counts[size_t(s * E + e)] && p.home_tokens[size_t(s * E + e)] >= 0, "ECHO plan: source ",
                         s, " expert ", e, ": home + clones = ", sum, " tokens, the counts say ", counts[size_t(s * E + e)]);
        }
    p.rank_load_before.assign(size_t(EP), 0);
    p.rank_load_after.assign(size_t(EP), 0);
    p.num_clones = 0;
    for (int64_t j = 0; j < slots; ++j) {
        int64_t sum = 0;
        for (int64_t s = 0; s < EP; ++s) {
            const int64_t c = p.clone_tokens[size_t(s * slots + j)];
            MOEKIT_CHECK(c >= 0 && (p.slot_expert[size_t(j)] >= 0 || c == 0), "ECHO plan: slot ", j, " gets ", c,
                         " tokens of source ", s, " (expert ", p.slot_expert[size_t(j)], ")");
            sum += c;
        }
        MOEKIT_CHECK(sum == p.slot_tokens[size_t(j)], "ECHO plan: slot ", j, " carries ", p.slot_tokens[size_t(j)],
                     " tokens, its sources send ", sum);
        p.rank_load_after[size_t(j / std::max<int64_t>(1, d.slots_per_rank))] += sum;
        p.num_clones += p.slot_expert[size_t(j)] >= 0;
    }
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            p.rank_load_before[size_t(d.home_rank(e))] += counts[size_t(s * E + e)];
            p.rank_load_after[size_t(d.home_rank(e))] += p.home_tokens[size_t(s * E + e)];
        }
}

EchoPlan random_plan(const EchoDims& d, const std::vector<int64_t>& counts, uint64_t seed) {
    validate(d);
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots();
    MOEKIT_CHECK(int64_t(counts.size()) == EP * E, "counts has ", counts.size(), " entries, expected EP*E = ", EP * E);
    EchoPlan p;
    p.dims = d;
    p.algorithm = EchoAlgorithm::waterfill;  // not used: the plan is drawn, not planned
    p.slot_expert.assign(size_t(slots), -1);
    p.slot_tokens.assign(size_t(slots), 0);
    p.home_tokens.assign(size_t(EP * E), 0);
    p.clone_tokens.assign(size_t(EP * slots), 0);
    echo_random_plan_draw(d, counts.data(), seed, p.slot_expert.data(), p.slot_tokens.data(), p.home_tokens.data(),
                          p.clone_tokens.data());
    finish_and_check(p, counts);
    p.target = p.max_after();
    return p;
}

}  // namespace moekit::echo
