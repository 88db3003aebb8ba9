// moekit::Layer: one MoE layer on tensor views, the API a framework binds to. Built once from a MoeConfig and
// static shape bounds, it owns its workspace (every buffer sized at construction); forward/backward take the
// parameters, gradients and activations as views and only enqueue work on the caller's stream: no
// allocation, no host copy, no host wait on CUDA, so a whole training iteration can be captured in one CUDA
// graph. The CPU backend implements the same interface on host memory (synchronously) and is the oracle.
//
//   dtypes      CUDA                                   CPU
//   parameters  bf16 (expert_bias: f32, f64 if fp64)   f32 (expert_bias: f64)
//   gradients   f32, accumulated (+=) like main_grad   f32, accumulated
//   activations input/output/grad_output bf16,         f32
//               grad_input f32
// Shapes: T = seq_length * micro_batch_size tokens, H hidden, E experts, F expert FFN, F1 = F (x2 with GLU),
// Fs shared FFN. Every view is checked (shape, dtype, memory, device, null) before any work is enqueued; a
// bad one throws UsageError naming the tensor, what it is and what was expected.
// Implementations: src/cpu/device_layer.cpp, src/cuda/device_layer.cu. Example: examples/layer_api.cpp.
#pragma once
#include <cstdint>
#include <memory>

#include "moekit/config.h"
#include "moekit/view.h"

namespace moekit {

class Communicator;  // moekit/comm.h

// Static bounds: the token shape every call uses (buffers are sized from it).
struct LayerBounds {
    int64_t seq_length = 0;        // S
    int64_t micro_batch_size = 1;  // B
    int64_t num_tokens() const { return seq_length * micro_batch_size; }
};

// Megatron's parameter tensors (state-dict names in include/moekit/weights.h); experts stacked along dim 0.
struct LayerParams {
    TensorView router_weight;  // [E, H]
    TensorView expert_bias;    // [E] (only with --moe-router-enable-expert-bias)
    TensorView fc1;            // [E, F1, H]
    TensorView fc2;            // [E, H, F]
    TensorView shared_fc1;     // [Fs1, H] (only with a shared expert)
    TensorView shared_fc2;     // [H, Fs]
    TensorView shared_gate;    // [1, H]   (only with --moe-shared-expert-gate)
};

// Gradients of the trainable parameters (not expert_bias), same shapes, f32.
struct LayerGrads {
    TensorView router_weight, fc1, fc2, shared_fc1, shared_fc2, shared_gate;
};

struct ForwardArgs {
    TensorView input;         // [T, H]
    TensorView output;        // [T, H]
    TensorView padding_mask;  // [T] u8, 1 = padding (optional)
    TensorView jitter_seed;   // [1] i64 seed of --moe-input-jitter-eps draws (optional; 0 when absent)
    bool training = true;     // losses, their gradients and the router trackers only when training
};

struct BackwardArgs {
    TensorView grad_output;            // [T, H]
    TensorView grad_input;             // [T, H] f32
    bool accumulate_grad_input = false;  // grad_input += (a residual stream) instead of =
};

// Device-resident results of the last forward, valid until the next forward (views into the workspace).
struct LayerResults {
    TensorView tokens_per_expert;  // [E] i32: rows each expert processed (after drops, incl. padding rows)
    TensorView losses;             // [4] f32|f64: aux, seq_aux, global_aux, z (Megatron's attached values)
    TensorView probs;              // [T, E] f32|f64 dense, zero outside the routing map
    TensorView routing_map;        // [T, E] u8
};

// Bytes the layer holds, measured from its own allocations.
struct LayerMemory {
    int64_t workspace_bytes = 0;         // everything the layer allocated
    int64_t saved_activation_bytes = 0;  // the part that lives from forward to backward
    int64_t num_tokens = 0;
    double saved_bytes_per_token() const { return num_tokens ? double(saved_activation_bytes) / double(num_tokens) : 0; }
};

class Layer {
public:
    // Throws UsageError for an invalid configuration or one the backend does not support.
    static std::unique_ptr<Layer> create(const MoeConfig& config, const LayerBounds& bounds, Backend backend,
                                         int device = 0);
    // Expert parallelism: `ep` is this rank's EP group of config.expert_model_parallel_size ranks (a group of
    // make_process_groups; it must outlive the layer, and every rank of it creates and calls its layer in step).
    // fc1, fc2 and their grads then hold only the L = E / EP local experts [ep.rank() * L, +L); the router,
    // shared expert, losses and results stay whole. The CUDA backend makes its device communicator from `ep`:
    // virtual ranks (a `local` group) share the current GPU, MPI ranks talk over NCCL (one GPU per process, by
    // its local rank; `device` must be that GPU). The CPU backend runs one rank only (EP = 1).
    static std::unique_ptr<Layer> create(const MoeConfig& config, const LayerBounds& bounds, Backend backend,
                                         Communicator& ep, int device = 0);
    virtual ~Layer() = default;

    virtual Backend backend() const = 0;
    virtual int device() const = 0;
    virtual const MoeConfig& config() const = 0;
    virtual const LayerBounds& bounds() const = 0;
    virtual DType param_dtype() const = 0;       // bf16 (cuda) | f32 (cpu)
    virtual DType activation_dtype() const = 0;  // bf16 (cuda) | f32 (cpu)
    virtual DType router_dtype() const = 0;      // f32 | f64: expert_bias, losses, probs
    virtual int64_t local_experts() const = 0;   // experts fc1/fc2 hold: E, or E / EP under expert parallelism

    // Enqueue one forward on `stream`; the layer saves what backward needs in its workspace.
    virtual void forward(const LayerParams& params, const ForwardArgs& args, Stream stream) = 0;
    // Enqueue the backward of the last forward (same params); parameter gradients accumulate (+=) into grads.
    virtual void backward(const LayerParams& params, const LayerGrads& grads, const BackwardArgs& args,
                          Stream stream) = 0;

    // Megatron's per-global-batch router updates, enqueued: expert_bias += rate * sign(mean(c) - c) from the
    // counts accumulated since the last update, then the counts restart; and the global_aux_loss tracker reset.
    // Under expert parallelism the counts are this rank's tokens' (Megatron sums them over data-parallel ranks
    // first: moekit train's CUDA EP engine does, src/cuda/ep_train_engine.cu).
    virtual void update_expert_bias(const TensorView& expert_bias, Stream stream) = 0;
    virtual void reset_global_aux_loss_tracker(Stream stream) = 0;

    virtual LayerResults results() const = 0;
    virtual LayerMemory memory() const = 0;
};

// Views of the CPU backend's dtypes over host arrays (tests, tools, examples).
inline TensorView host_view(float* p, std::initializer_list<int64_t> dims) { return TensorView(p, DType::f32, dims); }
inline TensorView host_view(double* p, std::initializer_list<int64_t> dims) { return TensorView(p, DType::f64, dims); }
inline TensorView host_view(uint8_t* p, std::initializer_list<int64_t> dims) { return TensorView(p, DType::u8, dims); }

}  // namespace moekit
