// The `moekit train` job: a student stack of residual MoE layers (h <- h + MoE(h)) learns to imitate a
// frozen random teacher of the same architecture, by MSE on fresh random tokens each step, with Adam.
// Runs on any LayerRunner device. Tool: tools/cmd_train.cpp; report: src/train/report.cpp; test: tests/cpu/test_train.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moekit/config.h"
#include "train/adam.h"

namespace moekit::train {

struct TrainOptions {
    MoeConfig config;            // one MoE layer; config.num_layers layers are stacked
    int64_t steps = 1000;
    AdamOptions adam;
    std::string device = "cpu";  // cpu | cuda
    uint64_t seed = 1234;        // student init, data; the teacher uses seed + 1
    int64_t eval_every = 50;     // held-out batch, no losses or bias counts (0 = never)
    double teacher_gain = 2.5;   // teacher expert weights = gain * Megatron init (far from identity)
};

struct StepRecord {
    int64_t step = 0;
    double loss = 0;            // MSE(student(x), y) / MSE(x, y): 1 = as good as the identity
    double eval_loss = -1;      // same on the held-out batch (-1 when not evaluated this step)
    double aux_loss = 0;        // sum over layers of the attached aux-type losses
    double z_loss = 0;
    double tokens_per_s = 0;
    std::vector<std::vector<int64_t>> tokens_per_expert;  // [layer][expert]
};

struct TrainResult {
    std::vector<StepRecord> steps;
    double seconds = 0;
    double identity_mse = 0;  // MSE(x, y) on the held-out batch: the normaliser
    int64_t tokens_per_step = 0;
};

// Max over experts / mean over experts of a layer's token counts (1 = perfectly balanced).
double load_imbalance(const std::vector<int64_t>& tokens_per_expert);

using ProgressFn = std::function<void(const TrainOptions&, const StepRecord&)>;
TrainResult run_training(const TrainOptions& options, const ProgressFn& progress = nullptr);

}  // namespace moekit::train
