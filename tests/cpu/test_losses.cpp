// Router-loss cases L1-L10 of megatron-moe.md §6.2 on the CPU reference (src/cpu/losses.cpp,
// src/cpu/router.cpp, src/cpu/sinkhorn.cpp): exact values, seq/global equalities, gradient
// injection, sharding invariance (L7), padding-mask equivalence (L8, bitwise in fp64), Sinkhorn.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "core/rng.h"
#include "cpu/losses.h"
#include "cpu/router.h"

namespace moekit::cpu {
namespace {

MoeConfig loss_config(int64_t E, int64_t k, std::vector<std::string> types, std::vector<double> coeffs,
                      const std::string& score = "softmax") {
    MoeConfig c;
    c.num_moe_experts = E;
    c.moe_router_topk = k;
    c.moe_router_score_function = score;
    c.moe_router_pre_softmax = score == "softmax" && k == 1;
    c.moe_router_load_balancing_type = std::move(types);
    c.moe_aux_loss_coeff = std::move(coeffs);
    return c;
}

Matrix<double> random_matrix(int64_t rows, int64_t cols, uint64_t seed, double scale = 1.0) {
    Rng rng(seed);
    Matrix<double> m(rows, cols);
    for (auto& v : m.data) v = scale * rng.normal();
    return m;
}

Matrix<double> identity(int64_t n) {
    Matrix<double> m(n, n);
    for (int64_t i = 0; i < n; ++i) m(i, i) = 1;
    return m;
}

struct RouterRun {
    RouterContext<double> ctx;
    Matrix<double> grad_hidden, grad_weight;
};

// Forward, then backward with grad_probs (zeros when empty).
RouterRun run(const MoeConfig& c, const Matrix<double>& w, const Matrix<double>& hidden, RouterState& state,
              int64_t seq_length = 0, int64_t batch = 1, const std::vector<uint8_t>& padding = {},
              const Matrix<double>& grad_probs = {}, const std::vector<double>& bias = {}) {
    LayerInput<double> in;
    in.hidden = hidden;
    in.seq_length = seq_length;
    in.micro_batch_size = batch;
    in.padding_mask = padding;
    RouterRun r;
    router_forward(c, w, bias, in, state, r.ctx);
    const Matrix<double> g = grad_probs.empty() ? Matrix<double>(hidden.rows, c.num_experts()) : grad_probs;
    router_backward(c, w, r.ctx, g, r.grad_hidden, r.grad_weight);
    return r;
}

TEST(Losses, L1AuxExample) {
    const double scores[4] = {0.8, 0.2, 0.6, 0.4};
    EXPECT_DOUBLE_EQ(switch_load_balancing_loss(scores, 2, 2, {2, 0}, 2.0, 1, 2, 1.0), 1.4);
    // Through the router: softmax logits log(s) reproduce the scores.
    Matrix<double> logits(2, 2);
    for (int i = 0; i < 4; ++i) logits.data[size_t(i)] = std::log(scores[i]);
    RouterState st;
    RouterRun r = run(loss_config(2, 1, {"aux_loss"}, {1.0}), identity(2), logits, st);
    EXPECT_NEAR(r.ctx.losses.aux_loss, 1.4, 1e-12);
    EXPECT_EQ(r.ctx.tokens_per_expert, (std::vector<int64_t>{2, 0}));
}

TEST(Losses, L2UniformScoresGiveCoeff) {
    for (const std::string score : {"softmax", "sigmoid", "sqrtsoftplus"})
        for (int64_t k : {1, 2}) {
            MoeConfig c = loss_config(4, k, {"aux_loss", "seq_aux_loss", "global_aux_loss"}, {0.3, 0.2, 0.1}, score);
            RouterState st;
            RouterRun r = run(c, Matrix<double>(4, 6), random_matrix(8, 6, 1), st, 4, 2);  // W = 0: equal logits
            SCOPED_TRACE(score + " k=" + std::to_string(k));
            EXPECT_NEAR(r.ctx.losses.aux_loss, 0.3, 1e-14);
            EXPECT_NEAR(r.ctx.losses.seq_aux_loss, 0.2, 1e-14);
            EXPECT_NEAR(r.ctx.losses.global_aux_loss, 0.1, 1e-14);
        }
}

TEST(Losses, L3SeqAuxB1EqualsAuxBitwise) {
    const Matrix<double> w = random_matrix(4, 5, 2), x = random_matrix(10, 5, 3);
    RouterState s1, s2;
    RouterRun aux = run(loss_config(4, 2, {"aux_loss"}, {0.01}), w, x, s1, 10, 1);
    RouterRun seq = run(loss_config(4, 2, {"seq_aux_loss"}, {0.01}), w, x, s2, 10, 1);
    EXPECT_GT(aux.ctx.losses.aux_loss, 0);
    EXPECT_EQ(aux.ctx.losses.aux_loss, seq.ctx.losses.seq_aux_loss);
    EXPECT_EQ(aux.grad_hidden.data, seq.grad_hidden.data);
    EXPECT_EQ(aux.grad_weight.data, seq.grad_weight.data);
}

TEST(Losses, L3SeqAuxIsMeanOverSequences) {
    const int64_t S = 6, B = 3, E = 4, H = 5;
    const Matrix<double> w = random_matrix(E, H, 4), x = random_matrix(S * B, H, 5, 2.0);
    RouterState st;
    RouterRun seq = run(loss_config(E, 2, {"seq_aux_loss"}, {0.5}), w, x, st, S, B);
    double mean = 0;
    for (int64_t b = 0; b < B; ++b) {
        Matrix<double> xb(S, H);
        for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h) xb(s, h) = x(s * B + b, h);
        RouterState sb;
        mean += run(loss_config(E, 2, {"aux_loss"}, {0.5}), w, xb, sb).ctx.losses.aux_loss / double(B);
    }
    EXPECT_NEAR(seq.ctx.losses.seq_aux_loss, mean, 1e-12 * mean);
    RouterState sa;
    RouterRun concat = run(loss_config(E, 2, {"aux_loss"}, {0.5}), w, x, sa, S, B);
    EXPECT_GT(std::fabs(concat.ctx.losses.aux_loss - seq.ctx.losses.seq_aux_loss), 1e-6);
}

TEST(Losses, L4GlobalAuxTracker) {
    const int64_t T = 12, E = 4, k = 2;
    const Matrix<double> w = random_matrix(E, 6, 6), x = random_matrix(T, 6, 7);
    RouterState sa, sg;
    RouterRun aux = run(loss_config(E, k, {"aux_loss"}, {0.1}), w, x, sa);
    RouterRun g1 = run(loss_config(E, k, {"global_aux_loss"}, {0.1}), w, x, sg);
    EXPECT_EQ(aux.ctx.losses.aux_loss, g1.ctx.losses.global_aux_loss);
    EXPECT_EQ(aux.grad_weight.data, g1.grad_weight.data);
    EXPECT_EQ(aux.grad_hidden.data, g1.grad_hidden.data);
    RouterRun g2 = run(loss_config(E, k, {"global_aux_loss"}, {0.1}), w, random_matrix(T, 6, 8), sg);
    run(loss_config(E, k, {"global_aux_loss"}, {0.1}), w, random_matrix(T, 6, 9), sg);
    EXPECT_EQ(sg.ga_steps, 3);
    EXPECT_EQ(std::accumulate(sg.global_tokens_per_expert.begin(), sg.global_tokens_per_expert.end(), 0.0),
              double(T * k * 3));
    EXPECT_NE(g2.ctx.losses.global_aux_loss, 0);
    // Reset (what MoeLayer::reset_global_aux_loss_tracker does) gives the first micro-batch again.
    std::fill(sg.global_tokens_per_expert.begin(), sg.global_tokens_per_expert.end(), 0.0);
    sg.ga_steps = 0;
    EXPECT_EQ(run(loss_config(E, k, {"global_aux_loss"}, {0.1}), w, x, sg).ctx.losses.global_aux_loss,
              g1.ctx.losses.global_aux_loss);
    // Eval does not touch the tracker.
    LayerInput<double> in;
    in.hidden = x;
    in.training = false;
    RouterContext<double> ctx;
    router_forward(loss_config(E, k, {"global_aux_loss"}, {0.1}), w, {}, in, sg, ctx);
    EXPECT_EQ(sg.ga_steps, 1);
}

TEST(Losses, L5ZLoss) {
    Matrix<double> zero(1, 2), l(2, 4);
    for (int e = 0; e < 4; ++e) l(0, e) = e + 1, l(1, e) = 9;
    EXPECT_NEAR(z_loss(zero, {}, 2.0, nullptr), 0.4804530 * 2, 1e-7);
    EXPECT_NEAR(z_loss(l, {0, 1}, 1.0, nullptr), 19.7152846, 1e-7);  // padded row excluded
    double weight = 0;
    EXPECT_NEAR(z_loss(l, {}, 1e-3, &weight), 1e-3 * (19.7152846 + std::pow(9 + std::log(4.0), 2)) / 2, 1e-9);
    EXPECT_EQ(weight, 1e-3 / 2);
    // Through the router (logits = hidden with W = I).
    MoeConfig c = loss_config(4, 2, {"none"}, {0.0});
    c.moe_z_loss_coeff = 0.5;
    RouterState st;
    EXPECT_NEAR(run(c, identity(4), l, st, 0, 1, {0, 1}).ctx.losses.z_loss, 0.5 * 19.7152846, 1e-7);
}

TEST(Losses, L6InjectionScale) {
    const Matrix<double> w = random_matrix(4, 5, 10), x = random_matrix(8, 5, 11);
    for (bool with_z : {false, true}) {
        MoeConfig c = loss_config(4, 2, {"aux_loss"}, {0.0});
        RouterState st;
        RouterRun none = run(c, w, x, st);
        for (double v : none.grad_weight.data) EXPECT_EQ(v, 0.0);
        if (with_z)
            c.moe_z_loss_coeff = 1e-2;
        else
            c.moe_aux_loss_coeff = {1e-2};
        c.moe_loss_backward_scale = 1.0;
        RouterRun one = run(c, w, x, st);
        c.moe_loss_backward_scale = 0.125;
        RouterRun eighth = run(c, w, x, st);
        double norm = 0;
        for (size_t i = 0; i < one.grad_weight.data.size(); ++i) {
            norm += std::fabs(one.grad_weight.data[i]);
            EXPECT_NEAR(eighth.grad_weight.data[i], 0.125 * one.grad_weight.data[i], 1e-15);
        }
        EXPECT_GT(norm, 1e-6) << "with_z=" << with_z;
    }
}

// L7: aux-loss gradient with the rows split over R ranks (counts all-reduced, local scores, the
// token total T_local * R) equals the unsplit gradient; the per-rank losses sum to the unsplit one.
TEST(Losses, L7ShardingInvariance) {
    const int64_t T = 12, E = 4, k = 2, R = 3, Tl = T / R;
    const double coeff = 0.05;
    for (const std::string name : {"softmax", "sigmoid", "sqrtsoftplus"}) {
        SCOPED_TRACE(name);
        const ScoreFunction f = score_function_from_name(name);
        const Matrix<double> logits = random_matrix(T, E, 12, 2.0);
        auto grad_of = [&](const Matrix<double>& l, const std::vector<double>& tokens, double total, double* loss) {
            Matrix<double> scores;
            std::vector<uint8_t> map;
            aux_scores(l, f, k, {}, scores, map);
            *loss = switch_load_balancing_loss(scores.data.data(), l.rows, E, tokens, total, k, E, coeff);
            Matrix<double> gs(l.rows, E), dl(l.rows, E);
            const double factor = E * coeff / (k * total * total);
            for (int64_t t = 0; t < l.rows; ++t)
                for (int64_t e = 0; e < E; ++e) gs(t, e) = factor * tokens[size_t(e)];
            aux_scores_backward(l, f, gs, {}, dl);
            return dl;
        };
        Matrix<double> scores;
        std::vector<uint8_t> map;
        aux_scores(logits, f, k, {}, scores, map);
        double full_loss = 0;
        const Matrix<double> full = grad_of(logits, column_counts(map, T, E), double(T), &full_loss);
        std::vector<Matrix<double>> parts;
        std::vector<double> tokens(size_t(E), 0.0);
        for (int64_t r = 0; r < R; ++r) {
            Matrix<double> part(Tl, E);
            std::copy_n(logits.row(r * Tl), Tl * E, part.data.begin());
            aux_scores(part, f, k, {}, scores, map);
            const auto local = column_counts(map, Tl, E);
            for (int64_t e = 0; e < E; ++e) tokens[size_t(e)] += local[size_t(e)];  // all-reduce SUM
            parts.push_back(part);
        }
        double sum_loss = 0;
        for (int64_t r = 0; r < R; ++r) {
            double loss = 0;
            const Matrix<double> dl = grad_of(parts[size_t(r)], tokens, double(Tl * R), &loss);
            sum_loss += loss;
            for (int64_t i = 0; i < Tl * E; ++i)
                EXPECT_NEAR(dl.data[size_t(i)], full.data[size_t(r * Tl * E + i)], 1e-15) << "r=" << r << " i=" << i;
        }
        EXPECT_NEAR(sum_loss, full_loss, 1e-14);
        // The router's aux gradient is the same as the assembled pieces (W = I: grad_hidden = dlogits).
        RouterState st;
        RouterRun routed = run(loss_config(E, k, {"aux_loss"}, {coeff}, name), identity(E), logits, st);
        EXPECT_NEAR(routed.ctx.losses.aux_loss, full_loss, 1e-15);
        for (int64_t i = 0; i < T * E; ++i)
            EXPECT_NEAR(routed.grad_hidden.data[size_t(i)], full.data[size_t(i)], 1e-15);
    }
}

// L8: a masked run equals the run on only the valid tokens, bitwise in fp64 (losses, probs,
// routing, counts, grads).
void expect_masked_equals_valid_only(const MoeConfig& c, int64_t S, int64_t B, const std::vector<uint8_t>& pad,
                                     int64_t valid_S, uint64_t seed) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    const int64_t T = S * B, E = c.num_experts(), H = 6;
    const Matrix<double> w = random_matrix(E, H, seed), x = random_matrix(T, H, seed + 1, 1.5);
    const Matrix<double> gp = random_matrix(T, E, seed + 2);
    const std::vector<double> bias = {0.01, -0.02, 0.0, 0.03, 0.0, 0.01, -0.01, 0.02};
    std::vector<int64_t> valid;
    for (int64_t t = 0; t < T; ++t)
        if (!pad[size_t(t)]) valid.push_back(t);
    Matrix<double> xv(int64_t(valid.size()), H), gv(int64_t(valid.size()), E);
    for (size_t i = 0; i < valid.size(); ++i) {
        std::copy_n(x.row(valid[i]), H, xv.row(int64_t(i)));
        std::copy_n(gp.row(valid[i]), E, gv.row(int64_t(i)));
    }
    const std::vector<double> b(bias.begin(), bias.begin() + E);
    RouterState sm, sv;
    for (int step = 0; step < 2; ++step) {  // twice: the global tracker carries over
        RouterRun m = run(c, w, x, sm, S, B, pad, gp, b);
        RouterRun v = run(c, w, xv, sv, valid_S, B, {}, gv, b);
        const LossValues& lm = m.ctx.losses;
        EXPECT_GT(lm.aux_loss + lm.seq_aux_loss + lm.global_aux_loss + lm.z_loss, 0);  // something is checked
        EXPECT_EQ(m.ctx.losses.aux_loss, v.ctx.losses.aux_loss);
        EXPECT_EQ(m.ctx.losses.seq_aux_loss, v.ctx.losses.seq_aux_loss);
        EXPECT_EQ(m.ctx.losses.global_aux_loss, v.ctx.losses.global_aux_loss);
        EXPECT_EQ(m.ctx.losses.z_loss, v.ctx.losses.z_loss);
        EXPECT_EQ(m.ctx.tokens_per_expert, v.ctx.tokens_per_expert);
        EXPECT_EQ(m.grad_weight.data, v.grad_weight.data);
        for (size_t i = 0; i < valid.size(); ++i)
            for (int64_t e = 0; e < E; ++e) {
                EXPECT_EQ(m.ctx.probs(valid[i], e), v.ctx.probs(int64_t(i), e));
                EXPECT_EQ(m.ctx.routing_map[size_t(valid[i] * E + e)], v.ctx.routing_map[i * size_t(E) + size_t(e)]);
            }
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H; ++h) {
                auto it = std::find(valid.begin(), valid.end(), t);
                const double expect = it == valid.end() ? 0.0 : v.grad_hidden(int64_t(it - valid.begin()), h);
                EXPECT_EQ(m.grad_hidden(t, h), expect) << "t=" << t << " h=" << h;
            }
    }
    EXPECT_EQ(sm.global_tokens_per_expert, sv.global_tokens_per_expert);
    EXPECT_EQ(sm.local_tokens_per_expert, sv.local_tokens_per_expert);
}

