// Finite-difference checks (float64) of the CPU router backward (src/cpu/router.cpp) w.r.t. the
// hidden input and the router weight, for every score function, selection mode, loss type,
// capacity policy, padding, jitter and Sinkhorn. Objective: sum(probs * R) for a fixed random R
// plus moe_loss_backward_scale * (aux + seq_aux + global_aux + z), which is what the injection adds.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/rng.h"
#include "cpu/router.h"

namespace moekit::cpu {
namespace {

struct GradCase {
    std::string name;
    std::function<void(MoeConfig&)> setup;
    int64_t E = 4, k = 2, S = 6, B = 1;
    bool padding = false, bias = false, prior_tracker = false;
};

void PrintTo(const GradCase& gc, std::ostream* os) { *os << gc.name; }

Matrix<double> random_matrix(int64_t rows, int64_t cols, Rng& rng, double scale) {
    Matrix<double> m(rows, cols);
    for (auto& v : m.data) v = scale * rng.normal();
    return m;
}

struct Eval {
    double objective = 0;
    RouterContext<double> ctx;
};

Eval evaluate(const MoeConfig& c, const Matrix<double>& w, const LayerInput<double>& in,
              const std::vector<double>& bias, const RouterState& state0, const Matrix<double>& R) {
    RouterState state = state0;  // the global tracker must start from the same point every time
    Eval ev;
    router_forward(c, w, bias, in, state, ev.ctx);
    for (int64_t i = 0; i < R.size(); ++i) ev.objective += ev.ctx.probs.data[size_t(i)] * R.data[size_t(i)];
    const LossValues& l = ev.ctx.losses;
    ev.objective += c.moe_loss_backward_scale * (l.aux_loss + l.seq_aux_loss + l.global_aux_loss + l.z_loss);
    return ev;
}

void run_gradcheck(const GradCase& gc, bool main_term, uint64_t seed) {
    SCOPED_TRACE(gc.name + (main_term ? "" : " (losses only)") + " seed=" + std::to_string(seed));
    const int64_t T = gc.S * gc.B, H = 5, E = gc.E;
    MoeConfig c;
    c.num_moe_experts = E;
    c.moe_router_topk = gc.k;
    c.moe_aux_loss_coeff = {0.0};
    c.moe_loss_backward_scale = 0.7;  // d total / d loss = 0.7, not 1, so the scale is checked too
    gc.setup(c);
    Rng rng(seed);
    const Matrix<double> w0 = random_matrix(E, H, rng, 0.7);
    LayerInput<double> in;
    in.hidden = random_matrix(T, H, rng, 1.0);
    in.seq_length = gc.S;
    in.micro_batch_size = gc.B;
    in.jitter_seed = seed;
    if (gc.padding) {
        in.padding_mask.assign(size_t(T), 0);
        in.padding_mask[1] = in.padding_mask[size_t(T - 2)] = 1;
    }
    const Matrix<double> R = main_term ? random_matrix(T, E, rng, 1.0) : Matrix<double>(T, E);
    std::vector<double> bias;
    if (gc.bias)
        for (int64_t e = 0; e < E; ++e) bias.push_back(0.2 * rng.normal());
    RouterState state0;
    if (gc.prior_tracker) {  // an earlier micro-batch in the global batch
        LayerInput<double> prior = in;
        prior.hidden = random_matrix(T, H, rng, 1.0);
        RouterContext<double> ignored;
        router_forward(c, w0, bias, prior, state0, ignored);
    }

    const Eval base = evaluate(c, w0, in, bias, state0, R);
    Matrix<double> grad_hidden, grad_weight;
    router_backward(c, w0, base.ctx, R, grad_hidden, grad_weight);

    const double eps = 1e-6;
    double max_grad = 0;
    // Central differences: truncation ~eps^2, rounding ~1e-16 |J| / eps ~ 1e-9; 1e-7 + 1e-6 relative.
    auto check = [&](double analytic, const std::function<double(double)>& eval_at, const char* what, int64_t i) {
        const double fd = (eval_at(eps) - eval_at(-eps)) / (2 * eps);
        max_grad = std::max(max_grad, std::fabs(analytic));
        EXPECT_NEAR(analytic, fd, 1e-7 + 1e-6 * std::fabs(fd)) << what << " element " << i;
    };
    auto same_selection = [&](const Eval& ev) {
        return ev.ctx.routing_map == base.ctx.routing_map && ev.ctx.topk_idx == base.ctx.topk_idx;
    };
    for (int64_t i = 0; i < in.hidden.size(); ++i)
        check(
            grad_hidden.data[size_t(i)],
            [&](double d) {
                LayerInput<double> p = in;
                p.hidden.data[size_t(i)] += d;
                Eval ev = evaluate(c, w0, p, bias, state0, R);
                EXPECT_TRUE(same_selection(ev)) << "selection changed under the FD step; pick another seed";
                return ev.objective;
            },
            "hidden", i);
    for (int64_t i = 0; i < w0.size(); ++i)
        check(
            grad_weight.data[size_t(i)],
            [&](double d) {
                Matrix<double> w = w0;
                w.data[size_t(i)] += d;
                Eval ev = evaluate(c, w, in, bias, state0, R);
                EXPECT_TRUE(same_selection(ev)) << "selection changed under the FD step; pick another seed";
                return ev.objective;
            },
            "router weight", i);
    EXPECT_GT(max_grad, 1e-4);  // the check compared something non-trivial
}

std::vector<GradCase> cases() {
    auto types = [](std::vector<std::string> t, std::vector<double> coeffs) {
        return [=](MoeConfig& c) {
            c.moe_router_load_balancing_type = t;
            c.moe_aux_loss_coeff = coeffs;
        };
    };
    std::vector<GradCase> v;
    v.push_back({"softmax post", [](MoeConfig&) {}});
    v.push_back({"softmax pre", [](MoeConfig& c) { c.moe_router_pre_softmax = true; }});
    v.push_back({"softmax pre k=1", [](MoeConfig& c) { c.moe_router_pre_softmax = true; }, 4, 1});
    v.push_back({"sigmoid", [](MoeConfig& c) { c.moe_router_score_function = "sigmoid"; }});
    v.push_back({"sqrtsoftplus", [](MoeConfig& c) { c.moe_router_score_function = "sqrtsoftplus"; }});
    v.push_back({"sigmoid k=1", [](MoeConfig& c) { c.moe_router_score_function = "sigmoid"; }, 4, 1});
    v.push_back({"sqrtsoftplus k=3", [](MoeConfig& c) { c.moe_router_score_function = "sqrtsoftplus"; }, 6, 3});
    v.push_back({"group-limited sigmoid",
                 [](MoeConfig& c) {
                     c.moe_router_score_function = "sigmoid";
                     c.moe_router_num_groups = 4;
                     c.moe_router_group_topk = 2;
                 },
                 8, 2});
    v.push_back({"group-limited softmax pre",
                 [](MoeConfig& c) {
                     c.moe_router_pre_softmax = true;
                     c.moe_router_num_groups = 4;
                     c.moe_router_group_topk = 2;
                 },
                 8, 4});
    GradCase bias{"expert bias",
                  [](MoeConfig& c) {
                      c.moe_router_score_function = "sigmoid";
                      c.moe_router_enable_expert_bias = true;
                  },
                  6, 2};
    bias.bias = true;
    v.push_back(bias);
    v.push_back({"scaling factor sigmoid", [](MoeConfig& c) {
                     c.moe_router_score_function = "sigmoid";
                     c.moe_router_topk_scaling_factor = 2.5;
                 }});
    v.push_back({"scaling factor softmax", [](MoeConfig& c) { c.moe_router_topk_scaling_factor = 1.5; }});
    v.push_back({"aux_loss", types({"aux_loss"}, {0.3})});
    v.push_back({"seq_aux_loss", types({"seq_aux_loss"}, {0.3}), 4, 2, 3, 2});
    GradCase global{"global_aux_loss", types({"global_aux_loss"}, {0.3})};
    global.prior_tracker = true;
    v.push_back(global);
    for (const std::string score : {"softmax", "sigmoid", "sqrtsoftplus"}) {
        GradCase all{"all losses " + score,
                     [=](MoeConfig& c) {
                         c.moe_router_score_function = score;
                         c.moe_router_load_balancing_type = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
                         c.moe_aux_loss_coeff = {0.2, 0.3, 0.1};
                         c.moe_z_loss_coeff = 0.05;
                     },
                     4,
                     2,
                     3,
                     2};
        all.prior_tracker = true;
        v.push_back(all);
    }
    v.push_back({"z-loss", [](MoeConfig& c) { c.moe_z_loss_coeff = 0.1; }});
    v.push_back({"capacity probs", [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.5; }, 4, 2, 8});
    v.push_back({"capacity position",
                 [](MoeConfig& c) {
                     c.moe_expert_capacity_factor = 0.5;
                     c.moe_token_drop_policy = "position";
                 },
                 4, 2, 8});
    v.push_back({"capacity pad",
                 [](MoeConfig& c) {
                     c.moe_expert_capacity_factor = 1.0;
                     c.moe_pad_expert_input_to_capacity = true;
                 },
                 4, 2, 8});
    GradCase pad{"padding mask",
                 [](MoeConfig& c) {
                     c.moe_router_load_balancing_type = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
                     c.moe_aux_loss_coeff = {0.2, 0.3, 0.1};
                     c.moe_z_loss_coeff = 0.05;
                     c.moe_expert_capacity_factor = 1.0;
                 },
                 4,
                 2,
                 4,
                 2};
    pad.padding = true;
    v.push_back(pad);
    v.push_back({"jitter", [](MoeConfig& c) {
                     c.moe_input_jitter_eps = 0.1;
                     c.moe_aux_loss_coeff = {0.3};
                     c.moe_z_loss_coeff = 0.05;
                 }});
    v.push_back({"sinkhorn k=1", [](MoeConfig& c) { c.moe_router_load_balancing_type = {"sinkhorn"}; }, 4, 1});
    v.push_back({"sinkhorn k=2", [](MoeConfig& c) {
                     c.moe_router_load_balancing_type = {"sinkhorn"};
                     c.moe_z_loss_coeff = 0.05;
                 }});
    return v;
}

class RouterGradcheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(RouterGradcheck, MatchesFiniteDifferences) {
    const GradCase& gc = GetParam();
    run_gradcheck(gc, true, 1000 + uint64_t(gc.name.size()));
    const bool has_losses =
        gc.name.find("loss") != std::string::npos || gc.name == "jitter" || gc.name == "padding mask";
    if (has_losses) run_gradcheck(gc, false, 2000 + uint64_t(gc.name.size()));
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterGradcheck, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<GradCase>& info) {
                             std::string n = info.param.name;
                             for (char& ch : n)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return n;
                         });

}  // namespace
}  // namespace moekit::cpu
