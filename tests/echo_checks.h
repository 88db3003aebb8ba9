// The ECHO exactness checks (issue 9, deliver 4), shared by the virtual-rank test
// (tests/cpu/test_echo_virtual.cpp) and the MPI test (tests/mpi/test_echo_mpi.cpp): on a random case
// (tests/ep_harness.h, capacity off: ECHO is dropless), this rank's run with ECHO (planned, or forced
// random cloning) against the same run without it. Bitwise: outputs, input grads, probs, map, losses,
// expert bias, router and shared-expert grads (every one is a per-row value summed in the same order).
// Expert weight grads: a clone's partial sum is added to its home expert's, so only within
// echo_grad_tol (fp32 1e-5, fp64 1e-12, relative to the tensor's largest magnitude, at least 1). Plus the planner invariants over the actual dispatch.
#pragma once
#include "ep_checks.h"

#include "cpu/budget_step.h"
#include "cpu/dispatch_echo.h"

namespace moekit::test {

template <typename T>
constexpr double echo_grad_tol() {
    return sizeof(T) == 8 ? 1e-12 : 1e-5;
}

struct EchoOptions {
    int64_t slots_per_rank = 1;
    bool forced = false;  // forced random cloning (EchoDispatcher::force_random_plans)
    bool recompute = false;
    std::string algorithm = "waterfill";
    double budget_factor = 0;  // > 0: --moe-expert-rank-capacity-factor (the budgeted ECHO dispatch)
    std::string describe() const {
        return str("S=", slots_per_rank, forced ? " forced-random" : " planned", " ", algorithm,
                   recompute ? " recompute" : "", budget_factor > 0 ? str(" budget f=", budget_factor) : "");
    }
};

// A random EP case without capacity (ECHO is dropless) on the alltoall dispatcher.
inline EpCase echo_case(uint64_t seed, int ranks) {
    EpCase k = random_ep_case(seed, ranks);
    k.config.moe_expert_capacity_factor.reset();
    k.config.moe_pad_expert_input_to_capacity = false;
    k.config.moe_token_dispatcher_type = "alltoall";
    return k;
}

// What the ECHO run saw of its own dispatch (for the invariants).
template <typename T>
struct EchoProbe {
    std::vector<uint8_t> sent_map;  // [T, E + EP*S]
    Matrix<T> sent_probs;
    echo::EchoPlan plan;
    std::string plan_bytes;
    cpu::EchoTraffic traffic;
    cpu::BudgetOverflowReport budget;  // the budgeted step's report (overflow: the step was re-run)
};

template <typename T>
RankRun<T> run_echo_rank(Communicator& world, const EpCase& k, const EpInputs<T>& in, int ep_size, const EchoOptions& o,
                         EchoProbe<T>* probe) {
    MoeConfig c = k.config;
    c.expert_model_parallel_size = ep_size;
    c.moe_token_dispatcher_type = "alltoall";
    c.moe_enable_echo = true;
    c.moe_num_echo_experts = o.slots_per_rank * ep_size;
    c.moe_echo_algorithm = o.algorithm;
    c.moe_echo_recompute_expert_dispatch = o.recompute;
    if (o.budget_factor > 0) c.moe_expert_rank_capacity_factor = o.budget_factor;
    auto groups = make_process_groups(world, ep_size);
    cpu::MoePipeline<T> layer(c, *groups);
    MOEKIT_CHECK(layer.echo_dispatcher() != nullptr, "--moe-enable-echo did not select the ECHO dispatcher");
    if (o.forced) layer.echo_dispatcher()->force_random_plans(k.seed * 7919 + 17);
    Matrix<T> grad_output;
    const LayerInput<T> li = micro_batch(k, in, world.rank(), &grad_output);
    RankRun<T> run;
    // One step through the budget protocol (a plain step without a budget); an overflow re-runs it.
    const cpu::BudgetOverflowReport report = cpu::run_budgeted_step<T>(layer, world, [&] {
        run.output = layer.forward(in.weights, li);
        if (probe) {
            layer.echo_dispatcher()->sent_routing(probe->sent_map, probe->sent_probs);
            probe->plan = layer.echo_dispatcher()->plan();
            probe->plan_bytes = echo::plan_bytes(probe->plan);
        }
        run.grads = zeros_like(in.weights);
        run.grad_input = layer.backward(in.weights, grad_output, run.grads);
    });
    if (probe) probe->budget = report;
    finish_rank_run(layer, in, run);
    if (probe) probe->traffic = layer.echo_experts()->traffic();
    return run;
}

// ECHO on against off on this rank (EP = ep_size over `world`). Collectives in the same order on
// every rank whatever the data.
template <typename T>
Verdict check_echo_case(Communicator& world, const EpCase& k, int ep_size, const EchoOptions& o,
                        int64_t* clones = nullptr, double* worst_grad_rel = nullptr, bool* overflowed = nullptr) {
    const int r = world.rank();
    const int64_t E = k.config.num_experts();
    Verdict v;
    v.context = str("rank ", r, "/", world.size(), " EP=", ep_size, " [", k.describe(), ", ", o.describe(), ", ",
                    sizeof(T) == 8 ? "fp64" : "fp32", "]");
    const EpInputs<T> in = make_ep_inputs<T>(k, world.size());
    const RankRun<T> off = run_ep_rank(world, k, in, ep_size, "alltoall");
    EchoProbe<T> probe;
    const RankRun<T> on = run_echo_rank(world, k, in, ep_size, o, &probe);
    double norm = 0;
    for (T x : off.output.data) norm += std::abs(double(x));
    v.expect(norm > 0, "the output without ECHO is all zeros (the test would prove nothing)");

    v.same("output (ECHO vs off)", on.output, off.output, 0.0);
    v.same("grad_input (ECHO vs off)", on.grad_input, off.grad_input, 0.0);
    v.same("probs (ECHO vs off)", on.probs, off.probs, 0.0);
    v.expect(on.routing_map == off.routing_map, "routing_map (ECHO vs off)");
    v.expect(std::memcmp(&on.losses, &off.losses, sizeof(LossValues)) == 0, "losses not bitwise equal (ECHO vs off)");
    v.expect(on.expert_bias == off.expert_bias, "updated expert_bias (ECHO vs off)");
    cpu::EpLayout layout;
    layout.num_experts = E;
    layout.ep_size = ep_size;
    layout.ep_rank = r % ep_size;
    layout.num_local_experts = E / ep_size;
    {
        const std::string ctx = v.context;
        v.context += " grads ECHO vs off";
        compare_grads(v, on.grads, off.grads, layout, 0.0, echo_grad_tol<T>());
        v.context = ctx;
    }
    if (worst_grad_rel)  // largest |diff| / largest |grad| of a local expert's tensor (for the log)
        for (int64_t e = layout.first_local_expert(); e < layout.first_local_expert() + layout.num_local_experts; ++e)
            for (const auto* pair : {&on.grads.fc1, &on.grads.fc2}) {
                const Matrix<T>& a = (*pair)[size_t(e)];
                const Matrix<T>& b = (pair == &on.grads.fc1 ? off.grads.fc1 : off.grads.fc2)[size_t(e)];
                double d = 0, m = 0;
                for (size_t i = 0; i < a.data.size(); ++i)
                    d = std::max(d, std::abs(double(a.data[i]) - double(b.data[i]))), m = std::max(m, std::abs(double(b.data[i])));
                if (m > 0) *worst_grad_rel = std::max(*worst_grad_rel, d / m);
            }

    // Planner invariants over the dispatch this rank did: every (token, expert) of the router's map is
    // sent exactly once, to its home or to a clone of that expert; folding the clone columns back gives
    // the map and the probs bit for bit (so every token keeps exactly its k experts).
    const echo::EchoPlan& p = probe.plan;
    if (clones) *clones = p.num_clones;
    if (overflowed) *overflowed = probe.budget.overflow;
    v.expect(probe.budget.overflow == false || o.budget_factor > 0, "an overflow without a budget");
    const int64_t slots = p.dims.num_slots(), cols = E + slots, tokens = int64_t(on.routing_map.size()) / E;
    v.expect(int64_t(probe.sent_map.size()) == tokens * cols, "sent map has the wrong size");
    std::vector<uint8_t> folded(size_t(tokens * E), 0);
    Matrix<T> folded_probs(tokens, E);
    bool once = true;
    for (int64_t t = 0; t < tokens && once; ++t) {
        int64_t kept = 0, routed = 0;
        for (int64_t c = 0; c < cols; ++c) {
            const uint8_t m = probe.sent_map[size_t(t * cols + c)];
            if (!m) continue;
            once = once && m == 1;
            const int64_t e = c < E ? c : p.slot_expert[size_t(c - E)];
            if (e < 0) {
                once = false;
                continue;
            }
            once = once && folded[size_t(t * E + e)] == 0;
            folded[size_t(t * E + e)] = 1;
            folded_probs(t, e) = probe.sent_probs(t, c);
            ++kept;
        }
        for (int64_t e = 0; e < E; ++e) routed += on.routing_map[size_t(t * E + e)];
        v.expect(kept == routed, str("token ", t, " keeps ", kept, " experts after ECHO, the router gave ", routed));
    }
    v.expect(once, "a (token, expert) pair was sent twice or to an empty slot");
    v.expect(folded == on.routing_map, "folding the clone columns does not give back the routing map");
    Matrix<T> dense_probs(tokens, E);  // the router's probs on its map (zero off the map)
    for (int64_t i = 0; i < tokens * E; ++i)
        if (on.routing_map[size_t(i)]) dense_probs.data[size_t(i)] = on.probs.data[size_t(i)];
    v.same("probs folded from the clone columns", folded_probs, dense_probs, 0.0);

    // The plan is the same on every rank of the EP group (all ranks compare with every other).
    const auto all_plans = world.all_gather_v(std::vector<char>(probe.plan_bytes.begin(), probe.plan_bytes.end()));
    for (int q = 0; q < world.size(); ++q)
        if (q / ep_size == r / ep_size)
            v.expect(std::string(all_plans[size_t(q)].begin(), all_plans[size_t(q)].end()) == probe.plan_bytes,
                     str("the ECHO plan of rank ", q, " differs from this rank's"));
    // Clones of experts homed elsewhere move weights (and their grads come back).
    // Weights go out from the home rank, the gradients come back from the rank holding the clone, unless the
    // clone was given no tokens (it adds nothing: echo_clone_adds).
    int64_t remote_clones = 0, remote_slots = 0;
    for (int64_t j = 0; j < slots; ++j) {
        const int64_t e = p.slot_expert[size_t(j)], holder = j / p.dims.slots_per_rank;
        if (e < 0 || p.dims.home_rank(e) == holder) continue;
        remote_clones += p.dims.home_rank(e) == layout.ep_rank;
        remote_slots += holder == layout.ep_rank && p.slot_tokens[size_t(j)] > 0;
    }
    const int64_t per_expert = int64_t((in.weights.fc1[0].data.size() + in.weights.fc2[0].data.size()) * sizeof(T));
    const int64_t attempts = probe.budget.overflow ? 2 : 1;  // an overflow re-runs the whole step
    v.expect(probe.traffic.weight_bytes == attempts * remote_clones * per_expert * (o.recompute ? 2 : 1) &&
                 probe.traffic.grad_bytes == attempts * remote_slots * per_expert,
             str("clone traffic ", probe.traffic.weight_bytes, " weight bytes, ", probe.traffic.grad_bytes,
                 " grad bytes for ", remote_clones, " clones of this rank's experts elsewhere and ", remote_slots,
                 " slots here cloning remote experts, of ", per_expert, " bytes each",
                 o.recompute ? " (weights sent twice)" : ""));
    return v;
}

}  // namespace moekit::test
