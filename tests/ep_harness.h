// The expert-parallel equivalence harness, shared by the MPI test (tests/mpi/test_ep_mpi.cpp) and
// the virtual-rank test (tests/cpu/test_ep_virtual.cpp): random layer configurations (seeded,
// printed), a global batch [S, N*B, H] split into N micro-batches along B, one rank's run of the
// pipeline at a given EP, the N independent one-rank runs it must equal, and comparisons.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "cpu/moe_pipeline.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::test {

struct EpCase {
    uint64_t seed = 0;
    MoeConfig config;
    int64_t seq = 0, local_batch = 1;  // S, B per rank
    bool padding = false;              // a random padding mask (some tokens of every rank)
    bool skew = false;                 // a hot expert, and cold experts that get no token
    std::vector<int64_t> cold;         // experts made cold (skew)
    std::string describe() const;
};

inline bool has_global_aux(const MoeConfig& c) { return c.aux_loss_coeff("global_aux_loss") > 0; }

inline std::string EpCase::describe() const {
    const MoeConfig& c = config;
    std::string s = str("seed=", seed, " S=", seq, " B/rank=", local_batch, " H=", c.hidden_size, " E=", c.num_experts(),
                        " k=", c.moe_router_topk, " F=", c.expert_ffn(), c.gated_linear_unit ? " swiglu" : "",
                        " score=", c.moe_router_score_function, c.moe_router_pre_softmax ? " pre-softmax" : "");
    if (c.moe_router_num_groups) s += str(" groups=", *c.moe_router_num_groups, "/", *c.moe_router_group_topk);
    if (c.moe_router_enable_expert_bias) s += " expert-bias";
    if (c.moe_expert_capacity_factor)
        s += str(" cf=", *c.moe_expert_capacity_factor, " drop=", c.moe_token_drop_policy,
                 c.moe_pad_expert_input_to_capacity ? " pad" : "");
    for (size_t i = 0; i < c.moe_router_load_balancing_type.size(); ++i)
        s += str(" ", c.moe_router_load_balancing_type[i], "=", c.moe_aux_loss_coeff[i]);
    if (c.moe_z_loss_coeff) s += " z-loss";
    if (c.moe_input_jitter_eps) s += " jitter";
    if (c.shared_ffn() > 0) s += str(" shared=", c.shared_ffn(), c.moe_shared_expert_gate ? "+gate" : "");
    if (padding) s += " padding-mask";
    if (skew) {
        s += " skew(cold:";
        for (int64_t e : cold) s += str(" ", e);
        s += ")";
    }
    return s;
}

// A valid random configuration for `ranks` ranks (E divisible by every EP tried: ranks).
inline EpCase random_ep_case(uint64_t seed, int ranks) {
    for (uint64_t attempt = 0;; ++attempt) {
        Rng rng(seed, 1000 + attempt);
        EpCase k;
        k.seed = seed;
        MoeConfig& c = k.config;
        c.hidden_size = 8 + 4 * rng.below(2);
        c.num_moe_experts = int64_t(ranks) * (rng.below(2) == 0 ? 2 : (ranks == 2 ? 4 : 3));
        const int64_t E = c.num_experts();
        c.moe_ffn_hidden_size = 4 + 2 * rng.below(3);
        if (rng.below(2)) c.gated_linear_unit = true, c.activation_func = "silu";
        c.moe_router_topk = 1 + rng.below(std::min<int64_t>(E, 4));
        if (rng.below(3) == 0) {
            c.moe_router_score_function = "sigmoid";
            if (rng.below(2)) c.moe_router_enable_expert_bias = true;
        } else if (c.moe_router_topk == 1 || rng.below(3) == 0) {
            c.moe_router_pre_softmax = true;
        }
        if (E % 2 == 0 && E >= 4 && rng.below(3) == 0) {
            c.moe_router_num_groups = 2;
            c.moe_router_group_topk = 1;
            c.moe_router_topk = std::min<int64_t>(c.moe_router_topk, E / 2);
        }
        const int64_t lb = rng.below(5);
        if (lb == 0) c.moe_router_load_balancing_type = {"aux_loss"}, c.moe_aux_loss_coeff = {0.05};
        if (lb == 1) c.moe_router_load_balancing_type = {"seq_aux_loss"}, c.moe_aux_loss_coeff = {0.1};
        if (lb == 2) c.moe_router_load_balancing_type = {"global_aux_loss"}, c.moe_aux_loss_coeff = {0.2};
        if (lb == 3)
            c.moe_router_load_balancing_type = {"aux_loss", "global_aux_loss"}, c.moe_aux_loss_coeff = {0.05, 0.1};
        if (lb == 4) c.moe_router_load_balancing_type = {"none"}, c.moe_aux_loss_coeff = {0.0};
        if (rng.below(3) == 0) c.moe_z_loss_coeff = 0.01;
        if (rng.below(4) == 0) c.moe_input_jitter_eps = 0.05;
        if (rng.below(2)) {
            const double factors[] = {0.5, 1.0, 1.5};
            c.moe_expert_capacity_factor = factors[rng.below(3)];
            c.moe_token_drop_policy = rng.below(2) ? "probs" : "position";
            c.moe_pad_expert_input_to_capacity = rng.below(2) == 0;
        }
        if (rng.below(2)) {
            c.moe_shared_expert_intermediate_size = 6;
            c.moe_shared_expert_gate = rng.below(2) == 0;
        }
        k.seq = 3 + rng.below(5);
        k.local_batch = 1 + rng.below(2);
        k.padding = rng.below(3) == 0;
        k.skew = rng.below(2) == 0;
        if (k.skew) {
            // Cold experts: the whole block of one EP rank sometimes (a rank that receives nothing).
            const int64_t L = E / ranks;
            if (rng.below(2)) {
                const int64_t r = rng.below(ranks);
                for (int64_t l = 0; l < L; ++l) k.cold.push_back(r * L + l);
            } else {
                k.cold.push_back(rng.below(E));
            }
            // Keep enough warm experts for top-k; with k = E nothing can be cold.
            if (E - int64_t(k.cold.size()) < c.moe_router_topk) k.cold.resize(1);
            if (E - 1 < c.moe_router_topk) k.cold.clear(), k.skew = false;
        }
        c.seq_length = k.seq;
        c.micro_batch_size = k.local_batch;
        c.seed = seed;
        if (c.validation_errors().empty()) return k;
    }
}

