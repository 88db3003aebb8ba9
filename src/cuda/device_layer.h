// The CUDA backend of moekit::Layer (src/cuda/device_layer.cu): checks the views, binds them into a
// CudaMoeLayer created without I/O buffers, and enqueues. Host-only header (no CUDA types).
#pragma once
#include <memory>

#include "moekit/device_layer.h"

namespace moekit::cuda {

class CudaMoeLayer;

// A moekit::Layer whose inner CudaMoeLayer is reachable (stage timing, tracker carry-over, tests).
class CudaLayer : public Layer {
public:
    virtual CudaMoeLayer& inner() = 0;
};

std::unique_ptr<CudaLayer> make_cuda_layer(const MoeConfig& config, const LayerBounds& bounds, int device);

}  // namespace moekit::cuda
