// One rank's forward + backward of the CUDA layer inside an EP group, at the float host interface of
// `moekit layer` (tools/layer_ep.cpp) and the GPU EP tests: weights and this rank's micro-batch go up
// as bf16, results come back as float. Host-only header (no CUDA types).
// Implementation: src/cuda/ep_rank_step.cu. Tests: tests/gpu/test_cuda_ep.cu.
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/comm.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::cuda {

struct EpRankStep {
    Matrix<float> output, grad_input, probs;  // [T, H], [T, H], [T, E] of this rank's tokens
    std::vector<uint8_t> routing_map;         // [T, E]
    MoeWeights<float> grads;  // this rank's: router and shared in full, experts only the local ones (not reduced)
    RoutingSummary summary;   // tokens per expert and losses of this rank's tokens
    int64_t bytes_sent = 0;   // by this rank's dispatcher, forward + backward
    int64_t host_syncs = 0;
    // --moe-expert-rank-capacity-factor: the budget, and whether an overflow made the step re-run.
    bool budgeted = false, overflow = false;
    int64_t budget_rows = 0, peak_rows = 0;
    // --moe-enable-echo: clones of the step's plan and the rows per EP rank without / with them.
    int64_t echo_clones = 0;
    std::vector<int64_t> echo_load_before, echo_load_after;
};

// Collective over groups.ep (its transport picks the device one: local -> virtual ranks on the current
// GPU, mpi -> NCCL). config.micro_batch_size must be this rank's B.
// forced_echo_seed != 0 (with --moe-enable-echo): the step uses a forced random ECHO plan (a test hook).
EpRankStep run_ep_rank_step(const MoeConfig& config, const ProcessGroups& groups, const MoeWeights<float>& weights,
                            const LayerInput<float>& input, const Matrix<float>& grad_output,
                            uint64_t forced_echo_seed = 0);

}  // namespace moekit::cuda
