// The checks of the expert-parallel tests (tests/mpi/test_ep_mpi.cpp, tests/cpu/test_ep_virtual.cpp)
// on one case: this rank's EP = N run against EP = 1 over the same data-parallel ranks and against the
// N independent one-rank runs, allgather against alltoall, the whole-batch global_aux_loss, and
// (optionally) virtual ranks against this transport bit for bit. Cases and runs: tests/ep_harness.h.
#pragma once
#include "ep_harness.h"

namespace moekit::test {

// Reduction-order tolerance of a dtype (sums of a few hundred terms).
template <typename T>
constexpr double reorder_tol() {
    return sizeof(T) == 8 ? 1e-12 : 2e-5;
}

// Parameter grads of one rank's EP run against a reference sum: router, shared expert and gate
// `exact_dense` (the same rank-order sum of the same per-rank values), the rank's local experts
// within `expert_tol`, the other experts untouched (zero).
template <typename T>
void compare_grads(Verdict& v, const MoeWeights<T>& got, const MoeWeights<T>& want, const cpu::EpLayout& ep,
                   double dense_tol, double expert_tol) {
    v.same("grad.router.weight", got.router_weight, want.router_weight, dense_tol);
    v.same("grad.shared_experts.linear_fc1.weight", got.shared_fc1, want.shared_fc1, dense_tol);
    v.same("grad.shared_experts.linear_fc2.weight", got.shared_fc2, want.shared_fc2, dense_tol);
    v.same("grad.shared_experts.gate_weight", got.shared_gate, want.shared_gate, dense_tol);
    for (int64_t e = 0; e < ep.num_experts; ++e) {
        const bool local = e >= ep.first_local_expert() && e < ep.first_local_expert() + ep.num_local_experts;
        const std::string n = str("grad.experts.local_experts.", e);
        if (local) {
            v.same(n + ".linear_fc1.weight", got.fc1[size_t(e)], want.fc1[size_t(e)], expert_tol);
            v.same(n + ".linear_fc2.weight", got.fc2[size_t(e)], want.fc2[size_t(e)], expert_tol);
        } else {
            v.same(n + ".linear_fc1.weight (not local: untouched)", got.fc1[size_t(e)],
                   Matrix<T>(got.fc1[size_t(e)].rows, got.fc1[size_t(e)].cols), 0.0);
        }
    }
}

template <typename T>
void add_grads(MoeWeights<T>& acc, const MoeWeights<T>& g) {
    auto add = [](Matrix<T>& a, const Matrix<T>& b) {
        for (size_t i = 0; i < a.data.size(); ++i) a.data[i] = a.data[i] + b.data[i];
    };
    add(acc.router_weight, g.router_weight);
    add(acc.shared_fc1, g.shared_fc1);
    add(acc.shared_fc2, g.shared_fc2);
    add(acc.shared_gate, g.shared_gate);
    for (size_t e = 0; e < acc.fc1.size(); ++e) add(acc.fc1[e], g.fc1[e]), add(acc.fc2[e], g.fc2[e]);
}

template <typename T>
bool bytes_equal(const Matrix<T>& a, const Matrix<T>& b) {
    // Empty tensors are equal without memcmp (an empty vector's data() may be null).
    return a.rows == b.rows && a.cols == b.cols &&
           (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(T)) == 0);
}

// Every tensor of two runs bit for bit (virtual ranks vs MPI ranks).
template <typename T>
void compare_bitwise(Verdict& v, const RankRun<T>& a, const RankRun<T>& b) {
    v.expect(bytes_equal(a.output, b.output), "output not bitwise equal");
    v.expect(bytes_equal(a.grad_input, b.grad_input), "grad_input not bitwise equal");
    v.expect(bytes_equal(a.probs, b.probs), "probs not bitwise equal");
    v.expect(a.routing_map == b.routing_map, "routing_map not equal");
    v.expect(std::memcmp(&a.losses, &b.losses, sizeof(LossValues)) == 0, "losses not bitwise equal");
    v.expect(a.expert_bias == b.expert_bias, "updated expert_bias not equal");
    v.expect(bytes_equal(a.grads.router_weight, b.grads.router_weight), "grad.router.weight not bitwise equal");
    v.expect(bytes_equal(a.grads.shared_fc1, b.grads.shared_fc1) && bytes_equal(a.grads.shared_fc2, b.grads.shared_fc2) &&
                 bytes_equal(a.grads.shared_gate, b.grads.shared_gate),
             "shared-expert grads not bitwise equal");
    for (size_t e = 0; e < a.grads.fc1.size(); ++e)
        v.expect(bytes_equal(a.grads.fc1[e], b.grads.fc1[e]) && bytes_equal(a.grads.fc2[e], b.grads.fc2[e]),
                 str("grad of expert ", e, " not bitwise equal"));
}