TEST(Losses, L8PaddingMaskEqualsValidOnly) {
    // Scattered padding, B = 1: aux + global + z-loss, capacity (probs policy), softmax.
    MoeConfig a = loss_config(4, 2, {"aux_loss", "global_aux_loss"}, {0.01, 0.02});
    a.moe_z_loss_coeff = 1e-3;
    a.moe_expert_capacity_factor = 1.0;
    expect_masked_equals_valid_only(a, 12, 1, {0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0}, 0, 21);
    a.moe_pad_expert_input_to_capacity = true;
    a.moe_token_drop_policy = "position";
    expect_masked_equals_valid_only(a, 12, 1, {1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1}, 0, 22);
    // Trailing padding of every sequence (S = 5, 3 valid, B = 2): seq_aux, sigmoid + expert bias.
    MoeConfig s = loss_config(8, 2, {"seq_aux_loss", "aux_loss"}, {0.1, 0.01}, "sigmoid");
    s.moe_router_enable_expert_bias = true;
    s.moe_z_loss_coeff = 1e-2;
    std::vector<uint8_t> trailing(10, 0);
    for (int t = 6; t < 10; ++t) trailing[size_t(t)] = 1;
    expect_masked_equals_valid_only(s, 5, 2, trailing, 3, 23);
    // Sinkhorn selection runs on the valid rows only.
    MoeConfig k = loss_config(4, 2, {"sinkhorn"}, {0.0});
    k.moe_z_loss_coeff = 1e-2;
    expect_masked_equals_valid_only(k, 8, 1, {0, 0, 1, 0, 0, 1, 0, 0}, 0, 24);
}

