// The CUDA backend of moekit::Layer (src/cuda/device_layer.cu): checks the views, binds them into a
// CudaMoeLayer created without I/O buffers, and enqueues. Host-only header (no CUDA types).
#pragma once
#include <memory>

#include "moekit/device_layer.h"

namespace moekit {
class Communicator;
}

namespace moekit::cuda {

class CudaMoeLayer;

// A moekit::Layer whose inner CudaMoeLayer is reachable (stage timing, tracker carry-over, tests).
class CudaLayer : public Layer {
public:
    virtual CudaMoeLayer& inner() = 0;
};

class DeviceComm;

// One rank (config.expert_model_parallel_size must be 1), or a rank of an EP group over `ep` (the caller's device
// communicator, kept by reference: the training engine shares one among its layers).
std::unique_ptr<CudaLayer> make_cuda_layer(const MoeConfig& config, const LayerBounds& bounds, int device,
                                           DeviceComm* ep = nullptr);
// moekit train's layers: `config` with --deterministic-mode, so that the grouped GEMMs take the rule's configuration
// and a run resumed in another process computes the same bits (a measured choice may differ between processes).
MoeConfig train_layer_config(MoeConfig config);
// A rank of the EP group `ep` (Layer::create's EP form): the layer makes and owns its device communicator.
std::unique_ptr<CudaLayer> make_cuda_layer(const MoeConfig& config, const LayerBounds& bounds, int device,
                                           Communicator& ep);

}  // namespace moekit::cuda