template <typename T>
struct EpInputs {
    MoeWeights<T> weights;
    Matrix<T> hidden;                   // [S * N*B, H], row s*(N*B) + b
    Matrix<T> grad_output;              // same shape
    std::vector<uint8_t> padding_mask;  // [S * N*B] (empty = none)
    int ranks = 1;
};

// Global weights and batch of a case (identical on every rank: a function of the seed only).
template <typename T>
EpInputs<T> make_ep_inputs(const EpCase& k, int ranks) {
    const MoeConfig& c = k.config;
    const int64_t H = c.hidden_size, E = c.num_experts(), Bg = k.local_batch * ranks, rows = k.seq * Bg;
    EpInputs<T> in;
    in.ranks = ranks;
    in.weights = init_weights<T>(c, k.seed);
    in.hidden = Matrix<T>(rows, H);
    in.grad_output = Matrix<T>(rows, H);
    for (int64_t i = 0; i < rows * H; ++i) {
        in.hidden.data[size_t(i)] = T(normal01(k.seed, 11, uint64_t(i)));
        in.grad_output.data[size_t(i)] = T(normal01(k.seed, 12, uint64_t(i)));
    }
    // Router init std 0.02 gives near-uniform scores; scale the router so routing is decisive.
    for (auto& v : in.weights.router_weight.data) v = T(double(v) * 20);
    if (c.moe_router_enable_expert_bias) {
        in.weights.expert_bias.assign(size_t(E), 0.0);
        for (int64_t e = 0; e < E; ++e) in.weights.expert_bias[size_t(e)] = 0.1 * normal01(k.seed, 13, uint64_t(e));
    }
    if (k.skew) {
        // Every token gets +2 along feature 0; the hot expert's router row +1.5 there, cold rows -50.
        for (int64_t t = 0; t < rows; ++t) in.hidden(t, 0) = T(std::abs(double(in.hidden(t, 0))) + 2.0);
        in.weights.router_weight(0, 0) = T(1.5);
        for (int64_t e : k.cold) in.weights.router_weight(e, 0) = T(-50.0);
        if (c.moe_router_enable_expert_bias)
            for (int64_t e : k.cold) in.weights.expert_bias[size_t(e)] = -100.0;
    }
    if (k.padding) {
        in.padding_mask.assign(size_t(rows), 0);
        for (int64_t t = 0; t < rows; ++t) in.padding_mask[size_t(t)] = uniform01(k.seed, 14, uint64_t(t)) < 0.25;
    }
    return in;
}

// Micro-batch r of N: columns [r*B, r*B + B) of the [S, N*B] batch, as a layer input [S*B, H].
template <typename T>
LayerInput<T> micro_batch(const EpCase& k, const EpInputs<T>& in, int r, Matrix<T>* grad_output) {
    const int64_t H = k.config.hidden_size, B = k.local_batch, Bg = B * in.ranks, S = k.seq;
    LayerInput<T> li;
    li.hidden = Matrix<T>(S * B, H);
    if (grad_output) *grad_output = Matrix<T>(S * B, H);
    if (!in.padding_mask.empty()) li.padding_mask.assign(size_t(S * B), 0);
    for (int64_t s = 0; s < S; ++s)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t g = s * Bg + int64_t(r) * B + b, l = s * B + b;
            std::copy(in.hidden.row(g), in.hidden.row(g) + H, li.hidden.row(l));
            if (grad_output) std::copy(in.grad_output.row(g), in.grad_output.row(g) + H, grad_output->row(l));
            if (!in.padding_mask.empty()) li.padding_mask[size_t(l)] = in.padding_mask[size_t(g)];
        }
    li.seq_length = S;
    li.micro_batch_size = B;
    li.training = true;
    li.jitter_seed = k.seed;
    return li;
}

