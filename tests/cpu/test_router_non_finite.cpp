// Non-finite router scores (issue 11): a NaN or Inf in the logits (from a NaN weight, an Inf input or an
// overflow) must still give k valid, distinct experts per row, deterministically (NaN ranks last, ties by
// index: core/router_math.h), through top-k, group-limited top-k, Sinkhorn, capacity dropping and the aux
// losses, and through a whole CPU layer forward+backward. On the code before the fix, top-k returned -1
// and the layer wrote out of bounds (double free). Also: the capacity formula saturates (cf 1e19 dropped
// every token) and the finite-check helper. CUDA twin: tests/gpu/test_cuda_router_non_finite.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "core/finite.h"
#include "core/loss_math.h"
#include "core/rng.h"
#include "core/router_math.h"
#include "cpu/router.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::cpu {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Every selected index of every valid row is in [0, E), k per row, distinct; the map has k ones per row.
template <typename T>
void expect_valid_routing(const RouterContext<T>& ctx, int64_t rows, int64_t E, int64_t k) {
    ASSERT_EQ(int64_t(ctx.topk_idx.size()), rows * k);
    for (int64_t t = 0; t < rows; ++t) {
        std::set<int64_t> picked;
        for (int64_t j = 0; j < k; ++j) {
            const int64_t i = ctx.topk_idx[size_t(t * k + j)];
            ASSERT_GE(i, 0) << "row " << t;
            ASSERT_LT(i, E) << "row " << t;
            picked.insert(i);
        }
        EXPECT_EQ(int64_t(picked.size()), k) << "row " << t << ": repeated expert";
    }
}

// A random row with NaNs, +-Inf and duplicates: the order is total (NaNs last by index), so top-E is a
// permutation, finite values descend, and two runs agree.
TEST(RouterNonFinite, TopkOrderIsTotalWithNaNAndInf) {
    const uint64_t seed = 1101;
    std::printf("seed %llu\n", (unsigned long long)seed);
    Rng rng(seed);
    for (int trial = 0; trial < 50; ++trial) {
        const int64_t E = 3 + int64_t(rng.uniform() * 30);
        std::vector<double> s(static_cast<size_t>(E));
        for (auto& v : s) {
            const double u = rng.uniform();
            v = u < 0.2 ? kNaN : u < 0.3 ? kInf : u < 0.4 ? -kInf : u < 0.5 ? 1.0 : rng.normal();
        }
        std::vector<int64_t> idx(static_cast<size_t>(E), -7);
        topk_ordered(s.data(), static_cast<const uint8_t*>(nullptr), E, E, idx.data());
        std::set<int64_t> seen(idx.begin(), idx.end());
        ASSERT_EQ(int64_t(seen.size()), E) << "trial " << trial;
        ASSERT_GE(*seen.begin(), 0);
        ASSERT_LT(*seen.rbegin(), E);
        bool in_nans = false;
        for (int64_t j = 0; j < E; ++j) {
            const double v = s[size_t(idx[size_t(j)])];
            if (std::isnan(v)) {
                if (in_nans) EXPECT_LT(idx[size_t(j - 1)], idx[size_t(j)]) << "NaNs by index";
                in_nans = true;
                continue;
            }
            EXPECT_FALSE(in_nans) << "a number after a NaN at rank " << j;
            if (j > 0) {
                const double prev = s[size_t(idx[size_t(j - 1)])];
                EXPECT_TRUE(prev > v || (prev == v && idx[size_t(j - 1)] < idx[size_t(j)])) << "rank " << j;
            }
        }
    }
}

TEST(RouterNonFinite, AllNaNRowPicksLowestIndices) {
    const std::vector<float> s(6, std::numeric_limits<float>::quiet_NaN());
    int64_t idx[3] = {-7, -7, -7};
    topk_ordered(s.data(), static_cast<const uint8_t*>(nullptr), 6, 3, idx);
    EXPECT_EQ(idx[0], 0);
    EXPECT_EQ(idx[1], 1);
    EXPECT_EQ(idx[2], 2);
}