// Every EP check of one case on this rank of `world` (N ranks, micro-batch = rank). Collectives run
// in the same order on every rank whatever the data, so a mismatch never leaves a rank waiting.
// `virtual_twin`: also run the same EP = N job on N virtual ranks in this process and demand the
// bits of this rank's run (world is then the MPI world).
template <typename T>
Verdict check_ep_case(Communicator& world, const EpCase& k, bool virtual_twin) {
    const int N = world.size(), r = world.rank();
    const MoeConfig& c = k.config;
    const bool global_aux = has_global_aux(c);
    constexpr double tol = reorder_tol<T>();
    Verdict v;
    v.context = str("rank ", r, "/", N, " [", k.describe(), ", ", sizeof(T) == 8 ? "fp64" : "fp32", "]");
    const EpInputs<T> in = make_ep_inputs<T>(k, N);

    // Reference A: N independent one-rank runs on the micro-batches, grads summed in rank order.
    std::vector<RankRun<T>> single;
    for (int p = 0; p < N; ++p) single.push_back(run_single(k, in, p));
    MoeWeights<T> single_sum = single[0].grads;
    for (int p = 1; p < N; ++p) add_grads(single_sum, single[size_t(p)].grads);
    const RankRun<T>& mine = single[size_t(r)];
    double norm = 0;
    for (T x : mine.output.data) norm += std::abs(double(x));
    v.expect(norm > 0, "the reference output is all zeros (the test would prove nothing)");
    const int64_t E = c.num_experts();
    std::vector<double> counts(size_t(E), 0.0);  // valid tokens routed to each expert, whole batch
    for (const auto& s : single)
        for (size_t i = 0; i < s.routing_map.size(); ++i) counts[i % size_t(E)] += s.routing_map[i];
    if (k.skew && !c.moe_pad_expert_input_to_capacity)
        for (int64_t e : k.cold) v.expect(counts[size_t(e)] == 0, str("cold expert ", e, " got tokens"));

    std::vector<int> ep_sizes = {1, N};
    if (N == 4) ep_sizes.push_back(2);
    std::vector<std::vector<RankRun<T>>> runs(2);  // [dispatcher][ep index]
    const std::string dispatchers[2] = {"allgather", "alltoall"};
    for (int d = 0; d < 2; ++d)
        for (int ep : ep_sizes) runs[size_t(d)].push_back(run_ep_rank(world, k, in, ep, dispatchers[d]));

    for (int d = 0; d < 2; ++d) {
        const bool a2a = d == 1;
        for (size_t i = 0; i < ep_sizes.size(); ++i) {
            const RankRun<T>& run = runs[size_t(d)][i];
            cpu::EpLayout layout;
            layout.num_experts = E;
            layout.ep_size = ep_sizes[i];
            layout.ep_rank = r % ep_sizes[i];
            layout.num_local_experts = E / ep_sizes[i];
            const std::string where = str(" (", dispatchers[d], ", EP=", ep_sizes[i], ")");
            // Against reference B, EP = 1 over the same data-parallel world (global_aux_loss included).
            const RankRun<T>& b = runs[size_t(d)][0];
            v.same("output vs EP=1" + where, run.output, b.output, a2a ? 0.0 : tol);
            v.same("grad_input vs EP=1" + where, run.grad_input, b.grad_input, a2a ? 0.0 : tol);
            v.same("probs vs EP=1" + where, run.probs, b.probs, 0.0);
            v.expect(run.routing_map == b.routing_map, "routing_map vs EP=1" + where);
            v.same("aux_loss vs EP=1" + where, run.losses.aux_loss, b.losses.aux_loss, 0.0);
            v.same("seq_aux_loss vs EP=1" + where, run.losses.seq_aux_loss, b.losses.seq_aux_loss, 0.0);
            v.same("global_aux_loss vs EP=1" + where, run.losses.global_aux_loss, b.losses.global_aux_loss, 0.0);
            v.same("z_loss vs EP=1" + where, run.losses.z_loss, b.losses.z_loss, 0.0);
            v.expect(run.expert_bias == b.expert_bias, "updated expert_bias vs EP=1" + where);
            {
                const std::string ctx = v.context;
                v.context += where + " vs EP=1";
                compare_grads(v, run.grads, b.grads, layout, 0.0, tol);
                v.context = ctx;
            }
            // Against reference A, the independent runs (global_aux_loss all-reduces its counts over
            // the data-parallel ranks, so with it only the forward and the expert grads can agree).
            v.same("output vs independent EP=1 run" + where, run.output, mine.output, a2a ? 0.0 : tol);
            v.same("probs vs independent run" + where, run.probs, mine.probs, 0.0);
            v.expect(run.routing_map == mine.routing_map, "routing_map vs independent run" + where);
            v.same("aux_loss vs independent run" + where, run.losses.aux_loss, mine.losses.aux_loss, 0.0);
            v.same("seq_aux_loss vs independent run" + where, run.losses.seq_aux_loss, mine.losses.seq_aux_loss, 0.0);
            v.same("z_loss vs independent run" + where, run.losses.z_loss, mine.losses.z_loss, 0.0);
            if (!global_aux) {
                v.same("grad_input vs independent run" + where, run.grad_input, mine.grad_input, a2a ? 0.0 : tol);
                const std::string ctx = v.context;
                v.context += where + " vs the sum of independent runs";
                compare_grads(v, run.grads, single_sum, layout, 0.0, tol);
                v.context = ctx;
            } else {
                for (int64_t e = layout.first_local_expert(); e < layout.first_local_expert() + layout.num_local_experts; ++e)
                    v.same(str("grad of expert ", e, " vs the sum of independent runs", where), run.grads.fc1[size_t(e)],
                           single_sum.fc1[size_t(e)], tol);
            }
            if (c.moe_router_enable_expert_bias) {
                std::vector<double> bias = in.weights.expert_bias, cnt = counts;
                cpu::update_expert_bias(c.moe_router_bias_update_rate, bias, cnt);
                v.expect(run.expert_bias == bias, "expert_bias update from the whole batch's counts" + where);
            }
        }
    }
    // allgather against alltoall at every EP: the experts see the same rows in the same order.
    for (size_t i = 0; i < ep_sizes.size(); ++i) {
        const RankRun<T>&ag = runs[0][i], &aa = runs[1][i];
        const std::string where = str(" (allgather vs alltoall, EP=", ep_sizes[i], ")");
        v.same("output" + where, ag.output, aa.output, tol);
        v.same("grad_input" + where, ag.grad_input, aa.grad_input, tol);
        v.same("probs" + where, ag.probs, aa.probs, 0.0);
        cpu::EpLayout layout;
        layout.num_experts = E;
        layout.ep_size = ep_sizes[i];
        layout.ep_rank = r % ep_sizes[i];
        layout.num_local_experts = E / ep_sizes[i];
        const std::string ctx = v.context;
        v.context += where;
        compare_grads(v, ag.grads, aa.grads, layout, 0.0, 0.0);
        v.context = ctx;
    }
    // global_aux_loss: the ranks' values sum to that of one run on the whole batch (not with jitter:
    // its draws are indexed by the token's row, which differs in the whole batch).
    if (global_aux && !c.moe_input_jitter_eps) {
        double sum = runs[1][1].losses.global_aux_loss;  // alltoall, EP = N
        world.all_reduce(&sum, 1);
        MoeConfig whole = c;
        whole.micro_batch_size = k.local_batch * N;
        cpu::MoeLayer<T> layer(whole);
        LayerInput<T> li;
        li.hidden = in.hidden;
        li.padding_mask = in.padding_mask;
        li.seq_length = k.seq;
        li.micro_batch_size = whole.micro_batch_size;
        li.jitter_seed = k.seed;
        (void)layer.forward(in.weights, li);
        v.same("sum of the ranks' global_aux_loss vs one run on the whole batch", sum,
               layer.summary().losses.global_aux_loss, tol);
    }
    if (virtual_twin) {
        for (int d = 0; d < 2; ++d) {
            std::vector<RankRun<T>> twins(static_cast<size_t>(N));
            comm::run_virtual_ranks(N, [&](Communicator& vworld) {
                twins[size_t(vworld.rank())] = run_ep_rank(vworld, k, in, N, dispatchers[d]);
            });
            const std::string ctx = v.context;
            v.context += str(" (virtual vs MPI ranks, ", dispatchers[d], ", EP=", N, ")");
            compare_bitwise(v, twins[size_t(r)], runs[size_t(d)][1]);  // ep_sizes[1] = N
            v.context = ctx;
        }
    }
    return v;
}

}  // namespace moekit::test
