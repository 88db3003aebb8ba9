// Router forward cases of megatron-moe.md §6.2 on the CPU reference (src/cpu/router.cpp):
// R1-R6 exact values, R7 invariants on random logits, C1/C2 capacity and dropping, expert-bias
// counts, eval mode, jitter and the row tie-break. Gradients: test_router_gradcheck.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "core/rng.h"
#include "core/router_math.h"
#include "cpu/router.h"

namespace moekit::cpu {
namespace {

MoeConfig base_config(int64_t E, int64_t k, const std::string& score = "softmax") {
    MoeConfig c;
    c.num_moe_experts = E;
    c.moe_router_topk = k;
    c.moe_router_score_function = score;
    return c;
}

// Runs the router on the given logits: hidden = logits and W = identity, so x.W^T = logits exactly.
template <typename T>
RouterContext<T> route(const MoeConfig& cfg, const std::vector<std::vector<double>>& logits,
                       const std::vector<double>& bias = {}, RouterState* state = nullptr, bool training = true,
                       const std::vector<uint8_t>& padding = {}) {
    const int64_t E = cfg.num_experts(), rows = int64_t(logits.size());
    Matrix<T> w(E, E);
    for (int64_t e = 0; e < E; ++e) w(e, e) = T(1);
    LayerInput<T> in;
    in.hidden = Matrix<T>(rows, E);
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t e = 0; e < E; ++e) in.hidden(t, e) = T(logits[size_t(t)][size_t(e)]);
    in.seq_length = rows;
    in.training = training;
    in.padding_mask = padding;
    RouterState local;
    RouterContext<T> ctx;
    router_forward(cfg, w, bias, in, state ? *state : local, ctx);
    return ctx;
}

std::vector<std::vector<double>> random_logits(int64_t rows, int64_t E, uint64_t seed, double scale = 2.0) {
    Rng rng(seed);
    std::vector<std::vector<double>> l(static_cast<size_t>(rows), std::vector<double>(static_cast<size_t>(E)));
    for (auto& row : l)
        for (auto& v : row) v = scale * rng.normal();
    return l;
}

// Expected single-row probs, float tolerance 1e-6 relative (the §6.2 values have 7-8 digits).
template <typename T>
void expect_row(const RouterContext<T>& ctx, const std::vector<double>& probs, const std::vector<int>& map) {
    for (size_t e = 0; e < probs.size(); ++e) {
        EXPECT_NEAR(double(ctx.probs(0, int64_t(e))), probs[e], 1e-6 * std::max(1.0, std::fabs(probs[e]))) << "e=" << e;
        EXPECT_EQ(int(ctx.routing_map[e]), map[e]) << "e=" << e;
    }
}

template <typename T>
class RouterValues : public ::testing::Test {};
using Precisions = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RouterValues, Precisions);

TYPED_TEST(RouterValues, R1SoftmaxPost) {
    auto ctx = route<TypeParam>(base_config(4, 2), {{1, 2, 3, 4}});
    expect_row(ctx, {0, 0, 0.26894142, 0.73105858}, {0, 0, 1, 1});
    EXPECT_NEAR(double(ctx.probs(0, 2) + ctx.probs(0, 3)), 1.0, 1e-6);
    EXPECT_EQ(ctx.tokens_per_expert, (std::vector<int64_t>{0, 0, 1, 1}));
}

TYPED_TEST(RouterValues, R2SoftmaxPre) {
    MoeConfig c = base_config(4, 2);
    c.moe_router_pre_softmax = true;
    auto ctx = route<TypeParam>(c, {{1, 2, 3, 4}});
    expect_row(ctx, {0, 0, 0.2368828, 0.6439143}, {0, 0, 1, 1});
    EXPECT_NEAR(double(ctx.probs(0, 2) + ctx.probs(0, 3)), 0.8807971, 1e-6);
}

