// The training task's fixed parts, shared by every engine so they train the same model on the same data:
// the student's and the teacher's initial weights, and the held-out data stream (trainer.h has the task).
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/weights.h"
#include "train/trainer.h"

namespace moekit::train {

constexpr uint64_t kEvalStream = 0xe7a1u;  // data stream of the held-out batch; step s uses stream s

// All-zero weights of the configuration's shapes (expert_bias empty).
MoeWeights<float> zero_weights(const MoeConfig& config);
// The held-out loss normaliser MSE(x, y) must be finite and positive: UsageError naming the teacher's flags.
void require_teacher_differs(const TrainOptions& o, double identity_mse);
// Layer l of the student: Megatron's init with seed * 1000003 + l.
std::vector<MoeWeights<float>> student_weights(const TrainOptions& o);
// The teacher: same architecture, seed + 1, expert weights scaled by the gain and a 10x sharper router, so
// its routing is far from the identity and its experts differ clearly.
std::vector<MoeWeights<float>> teacher_weights(const TrainOptions& o);

// --skew zipf:S (o.skew_zipf > 0): feature 0 of every synthetic token is 1, and router row e's weight on it
// is a per-expert logit offset -S * ln(i + 1) * beta, i = e's rank in a seeded random popularity order
// (echo::zipf_popularity, as `moekit plan --synthetic`), beta = sqrt(6)/pi * the std of the rest of the
// logit (init_method_std * sqrt(H - 1)): with Gumbel-like logit noise of scale beta, top-1 popularity is
// (i + 1)^-S, a Zipf law; the Gaussian logits of the task make it approximately so. Applied to the student
// and (before its 10x router) the teacher. Tests: tests/cpu/test_train_skew.cpp.
void apply_zipf_router_skew(const TrainOptions& o, MoeWeights<float>& w);
// The synthetic tokens [rows, H] of data stream `stream` (N(0, 1); feature 0 = 1 with --skew).
Matrix<float> task_tokens(const TrainOptions& o, int64_t rows, uint64_t stream);

}  // namespace moekit::train