MoeConfig config_for(int64_t E, int64_t k, const std::string& score) {
    MoeConfig c;
    c.hidden_size = 8;
    c.num_moe_experts = E;
    c.moe_router_topk = k;
    c.moe_router_score_function = score;
    c.moe_router_pre_softmax = k == 1 && score == "softmax";
    return c;
}

// The router on random input [rows, H] with router weight [E, H]; `poison` plants non-finite values.
template <typename T>
RouterContext<T> route_poisoned(const MoeConfig& c, int64_t rows, uint64_t seed,
                                const std::function<void(Matrix<T>& x, Matrix<T>& w)>& poison,
                                const std::vector<double>& bias = {}) {
    const int64_t E = c.num_experts(), H = c.hidden_size;
    Rng rng(seed);
    Matrix<T> w(E, H);
    LayerInput<T> in;
    in.hidden = Matrix<T>(rows, H);
    for (auto& v : w.data) v = T(rng.normal());
    for (auto& v : in.hidden.data) v = T(rng.normal());
    poison(in.hidden, w);
    in.seq_length = rows;
    RouterState state;
    RouterContext<T> ctx;
    router_forward(c, w, bias, in, state, ctx);
    return ctx;
}

TEST(RouterNonFinite, NaNRouterWeightGivesValidDeterministicRouting) {
    const uint64_t seed = 1102;
    std::printf("seed %llu\n", (unsigned long long)seed);
    const int64_t rows = 24, E = 8;
    struct Case {
        const char* name;
        int64_t k;
        std::string score;
        bool groups, bias, capacity, aux, sinkhorn;
    };
    const Case cases[] = {
        {"softmax post", 2, "softmax", false, false, false, true, false},
        {"softmax pre k1", 1, "softmax", false, false, false, true, false},
        {"sigmoid groups bias", 4, "sigmoid", true, true, false, true, false},
        {"sqrtsoftplus capacity", 2, "sqrtsoftplus", false, false, true, true, false},
        {"softmax capacity", 3, "softmax", false, false, true, false, false},
        {"sinkhorn", 2, "softmax", false, false, false, false, true},
    };
    for (const auto& cs : cases) {
        SCOPED_TRACE(cs.name);
        MoeConfig c = config_for(E, cs.k, cs.score);
        if (cs.groups) c.moe_router_num_groups = 4, c.moe_router_group_topk = 2;
        if (cs.bias) c.moe_router_enable_expert_bias = true;
        if (cs.capacity) c.moe_expert_capacity_factor = 1.0;
        if (cs.aux) c.moe_aux_loss_coeff = {1e-2}, c.moe_z_loss_coeff = 1e-3;
        if (cs.sinkhorn) c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
        ASSERT_TRUE(c.validation_errors().empty()) << c.validation_errors()[0];
        const std::vector<double> bias = cs.bias ? std::vector<double>(size_t(E), 0.01) : std::vector<double>{};
        // NaN in row 3 of router.weight: expert 3's logit is NaN for every token; an Inf input on token 5
        // makes its whole logit row non-finite.
        auto poison = [](Matrix<float>& x, Matrix<float>& w) {
            w(3, 1) = std::numeric_limits<float>::quiet_NaN();
            x(5, 2) = std::numeric_limits<float>::infinity();
        };
        const auto a = route_poisoned<float>(c, rows, seed, poison, bias);
        const auto b = route_poisoned<float>(c, rows, seed, poison, bias);
        expect_valid_routing(a, rows, E, cs.k);
        EXPECT_EQ(a.topk_idx, b.topk_idx) << "not deterministic";
        EXPECT_EQ(a.routing_map, b.routing_map);
        EXPECT_EQ(a.non_finite_rows, rows) << "every row has expert 3's NaN logit";
        if (!cs.sinkhorn) {
            // A NaN logit ranks last: expert 3 is never picked while other experts are left.
            for (int64_t t = 0; t < rows; ++t)
                for (int64_t j = 0; j < cs.k; ++j) EXPECT_NE(a.topk_idx[size_t(t * cs.k + j)], 3) << "row " << t;
        }
    }
}

