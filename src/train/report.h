// What `moekit train` leaves behind: report.json (resolved config, per-step loss, losses, speed,
// per-layer per-expert loads) and train.png (loss curve; layer 0's per-expert load over steps).
#pragma once
#include <string>

#include "train/trainer.h"

namespace moekit::train {

// Writes <out_dir>/report.json and <out_dir>/train.png (creating out_dir); throws UsageError when it cannot.
void write_report(const std::string& out_dir, const TrainOptions& options, const TrainResult& result);

}  // namespace moekit::train
