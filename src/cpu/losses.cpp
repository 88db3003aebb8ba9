// CPU reference of the router losses (Megatron §2.1-2.4): aux scores, aux_loss, seq_aux_loss,
// global_aux_loss with its tracker, z-loss. Row maths in src/core/loss_math.h; declarations and
// shapes in src/cpu/losses.h; tests in tests/cpu/test_losses.cpp.
#include "cpu/losses.h"

#include <cmath>

#include "core/loss_math.h"
#include "moekit/error.h"

namespace moekit::cpu {

namespace {
bool is_padding(const std::vector<uint8_t>& mask, int64_t t) { return !mask.empty() && mask[size_t(t)] != 0; }
}  // namespace

ScoreFunction score_function_from_name(const std::string& name) {
    if (name == "softmax") return ScoreFunction::softmax;
    if (name == "sigmoid") return ScoreFunction::sigmoid;
    if (name == "sqrtsoftplus") return ScoreFunction::sqrtsoftplus;
    throw UsageError(str("--moe-router-score-function=", name, " must be one of softmax, sigmoid, sqrtsoftplus"));
}

template <typename T>
void aux_scores(const Matrix<T>& logits, ScoreFunction f, int64_t topk, const std::vector<uint8_t>& padding_mask,
                Matrix<T>& scores, std::vector<uint8_t>& map) {
    const int64_t rows = logits.rows, E = logits.cols;
    MOEKIT_CHECK(topk >= 1 && topk <= E, "aux-loss top-k ", topk, " must be in [1, E=", E, "]");
    scores = Matrix<T>(rows, E);
    map.assign(size_t(rows * E), 0);
    std::vector<int64_t> idx(static_cast<size_t>(topk));
    for (int64_t t = 0; t < rows; ++t) {
        if (is_padding(padding_mask, t)) continue;  // padded rows stay zero in scores and map
        aux_scores_row(f, logits.row(t), E, scores.row(t));
        topk_ordered(scores.row(t), static_cast<const uint8_t*>(nullptr), E, topk, idx.data());
        for (int64_t j = 0; j < topk; ++j) map[size_t(t * E + idx[size_t(j)])] = 1;
    }
}

template <typename T>
void aux_scores_backward(const Matrix<T>& logits, ScoreFunction f, const Matrix<T>& grad_scores,
                         const std::vector<uint8_t>& padding_mask, Matrix<T>& grad_logits) {
    for (int64_t t = 0; t < logits.rows; ++t) {
        if (is_padding(padding_mask, t)) continue;
        aux_scores_row_backward(f, logits.row(t), logits.cols, grad_scores.row(t), grad_logits.row(t));
    }
}

std::vector<double> column_counts(const std::vector<uint8_t>& map, int64_t rows, int64_t cols) {
    std::vector<double> counts(size_t(cols), 0.0);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) counts[size_t(c)] += map[size_t(r * cols + c)];
    return counts;
}

template <typename T>
double switch_load_balancing_loss(const T* scores, int64_t rows, int64_t cols, const std::vector<double>& tokens,
                                  double total_tokens, int64_t topk, int64_t num_experts, double coeff) {
    if (total_tokens <= 0) return 0.0;  // nothing valid: no loss (Megatron would divide by zero)
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) {
        double p = 0;  // aggregated score of column c over the rows
        for (int64_t r = 0; r < rows; ++r) p += double(scores[r * cols + c]);
        sum += p * tokens[size_t(c)];
    }
    return sum * switch_loss_factor(coeff, num_experts, topk, total_tokens);
}

