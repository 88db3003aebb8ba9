// ECHO planner, CPU executor (see planner.h): the same steps, helpers and orders as the one-block CUDA
// kernel in src/cuda/echo_plan.cu, run sequentially, so the two plans agree bit for bit. The plan equals
// that of the executor before its speed-up (tests/cpu/echo_reference_planner.h) byte for byte.
#include "echo/planner.h"

#include <algorithm>
#include <cstring>

#include "moekit/error.h"

namespace moekit::echo {

EchoAlgorithm parse_algorithm(const std::string& name, const std::string& flag) {
    if (name == "greedy") return EchoAlgorithm::greedy;
    if (name == "waterfill") return EchoAlgorithm::waterfill;
    throw UsageError(str(flag, "=", name, ": must be greedy (MoE Echo's one-shot greedy) or waterfill"));
}

const char* algorithm_name(EchoAlgorithm a) { return a == EchoAlgorithm::greedy ? "greedy" : "waterfill"; }

void validate(const EchoDims& d) {
    MOEKIT_REQUIRE(d.ep >= 1, "ECHO planner: EP=", d.ep, " must be >= 1");
    MOEKIT_REQUIRE(d.num_experts > 0, "ECHO planner: E=", d.num_experts, " must be > 0");
    MOEKIT_REQUIRE(d.num_experts % d.ep == 0, "ECHO planner: E=", d.num_experts, " must be divisible by EP=", d.ep,
                   " (experts are homed in order, E/EP per rank)");
    MOEKIT_REQUIRE(d.slots_per_rank >= 0, "ECHO planner: S=", d.slots_per_rank, " spare slots per rank must be >= 0");
    MOEKIT_REQUIRE(d.group_floor_rows >= 0 && d.group_floor_rows <= (int64_t(1) << 20),
                   "ECHO planner: group floor ", d.group_floor_rows, " rows must be in [0, 2^20]");
}

std::string to_string(const EchoDims& d) {
    return str("EP=", d.ep, " E=", d.num_experts, " S=", d.slots_per_rank,
               d.group_floor_rows > 0 ? str(" floor=", d.group_floor_rows) : std::string());
}

int64_t EchoPlan::max_before() const {
    return rank_load_before.empty() ? 0 : *std::max_element(rank_load_before.begin(), rank_load_before.end());
}
int64_t EchoPlan::max_after() const {
    return rank_load_after.empty() ? 0 : *std::max_element(rank_load_after.begin(), rank_load_after.end());
}
int64_t EchoPlan::total_tokens() const {
    int64_t t = 0;
    for (int64_t v : rank_load_before) t += v;
    return t;
}
double EchoPlan::max_over_mean_before() const {
    const int64_t t = total_tokens();
    return t == 0 ? 1.0 : double(max_before()) * double(dims.ep) / double(t);
}
double EchoPlan::max_over_mean_after() const {
    const int64_t t = total_tokens();
    return t == 0 ? 1.0 : double(max_after()) * double(dims.ep) / double(t);
}

EchoPlan plan(const EchoDims& d, const std::vector<int64_t>& counts, EchoAlgorithm algorithm) {
    validate(d);
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots();
    MOEKIT_CHECK(int64_t(counts.size()) == EP * E, "counts has ", counts.size(), " entries, expected EP*E = ", EP * E);
    for (size_t i = 0; i < counts.size(); ++i)
        MOEKIT_REQUIRE(counts[i] >= 0, "ECHO planner: counts[", int64_t(i) / E, "][", int64_t(i) % E, "]=", counts[i],
                       " must be >= 0");
    const int64_t* c = counts.data();

    // Statistics, the walk list and the receivers (the kernel computes each entry in its own thread).
    // load: what the walk balances (echo_rank_cost: tokens, or time in tokens' worth).
    std::vector<int64_t> total(E), load(EP), tokens(EP), base(E), key(E);
    for (int64_t e = 0; e < E; ++e) total[e] = echo_expert_total(d, c, e);
    int64_t all = 0;
    for (int64_t r = 0; r < EP; ++r) {
        all += load[r] = echo_rank_cost(d, total.data(), r);
        tokens[r] = echo_rank_load(d, total.data(), r);
    }
    const int64_t mean_floor = all / EP, max_before = *std::max_element(load.begin(), load.end());
    for (int64_t e = 0; e < E; ++e) {
        base[e] = echo_walk_base(d, total.data(), load.data(), e);
        key[e] = echo_list_key(algorithm, base[e], total[e], mean_floor);
    }
    // List and receivers, each with its sentinels (base -1: under every target; load `all`: no room).
    std::vector<int64_t> list_base(E + 1, -1), list_cap(E + 1, 0), recv_load(EP + 2, all);
    std::vector<int32_t> list_expert(E + 1, -1), rank_order(EP);
    for (int64_t e = 0; e < E; ++e) {
        if (key[e] < 0) continue;
        const int64_t pos = echo_desc_position(key.data(), E, e);
        list_base[pos] = base[e], list_cap[pos] = total[e], list_expert[pos] = int32_t(e);
    }
    for (int64_t r = 0; r < EP; ++r) {
        const int64_t pos = echo_asc_position(load.data(), EP, r);
        rank_order[pos] = int32_t(r), recv_load[pos] = load[r];
    }

    EchoPlan p;
    p.dims = d;
    p.algorithm = algorithm;
    p.slot_expert.assign(slots, -1);
    p.slot_tokens.assign(slots, 0);
    if (algorithm == EchoAlgorithm::greedy) {
        p.target = mean_floor;  // spill that finds no room stays home
        echo_walk<false, true>(d, all, mean_floor, list_base.data(), list_cap.data(), list_expert.data(),
                               recv_load.data(), rank_order.data(), p.slot_expert.data(), p.slot_tokens.data());
    } else {
        int64_t lo = echo_search_floor(d, all), hi = max_before;
        std::vector<uint8_t> feasible(kEchoSearchWays);
        while (hi - lo > 1) {
            for (int64_t i = 0; i < kEchoSearchWays; ++i) {
                const int64_t cand = echo_search_candidate(lo, hi, i, kEchoSearchWays);
                feasible[i] = cand >= 0 && echo_walk<true, false>(d, all, cand, list_base.data(), list_cap.data(),
                                                                  list_expert.data(), recv_load.data(),
                                                                  rank_order.data(), nullptr, nullptr);
            }
            if (!echo_search_update(&lo, &hi, feasible.data(), kEchoSearchWays)) break;
        }
        p.target = hi;
        const bool ok = echo_walk<true, true>(d, all, hi, list_base.data(), list_cap.data(), list_expert.data(),
                                              recv_load.data(), rank_order.data(), p.slot_expert.data(),
                                              p.slot_tokens.data());
        MOEKIT_CHECK(ok, "the water-fill failed at a target it met during the search (", hi, ")");
    }

    // Home remainders, source split and loads after.
    std::vector<int64_t>& home = total;  // total[e] minus its clones' tokens
    for (int64_t j = 0; j < slots; ++j)
        if (p.slot_expert[j] >= 0) home[p.slot_expert[j]] -= p.slot_tokens[j];
    p.home_tokens.assign(EP * E, 0);
    p.clone_tokens.assign(EP * slots, 0);
    for (int64_t e = 0; e < E; ++e) echo_fill_interval(d, c, e, 0, home[e], p.home_tokens.data() + e, E);
    for (int64_t j = 0; j < slots; ++j) {
        if (p.slot_expert[j] < 0) continue;  // the column stays zero
        const int64_t b = echo_slot_begin(home.data(), p.slot_expert.data(), p.slot_tokens.data(), j);
        echo_fill_interval(d, c, p.slot_expert[j], b, b + p.slot_tokens[j], p.clone_tokens.data() + j, slots);
    }
    p.rank_load_before = tokens;
    p.rank_load_after.resize(EP);
    for (int64_t r = 0; r < EP; ++r) p.rank_load_after[r] = echo_rank_load_after(d, home.data(), p.slot_tokens.data(), r);
    p.num_clones = std::count_if(p.slot_expert.begin(), p.slot_expert.end(), [](int32_t e) { return e >= 0; });
    return p;
}

std::string plan_bytes(const EchoPlan& p) {
    std::string out;
    auto put = [&](const void* data, size_t n) { out.append(static_cast<const char*>(data), n); };
    auto vec = [&](const auto& v) { put(v.data(), v.size() * sizeof(v[0])); };
    const int64_t head[6] = {p.dims.ep, p.dims.num_experts, p.dims.slots_per_rank, int64_t(p.algorithm),
                             p.target,  p.num_clones};
    put(head, sizeof(head));
    vec(p.slot_expert), vec(p.slot_tokens), vec(p.clone_tokens), vec(p.home_tokens), vec(p.rank_load_before),
        vec(p.rank_load_after);
    return out;
}

}  // namespace moekit::echo
