// LayerRunner over the CUDA layer (bf16 weights/activations, fp32 accumulation).
// Host-only header: no CUDA types, so C++ code can include it.
#pragma once
#include <memory>

#include "moekit/layer.h"

namespace moekit::cuda {
int device_count();  // 0 when the driver or device is missing (never throws)
std::unique_ptr<LayerRunner> make_cuda_layer_runner(const MoeConfig& config);
}