TYPED_TEST(RouterValues, R3SigmoidAndScaling) {
    MoeConfig c = base_config(4, 2, "sigmoid");
    expect_row(route<TypeParam>(c, {{1, 2, 3, 4}}), {0, 0, 0.4923912, 0.5076088}, {0, 0, 1, 1});
    c.moe_router_topk_scaling_factor = 2.5;
    expect_row(route<TypeParam>(c, {{1, 2, 3, 4}}), {0, 0, 1.2309781, 1.2690219}, {0, 0, 1, 1});
}

TYPED_TEST(RouterValues, R4SigmoidExpertBias) {
    MoeConfig c = base_config(4, 2, "sigmoid");
    c.moe_router_enable_expert_bias = true;
    auto ctx = route<TypeParam>(c, {{1, 2, 3, 4}}, {0, 1, 0, 0});
    expect_row(ctx, {0, 0.4728323, 0, 0.5271677}, {0, 1, 0, 1});
}

TYPED_TEST(RouterValues, R5SigmoidTop1Unnormalised) {
    auto ctx = route<TypeParam>(base_config(4, 1, "sigmoid"), {{1, 2, 3, 4}});
    expect_row(ctx, {0, 0, 0, 0.9820138}, {0, 0, 0, 1});
}

TYPED_TEST(RouterValues, R6GroupLimited) {
    MoeConfig c = base_config(4, 2, "sigmoid");
    c.moe_router_num_groups = 2;
    c.moe_router_group_topk = 1;
    expect_row(route<TypeParam>(c, {{5, 0, 4, 3.9}}), {0, 0, 0.5004725, 0.4995275}, {0, 0, 1, 1});
    // The group scores themselves (sum of the top k/group_topk = 2 sigmoid scores per group).
    const double l[4] = {5, 0, 4, 3.9};
    double s[4], g[2];
    uint8_t allowed[4];
    for (int e = 0; e < 4; ++e) s[e] = score_sigmoid(l[e]);
    group_limited_allowed(s, 4, 2, 1, 2, g, allowed);
    EXPECT_NEAR(g[0], 1.4933071, 1e-7);
    EXPECT_NEAR(g[1], 1.9621735, 1e-7);
    // Without groups top-2 is {0, 2}.
    expect_row(route<TypeParam>(base_config(4, 2, "sigmoid"), {{5, 0, 4, 3.9}}),
               {s[0] / (s[0] + s[2]), 0, s[2] / (s[0] + s[2]), 0}, {1, 0, 1, 0});
}

TEST(Router, SqrtSoftplusNormalisedOverK) {
    auto ctx = route<double>(base_config(4, 2, "sqrtsoftplus"), {{1, 2, 3, 4}});
    const double a = std::sqrt(std::log1p(std::exp(3.0))), b = std::sqrt(std::log1p(std::exp(4.0)));
    expect_row(ctx, {0, 0, a / (a + b), b / (a + b)}, {0, 0, 1, 1});
}

// The GPU top-k's integer key orders entries exactly as value_ranks_before: larger value first, -0 tied with +0,
// NaN after -inf, ties by index; above 0 (no entry) for every value.
TEST(Router, TopkOrderKeyMatchesValueOrder) {
    std::vector<float> vals = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-40f, -1e-40f,
                               3.4e38f, -3.4e38f, 1.17549435e-38f, 0.5f, -0.5f};
    Rng rng(17);
    for (int i = 0; i < 200; ++i)  // magnitudes from 1e-4 to 1e4, both signs
        vals.push_back(float((rng.uniform() - 0.5) * std::pow(10.0, 8.0 * (rng.uniform() - 0.5))));
    for (size_t a = 0; a < vals.size(); ++a) {
        ASSERT_GT(topk_order_key(vals[a]), 0u) << vals[a];
        for (size_t b = 0; b < vals.size(); ++b)
            for (int i : {3, 5})
                for (int j : {3, 5}) {
                    const uint32_t ka = topk_order_key(vals[a]), kb = topk_order_key(vals[b]);
                    const bool by_key = ka > kb || (ka == kb && i < j);
                    ASSERT_EQ(by_key, value_ranks_before(vals[a], i, vals[b], j))
                        << vals[a] << "@" << i << " vs " << vals[b] << "@" << j;
                }
    }
}

