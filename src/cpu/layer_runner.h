// LayerRunner over the CPU reference layer (float32).
#pragma once
#include <memory>

#include "moekit/layer.h"

namespace moekit::cpu {
std::unique_ptr<LayerRunner> make_cpu_layer_runner(const MoeConfig& config);
}