TEST(RouterNonFinite, InfInputWithAuxLossGivesValidRouting) {
    const uint64_t seed = 1103;
    std::printf("seed %llu\n", (unsigned long long)seed);
    MoeConfig c = config_for(6, 2, "softmax");
    c.moe_router_load_balancing_type = {"aux_loss", "seq_aux_loss"};
    c.moe_aux_loss_coeff = {1e-2, 1e-2};
    const auto ctx = route_poisoned<double>(c, 10, seed, [](Matrix<double>& x, Matrix<double>&) {
        for (int64_t h = 0; h < x.cols; ++h) x(4, h) = h % 2 ? kInf : -kInf;
        x(7, 0) = kNaN;
    });
    expect_valid_routing(ctx, 10, 6, 2);
    EXPECT_EQ(ctx.non_finite_rows, 2);
}

// A whole CPU layer forward+backward with a NaN router weight: no out-of-bounds write (the original crash
// was "double free or corruption"; ASan in `make test-asan` sees any stray write), every row routed to k experts.
TEST(RouterNonFinite, LayerWithNaNRouterWeightRunsForwardAndBackward) {
    const uint64_t seed = 1104;
    std::printf("seed %llu\n", (unsigned long long)seed);
    MoeConfig c = config_for(4, 2, "softmax");
    c.moe_ffn_hidden_size = 8;
    c.moe_aux_loss_coeff = {1e-2};
    c.moe_expert_capacity_factor = 1.5;
    MoeWeights<float> w = init_weights<float>(c, seed);
    w.router_weight(0, 0) = std::numeric_limits<float>::quiet_NaN();
    Rng rng(seed);
    LayerInput<float> in;
    in.hidden = Matrix<float>(12, c.hidden_size);
    for (auto& v : in.hidden.data) v = float(rng.normal());
    in.seq_length = 12;
    for (int rep = 0; rep < 2; ++rep) {
        MoeLayer<float> layer(c);
        layer.forward(w, in);
        MoeWeights<float> grads = zeros_like(w);
        layer.backward(w, Matrix<float>(12, c.hidden_size, 1.0f), grads);
        int64_t routed = 0;
        for (uint8_t m : layer.routing_map()) routed += m;
        EXPECT_LE(routed, 12 * 2);
        EXPECT_GT(routed, 0);
    }
}

// cf = 1e19: capacity = ceil(T*k/E * 1e19) is beyond int64; it saturates (no token dropped) instead of
// the undefined cast that wrapped negative and dropped every token with exit 0.
TEST(RouterNonFinite, CapacityFormulaSaturates) {
    EXPECT_EQ(capacity_of(8, 4, 1e19, 0), kCapacitySaturated);
    EXPECT_EQ(capacity_of(8, 4, 1e300, 0), kCapacitySaturated);
    EXPECT_EQ(capacity_of(8, 4, std::numeric_limits<double>::infinity(), 0), kCapacitySaturated);
    EXPECT_EQ(capacity_of(8, 4, 1.5, 0), 3);  // ordinary values unchanged
    EXPECT_EQ(get_capacity(int64_t(1) << 40, 2, 1e10, 0), kCapacitySaturated);

    const uint64_t seed = 1105;
    std::printf("seed %llu\n", (unsigned long long)seed);
    MoeConfig c = config_for(4, 2, "softmax");
    c.moe_expert_capacity_factor = 1e19;
    ASSERT_TRUE(c.validation_errors().empty());
    const auto ctx = route_poisoned<float>(c, 16, seed, [](Matrix<float>&, Matrix<float>&) {});
    int64_t routed = 0;
    for (uint8_t m : ctx.routing_map) routed += m;
    EXPECT_EQ(routed, 16 * 2) << "a huge capacity factor keeps every token";
}

TEST(FirstNonFinite, FindsFirstNaNOrInf) {
    std::vector<float> v(10, 1.0f);
    EXPECT_EQ(first_non_finite(v), -1);
    v[7] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(first_non_finite(v), 7);
    v[3] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(first_non_finite(v), 3);
    EXPECT_EQ(unflatten_index(13, {3, 5}), (std::vector<int64_t>{2, 3}));
}

}  // namespace
}  // namespace moekit::cpu
