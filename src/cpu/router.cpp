// CPU reference router (Megatron TopKRouter, §1.2, §2, §3): jitter, gating linear, score function
// + top-k / group-limited / expert bias / Sinkhorn, capacity dropping, aux and z losses, expert-bias
// counts; backward to hidden and router weight. T = float or double. Row maths in
// src/core/router_math.h and loss_math.h (shared with the CUDA twin src/cuda/router.cu).
// Tests: tests/cpu/test_router.cpp, test_losses.cpp, test_router_gradcheck.cpp.
#include "cpu/router.h"

#include <algorithm>
#include <numeric>

#include "core/loss_math.h"
#include "core/router_math.h"
#include "cpu/losses.h"
#include "cpu/parallel.h"
#include "moekit/error.h"

namespace moekit::cpu {

namespace {

constexpr int64_t kRowsPerChunk = 64;  // parallel_for granularity for the gating GEMMs

bool is_padding(const std::vector<uint8_t>& mask, int64_t t) { return !mask.empty() && mask[size_t(t)] != 0; }

bool uses_sinkhorn(const MoeConfig& config) {
    const auto& types = config.moe_router_load_balancing_type;
    return std::find(types.begin(), types.end(), "sinkhorn") != types.end();
}

RouteParams route_params(const MoeConfig& config) {
    RouteParams p;
    p.score = score_function_from_name(config.moe_router_score_function);
    p.pre_softmax = config.moe_router_pre_softmax;
    p.num_experts = config.num_experts();
    p.topk = config.moe_router_topk;
    if (config.moe_router_group_topk && *config.moe_router_group_topk > 0) {
        MOEKIT_CHECK(config.moe_router_num_groups && *config.moe_router_num_groups > 0 &&
                         p.num_experts % *config.moe_router_num_groups == 0,
                     "group-limited routing needs --moe-router-num-groups dividing E=", p.num_experts);
        p.num_groups = *config.moe_router_num_groups;
        p.group_topk = *config.moe_router_group_topk;
    }
    p.scaling_factor = config.moe_router_topk_scaling_factor.value_or(0.0);
    return p;
}

// Sinkhorn's probs: sigmoid (k = 1) or the full softmax (k > 1) at the chosen experts, which are
// row_probs of "sigmoid, k=1" and "softmax pre" with no scaling.
RouteParams sinkhorn_activation(int64_t E, int64_t k) {
    RouteParams p;
    p.score = k == 1 ? ScoreFunction::sigmoid : ScoreFunction::softmax;
    p.pre_softmax = true;
    p.num_experts = E;
    p.topk = k;
    return p;
}

// Per-expert capacity mask over the valid rows (apply_router_token_dropping). Candidates of each
// expert column are ranked by prob (policy "probs") or routed-first (policy "position"), ties by
// lower token index; the first `capacity` are kept.
template <typename T>
std::vector<uint8_t> capacity_mask(const RouterContext<T>& ctx, const std::vector<int64_t>& valid, int64_t E,
                                   int64_t capacity, const std::string& policy) {
    const int64_t rows = ctx.logits.rows;
    std::vector<uint8_t> keep(size_t(rows * E), 0);
    if (capacity > int64_t(valid.size())) {
        for (int64_t t : valid) std::fill_n(keep.begin() + t * E, E, uint8_t(1));
        return keep;
    }
    MOEKIT_REQUIRE(policy == "probs" || policy == "position", "--moe-token-drop-policy=", policy,
                   " must be probs or position");
    std::vector<int64_t> order(valid);
    for (int64_t e = 0; e < E; ++e) {
        if (policy == "probs") {
            // value_ranks_before with equal indices: larger prob first, NaN last (a plain `>` is no
            // strict weak order once a NaN appears); the stable sort breaks ties by token order.
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
                return value_ranks_before(ctx.probs(a, e), 0, ctx.probs(b, e), 0);
            });
        } else {
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
                return ctx.routing_map[size_t(a * E + e)] > ctx.routing_map[size_t(b * E + e)];
            });
        }
        for (int64_t i = 0; i < capacity; ++i) keep[size_t(order[size_t(i)] * E + e)] = 1;
        order = valid;  // restart from token order so ties break by index for every column
    }
    return keep;
}

}  // namespace

int64_t get_capacity(int64_t num_tokens, int64_t num_experts, double capacity_factor, int64_t min_capacity) {
    return capacity_of(num_tokens, num_experts, capacity_factor, min_capacity);
}

