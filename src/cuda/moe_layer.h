// CudaMoeLayer: one MoE layer on one GPU, bf16 weights/activations, fp32 accumulation, router in
// R = float (or double with --moe-router-dtype fp64). Every buffer is sized at construction from
// static bounds (T*k rows, or E*capacity with padding); forward(stream)/backward(stream) only
// enqueue work (no allocation, no host wait), so a whole step can be captured in one CUDA graph.
// Stages: router -> losses -> plan + dispatch -> shared expert -> fc1 -> act*p -> fc2 -> combine, where
// dispatch/combine are the dispatcher stage (src/cuda/dispatcher.h): plain permute/unpermute at EP = 1,
// allgather or alltoall over a DeviceComm at EP > 1 (then fc1/fc2 hold the L = E/EP local experts).
// Twin: cpu::MoeLayer (src/cpu/layer.cpp). Tests: tests/gpu/test_cuda_layer.cu, test_cuda_graph.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/device_comm.h"
#include "cuda/dispatcher.h"
#include "cuda/expert_gemm.h"
#include "cuda/losses.cuh"
#include "cuda/router.cuh"
#include "cuda/shared_expert.cuh"
#include "moekit/config.h"
#include "moekit/device_layer.h"
#include "moekit/layer.h"

namespace moekit::cuda {

struct CudaLayerShape {
    RouterShape router;
    LossShape loss;
    int64_t ffn = 0, fc1_rows = 0;  // F, F*(2 if GLU)
    bool gated_linear_unit = false;
    Activation act = Activation::gelu;
    bool has_shared = false;
    SharedExpertShape shared;
    int64_t max_rows = 0;           // static bound on permuted rows
    bool router_fp64 = false;       // R = double
    std::string dispatcher = "allgather";  // --moe-token-dispatcher-type (EP > 1)
    int ep_size = 1, ep_rank = 0;   // this layer's place in its EP group; experts [ep_rank*L, +L) are local
    double receive_factor = 0;      // --moe-expert-rank-capacity-factor: the budgeted dispatcher (EP > 1)
    int64_t echo_slots = 0;         // --moe-enable-echo: spare slots per rank (--moe-num-echo-experts / EP)
    EchoAlgorithm echo_algorithm = EchoAlgorithm::waterfill;  // --moe-echo-algorithm
    int64_t echo_group_floor_rows = 0;                        // --moe-echo-group-floor-rows
    bool gemm_rule_only = false;  // --deterministic-mode: the grouped GEMMs' rule, never a measured choice
    int64_t local_experts() const { return router.num_experts / ep_size; }
    // The budgeted (sync-free) dispatcher runs: a receive factor or ECHO spare slots, with EP > 1.
    bool sync_free_dispatch() const { return ep_size > 1 && (receive_factor > 0 || echo_slots > 0); }

