// CPU reference of the router's loss pieces (Megatron §2): aux-loss scores and map, the switch
// load-balancing loss (aux_loss, seq_aux_loss, global_aux_loss), z-loss and Sinkhorn, on
// Matrix<T> with T = float or double. Row-level maths: src/core/loss_math.h. Used by
// src/cpu/router.cpp; exposed separately so tests can assemble sharded losses (L7).
// Tests: tests/cpu/test_losses.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/router_math.h"
#include "cpu/router.h"
#include "moekit/comm.h"
#include "moekit/config.h"
#include "moekit/tensor.h"

namespace moekit::cpu {

// "softmax" | "sigmoid" | "sqrtsoftplus"; throws UsageError naming --moe-router-score-function.
ScoreFunction score_function_from_name(const std::string& name);

// compute_routing_scores_for_aux_loss: scores [T, E] (softmax over E, or sigmoid/sqrtsoftplus
// renormalised over E) and the plain top-k map [T, E]; rows with padding_mask[t] = 1 are zero.
template <typename T>
void aux_scores(const Matrix<T>& logits, ScoreFunction f, int64_t topk, const std::vector<uint8_t>& padding_mask,
                Matrix<T>& scores, std::vector<uint8_t>& map);

// Adds d loss / d logits for grad_scores = d loss / d scores [T, E]; padded rows get nothing.
template <typename T>
void aux_scores_backward(const Matrix<T>& logits, ScoreFunction f, const Matrix<T>& grad_scores,
                         const std::vector<uint8_t>& padding_mask, Matrix<T>& grad_logits);

// Column sums of a [rows, cols] 0/1 map.
std::vector<double> column_counts(const std::vector<uint8_t>& map, int64_t rows, int64_t cols);

// switch_load_balancing_loss_func on scores [rows, cols] (cols = E, or B*E for seq_aux):
// coeff * E / (k * total^2) * sum_c (sum_rows s_c) * tokens_c.
template <typename T>
double switch_load_balancing_loss(const T* scores, int64_t rows, int64_t cols, const std::vector<double>& tokens,
                                  double total_tokens, int64_t topk, int64_t num_experts, double coeff);

// The three aux losses of one forward (coefficients included) and their gradient w.r.t. the aux
// scores: d(aux + seq_aux + global_aux) / d scores[s*B + b, e] = score_grad[b*E + e].
struct AuxLossTerms {
    double aux_loss = 0, seq_aux_loss = 0, global_aux_loss = 0;
    std::vector<double> score_grad;         // [B*E]; empty when no aux loss is active
    std::vector<double> global_avg_tokens;  // [E] avg used by global_aux_loss (empty if inactive)
};

// Applies every aux type with a non-zero coefficient (Megatron order: aux, seq, global) on the
// aux scores/map; updates the global_aux_loss tracker in `state`. seq_length * micro_batch_size
// must equal the rows. Token totals come from the padding mask when one is given. global_aux_loss
// sums its token counts over the data-parallel group `dp` (Megatron's tp_dp_cp all-reduce; the
// token total becomes rows * |dp|, or the global routed count / k with padding); nullptr = one rank.
template <typename T>
AuxLossTerms aux_losses(const MoeConfig& config, const Matrix<T>& scores, const std::vector<uint8_t>& map,
                        bool has_padding, int64_t seq_length, int64_t micro_batch_size, RouterState& state,
                        Communicator* dp = nullptr);

// z-loss = coeff * mean over valid rows of logsumexp(l)^2 (count >= 1). *grad_weight receives
// coeff / count, the weight z_loss_backward needs.
template <typename T>
double z_loss(const Matrix<T>& logits, const std::vector<uint8_t>& padding_mask, double coeff, double* grad_weight);

template <typename T>
void z_loss_backward(const Matrix<T>& logits, const std::vector<uint8_t>& padding_mask, double weight,
                     Matrix<T>& grad_logits);

// Megatron sinkhorn(): diag(d0) exp(logits) diag(d1) with 1/T row and 1/E column targets,
// iterated until mean |d1_old - d1| <= tol. Selection only (no gradient).
template <typename T>
Matrix<T> sinkhorn(const Matrix<T>& logits, double tol = 1e-4);

}  // namespace moekit::cpu