void update_expert_bias(double rate, std::vector<double>& expert_bias, std::vector<double>& local_tokens_per_expert) {
    MOEKIT_CHECK(expert_bias.size() == local_tokens_per_expert.size(), "expert_bias has ", expert_bias.size(),
                 " entries but local_tokens_per_expert has ", local_tokens_per_expert.size());
    if (expert_bias.empty()) return;
    double sum = 0;
    for (double c : local_tokens_per_expert) sum += c;
    const double mean = sum / double(expert_bias.size());
    for (size_t i = 0; i < expert_bias.size(); ++i)
        expert_bias[i] = expert_bias_step(expert_bias[i], local_tokens_per_expert[i], mean, rate);
    std::fill(local_tokens_per_expert.begin(), local_tokens_per_expert.end(), 0.0);
}

template <typename T>
void router_forward(const MoeConfig& config, const Matrix<T>& router_weight, const std::vector<double>& expert_bias,
                    const LayerInput<T>& input, RouterState& state, RouterContext<T>& ctx, Communicator* dp) {
    const Matrix<T>& x = input.hidden;
    const int64_t rows = x.rows, H = x.cols, E = config.num_experts(), k = config.moe_router_topk;
    const int64_t B = std::max<int64_t>(1, input.micro_batch_size);
    MOEKIT_CHECK(E > 0, "router needs --num-experts > 0");
    MOEKIT_CHECK(router_weight.rows == E && router_weight.cols == H, "router.weight is [", router_weight.rows, ", ",
                 router_weight.cols, "], expected [", E, ", ", H, "]");
    MOEKIT_CHECK(k >= 1 && k <= E, "--moe-router-topk=", k, " must be in [1, E=", E, "]");
    MOEKIT_CHECK(input.padding_mask.empty() || int64_t(input.padding_mask.size()) == rows, "padding_mask has ",
                 input.padding_mask.size(), " entries, expected ", rows);

    ctx = RouterContext<T>{};
    ctx.padding_mask = input.padding_mask;
    ctx.training = input.training;
    ctx.micro_batch_size = B;
    ctx.seq_length = input.seq_length > 0 ? input.seq_length : rows / B;
    std::vector<int64_t> valid;
    for (int64_t t = 0; t < rows; ++t)
        if (!is_padding(input.padding_mask, t)) valid.push_back(t);
    ctx.valid_tokens = int64_t(valid.size());

    // 1. Input jitter (router copy only), element index t*H + h of this call's draws.
    ctx.router_input = x;
    if (config.moe_input_jitter_eps) {
        ctx.jitter = Matrix<T>(rows, H);
        for (int64_t i = 0; i < x.size(); ++i) {
            ctx.jitter.data[size_t(i)] = T(jitter_factor(input.jitter_seed, uint64_t(i), *config.moe_input_jitter_eps));
            ctx.router_input.data[size_t(i)] = x.data[size_t(i)] * ctx.jitter.data[size_t(i)];
        }
    }

    // 2. Gating linear logits = x_router . W^T (accumulated in double: the reference rounds once).
    ctx.logits = Matrix<T>(rows, E);
    parallel_for(rows, kRowsPerChunk, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t e = 0; e < E; ++e) {
                double acc = 0;
                const T* xr = ctx.router_input.row(t);
                const T* w = router_weight.row(e);
                for (int64_t h = 0; h < H; ++h) acc += double(xr[h]) * double(w[h]);
                ctx.logits(t, e) = T(acc);
            }
    });

    // 2b. --moe-router-force-load-balancing: N(0, 1) logits (RandomSTE). The backward uses the same
    // ctx.logits for d probs / d logits and hands dlogits to the gating linear unchanged: straight through.
    if (config.moe_router_force_load_balancing) {
        const uint64_t rank = dp ? uint64_t(dp->rank()) : 0;
        for (int64_t i = 0; i < ctx.logits.size(); ++i)
            ctx.logits.data[size_t(i)] = T(force_balance_logit(input.jitter_seed, rank, uint64_t(i)));
    }

    // 3. Selection and probs.
    const bool sinkhorn_routing = uses_sinkhorn(config);
    const RouteParams params = sinkhorn_routing ? sinkhorn_activation(E, k) : route_params(config);
    std::vector<T> bias;
    if (config.moe_router_enable_expert_bias && !sinkhorn_routing) {
        MOEKIT_CHECK(int64_t(expert_bias.size()) == E, "router.expert_bias has ", expert_bias.size(),
                     " entries, expected E=", E);
        bias.assign(expert_bias.begin(), expert_bias.end());
    }
    ctx.topk_idx.assign(size_t(rows * k), -1);
    ctx.probs = Matrix<T>(rows, E);
    ctx.routing_map.assign(size_t(rows * E), 0);
    Matrix<float> sinkhorn_matrix;
    if (sinkhorn_routing && ctx.training && !valid.empty()) {
        Matrix<float> valid_logits(int64_t(valid.size()), E);  // Megatron: explicit fp32 Sinkhorn
        for (size_t i = 0; i < valid.size(); ++i)
            for (int64_t e = 0; e < E; ++e) valid_logits(int64_t(i), e) = float(ctx.logits(valid[i], e));
        sinkhorn_matrix = sinkhorn(valid_logits);
    }
    std::vector<T> keys(static_cast<size_t>(E)), vals(static_cast<size_t>(k));
    std::vector<T> group_scores(static_cast<size_t>(std::max<int64_t>(1, params.num_groups)));
    std::vector<uint8_t> allowed(static_cast<size_t>(E));
    for (size_t i = 0; i < valid.size(); ++i) {
        const int64_t t = valid[i];
        int64_t* idx = ctx.topk_idx.data() + t * k;
        if (sinkhorn_routing && ctx.training) {
            topk_ordered(sinkhorn_matrix.row(int64_t(i)), static_cast<const uint8_t*>(nullptr), E, k, idx);
        } else {
            select_row(params, ctx.logits.row(t), bias.empty() ? nullptr : bias.data(), keys.data(),
                       group_scores.data(), allowed.data(), idx);
        }
        if (row_has_non_finite(ctx.logits.row(t), E)) ++ctx.non_finite_rows;
        row_probs(params, ctx.logits.row(t), idx, vals.data());
        for (int64_t j = 0; j < k; ++j) {
            ctx.probs(t, idx[j]) = vals[size_t(j)];
            ctx.routing_map[size_t(t * E + idx[j])] = 1;
        }
    }

    // 4. Capacity dropping (T = valid tokens).
    if (config.moe_expert_capacity_factor) {
        ctx.capacity = get_capacity(ctx.valid_tokens * k, E, *config.moe_expert_capacity_factor);
        ctx.keep_mask = capacity_mask(ctx, valid, E, ctx.capacity, config.moe_token_drop_policy);
        const bool pad = config.moe_pad_expert_input_to_capacity;
        for (int64_t t : valid)
            for (int64_t e = 0; e < E; ++e) {
                const size_t i = size_t(t * E + e);
                const uint8_t m = pad ? ctx.keep_mask[i] : uint8_t(ctx.routing_map[i] & ctx.keep_mask[i]);
                ctx.routing_map[i] = m;
                ctx.probs(t, e) = ctx.probs(t, e) * T(m);
            }
    }

    // 5. Losses (training only), on scores recomputed from the raw logits.
    if (ctx.training) {
        const bool any_aux = config.aux_loss_coeff("aux_loss") > 0 || config.aux_loss_coeff("seq_aux_loss") > 0 ||
                             config.aux_loss_coeff("global_aux_loss") > 0;
        if (any_aux) {
            Matrix<T> scores;
            std::vector<uint8_t> aux_map;
            aux_scores(ctx.logits, route_params(config).score, k, ctx.padding_mask, scores, aux_map);
            AuxLossTerms terms =
                aux_losses(config, scores, aux_map, !ctx.padding_mask.empty(), ctx.seq_length, B, state, dp);
            ctx.losses.aux_loss = terms.aux_loss;
            ctx.losses.seq_aux_loss = terms.seq_aux_loss;
            ctx.losses.global_aux_loss = terms.global_aux_loss;
            ctx.aux_score_grad = std::move(terms.score_grad);
            ctx.global_avg_tokens = std::move(terms.global_avg_tokens);
        }
        if (config.moe_z_loss_coeff)
            ctx.losses.z_loss = z_loss(ctx.logits, ctx.padding_mask, *config.moe_z_loss_coeff, &ctx.z_loss_weight);
    }

    // 6. Counts: tokens_per_expert and the expert-bias accumulator (post-drop map, valid rows).
    ctx.tokens_per_expert.assign(size_t(E), 0);
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t e = 0; e < E; ++e) ctx.tokens_per_expert[size_t(e)] += ctx.routing_map[size_t(t * E + e)];
    if (config.moe_router_enable_expert_bias && ctx.training) {
        if (state.local_tokens_per_expert.empty()) state.local_tokens_per_expert.assign(size_t(E), 0.0);
        MOEKIT_CHECK(int64_t(state.local_tokens_per_expert.size()) == E, "local_tokens_per_expert has ",
                     state.local_tokens_per_expert.size(), " entries, expected E=", E);
        for (int64_t e = 0; e < E; ++e)
            state.local_tokens_per_expert[size_t(e)] += double(ctx.tokens_per_expert[size_t(e)]);
    }
}

