// The CUDA data/expert-parallel training engine of `moekit train --device cuda` on several ranks or micro-batches
// per step (src/cuda/ep_train_engine.cu). Host-only header.
#pragma once
#include <memory>

#include "train/train_engine.h"

namespace moekit::cuda {
// Over options.world (every rank calls it; virtual ranks share the current GPU, MPI ranks use NCCL), or one rank.
std::unique_ptr<train::TrainEngine> make_cuda_ep_train_engine(const train::TrainOptions& options);
}
