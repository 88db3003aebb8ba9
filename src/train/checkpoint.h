// Training checkpoints in Megatron's layout: <dir>/iter_0000100/ holding model.safetensors (every layer's
// weights under Megatron's names, "decoder.layers.<l>.mlp." + the layer's state-dict name, fp32 master values,
// router.expert_bias in f64 as the run holds it), optimizer.safetensors (Adam's exp_avg.<name> and
// exp_avg_sq.<name>) and state.json (step, seed, configuration, the records of the steps so far), and
// <dir>/latest_checkpointed_iteration.txt. A checkpoint folder appears whole or not at all (written beside,
// then renamed). Test: tests/cpu/test_train.cpp (resume is bitwise).
#pragma once
#include <string>
#include <vector>

#include "train/train_engine.h"

namespace moekit::train {

struct Checkpoint {
    TrainState state;
    std::vector<StepRecord> history;  // the records of steps 1..state.step
};

// Writes the checkpoint of state.step; returns its folder. Throws UsageError naming --save on failure.
std::string save_checkpoint(const std::string& dir, const TrainOptions& options, const TrainState& state,
                            const std::vector<StepRecord>& history);

// Reads the latest checkpoint in `dir` and checks it fits `options` (same model shape, seed and task);
// throws UsageError naming --load and the mismatch.
Checkpoint load_checkpoint(const std::string& dir, const TrainOptions& options);

}  // namespace moekit::train
