// The device-resident training engine of `moekit train --device cuda` (src/cuda/train_engine.cu). Host-only header.
#pragma once
#include <memory>

#include "train/train_engine.h"

namespace moekit::cuda {
std::unique_ptr<train::TrainEngine> make_cuda_train_engine(const train::TrainOptions& options);
}