TEST(Router, TieBreakLowerExpertFirst) {
    auto ctx = route<double>(base_config(4, 2, "sigmoid"), {{1, 3, 3, 3}});
    EXPECT_EQ(ctx.routing_map, (std::vector<uint8_t>{0, 1, 1, 0}));
    EXPECT_EQ(ctx.topk_idx, (std::vector<int64_t>{1, 2}));
}

// R7: invariants over random logits (T=64, E=8) for every score-function variant and k.
TEST(Router, R7RandomInvariants) {
    const int64_t T = 64, E = 8;
    struct Variant {
        std::string score;
        bool pre;
        double scaling;
        int64_t groups, group_topk;
    };
    const std::vector<Variant> variants = {{"softmax", false, 0, 0, 0},   {"softmax", true, 0, 0, 0},
                                           {"sigmoid", false, 0, 0, 0},   {"sqrtsoftplus", false, 0, 0, 0},
                                           {"softmax", false, 2.5, 0, 0}, {"sigmoid", false, 2.5, 0, 0},
                                           {"sigmoid", false, 0, 4, 2},   {"softmax", true, 0, 4, 1}};
    uint64_t seed = 7;
    for (const Variant& v : variants)
        for (int64_t k : {1, 2, 8}) {
            if (v.score == "softmax" && !v.pre && k == 1) continue;  // a config error upstream (R7)
            if (v.groups && k > v.group_topk * (E / v.groups)) continue;
            MoeConfig c = base_config(E, k, v.score);
            c.moe_router_pre_softmax = v.pre;
            if (v.scaling) c.moe_router_topk_scaling_factor = v.scaling;
            if (v.groups) c.moe_router_num_groups = v.groups, c.moe_router_group_topk = v.group_topk;
            const auto logits = random_logits(T, E, ++seed);
            auto ctx = route<float>(c, logits);
            SCOPED_TRACE(v.score + (v.pre ? " pre" : "") + " k=" + std::to_string(k) + " seed=" + std::to_string(seed));
            int64_t total = 0;
            for (int64_t t = 0; t < T; ++t) {
                int64_t n = 0;
                double sum = 0;
                std::vector<int> groups_touched(static_cast<size_t>(std::max<int64_t>(1, v.groups)), 0);
                for (int64_t e = 0; e < E; ++e) {
                    const bool on = ctx.routing_map[size_t(t * E + e)];
                    n += on;
                    sum += ctx.probs(t, e);
                    ASSERT_EQ(on, ctx.probs(t, e) > 0) << "t=" << t << " e=" << e;
                    if (on && v.groups) groups_touched[size_t(e / (E / v.groups))] = 1;
                }
                ASSERT_EQ(n, k) << "t=" << t;
                total += n;
                const double target = v.scaling ? v.scaling : 1.0;
                if ((v.score == "softmax" && !v.pre) || (v.score != "softmax" && k > 1))
                    EXPECT_NEAR(sum, target, 1e-5 * target) << "t=" << t;  // fp32 row sum
                if (v.score == "softmax" && v.pre && k < E) EXPECT_LT(sum, 1.0) << "t=" << t;
                if (v.groups) EXPECT_LE(std::accumulate(groups_touched.begin(), groups_touched.end(), 0), v.group_topk);
            }
            EXPECT_EQ(total, T * k);
            EXPECT_EQ(std::accumulate(ctx.tokens_per_expert.begin(), ctx.tokens_per_expert.end(), int64_t(0)), T * k);
        }
}

TEST(Router, FloatAndDoubleAgree) {
    MoeConfig c = base_config(8, 2, "sigmoid");
    const auto logits = random_logits(32, 8, 99);
    auto f = route<float>(c, logits);
    auto d = route<double>(c, logits);
    EXPECT_EQ(f.routing_map, d.routing_map);
    for (int64_t i = 0; i < f.probs.size(); ++i) EXPECT_NEAR(f.probs.data[size_t(i)], d.probs.data[size_t(i)], 1e-6);
}

