// The expert-parallel equivalence harness, shared by the MPI test (tests/mpi/test_ep_mpi.cpp) and
// the virtual-rank test (tests/cpu/test_ep_virtual.cpp): random layer configurations (seeded,
// printed), a global batch [S, N*B, H] split into N micro-batches along B, one rank's run of the
// pipeline at a given EP, the independent one-rank runs, and the Verdict that collects mismatches.
// The checks themselves: tests/ep_checks.h.
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
// After a rank's forward and backward: gradients reduced as Megatron does, the router's results, and the
// expert bias after one update (shared by every multi-rank run of the tests).
template <typename T>
void finish_rank_run(cpu::MoePipeline<T>& layer, const EpInputs<T>& in, RankRun<T>& run) {
    layer.reduce_gradients(run.grads);
    run.probs = layer.probs();
    run.routing_map = layer.routing_map();
    run.losses = layer.summary().losses;
    MoeWeights<T> w = in.weights;
    layer.update_expert_bias(w);
    run.expert_bias = w.expert_bias;
}

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
    finish_rank_run(layer, in, run);
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

}  // namespace moekit::test
