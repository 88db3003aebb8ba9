// Checks of the budgeted dispatcher (src/cpu/dispatch_budgeted.h) on one rank of `world` (EP = world
// size), shared by the MPI test (tests/mpi/test_ep_mpi.cpp, -np 2 and 4) and the virtual-rank test
// (tests/cpu/test_dispatch_budgeted.cpp). Every expectation is derived independently from the
// all-gathered routing maps; collectives run in the same order on every rank whatever the data.
#pragma once
#include <algorithm>
#include <cstring>

#include "core/dispatch_math.h"
#include "cpu/budget_step.h"
#include "cpu/dispatch_budgeted.h"
#include "ep_checks.h"

namespace moekit::test {

// Rows every rank of `world` would receive (world rank order): the sum over the sources of its EP group
// `ep` of their rows for its experts, from the EP group's routing maps.
inline std::vector<int64_t> expected_received(Communicator& world, Communicator& ep, const std::vector<uint8_t>& my_map,
                                              int64_t E) {
    const std::vector<uint8_t> maps = ep.all_gather(my_map);  // [EP][T, E]
    const int64_t L = E / ep.size();
    int64_t mine = 0;
    for (size_t i = 0; i < maps.size(); ++i)
        if (int64_t(i % size_t(E)) / L == ep.rank()) mine += maps[i];
    return world.all_gather(std::vector<int64_t>{mine});
}

// The report every rank must get, from the expected receive counts.
inline void check_report(Verdict& v, const cpu::BudgetOverflowReport& r, const std::vector<int64_t>& recv,
                         int64_t budget, int64_t tokens, int64_t topk) {
    std::vector<int> over;
    int64_t peak = 0;
    for (size_t p = 0; p < recv.size(); ++p) {
        if (recv[p] > budget) over.push_back(int(p));
        peak = std::max(peak, recv[p]);
    }
    v.expect(r.overflow == !over.empty(), str("report.overflow = ", r.overflow, ", expected ", !over.empty()));
    v.expect(r.overflowed_ranks == over, "report names the wrong overflowed ranks");
    v.expect(r.budget_rows == budget, str("report budget ", r.budget_rows, " vs ", budget));
    v.expect(r.peak_rows == peak, str("report peak ", r.peak_rows, " vs ", peak));
    // The smallest factor in 0.01 steps whose budget holds the peak.
    const int64_t c = std::llround(r.sufficient_factor * 100);
    v.expect(budget_rows(tokens, topk, double(c) / 100.0) >= peak,
             str("sufficient factor ", r.sufficient_factor, " gives a budget below the peak ", peak));
    v.expect(c == 0 ? peak == 0 : budget_rows(tokens, topk, double(c - 1) / 100.0) < peak,
             str("sufficient factor ", r.sufficient_factor, " is not the smallest (0.01 steps) for peak ", peak));
    if (r.overflow)
        v.expect(r.message().find(str(r.sufficient_factor)) != std::string::npos, "log line lacks the factor");
}

// Dispatcher level: budgeted vs alltoall on the same random routing (rank-dependent data, seed printed
// by the caller). `factor` generous (no overflow) or tiny (overflow on the ranks that receive most).
template <typename T>
Verdict check_budgeted_dispatch(Communicator& world, uint64_t seed, double factor) {
    const int N = world.size(), me = world.rank();
    Rng shape(seed, 1);
    const int64_t L = 1 + shape.below(3), E = L * N, k = 1 + shape.below(std::min<int64_t>(E, 3));
    const int64_t Tn = 20 + shape.below(20), H = 4 + shape.below(5);
    Verdict v;
    v.context = str("rank ", me, "/", N, " [budgeted dispatch seed=", seed, " E=", E, " k=", k, " T=", Tn, " H=", H,
                    " f=", factor, ", ", sizeof(T) == 8 ? "fp64" : "fp32", "]");
    // Rank-dependent tokens and routing; a hot block of experts (those of rank seed % N) for skew.
    Rng rng(seed, 100 + uint64_t(me));
    Matrix<T> tokens(Tn, H), probs(Tn, E);
    std::vector<uint8_t> map(size_t(Tn * E), 0);
    const int64_t hot = int64_t(seed % uint64_t(N)) * L;
    for (auto& x : tokens.data) x = T(rng.normal());
    for (int64_t t = 0; t < Tn; ++t) {
        if (rng.below(8) == 0) continue;  // a padding-like token with no expert
        for (int64_t j = 0; j < k;) {
            const int64_t e = rng.below(2) ? hot + rng.below(L) : rng.below(E);
            if (map[size_t(t * E + e)]) {
                if (rng.below(4) == 0) break;  // fewer than k is valid too (a dropped expert)
                continue;
            }
            map[size_t(t * E + e)] = 1;
            probs(t, e) = T(0.05 + rng.uniform());
            ++j;
        }
    }
    const std::vector<int64_t> recv = expected_received(world, world, map, E);
    // Every source's plan, for the source rows and the count matrix.
    const std::vector<uint8_t> maps = world.all_gather(map);
    std::vector<cpu::RoutingPlan<T>> plans;
    std::vector<int64_t> count_matrix;
    for (int s = 0; s < N; ++s) {
        std::vector<uint8_t> ms(maps.begin() + long(size_t(s) * map.size()), maps.begin() + long(size_t(s + 1) * map.size()));
        plans.push_back(cpu::build_routing_plan(ms, Matrix<T>(), Tn, E));
        count_matrix.insert(count_matrix.end(), plans.back().tokens_per_expert.begin(), plans.back().tokens_per_expert.end());
    }

    cpu::EpLayout layout;
    layout.num_experts = E, layout.num_local_experts = L, layout.ep_size = N, layout.ep_rank = me;
    auto a2a = cpu::make_alltoall_dispatcher<T>(layout, world);
    cpu::BudgetedDispatcher<T> bud(layout, world, Tn, k, H, factor);
    const int64_t budget = bud.budget_rows(), held = std::min(recv[size_t(me)], budget);
    v.expect(budget == align_up(int64_t(std::ceil(double(Tn * k) * factor)), kBudgetRowAlign), "budget formula");

    const cpu::DispatchedRows<T> da = a2a->dispatch(tokens, probs, map);
    bud.begin_step();
    const cpu::DispatchedRows<T> db = bud.dispatch(tokens, probs, map);
    v.expect(da.rows.rows == recv[size_t(me)], "alltoall received count vs the maps");
    v.expect(bud.received_rows() == recv[size_t(me)], str("received_rows ", bud.received_rows(), " vs ", recv[size_t(me)]));
    v.expect(bud.overflowed() == (recv[size_t(me)] > budget), "this rank's overflow flag");
    v.expect(bud.count_matrix() == count_matrix, "count matrix vs the sources' plans");
    // Rows and probs: the budget's prefix of alltoall's, bit for bit; offsets clipped at the budget.
    v.expect(db.rows.rows == held && db.rows.cols == H, "held rows shape");
    v.expect(held == 0 || std::memcmp(db.rows.data.data(), da.rows.data.data(), size_t(held * H) * sizeof(T)) == 0,
             "permuted rows not bitwise equal to alltoall's");
    v.expect(held == 0 || std::memcmp(db.probs.data(), da.probs.data(), size_t(held) * sizeof(T)) == 0,
             "row probs not bitwise equal");
    for (int64_t l = 0; l <= L; ++l)
        v.expect(db.offsets[size_t(l)] == std::min(da.offsets[size_t(l)], budget), str("offset of local expert ", l));
    // Source rows: chunk (l, s) holds source s's rows for expert me*L + l, in its permutation-1 order.
    for (int64_t l = 0; l < L; ++l)
        for (int s = 0; s < N; ++s) {
            const int64_t e = me * L + l, o = bud.chunk_offsets()[size_t(l * N + s)];
            for (int64_t i = 0; i < plans[size_t(s)].tokens_per_expert[size_t(e)] && o + i < budget; ++i)
                if (bud.buffer_sources()[o + i] != plans[size_t(s)].offsets[size_t(e)] + i) {
                    v.expect(false, str("source row of chunk (", l, ", ", s, ") row ", i));
                    break;
                }
        }
    // Padding slack untouched: every byte past the held rows still holds the fill byte.
    auto untouched = [&](const void* p, int64_t from, int64_t to) {
        const auto* b = static_cast<const unsigned char*>(p);
        for (int64_t i = from; i < to; ++i)
            if (b[i] != cpu::BudgetedDispatcher<T>::kSlackByte) return false;
        return true;
    };
    const int64_t t = int64_t(sizeof(T));
    v.expect(untouched(bud.buffer_rows(), held * H * t, budget * H * t), "slack rows written");
    v.expect(untouched(bud.buffer_probs(), held * t, budget * t), "slack probs written");
    v.expect(untouched(bud.buffer_sources(), held * 8, budget * 8), "slack source rows written");

    // combine / backward: alltoall with every row past the budget zeroed is what must come out.
    Matrix<T> expert_out(da.rows.rows, H), grad_rows(da.rows.rows, H), grad_out(Tn, H);
    std::vector<T> grad_row_probs(size_t(da.rows.rows));
    for (auto& x : expert_out.data) x = T(rng.normal());
    for (auto& x : grad_rows.data) x = T(rng.normal());
    for (auto& x : grad_out.data) x = T(rng.normal());
    for (auto& x : grad_row_probs) x = T(rng.normal());
    auto prefix = [&](const Matrix<T>& m) {
        Matrix<T> p(held, H);
        std::copy(m.data.begin(), m.data.begin() + long(held * H), p.data.begin());
        return p;
    };
    auto zero_tail = [&](Matrix<T> m) {
        std::fill(m.data.begin() + long(held * H), m.data.end(), T(0));
        return m;
    };
    std::vector<T> grad_probs_zeroed = grad_row_probs;
    std::fill(grad_probs_zeroed.begin() + long(held), grad_probs_zeroed.end(), T(0));
    const std::vector<T> grad_probs_held(grad_row_probs.begin(), grad_row_probs.begin() + long(held));

    v.same("combine", bud.combine(prefix(expert_out)), a2a->combine(zero_tail(expert_out)), 0.0);
    const Matrix<T> cb_a = a2a->combine_backward(grad_out), cb_b = bud.combine_backward(grad_out);
    v.same("combine_backward", cb_b, prefix(cb_a), 0.0);
    Matrix<T> gt_a, gp_a, gt_b, gp_b;
    a2a->dispatch_backward(zero_tail(grad_rows), grad_probs_zeroed, gt_a, gp_a);
    bud.dispatch_backward(prefix(grad_rows), grad_probs_held, gt_b, gp_b);
    v.same("dispatch_backward grad_tokens", gt_b, gt_a, 0.0);
    v.same("dispatch_backward grad_probs", gp_b, gp_a, 0.0);

    const cpu::BudgetOverflowReport rep = bud.end_step(world);
    check_report(v, rep, recv, budget, Tn, k);
    v.expect(bud.overflow_events() == (rep.overflow ? 1 : 0), "overflow event count");
    v.expect(!bud.overflowed(), "end_step clears the flag");
    return v;
}

template <typename T>
struct BudgetedRun {
    RankRun<T> run;
    cpu::BudgetOverflowReport report;
    int64_t events = 0;
};

// One rank's step of the pipeline with the budgeted dispatcher (EP = world size), through
// run_budgeted_step (the overflow re-run) when `recover`, else one forward only (what a step would
// have produced without the re-run).
template <typename T>
BudgetedRun<T> run_budgeted_rank(Communicator& world, int ep_size, const EpCase& k, const EpInputs<T>& in,
                                 const std::string& type, double factor, bool recover) {
    MoeConfig c = k.config;
    c.expert_model_parallel_size = ep_size;
    c.moe_token_dispatcher_type = type;
    c.moe_expert_rank_capacity_factor = factor;
    auto groups = make_process_groups(world, ep_size);
    cpu::MoePipeline<T> layer(c, *groups);
    auto* bud = dynamic_cast<cpu::BudgetedDispatcher<T>*>(&layer.dispatcher());
    MOEKIT_CHECK(bud || ep_size == 1, "the config did not select the budgeted dispatcher");
    Matrix<T> grad_output;
    const LayerInput<T> li = micro_batch(k, in, world.rank(), &grad_output);
    BudgetedRun<T> out;
    RankRun<T>& run = out.run;
    if (!recover) {
        bud->begin_step();
        run.output = layer.forward(in.weights, li);
        out.report = bud->end_step(world);
        return out;
    }
    out.report = cpu::run_budgeted_step<T>(layer, world, [&] {
        run.output = layer.forward(in.weights, li);
        run.grads = zeros_like(in.weights);
        run.grad_input = layer.backward(in.weights, grad_output, run.grads);
    });
    out.events = bud ? bud->overflow_events() : 0;
    finish_rank_run(layer, in, run);
    return out;
}

// A random EP case usable with the budget (no pad-to-capacity); `large`: 32 tokens per rank and no
// padding, so that a tiny factor's 16-row budget must overflow somewhere (the mean receive is >= 32).
inline EpCase budget_case(uint64_t seed, int ranks, bool large) {
    EpCase k = random_ep_case(seed, ranks);
    k.config.moe_pad_expert_input_to_capacity = false;
    if (large) {
        k.seq = 16, k.local_batch = 2, k.padding = false;
        k.config.moe_expert_capacity_factor.reset();  // dropless: every token brings k rows
        k.config.seq_length = k.seq, k.config.micro_batch_size = k.local_batch;
    }
    return k;
}

// Pipeline level at EP = ep_size (EP groups of the world, the re-run agreed over the world): the budgeted
// step (with the re-run) equals the alltoall step bit for bit; with a tiny factor the overflow is
// reported to every rank with the right ranks and factor, the first attempt really differed, and the
// suggested factor does not overflow. `virtual_twin`: the same job on virtual ranks gives the same
// bits (world is then the MPI world).
template <typename T>
Verdict check_budgeted_pipeline(Communicator& world, int ep_size, const EpCase& k, double factor, bool expect_overflow,
                                bool virtual_twin) {
    const int N = world.size(), r = world.rank();
    Verdict v;
    v.context = str("rank ", r, "/", N, " [budgeted pipeline EP=", ep_size, " f=", factor, " ", k.describe(), ", ",
                    sizeof(T) == 8 ? "fp64" : "fp32", "]");
    const EpInputs<T> in = make_ep_inputs<T>(k, N);
    const std::string type = k.seed % 2 ? "flex" : "alltoall";
    const RankRun<T> ref = run_ep_rank(world, k, in, ep_size, "alltoall");
    const BudgetedRun<T> got = run_budgeted_rank(world, ep_size, k, in, type, factor, true);
    {
        const std::string ctx = v.context;
        v.context += str(" (", type, "+budget vs alltoall)");
        compare_bitwise(v, got.run, ref);
        v.context = ctx;
    }
    const int64_t Tn = k.seq * k.local_batch, topk = k.config.moe_router_topk;
    const int64_t budget = budget_rows(Tn, topk, factor);
    auto groups = make_process_groups(world, ep_size);
    const std::vector<int64_t> recv = expected_received(world, *groups->ep, ref.routing_map, k.config.num_experts());
    check_report(v, got.report, recv, budget, Tn, topk);
    v.expect(got.report.overflow == expect_overflow, str("overflow ", got.report.overflow, ", the test expected ",
                                                         expect_overflow, " (its premise)"));
    v.expect(got.events == (got.report.overflow ? 1 : 0), str("overflow events ", got.events));
    if (got.report.overflow) {
        // Without the re-run the output of some rank is wrong: the recovery is what makes it right.
        const BudgetedRun<T> raw = run_budgeted_rank(world, ep_size, k, in, type, factor, false);
        int64_t differs = bytes_equal(raw.run.output, ref.output) ? 0 : 1;
        world.all_reduce(&differs, 1, ReduceOp::max);
        v.expect(differs == 1, "the overflowing step without the re-run equals the dropless one (test proves nothing)");
        v.expect(raw.report.overflow, "the step without the re-run did not report the overflow");
        // The factor the log suggests is enough.
        const BudgetedRun<T> again = run_budgeted_rank(world, ep_size, k, in, type, got.report.sufficient_factor, true);
        v.expect(!again.report.overflow, str("the suggested factor ", got.report.sufficient_factor, " overflows too"));
        v.expect(bytes_equal(again.run.output, ref.output), "output with the suggested factor");
    }
    if (virtual_twin) {
        std::vector<BudgetedRun<T>> twins(static_cast<size_t>(N));
        comm::run_virtual_ranks(N, [&](Communicator& vw) {
            twins[size_t(vw.rank())] = run_budgeted_rank(vw, ep_size, k, in, type, factor, true);
        });
        const std::string ctx = v.context;
        v.context += " (virtual vs MPI ranks)";
        compare_bitwise(v, twins[size_t(r)].run, got.run);
        v.expect(twins[size_t(r)].report.overflowed_ranks == got.report.overflowed_ranks, "overflowed ranks differ");
        v.context = ctx;
    }
    return v;
}

}  // namespace moekit::test