// The float reference follows the double one (gating linear and router backward included).
TEST(Router, FloatBackwardFollowsDouble) {
    MoeConfig c = base_config(8, 2, "sigmoid");
    c.moe_aux_loss_coeff = {0.1};
    c.moe_z_loss_coeff = 1e-2;
    Rng rng(17);
    Matrix<double> w(8, 16), x(32, 16), gp(32, 8);
    for (auto* m : {&w, &x, &gp})
        for (auto& v : m->data) v = rng.normal();
    LayerInput<double> in;
    in.hidden = x;
    LayerInput<float> inf;
    inf.hidden = x.cast<float>();
    RouterState sd, sf;
    RouterContext<double> cd;
    RouterContext<float> cf;
    router_forward(c, w, {}, in, sd, cd);
    router_forward(c, w.cast<float>(), {}, inf, sf, cf);
    ASSERT_EQ(cd.routing_map, cf.routing_map);
    Matrix<double> gxd, gwd;
    Matrix<float> gxf, gwf;
    router_backward(c, w, cd, gp, gxd, gwd);
    router_backward(c, w.cast<float>(), cf, gp.cast<float>(), gxf, gwf);
    // fp32 rounding of O(1) values through a few ops: 1e-5 relative to the largest gradient.
    double scale = 0;
    for (double v : gwd.data) scale = std::max(scale, std::fabs(v));
    for (int64_t i = 0; i < gwd.size(); ++i) EXPECT_NEAR(gwf.data[size_t(i)], gwd.data[size_t(i)], 1e-5 * scale);
    for (int64_t i = 0; i < gxd.size(); ++i) EXPECT_NEAR(gxf.data[size_t(i)], gxd.data[size_t(i)], 1e-5 * scale);
    EXPECT_NEAR(cf.losses.aux_loss, cd.losses.aux_loss, 1e-6 * cd.losses.aux_loss);
    EXPECT_NEAR(cf.losses.z_loss, cd.losses.z_loss, 1e-6 * cd.losses.z_loss);
}

TEST(Capacity, C1GetCapacity) {
    EXPECT_EQ(get_capacity(16, 4, 1.0), 4);
    EXPECT_EQ(get_capacity(16, 4, 0.5), 2);
    EXPECT_EQ(get_capacity(16, 4, 1.1), 5);
    EXPECT_EQ(get_capacity(16, 4, 0.5, 3), 3);  // min_capacity
}

