// ECHO on the budgeted dispatcher (issue 9; megatron-moe.md §7): the device steps that the budgeted
// protocol (src/cuda/dispatch_budgeted.cu) runs when spare slots exist. After the count exchange every
// rank plans from the same [EP, E] matrix (src/cuda/echo_plan.cuh), derives its send tables over L + S
// buckets per receiver (src/core/echo_dispatch_math.h: first home, then the clones in slot order), pushes
// each clone's weights from its home rank into the slot on the clone's rank, and in backward adds every
// clone's weight gradient into the home expert's in global slot order. CPU twin: src/cpu/dispatch_echo.h,
// src/cpu/echo_experts.h. Tests: tests/gpu/test_cuda_echo.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/dispatcher.h"
#include "cuda/echo_plan.cuh"

namespace moekit::cuda {

// The budgeted dispatcher's per-rank device tables over C = EP * B chunks (B buckets per receiver: L home
// experts, then S slots); chunk (q, b) is index q * B + b on the sender side, b * EP + s on the receiver.
struct BudgetTables {
    int32_t* send_src = nullptr;        // [EP*B] first permutation-1 row of chunk (q, b) here
    int32_t* send_dst = nullptr;        // [EP*B] its first row in receiver q's buffer
    int32_t* send_n = nullptr;          // [EP*B] rows of it that fit the budget
    int32_t* chunk_start = nullptr;     // [B*EP + 1] this rank's buffer: chunk b*EP + s starts here (clipped)
    int32_t* expert_offsets = nullptr;  // [B + 1] the grouped GEMMs' offsets
    int32_t* held = nullptr;            // [1] rows this rank holds (<= budget)
    unsigned long long* status = nullptr;  // [6] overflow, peak rows, wait error, its rank, peer, barrier
    uint64_t* epoch = nullptr;          // [1] barriers passed
};

// A rank's ECHO state on the device (its own memory): the plan, identical on every rank.
struct EchoDeviceState {
    EchoDims dims;
    EchoAlgorithm algorithm = EchoAlgorithm::waterfill;
    int64_t* counts = nullptr;        // [EP, E] the exchanged counts as int64 (the planner's input)
    EchoDevicePlan plan;
    int64_t* recv_offsets = nullptr;  // [EP][(L + S) * EP + 1] every receiver's chunk offsets
    bool forced = false;              // test hook: forced random plans (src/core/echo_random_plan_math.h)
    uint64_t forced_seed = 0;
};

// counts32: the exchanged [EP, E] matrix; plan_offsets: this rank's permutation-1 offsets [E + 1].
// Plans (or draws the forced random plan), then fills the tables (clipped at `budget`; overflow and peak in status like the plain protocol).
void echo_plan_and_tables(const EchoDeviceState& st, const int32_t* counts32, const int32_t* plan_offsets, int rank,
                          int64_t budget, const BudgetTables& t, cudaStream_t stream);

// Where the slot buffers are in every rank's symmetric buffer (byte offsets, the same on all ranks).
struct EchoSlotRegions {
    int64_t fc1 = 0, fc2 = 0;            // bf16 [S, F1, H], [S, H, F]
    int64_t grad_fc1 = 0, grad_fc2 = 0;  // fp32, same shapes
    int64_t fc1_elems = 0, fc2_elems = 0;  // one expert's F1*H, H*F
};

// Home rank side: my experts' weights into every slot (on any rank) that clones one of them.
void echo_push_clone_weights(const EchoDeviceState& st, const ExpertParams& w, char* const* peers,
                             const EchoSlotRegions& r, int rank, int blocks, cudaStream_t stream);
// Home rank side, after a barrier that follows every rank's weight-gradient GEMMs: grad[e] += the clone
// gradients of e read from their ranks' slots, in ascending global slot order (deterministic).
void echo_add_clone_grads(const EchoDeviceState& st, const ExpertParams& w, char* const* peers,
                          const EchoSlotRegions& r, int rank, int blocks, cudaStream_t stream);

// Loads these kernels (and the planner's) now, outside any step: see BudgetedDispatcher's warm-up.
void echo_preload_kernels();

}  // namespace moekit::cuda