template <typename T>
void router_backward(const MoeConfig& config, const Matrix<T>& router_weight, const RouterContext<T>& ctx,
                     const Matrix<T>& grad_probs, Matrix<T>& grad_hidden, Matrix<T>& grad_router_weight) {
    const int64_t rows = ctx.logits.rows, E = ctx.logits.cols, H = ctx.router_input.cols, k = config.moe_router_topk;
    const int64_t B = ctx.micro_batch_size;
    MOEKIT_CHECK(grad_probs.rows == rows && grad_probs.cols == E, "grad_probs is [", grad_probs.rows, ", ",
                 grad_probs.cols, "], expected [", rows, ", ", E, "]");
    if (grad_hidden.empty()) grad_hidden = Matrix<T>(rows, H);
    if (grad_router_weight.empty()) grad_router_weight = Matrix<T>(E, H);
    MOEKIT_CHECK(grad_hidden.rows == rows && grad_hidden.cols == H, "grad_hidden must be [", rows, ", ", H, "]");
    MOEKIT_CHECK(grad_router_weight.rows == E && grad_router_weight.cols == H, "grad_router_weight must be [", E, ", ",
                 H, "]");

    const bool sinkhorn_routing = uses_sinkhorn(config);
    const RouteParams params = sinkhorn_routing ? sinkhorn_activation(E, k) : route_params(config);
    const double scale = config.moe_loss_backward_scale;
    Matrix<T> dlogits(rows, E);
    std::vector<T> g(static_cast<size_t>(k));
    for (int64_t t = 0; t < rows; ++t) {
        if (is_padding(ctx.padding_mask, t)) continue;
        const int64_t* idx = ctx.topk_idx.data() + t * k;
        for (int64_t j = 0; j < k; ++j) {
            const size_t i = size_t(t * E + idx[j]);
            // Dropped entries were multiplied by 0; kept ones by 1 (same for pad-to-capacity).
            g[size_t(j)] = ctx.keep_mask.empty() ? grad_probs.data[i] : grad_probs.data[i] * T(ctx.keep_mask[i]);
        }
        row_probs_backward(params, ctx.logits.row(t), idx, g.data(), dlogits.row(t));
    }
    // Loss injection (MoEAuxLossAutoScaler): d total / d loss = scale.
    if (!ctx.aux_score_grad.empty()) {
        Matrix<T> grad_scores(rows, E);
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t e = 0; e < E; ++e) grad_scores(t, e) = T(scale * ctx.aux_score_grad[size_t((t % B) * E + e)]);
        aux_scores_backward(ctx.logits, route_params(config).score, grad_scores, ctx.padding_mask, dlogits);
    }
    if (ctx.z_loss_weight != 0) z_loss_backward(ctx.logits, ctx.padding_mask, scale * ctx.z_loss_weight, dlogits);

    // Gating linear backward: dW += dlogits^T x_router; dx += (dlogits W) * jitter. Each output
    // element is summed by one thread in a fixed order (t, resp. e ascending): deterministic.
    parallel_for(E, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> acc(static_cast<size_t>(H));
        for (int64_t e = begin; e < end; ++e) {
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t t = 0; t < rows; ++t) {
                const double d = double(dlogits(t, e));
                const T* xr = ctx.router_input.row(t);
                for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += d * double(xr[h]);
            }
            for (int64_t h = 0; h < H; ++h) grad_router_weight(e, h) += T(acc[size_t(h)]);
        }
    });
    parallel_for(rows, kRowsPerChunk, [&](int64_t begin, int64_t end) {
        std::vector<double> acc(static_cast<size_t>(H));
        for (int64_t t = begin; t < end; ++t) {
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t e = 0; e < E; ++e) {
                const double d = double(dlogits(t, e));
                const T* w = router_weight.row(e);
                for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += d * double(w[h]);
            }
            for (int64_t h = 0; h < H; ++h)
                grad_hidden(t, h) += ctx.jitter.empty() ? T(acc[size_t(h)]) : T(acc[size_t(h)]) * ctx.jitter(t, h);
        }
    });
}

#define MOEKIT_INSTANTIATE_ROUTER(T)                                                                                \
    template void router_forward<T>(const MoeConfig&, const Matrix<T>&, const std::vector<double>&,                 \
                                    const LayerInput<T>&, RouterState&, RouterContext<T>&, Communicator*);          \
    template void router_backward<T>(const MoeConfig&, const Matrix<T>&, const RouterContext<T>&, const Matrix<T>&, \
                                     Matrix<T>&, Matrix<T>&);

MOEKIT_INSTANTIATE_ROUTER(float)
MOEKIT_INSTANTIATE_ROUTER(double)
#undef MOEKIT_INSTANTIATE_ROUTER

}  // namespace moekit::cpu
