// CUDA dispatcher stage (Megatron MoETokenDispatcher, megatron-moe.md §1.3): moves a rank's routed rows to
// the EP ranks that own their experts and back. The layer (src/cuda/moe_layer.cu) builds the routing plan
// over the global experts; the dispatcher turns it into the local experts' input and returns their
// output to the tokens. Implementations: dispatch_local.cu (EP = 1: permute/combine, no communication),
// dispatch_allgather.cu (device all-gathers, static buffers, no host sync), dispatch_alltoall.cu (host
// split sizes: the synchronous baseline), dispatch_budgeted.cu (sync-free, fixed receive budgets; with
// ECHO spare slots, dispatch_echo.cu). Twin: src/cpu/dispatcher.h. Tests: tests/gpu/test_cuda_ep.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/device_comm.h"
#include "core/echo_plan_math.h"
#include "cuda/permute.cuh"
#include "cuda/router.cuh"

namespace moekit::cuda {

// What the local experts consume; device memory owned by the dispatcher, valid until the next dispatch.
template <typename R>
struct ExpertInput {
    int64_t num_experts = 0;                // L local experts
    int64_t max_rows = 0;                   // static bound on offsets[L]
    const __nv_bfloat16* rows = nullptr;    // [max_rows, H] grouped by local expert
    const R* probs = nullptr;               // [max_rows] routing prob of each row
    const int32_t* offsets = nullptr;       // [L + S + 1] on the device
    // ECHO (issue 9): S spare slots after the L home experts; slot s computes with slot_fc1/fc2[s] (clone
    // weights the dispatcher brought in) and its weight gradients go to slot_grad_fc1/fc2[s] (fp32), which
    // the dispatcher adds into the home experts' gradients in dispatch_backward. S = 0 without ECHO.
    int64_t num_slots = 0;
    const __nv_bfloat16* slot_fc1 = nullptr;  // [S, F1, H]
    const __nv_bfloat16* slot_fc2 = nullptr;  // [S, H, F]
    float* slot_grad_fc1 = nullptr;           // [S, F1, H]
    float* slot_grad_fc2 = nullptr;           // [S, H, F]
    // rows not written yet (CudaDispatcher::set_rows_deferred): the first expert GEMM gathers them from the tokens
    // (RowGather over the plan's row_token), or the caller has the dispatcher write them (write_rows).
    bool rows_pending = false;
};

// The local experts' parameters (the layer's, bound per step): ECHO clones read the weights and add their
// gradients into the grads.
struct ExpertParams {
    const __nv_bfloat16* fc1 = nullptr;  // [L, F1, H]
    const __nv_bfloat16* fc2 = nullptr;  // [L, H, F]
    float* grad_fc1 = nullptr;           // [L, F1, H]
    float* grad_fc2 = nullptr;           // [L, H, F]
};

// Traffic of the last step, for benchmarks (host values; the budgeted dispatcher reads its count matrix).
struct DispatchTraffic {
    int64_t bytes_sent = 0;   // by this rank, forward + backward, to other ranks
    int64_t host_syncs = 0;   // device-to-host waits in the last forward + backward
};

// The budgeted dispatcher's end-of-step verdict (megatron-moe.md §4.6). Every rank holds the whole [EP, E]
// count matrix, so every rank computes the same verdict without another collective.
struct BudgetStatus {
    bool budgeted = false;   // the dispatcher has a receive budget
    bool overflow = false;   // some rank would have received more rows than its budget: the step is invalid
    int64_t budget_rows = 0; // per rank
    int64_t peak_rows = 0;   // most rows any rank would have received this step
};

// ECHO's last plan, as every rank computed it (empty without ECHO).
struct EchoStepSummary {
    int64_t clones = 0;
    std::vector<int64_t> load_before, load_after;  // [EP] rows per rank without / with the clones
};

template <typename R>
class CudaDispatcher {
public:
    virtual ~CudaDispatcher() = default;
    virtual std::string name() const = 0;
    virtual int64_t num_local_experts() const = 0;
    virtual int64_t expert_max_rows() const = 0;
    virtual size_t allocated_bytes() const = 0;
    virtual size_t saved_bytes() const = 0;  // what forward keeps for backward
    virtual DispatchTraffic traffic() const { return {}; }
    virtual __nv_bfloat16* expert_rows_buffer() = 0;  // the [max_rows, H] rows (stage tests)

