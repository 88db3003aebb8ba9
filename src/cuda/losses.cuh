// CUDA router losses (Megatron §2): aux_loss, seq_aux_loss, global_aux_loss, z-loss values and
// gradients, plus the expert-bias token counts — all on the device, read by the host only after
// the step. Statistics are deterministic column reductions (per chunk of positions, folded in order).
// Twin: src/cpu/router.cpp (losses). Test: tests/gpu/test_cuda_stages.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/chunk_math.h"

#include "cuda/router.cuh"
#include "moekit/config.h"

namespace moekit::cuda {

struct LossShape {
    double aux_coeff = 0, seq_aux_coeff = 0, global_aux_coeff = 0, z_coeff = 0;
    double backward_scale = 1;  // moe_loss_backward_scale
    __host__ __device__ bool need_aux() const { return aux_coeff != 0 || seq_aux_coeff != 0 || global_aux_coeff != 0; }
    __host__ __device__ bool any() const { return need_aux() || z_coeff != 0; }
    static LossShape from_config(const MoeConfig& config);
};

// Loss values on the device, in the order of moekit::LossValues.
enum LossSlot : int { kAuxLoss = 0, kSeqAuxLoss = 1, kGlobalAuxLoss = 2, kZLoss = 3, kNumLossSlots = 4 };

template <typename R>
struct LossTensors {
    const R* logits = nullptr;              // [T, E]
    const uint8_t* routing_map = nullptr;   // [T, E] after dropping
    const uint8_t* padding_mask = nullptr;  // [T] 1 = padding
    R* aux_scores = nullptr;                // [T, E] scores for the aux losses (0 on padding rows)
    uint8_t* aux_map = nullptr;             // [T, E] plain top-k of aux_scores (0 on padding rows)
    R* lse = nullptr;                       // [T] log-sum-exp of the logits (z-loss)
    R* score_sums = nullptr;                // [B, E] sum over the sequence of aux_scores
    int32_t* aux_counts = nullptr;          // [B, E] sum over the sequence of aux_map
    int32_t* valid_counts = nullptr;        // [B, E] routing_map counts of valid tokens
    R* grad_coeff = nullptr;                // [B, E] d(all aux losses)/d aux_score (scale included)
    R* z_grad_coeff = nullptr;              // [1] d z / d lse^2 per valid token (scale included)
    R* losses = nullptr;                    // [kNumLossSlots]
    double* local_tokens_per_expert = nullptr;   // [E] expert-bias counts (accumulated)
    double* global_tokens_per_expert = nullptr;  // [E] global_aux_loss tracker (accumulated)
    int32_t* ga_steps = nullptr;                 // [1] global_aux_loss micro-batch count
    R* chunk_scores = nullptr;     // [loss_chunk_score_elems] per-chunk score sums and z sums (scratch)
    int32_t* chunk_counts = nullptr;  // [loss_chunk_count_elems] per-chunk aux, valid and valid-token counts (scratch)
};

// Column statistics are summed per chunk of chunk_length(S, kLossThreadsPerChunk) sequence positions (losses.cu,
// core/chunk_math.h), a block a chunk, then folded in order.
constexpr int kLossThreadsPerChunk = 128;
constexpr int64_t loss_chunk_positions(int64_t seq_length) { return chunk_length(seq_length, kLossThreadsPerChunk); }
constexpr int64_t loss_chunks(int64_t seq_length) { return chunk_count(seq_length, kLossThreadsPerChunk); }
constexpr int64_t loss_chunk_score_elems(int64_t seq_length, int64_t batch, int64_t experts) {
    return loss_chunks(seq_length) * batch * (experts + 1);
}
constexpr int64_t loss_chunk_count_elems(int64_t seq_length, int64_t batch, int64_t experts) {
    return loss_chunks(seq_length) * batch * (2 * experts + 1);
}

// Dynamic shared memory a block of the forward's aux-score kernel takes (a token's scores a warp; with an aux loss).
size_t aux_scores_smem_bytes(int64_t num_experts, bool fp64);

// Forward: statistics, loss values, gradient coefficients, tracker updates (training only).
template <typename R>
void losses_forward(const RouterShape& shape, const LossShape& loss, const LossTensors<R>& t, cudaStream_t stream);

// grad_logits [T, E] += d(aux, seq aux, global aux, z losses)/d logits, each scaled by
// backward_scale.
template <typename R>
void losses_backward(const RouterShape& shape, const LossShape& loss, const LossTensors<R>& t, R* grad_logits,
                     cudaStream_t stream);

}  // namespace moekit::cuda
