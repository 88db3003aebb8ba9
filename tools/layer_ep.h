// `moekit layer` on several ranks (mpirun -np N, or --virtual-ranks N): the global input [S, B, H] is
// split along B into one micro-batch per rank, each rank runs the pipeline at the configured EP (the CPU
// reference, or with device "cuda" the GPU layer: virtual ranks share one GPU, MPI ranks use NCCL),
// and the results come back in the original token order with grads summed over ranks. Used by
// tools/cmd_layer.cpp; file contract in docs/usage.md. Tests: tests/cpu/test_cmd_layer_ep.cpp.
#pragma once
#include <string>
#include <vector>

#include "cpu/dispatch_budgeted.h"
#include "moekit/comm.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::tools {

// What the single-process path produces, for the whole batch.
template <typename T>
struct LayerResults {
    Matrix<T> output, grad_input;       // [S*B, H], row s*B + b
    Matrix<T> probs;                    // [S*B, E]
    std::vector<uint8_t> routing_map;   // [S*B, E]
    MoeWeights<T> grads;                // every parameter's grad, summed over ranks
    std::vector<int64_t> tokens_per_expert;  // [E] summed over ranks
    std::vector<LossValues> rank_losses;     // [ranks]
    // --moe-expert-rank-capacity-factor: the budgeted dispatcher's end-of-step report (overflow = the
    // step was re-run through alltoall) and how many overflow events it counted.
    bool budgeted = false;
    cpu::BudgetOverflowReport budget;
    int64_t overflow_events = 0;
};

// One rank's part; every rank of `world` calls it with the same arguments (all ranks read the same
// files). `fingerprint` (the resolved configuration and what was read) must agree across ranks:
// a mismatch is a UsageError on every rank naming the ranks and the first differing field. The
// results are complete on every rank (rank 0 writes them).
template <typename T>
LayerResults<T> run_layer_ranks(Communicator& world, const MoeConfig& config, const MoeWeights<T>& weights,
                                const LayerInput<T>& input, const Matrix<T>& grad_output,
                                const std::string& fingerprint, const std::string& device = "cpu");

// A digest of tensors, for the fingerprint (FNV-1a over the bytes).
uint64_t digest_bytes(const void* data, size_t bytes, uint64_t seed = 1469598103934665603ull);

}  // namespace moekit::tools