    // plan over this rank's [T, E] routing, hidden [T, H] -> the local experts' rows.
    virtual ExpertInput<R> dispatch(const RoutingPlan<R>& plan, const uint8_t* routing_map, const R* probs,
                                    const __nv_bfloat16* hidden, cudaStream_t stream) = 0;
    // expert_out [max_rows, H] -> out [T, H] = sum of each token's rows (+ shared_out * gate; both optional).
    virtual void combine(const RoutingPlan<R>& plan, const __nv_bfloat16* expert_out, const __nv_bfloat16* shared_out,
                         const float* shared_gate, __nv_bfloat16* out, cudaStream_t stream) = 0;
    // grad_out [T, H] -> grad of expert_out [max_rows, H]: written to `scratch` (the caller's) or to the
    // dispatcher's own receive buffer; returns where they are.
    virtual const __nv_bfloat16* combine_backward(const RoutingPlan<R>& plan, const __nv_bfloat16* grad_out,
                                                  __nv_bfloat16* scratch, cudaStream_t stream) = 0;
    // Grads of the expert rows [max_rows, H] and their probs [max_rows] -> grad_input [T, H] (= or +=) and
    // dense grad_probs [T, E] (zero off the map).
    virtual void dispatch_backward(const RoutingPlan<R>& plan, const uint8_t* routing_map,
                                   const __nv_bfloat16* grad_rows, const R* grad_row_probs, float* grad_input,
                                   bool accumulate, R* grad_probs, cudaStream_t stream) = 0;

    // Whether dispatch_backward leaves the experts' rows (ExpertInput::rows) and combine_backward's result alone, so
    // that a wgrad reading them may still run beside it (the layer's wgrad overlap, moe_layer.h).
    virtual bool backward_leaves_expert_rows() const { return false; }

    // EP = 1 (the rows are a permutation of this rank's tokens): while on, dispatch leaves the rows unwritten and
    // says so (ExpertInput::rows_pending), for fc1's loads to gather; returns whether this dispatcher defers.
    virtual bool set_rows_deferred(bool) { return false; }
    // The rows dispatch left pending, written as dispatch would have (where fc1 did not gather them).
    virtual void write_rows(const RoutingPlan<R>&, const __nv_bfloat16*, cudaStream_t) {}

    // ---- the budgeted dispatcher's step protocol (no-ops elsewhere) ----
    // Reads and clears the device flags (a host sync: call between steps). Throws moekit::Error naming the
    // rank, peer and barrier if a device wait timed out.
    virtual BudgetStatus end_step() { return {}; }
    // While on, the calls run the synchronous alltoall path (the re-run after an overflow).
    virtual void set_synchronous(bool) {}
    // ECHO: where this step's expert weights and grads are (set before dispatch; a no-op elsewhere).
    virtual void set_expert_params(const ExpertParams&) {}
    // ECHO: the last step's plan summary (device values read on the host: between steps only).
    virtual EchoStepSummary echo_summary() const { return {}; }
    // ECHO test hook: every later step draws a forced random plan from `seed` instead of planning.
    virtual void force_random_echo_plans(uint64_t) {}
};

// Blocks (so SMs) the budgeted dispatcher's push/return kernels take by default; the rest stay with the GEMMs.
inline constexpr int kBudgetedDispatchBlocks = 32;

// Static bounds of a rank's dispatcher.
struct DispatchShape {
    RouterShape router;          // this rank's tokens, all E experts
    int64_t plan_max_rows = 0;   // bound on this rank's permuted rows (RouterShape::max_rows)
    int ep_size = 1, ep_rank = 0;
    double receive_factor = 0;   // --moe-expert-rank-capacity-factor (0 = none): the budgeted dispatcher
    int64_t echo_slots = 0;      // ECHO spare slots per rank (--moe-num-echo-experts / EP; 0 = no ECHO)
    EchoAlgorithm echo_algorithm = EchoAlgorithm::waterfill;
    int64_t echo_group_floor_rows = 0;  // plan for time (EchoDims::group_floor_rows)
    int64_t fc1_rows = 0, ffn = 0;  // an expert's weights: fc1 [F1, H], fc2 [H, F] (ECHO copies them)
    int dispatch_blocks = kBudgetedDispatchBlocks;  // the budgeted dispatcher's copy kernels (benchmarks vary it)
    int64_t local_experts() const { return router.num_experts / ep_size; }
    // Rows one source rank can send to one EP rank: L * capacity with padding, else T * min(k, L).
    int64_t rows_per_source() const;
};

// --moe-token-dispatcher-type allgather | alltoall (flex = alltoall here); with a receive factor (EP > 1,
// alltoall or flex) or ECHO spare slots the budgeted one; EP = 1 is the local one whatever the type. `ep` (null at EP = 1) is
// kept by reference.
template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_cuda_dispatcher(const std::string& type, const DispatchShape& shape,
                                                        DeviceComm* ep);

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_local_dispatcher(const DispatchShape& shape);
template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_allgather_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep);
template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_alltoall_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep);
template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_budgeted_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep);

}  // namespace moekit::cuda
