// TrainEngine: what the training loop (src/train/trainer.cpp) needs from a device. One implementation per
// placement: the host loop over LayerRunners (src/train/host_engine.cpp, the CPU reference and the old
// host-copy CUDA path) and the device-resident CUDA engine whose iteration is one CUDA graph
// (src/cuda/train_engine.cu). Both compute the same task in the same order (trainer.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moekit/weights.h"
#include "train/trainer.h"

namespace moekit::train {

// Everything a run needs to continue bit for bit: written by checkpoints (src/train/checkpoint.cpp).
// The data is a pure function of (seed, step) and the router trackers restart every step, so the step
// count, the weights (expert bias included) and Adam's moments are the whole state.
struct TrainState {
    int64_t step = 0;                         // completed iterations (= Adam's step)
    std::vector<MoeWeights<float>> weights;   // [layer] fp32 master weights, expert_bias in double
    std::vector<std::vector<float>> adam_m;   // [parameter tensor] in for_each_parameter order, all layers
    std::vector<std::vector<float>> adam_v;
};

// Measured facts about a run that the summary and report.json show (GPU engine; zeros elsewhere).
struct EngineReport {
    int64_t device_bytes = 0;            // bytes moekit allocated on the device for the run
    int64_t device_used_bytes = 0;       // cudaMemGetInfo used delta over the set-up (+ cuBLAS, graphs)
    int64_t layer_workspace_bytes = 0;   // one layer's workspace
    double saved_bytes_per_token = 0;    // one layer's activations kept from forward to backward, per token
    double iteration_ms = 0;             // one captured iteration, replayed alone
    double parts_ms = 0;                 // the sum of its parts, each timed alone
    double expert_gemm_ms = 0;           // fc1 + fc2 forward and backward over all layers (stage timing)
    double expert_gemm_tflops = 0;       // their rate (student fwd+bwd GEMM FLOPs / expert_gemm_ms)
    double dense_cublas_tflops = 0;      // dense bf16 cuBLAS GEMM of the same shape, same run
    double model_tflops = 0;             // all expert GEMM FLOPs of an iteration (teacher incl.) / iteration_ms
    std::string parts;                   // "name ms, ..." for the summary
};

class TrainEngine {
public:
    virtual ~TrainEngine() = default;
    virtual double identity_mse() const = 0;  // MSE(x, y) of the held-out batch
    virtual void step() = 0;                  // one iteration (enqueued on the GPU engine)
    virtual void eval() = 0;                  // held-out loss of the current weights, recorded with the last step
    // Records of finished steps, in order. wait=false returns what is already known without blocking on
    // the GPU (the GPU engine copies records asynchronously at each call and hands them over at the next).
    virtual std::vector<StepRecord> collect(bool wait) = 0;
    virtual TrainState state() = 0;                   // host copy (waits for the device)
    virtual void load_state(const TrainState& s) = 0; // continue from s
    // Memory, and with measure_speed the speed measurements (GPU engine: it replays iterations, so it comes last).
    virtual EngineReport report(bool measure_speed) = 0;
};

std::unique_ptr<TrainEngine> make_host_engine(const TrainOptions& options);
// The ranks of a run must train the same model on the same task: a difference is refused (UsageError) on every
// rank. Collective over world.
void check_same_options(Communicator& world, const TrainOptions& o);
// make(*options.world), or make(a world of one rank) with that world owned along with the engine.
std::unique_ptr<TrainEngine> on_world(const TrainOptions& options,
                                      const std::function<std::unique_ptr<TrainEngine>(Communicator&)>& make);
// Data- and expert-parallel CPU engine over options.world (or one rank): src/train/ep_engine.cpp.
std::unique_ptr<TrainEngine> make_ep_engine(const TrainOptions& options);

}  // namespace moekit::train