// C2: T=32, E=4, k=2 with every policy and pad setting.
TEST(Capacity, C2Dropping) {
    const int64_t T = 32, E = 4, k = 2;
    const auto logits = random_logits(T, E, 2024);
    auto count = [](const RouterContext<double>& ctx) {
        return std::accumulate(ctx.routing_map.begin(), ctx.routing_map.end(), int64_t(0));
    };
    MoeConfig c = base_config(E, k);
    const auto dropless = route<double>(c, logits);
    EXPECT_EQ(count(dropless), 64);
    for (const std::string policy : {"probs", "position"}) {
        SCOPED_TRACE(policy);
        c.moe_token_drop_policy = policy;
        c.moe_expert_capacity_factor = 1.0;
        c.moe_pad_expert_input_to_capacity = true;
        auto pad = route<double>(c, logits);
        EXPECT_EQ(pad.capacity, 16);
        for (int64_t e = 0; e < E; ++e) EXPECT_EQ(pad.tokens_per_expert[size_t(e)], 16);
        c.moe_pad_expert_input_to_capacity = false;
        auto drop = route<double>(c, logits);
        for (int64_t e = 0; e < E; ++e) {
            EXPECT_EQ(drop.tokens_per_expert[size_t(e)], std::min<int64_t>(16, dropless.tokens_per_expert[size_t(e)]));
            // Kept entries: the largest probs (policy probs) or the lowest token indices (position).
            double min_kept = 1e9, max_dropped = -1;
            int64_t last_kept = -1, first_dropped = T;
            for (int64_t t = 0; t < T; ++t) {
                const size_t i = size_t(t * E + e);
                if (!dropless.routing_map[i]) continue;
                EXPECT_EQ(bool(pad.routing_map[i]), bool(drop.routing_map[i]));  // pad keeps the same routed rows
                if (drop.routing_map[i]) {
                    min_kept = std::min(min_kept, drop.probs(t, e));
                    last_kept = t;
                    EXPECT_EQ(drop.probs(t, e), dropless.probs(t, e));  // not renormalised
                } else {
                    max_dropped = std::max(max_dropped, dropless.probs(t, e));
                    first_dropped = std::min(first_dropped, t);
                    EXPECT_EQ(drop.probs(t, e), 0.0);
                }
            }
            if (policy == "probs") EXPECT_GE(min_kept, max_dropped);
            if (policy == "position") EXPECT_LT(last_kept, first_dropped);
        }
        // Pad rows that are not routed carry prob 0.
        for (int64_t i = 0; i < T * E; ++i)
            if (pad.routing_map[size_t(i)] && !dropless.routing_map[size_t(i)])
                EXPECT_EQ(pad.probs.data[size_t(i)], 0.0);
        c.moe_expert_capacity_factor = 2.0;
        c.moe_pad_expert_input_to_capacity = true;
        auto all = route<double>(c, logits);
        EXPECT_EQ(all.capacity, 32);
        EXPECT_EQ(count(all), 128);
    }
    // Some expert must actually be over-subscribed for the cf=1 checks to mean anything.
    EXPECT_GT(*std::max_element(dropless.tokens_per_expert.begin(), dropless.tokens_per_expert.end()), 16);
}

TEST(Capacity, CountsValidTokensOnly) {
    MoeConfig c = base_config(4, 2);
    c.moe_expert_capacity_factor = 1.0;
    c.moe_pad_expert_input_to_capacity = true;
    std::vector<uint8_t> pad(32, 0);
    for (int t = 24; t < 32; ++t) pad[size_t(t)] = 1;
    auto ctx = route<double>(c, random_logits(32, 4, 5), {}, nullptr, true, pad);
    EXPECT_EQ(ctx.capacity, 12);  // get_capacity(24 * 2, 4, 1)
    for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(ctx.tokens_per_expert[size_t(e)], 12);
    for (int t = 24; t < 32; ++t)
        for (int e = 0; e < 4; ++e) EXPECT_EQ(ctx.routing_map[size_t(t * 4 + e)], 0);
}

TEST(ExpertBias, CountsPostDropValidOnlyAndTrainingOnly) {
    MoeConfig c = base_config(4, 2, "sigmoid");
    c.moe_router_enable_expert_bias = true;
    const std::vector<double> bias = {0, 0, 0, 0};
    std::vector<uint8_t> pad(16, 0);
    pad[3] = pad[7] = pad[15] = 1;
    RouterState st;
    const auto logits = random_logits(16, 4, 11);
    auto ctx = route<double>(c, logits, bias, &st, true, pad);
    EXPECT_EQ(std::accumulate(st.local_tokens_per_expert.begin(), st.local_tokens_per_expert.end(), 0.0), 13 * 2);
    for (int64_t e = 0; e < 4; ++e)
        EXPECT_EQ(st.local_tokens_per_expert[size_t(e)], double(ctx.tokens_per_expert[size_t(e)]));
    route<double>(c, logits, bias, &st, false, pad);  // eval: no counts
    EXPECT_EQ(std::accumulate(st.local_tokens_per_expert.begin(), st.local_tokens_per_expert.end(), 0.0), 26);
    c.moe_expert_capacity_factor = 0.5;  // post-drop counts
    RouterState st2;
    auto dropped = route<double>(c, logits, bias, &st2, true, pad);
    for (int64_t e = 0; e < 4; ++e) {
        EXPECT_EQ(st2.local_tokens_per_expert[size_t(e)], double(dropped.tokens_per_expert[size_t(e)]));
        EXPECT_LE(dropped.tokens_per_expert[size_t(e)], dropped.capacity);
    }
}