TEST(Losses, L10Sinkhorn) {
    const int64_t T = 16, E = 4;
    const Matrix<double> logits = random_matrix(T, E, 30, 1.5);
    const Matrix<double> m = sinkhorn(logits);
    for (int64_t e = 0; e < E; ++e) {
        double col = 0;
        for (int64_t t = 0; t < T; ++t) col += m(t, e);
        EXPECT_NEAR(col, 1.0 / E, 5e-8);  // off by (1/E) * 1e-8 / (C^T d0)_e: Megatron's epsilon
    }
    for (int64_t t = 0; t < T; ++t) {
        double row = 0;
        for (int64_t e = 0; e < E; ++e) row += m(t, e);
        EXPECT_NEAR(row, 1.0 / T, 1e-3 / T);  // converged to mean |d1 change| <= 1e-4
    }
    const Matrix<float> mf = sinkhorn(logits.cast<float>());
    for (int64_t k : {1, 2}) {
        MoeConfig c = loss_config(E, k, {"sinkhorn"}, {0.0});
        RouterState st;
        RouterRun r = run(c, identity(E), logits, st);
        for (int64_t t = 0; t < T; ++t) {
            // Chosen experts: the top-k of the (fp32) Sinkhorn matrix.
            std::vector<int64_t> order(static_cast<size_t>(E));
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return mf(t, a) > mf(t, b); });
            double z = 0;
            for (int64_t e = 0; e < E; ++e) z += std::exp(logits(t, e));
            for (int64_t j = 0; j < E; ++j) {
                const int64_t e = order[size_t(j)];
                const bool chosen = j < k;
                EXPECT_EQ(r.ctx.routing_map[size_t(t * E + e)], chosen) << "t=" << t << " e=" << e;
                const double act = k == 1 ? 1 / (1 + std::exp(-logits(t, e))) : std::exp(logits(t, e)) / z;
                EXPECT_NEAR(r.ctx.probs(t, e), chosen ? act : 0.0, 1e-14);
            }
        }
    }
}

}  // namespace
}  // namespace moekit::cpu