    static CudaLayerShape from_config(const MoeConfig& config, int64_t seq_length, int64_t micro_batch_size);
    std::string to_string() const;
};

// Device pointers of a layer. "R" arrays are float or double (router_fp64). The inputs, parameters, outputs
// and gradients ("I/O", down to grad_shared_gate) are the layer's own buffers when it was created with
// own_io, otherwise the caller's memory given through bind(); the rest is the layer's workspace.
struct LayerBuffers {
    // ---- inputs the caller fills ----
    __nv_bfloat16* hidden = nullptr;        // [T, H]
    uint8_t* padding_mask = nullptr;        // [T] 1 = padding (zeros = none)
    uint64_t* jitter_seed = nullptr;        // [1] seed of --moe-input-jitter-eps draws (LayerInput::jitter_seed)
    __nv_bfloat16* grad_output = nullptr;   // [T, H]
    __nv_bfloat16* router_weight = nullptr; // [E, H]
    void* expert_bias = nullptr;            // [E] R
    __nv_bfloat16* fc1 = nullptr;           // [L, F1, H] the local experts (L = E at EP = 1)
    __nv_bfloat16* fc2 = nullptr;           // [L, H, F]
    __nv_bfloat16* shared_fc1 = nullptr;    // [Fs1, H]
    __nv_bfloat16* shared_fc2 = nullptr;    // [H, Fs]
    __nv_bfloat16* shared_gate = nullptr;   // [H]
    // ---- outputs ----
    __nv_bfloat16* output = nullptr;        // [T, H]
    float* grad_input = nullptr;            // [T, H]
    float* grad_router_weight = nullptr;    // [E, H]
    float* grad_fc1 = nullptr;              // [L, F1, H]
    float* grad_fc2 = nullptr;              // [L, H, F]
    float* grad_shared_fc1 = nullptr;       // [Fs1, H]
    float* grad_shared_fc2 = nullptr;       // [H, Fs]
    float* grad_shared_gate = nullptr;      // [H]
    // ---- intermediates (stage tests) ----
    void* logits = nullptr;                 // [T, E] R
    void* probs = nullptr;                  // [T, E] R
    uint8_t* routing_map = nullptr;         // [T, E]
    int32_t* topk_idx = nullptr;            // [T, k]
    float* sinkhorn = nullptr;              // [T, E] Sinkhorn matrix (valid rows; null without sinkhorn)
    int32_t* counts = nullptr;              // [E]
    int32_t* offsets = nullptr;             // [E + 1]
    int32_t* row_token = nullptr;           // [max_rows]
    void* row_prob = nullptr;               // [max_rows] R
    int32_t* token_offsets = nullptr;       // [T + 1]
    int32_t* token_rows = nullptr;          // [max_rows]
    __nv_bfloat16* rows = nullptr;          // [max_rows, H] permuted input
    __nv_bfloat16* fc1_out = nullptr;       // [max_rows, F1]
    __nv_bfloat16* act_out = nullptr;       // [max_rows, F] act * p
    __nv_bfloat16* expert_out = nullptr;    // [max_rows, H]
    void* grad_row_probs = nullptr;         // [max_rows] R
    void* grad_probs = nullptr;             // [T, E] R
    void* grad_logits = nullptr;            // [T, E] R
    void* losses = nullptr;                 // [4] R (LossSlot order)
    double* local_tokens_per_expert = nullptr;   // [E]
    double* global_tokens_per_expert = nullptr;  // [E]
    int32_t* ga_steps = nullptr;                 // [1]
};

// What backward does with existing gradient values.
struct BackwardOptions {
    bool accumulate_param_grads = false;  // parameter grads += (Megatron's main_grad) instead of =
    bool accumulate_grad_input = false;   // grad_input += (a residual stream) instead of =
};

// The expert wgrads beside the dgrad chain: each on a stream of its own (at the highest priority, so its CTAs are
// placed first), its persistent grid leaving wgrad_overlap_sms_left() SMs (GemmSmsLeftScope) to the chain's memory
// passes, which then run while it computes: fc2's wgrad beside the activation backward (and fc1's dgrad as SMs free
// up), fc1's beside the dispatch and router backward; joined at the end of backward. Only with a backend that may
// run GEMMs on two streams at once (ExpertGemm::concurrent_wgrad), a dispatcher whose backward leaves the experts'
// rows alone (CudaDispatcher::backward_leaves_expert_rows) and no ECHO slots (whose grads dispatch_backward reads).
// 1 = on, 0 = in line; -1 (default) = MOEKIT_WGRAD_OVERLAP=0|1, else in line. A graph captured from backward keeps
// the priority only where it is instantiated with cudaGraphInstantiateFlagUseNodePriority.
// Off by default: the step with it on / off (moekit bench --variant wgrad-overlap, H200, 2026-11-28), 4-16 SMs left,
// read 0.985-1.004 on qwen3-30b (six runs) and 1.009-1.024 on dsv3-ep8 and mixtral: the wgrads are themselves
// bound partly by their fp32 gradient stores, so the memory passes beside them gain about what the smaller grid
// loses (docs/perf.md).
void set_wgrad_overlap(int on);
bool wgrad_overlap_enabled();
// The SMs the overlapped wgrads leave: MOEKIT_WGRAD_OVERLAP_SMS (1..half the device), else kWgradOverlapSmsLeft.
inline constexpr int kWgradOverlapSmsLeft = 8;
int wgrad_overlap_sms_left();

enum class LayerStage : int { router, permute, shared_expert, fc1, activation, fc2, combine, count };
const char* layer_stage_name(LayerStage stage);
using StageTimesMs = std::array<float, size_t(LayerStage::count)>;

class CudaMoeLayer {
public:
    // Allocates everything (the I/O buffers only with own_io); throws UsageError for configurations
    // --device cuda does not support. With --expert-model-parallel-size N > 1, `ep` is this rank's
    // device communicator over its EP group of N ranks (kept by reference; collective with the peers).
    static std::unique_ptr<CudaMoeLayer> create(const MoeConfig& config, int64_t seq_length, int64_t micro_batch_size,
                                                bool own_io = true, DeviceComm* ep = nullptr);
    virtual ~CudaMoeLayer() = default;