TEST(ExpertBias, L9Update) {
    std::vector<double> bias = {0.5, 0, 0, 0}, counts = {10, 2, 4, 8};
    update_expert_bias(1e-3, bias, counts);
    EXPECT_DOUBLE_EQ(bias[0], 0.5 - 1e-3);
    EXPECT_DOUBLE_EQ(bias[1], 1e-3);
    EXPECT_DOUBLE_EQ(bias[2], 1e-3);
    EXPECT_DOUBLE_EQ(bias[3], -1e-3);
    EXPECT_EQ(counts, (std::vector<double>{0, 0, 0, 0}));
    std::vector<double> b2 = {1, 2}, equal = {5, 5};
    update_expert_bias(1e-3, b2, equal);
    EXPECT_EQ(b2, (std::vector<double>{1, 2}));
    std::vector<double> b3 = {0, 0, 0}, mid = {1, 2, 3};  // the count equal to the mean gets 0
    update_expert_bias(0.1, b3, mid);
    EXPECT_EQ(b3, (std::vector<double>{0.1, 0, -0.1}));
}

TEST(Router, PaddingRowsEmptyAndEvalHasNoLosses) {
    MoeConfig c = base_config(4, 2);
    c.moe_aux_loss_coeff = {0.1};
    c.moe_z_loss_coeff = 1e-3;
    std::vector<uint8_t> pad = {0, 1, 0, 1};
    auto ctx = route<double>(c, random_logits(4, 4, 3), {}, nullptr, true, pad);
    for (int e = 0; e < 4; ++e) {
        EXPECT_EQ(ctx.routing_map[size_t(4 + e)], 0);
        EXPECT_EQ(ctx.probs(1, e), 0.0);
        EXPECT_EQ(ctx.probs(3, e), 0.0);
    }
    EXPECT_GT(ctx.losses.aux_loss, 0);
    EXPECT_GT(ctx.losses.z_loss, 0);
    auto eval = route<double>(c, random_logits(4, 4, 3), {}, nullptr, false, pad);
    EXPECT_EQ(eval.losses.aux_loss, 0);
    EXPECT_EQ(eval.losses.z_loss, 0);
    EXPECT_TRUE(eval.aux_score_grad.empty());
    EXPECT_EQ(eval.routing_map, ctx.routing_map);
}

TEST(Router, JitterIsSeededAndBounded) {
    MoeConfig c = base_config(4, 2);
    c.moe_input_jitter_eps = 0.1;
    Matrix<double> w(4, 3);
    Rng rng(1);
    for (auto& v : w.data) v = rng.normal();
    LayerInput<double> in;
    in.hidden = Matrix<double>(5, 3, 1.0);
    in.jitter_seed = 42;
    RouterState st;
    RouterContext<double> a, b, other;
    router_forward(c, w, {}, in, st, a);
    router_forward(c, w, {}, in, st, b);
    in.jitter_seed = 43;
    router_forward(c, w, {}, in, st, other);
    EXPECT_EQ(a.jitter.data, b.jitter.data);
    EXPECT_NE(a.jitter.data, other.jitter.data);
    double lo = 2, hi = 0;
    for (double u : a.jitter.data) lo = std::min(lo, u), hi = std::max(hi, u);
    EXPECT_GE(lo, 0.9);
    EXPECT_LT(hi, 1.1);
    EXPECT_GT(hi - lo, 0.05);  // 15 draws spread over the interval
    for (int64_t i = 0; i < in.hidden.size(); ++i) EXPECT_EQ(a.router_input.data[size_t(i)], a.jitter.data[size_t(i)]);
}

}  // namespace
}  // namespace moekit::cpu
