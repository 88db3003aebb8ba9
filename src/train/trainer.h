// The `moekit train` job: a student stack of residual MoE layers (h <- h + MoE(h)) learns to imitate a
// frozen random teacher of the same architecture, by MSE on fresh random tokens each step, with Adam.
// On the CPU (and with --host-loop on CUDA) a host loop over LayerRunners (src/train/host_engine.cpp); on CUDA the
// device-resident engine, one CUDA graph per iteration (src/cuda/train_engine.cu). Tool: tools/cmd_train.cpp;
// checkpoints: src/train/checkpoint.cpp; report: src/train/report.cpp; tests: tests/cpu/test_train.cpp.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moekit/config.h"
#include "train/adam.h"

namespace moekit {
class Communicator;
}

namespace moekit::train {

struct TrainOptions {
    MoeConfig config;            // one MoE layer; config.num_layers layers are stacked
    int64_t steps = 1000;
    AdamOptions adam;
    std::string device = "cpu";  // cpu | cuda
    uint64_t seed = 1234;        // student init, data; the teacher uses seed + 1
    int64_t eval_every = 50;     // held-out batch, no losses or bias counts (0 = never)
    double teacher_gain = 2.5;   // teacher expert weights = gain * Megatron init (far from identity)
    int64_t log_interval = 10;   // records reach the host every N steps (the GPU engine's only host reads)
    std::string save_dir;        // --save: checkpoint folder ("" = none)
    int64_t save_interval = 0;   // --save-interval: steps between checkpoints (0 = only at the end)
    std::string load_dir;        // --load: continue from the latest checkpoint there
    bool host_loop = false;      // [moekit] --host-loop: the LayerRunner loop on any device (host copies)
    bool use_graph = true;       // GPU engine: replay one captured CUDA graph per iteration (false: eager)
    const std::atomic<int>* stop_signal = nullptr;  // set by SIGINT/SIGTERM: stop after the current step
    // Data and expert parallelism (src/train/ep_engine.cpp): the ranks of the run (nullptr = this process
    // alone). Every rank calls run_training with the same options; rank 0 alone reports and saves.
    Communicator* world = nullptr;
    // --global-batch-size: sequences per step, micro-batches of config.micro_batch_size each, spread evenly
    // over the ranks (0 = one micro-batch per rank, Megatron's default). Micro-batch m of step s draws its
    // tokens from data stream data_stream(s, m), so the global batch does not depend on the layout.
    int64_t global_batch_size = 0;
    // --skew zipf:S: expert popularity biased to a Zipf law of exponent S (0 = off; train_task.h says how).
    double skew_zipf = 0;
};

// How a run is laid out over ranks (report.json's `layout`).
struct RunLayout {
    int ranks = 1;
    std::string transport = "none";   // none | local (virtual ranks) | mpi
    int64_t expert_model_parallel_size = 1;
    int64_t global_batch_size = 0;    // sequences per step
    int64_t micro_batches = 1;        // per step, all ranks together
    int64_t micro_batches_per_rank = 1;
};
// The layout `o` asks for; UsageError naming the flag when it cannot be laid out.
RunLayout run_layout(const TrainOptions& o);
// Data stream of micro-batch m of step s: stream s for m = 0 (a one-micro-batch run draws what it always did).
constexpr uint64_t data_stream(int64_t step, int64_t micro_batch) {
    return uint64_t(step) | (uint64_t(micro_batch) << 40);
}

struct StepRecord {
    int64_t step = 0;
    double loss = 0;            // MSE(student(x), y) / MSE(x, y): 1 = as good as the identity
    double eval_loss = -1;      // same on the held-out batch (-1 when not evaluated this step)
    double aux_loss = 0;        // sum over layers of the attached aux-type losses
    double z_loss = 0;
    double tokens_per_s = 0;
    bool grads_finite = true;   // every gradient element finite (Megatron's check-for-nan-in-loss-and-grad)
    std::vector<std::vector<int64_t>> tokens_per_expert;  // [layer][expert]
    // --moe-enable-echo (EP engine): per layer, the step's mean over micro-batches and ranks of the slots
    // in use and of the busiest EP rank's load / mean rank load before and after the plan (empty without ECHO).
    std::vector<double> echo_clones, echo_max_over_mean_before, echo_max_over_mean_after;
};

struct EngineReport;

struct TrainResult {
    std::vector<StepRecord> steps;  // every step of the run, those before a --load included
    double seconds = 0;
    double identity_mse = 0;  // MSE(x, y) on the held-out batch: the normaliser
    int64_t tokens_per_step = 0;
    int64_t resumed_from = 0;       // the step a --load continued from (0 = a fresh run)
    int signal = 0;                 // the signal that stopped the run early (0 = ran to the end)
    std::string engine = "";        // "host loop" | "device-resident, one CUDA graph per iteration" | ...
    std::shared_ptr<EngineReport> perf;  // measured on the GPU engine (zeros elsewhere)
    std::string failure;            // why the run stopped early on a non-finite value ("" = it did not)
    RunLayout layout;
};

// Max over experts / mean over experts of a layer's token counts (1 = perfectly balanced).
double load_imbalance(const std::vector<int64_t>& tokens_per_expert);

// --moe-enable-echo: the run's means over steps and layers of the StepRecord's ECHO fields (zeros without).
struct EchoSummary {
    double clones_per_step = 0, max_over_mean_before = 0, max_over_mean_after = 0;
};
EchoSummary echo_summary(const TrainResult& r);

using ProgressFn = std::function<void(const TrainOptions&, const StepRecord&)>;
TrainResult run_training(const TrainOptions& options, const ProgressFn& progress = nullptr);

}  // namespace moekit::train