// What one rank's forward + backward produced (grads after the process-group reductions).
template <typename T>
struct RankRun {
    Matrix<T> output, grad_input, probs;
    std::vector<uint8_t> routing_map;
    LossValues losses;
    MoeWeights<T> grads;
    std::vector<double> expert_bias;  // after update_expert_bias (sigmoid + expert bias only)
};

// This rank's run of the pipeline at EP = ep_size over `world` (micro-batch = world rank).
template <typename T>
RankRun<T> run_ep_rank(Communicator& world, const EpCase& k, const EpInputs<T>& in, int ep_size,
                       const std::string& dispatcher) {
    MoeConfig c = k.config;
    c.expert_model_parallel_size = ep_size;
    c.moe_token_dispatcher_type = dispatcher;
    auto groups = make_process_groups(world, ep_size);
    cpu::MoePipeline<T> layer(c, *groups);
    Matrix<T> grad_output;
    const LayerInput<T> li = micro_batch(k, in, world.rank(), &grad_output);
    RankRun<T> run;
    run.output = layer.forward(in.weights, li);
    run.grads = zeros_like(in.weights);
    run.grad_input = layer.backward(in.weights, grad_output, run.grads);
    layer.reduce_gradients(run.grads);
    run.probs = layer.probs();
    run.routing_map = layer.routing_map();
    run.losses = layer.summary().losses;
    MoeWeights<T> w = in.weights;
    layer.update_expert_bias(w);
    run.expert_bias = w.expert_bias;
    return run;
}

// The independent single-rank run (cpu::MoeLayer, EP = 1) on micro-batch r.
template <typename T>
RankRun<T> run_single(const EpCase& k, const EpInputs<T>& in, int r) {
    cpu::MoeLayer<T> layer(k.config);
    Matrix<T> grad_output;
    const LayerInput<T> li = micro_batch(k, in, r, &grad_output);
    RankRun<T> run;
    run.output = layer.forward(in.weights, li);
    run.grads = zeros_like(in.weights);
    run.grad_input = layer.backward(in.weights, grad_output, run.grads);
    run.probs = layer.probs();
    run.routing_map = layer.routing_map();
    run.losses = layer.summary().losses;
    return run;
}

// Collects mismatches as text (so that every rank can report them after the collectives).
struct Verdict {
    std::vector<std::string> failures;
    std::string context;

    // tol = 0: exact (==, so +0 and -0 agree); else |a - b| <= tol * max(1, max |b|).
    template <typename T>
    void same(const std::string& what, const std::vector<T>& a, const std::vector<T>& b, double tol) {
        if (a.size() != b.size()) {
            failures.push_back(str(context, ": ", what, ": ", a.size(), " vs ", b.size(), " elements"));
            return;
        }
        double scale = 1, worst = 0;
        size_t worst_i = 0;
        for (const T& v : b) scale = std::max(scale, std::abs(double(v)));
        for (size_t i = 0; i < a.size(); ++i) {
            const double d = std::abs(double(a[i]) - double(b[i]));
            if (!(d <= worst) || std::isnan(d)) worst = std::isnan(d) ? INFINITY : d, worst_i = i;
        }
        if (worst > tol * scale || (tol == 0 && worst > 0))
            failures.push_back(str(context, ": ", what, " differs at [", worst_i, "]: ", double(a[worst_i]), " vs ",
                                   double(b[worst_i]), " (|diff| ", worst, ", allowed ", tol * scale, ")"));
    }
    template <typename T>
    void same(const std::string& what, const Matrix<T>& a, const Matrix<T>& b, double tol) {
        if (a.rows != b.rows || a.cols != b.cols) {
            failures.push_back(str(context, ": ", what, " is [", a.rows, ", ", a.cols, "] vs [", b.rows, ", ", b.cols, "]"));
            return;
        }
        same(what, a.data, b.data, tol);
    }
    void same(const std::string& what, double a, double b, double tol) {
        same(what, std::vector<double>{a}, std::vector<double>{b}, tol);
    }
    void expect(bool ok, const std::string& what) {
        if (!ok) failures.push_back(str(context, ": ", what));
    }
    std::string text() const {
        std::string s;
        for (const auto& f : failures) s += f + "\n";
        return s;
    }
};

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
    return a.rows == b.rows && a.cols == b.cols && std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(T)) == 0;
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
