// The CPU backend of moekit::Layer (src/cpu/device_layer.cpp).
#pragma once
#include <memory>

#include "moekit/device_layer.h"

namespace moekit::cpu {
std::unique_ptr<Layer> make_cpu_layer(const MoeConfig& config, const LayerBounds& bounds);
}