template <typename T>
AuxLossTerms aux_losses(const MoeConfig& config, const Matrix<T>& scores, const std::vector<uint8_t>& map,
                        bool has_padding, int64_t seq_length, int64_t micro_batch_size, RouterState& state,
                        Communicator* dp) {
    const int64_t rows = scores.rows, E = scores.cols, k = config.moe_router_topk, B = micro_batch_size;
    const double c_aux = config.aux_loss_coeff("aux_loss");
    const double c_seq = config.aux_loss_coeff("seq_aux_loss");
    const double c_glob = config.aux_loss_coeff("global_aux_loss");
    AuxLossTerms out;
    if (c_aux == 0 && c_seq == 0 && c_glob == 0) return out;
    MOEKIT_CHECK(B >= 1 && rows % B == 0, "router rows ", rows, " must be a multiple of micro_batch_size ", B);
    out.score_grad.assign(size_t(B * E), 0.0);

    const std::vector<double> tokens = column_counts(map, rows, E);
    double routed = 0;
    for (double c : tokens) routed += c;
    // get_tokens_per_expert_and_token_count: with a padding mask the token total is counted.
    const double total = has_padding ? routed / double(k) : double(rows);

    if (c_aux != 0) {
        out.aux_loss = switch_load_balancing_loss(scores.data.data(), rows, E, tokens, total, k, E, c_aux);
        const double f = total > 0 ? switch_loss_factor(c_aux, E, k, total) : 0.0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t e = 0; e < E; ++e) out.score_grad[size_t(b * E + e)] += f * tokens[size_t(e)];
    }
    if (c_seq != 0) {
        // [S*B, E] viewed as [S, B*E]: every (sequence, expert) pair is its own column.
        const int64_t S = seq_length;
        MOEKIT_CHECK(S * B == rows, "seq_aux_loss needs seq_length*micro_batch_size = rows: ", S, "*", B, " != ", rows);
        const std::vector<double> seq_tokens = column_counts(map, S, B * E);
        const double seq_total = has_padding ? routed / double(k * B) : double(S);
        out.seq_aux_loss =
            switch_load_balancing_loss(scores.data.data(), S, B * E, seq_tokens, seq_total, k, E, c_seq) / double(B);
        const double f = seq_total > 0 ? switch_loss_factor(c_seq, E, k, seq_total) / double(B) : 0.0;
        for (int64_t c = 0; c < B * E; ++c) out.score_grad[size_t(c)] += f * seq_tokens[size_t(c)];
    }
    if (c_glob != 0) {
        // get_tokens_per_expert_and_token_count over the data-parallel group.
        std::vector<double> global_tokens = tokens;
        double global_total = total;
        if (dp && dp->size() > 1) {
            dp->all_reduce(global_tokens.data(), E);
            double global_routed = 0;
            for (double c : global_tokens) global_routed += c;
            global_total = has_padding ? global_routed / double(k) : double(rows) * double(dp->size());
        }
        if (state.global_tokens_per_expert.empty()) state.global_tokens_per_expert.assign(size_t(E), 0.0);
        MOEKIT_CHECK(int64_t(state.global_tokens_per_expert.size()) == E, "global_tokens_per_expert has ",
                     state.global_tokens_per_expert.size(), " entries, expected E=", E);
        for (int64_t e = 0; e < E; ++e) state.global_tokens_per_expert[size_t(e)] += global_tokens[size_t(e)];
        state.ga_steps += 1;
        out.global_avg_tokens.resize(size_t(E));
        for (int64_t e = 0; e < E; ++e)
            out.global_avg_tokens[size_t(e)] = state.global_tokens_per_expert[size_t(e)] / double(state.ga_steps);
        out.global_aux_loss = switch_load_balancing_loss(scores.data.data(), rows, E, out.global_avg_tokens,
                                                         global_total, k, E, c_glob);
        const double f = global_total > 0 ? switch_loss_factor(c_glob, E, k, global_total) : 0.0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t e = 0; e < E; ++e) out.score_grad[size_t(b * E + e)] += f * out.global_avg_tokens[size_t(e)];
    }
    return out;
}

template <typename T>
double z_loss(const Matrix<T>& logits, const std::vector<uint8_t>& padding_mask, double coeff, double* grad_weight) {
    double sum = 0;
    int64_t count = 0;
    for (int64_t t = 0; t < logits.rows; ++t) {
        if (is_padding(padding_mask, t)) continue;
        sum += double(z_loss_row(logits.row(t), logits.cols));
        ++count;
    }
    const double n = double(count > 0 ? count : 1);  // torch.clamp(num_tokens, min=1)
    if (grad_weight) *grad_weight = coeff / n;
    return sum / n * coeff;
}

template <typename T>
void z_loss_backward(const Matrix<T>& logits, const std::vector<uint8_t>& padding_mask, double weight,
                     Matrix<T>& grad_logits) {
    for (int64_t t = 0; t < logits.rows; ++t) {
        if (is_padding(padding_mask, t)) continue;
        z_loss_row_backward(logits.row(t), logits.cols, T(weight), grad_logits.row(t));
    }
}

#define MOEKIT_INSTANTIATE_LOSSES(T)                                                                               \
    template void aux_scores<T>(const Matrix<T>&, ScoreFunction, int64_t, const std::vector<uint8_t>&, Matrix<T>&, \
                                std::vector<uint8_t>&);                                                            \
    template void aux_scores_backward<T>(const Matrix<T>&, ScoreFunction, const Matrix<T>&,                        \
                                         const std::vector<uint8_t>&, Matrix<T>&);                                 \
    template double switch_load_balancing_loss<T>(const T*, int64_t, int64_t, const std::vector<double>&, double,  \
                                                  int64_t, int64_t, double);                                       \
    template AuxLossTerms aux_losses<T>(const MoeConfig&, const Matrix<T>&, const std::vector<uint8_t>&, bool,     \
                                        int64_t, int64_t, RouterState&, Communicator*);                                           \
    template double z_loss<T>(const Matrix<T>&, const std::vector<uint8_t>&, double, double*);                     \
    template void z_loss_backward<T>(const Matrix<T>&, const std::vector<uint8_t>&, double, Matrix<T>&);

MOEKIT_INSTANTIATE_LOSSES(float)
MOEKIT_INSTANTIATE_LOSSES(double)
#undef MOEKIT_INSTANTIATE_LOSSES

}  // namespace moekit::cpu