    virtual const CudaLayerShape& shape() const = 0;
    virtual const LayerBuffers& buffers() const = 0;
    virtual void set_expert_gemm(const ExpertGemm& gemm) = 0;
    // Points the I/O fields (hidden .. grad_shared_gate) at `io`'s; a null padding_mask or jitter_seed falls
    // back to the layer's own (zeros). Host-side only: kernels enqueued afterwards use the new pointers.
    virtual void bind(const LayerBuffers& io) = 0;

    // Enqueue only. training: losses, their gradients and the expert-bias/global-aux trackers.
    virtual void forward(cudaStream_t stream, bool training) = 0;
    virtual void backward(cudaStream_t stream, const BackwardOptions& options = {}) = 0;

    // The dispatcher stage's traffic in the last step (bytes sent to other ranks, host syncs).
    virtual DispatchTraffic traffic() const = 0;
    // The budgeted dispatcher's step protocol (src/cuda/budget_step.h; no-ops for the other dispatchers):
    // the end-of-step verdict (a host read between steps), and the synchronous re-run switch.
    virtual BudgetStatus end_dispatch_step() = 0;
    virtual void set_synchronous_dispatch(bool on) = 0;
    // ECHO (--moe-enable-echo, EP > 1): the last step's plan summary (a host read between steps).
    virtual EchoStepSummary echo_summary() const = 0;
    // ECHO test hook: later steps draw forced random plans (clones the planner would not pick).
    virtual void force_random_echo_plans(uint64_t seed) = 0;
    // Device copies of the expert-bias counts and the global-aux tracker, so a re-run step counts once.
    virtual void save_router_trackers(cudaStream_t stream) = 0;
    virtual void restore_router_trackers(cudaStream_t stream) = 0;
    // Bytes of the layer's own allocations (workspace) and of the part saved from forward to backward.
    virtual LayerMemory memory() const = 0;

    // Per-stage cudaEvent timing of eager steps (off by default; not while capturing).
    virtual void enable_stage_timing(bool on) = 0;
    // Waits for the recorded events (outside a step).
    virtual StageTimesMs forward_times_ms() = 0;
    virtual StageTimesMs backward_times_ms() = 0;

    // Host reads, each a synchronous copy: call between steps only.
    virtual LossValues read_losses() const = 0;
    virtual std::vector<int64_t> read_tokens_per_expert() const = 0;
    virtual std::vector<double> read_local_tokens_per_expert() const = 0;
    virtual void reset_local_tokens_per_expert() = 0;
    virtual void reset_global_aux_loss_tracker() = 0;
};

}  // namespace moekit::cuda
