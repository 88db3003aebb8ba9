// Picks the backend that runs a layer: "cpu" (reference) or "cuda" (CUDA builds only).
#include "cpu/layer_runner.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#ifdef MOEKIT_WITH_CUDA
#include "cuda/layer_runner.h"
#endif

namespace moekit {

bool cuda_device_available() {
#ifdef MOEKIT_WITH_CUDA
    return cuda::device_count() > 0;
#else
    return false;
#endif
}

std::unique_ptr<LayerRunner> make_layer_runner(const MoeConfig& config, const std::string& device) {
    if (device == "cpu") return cpu::make_cpu_layer_runner(config);
    if (device == "cuda") {
#ifdef MOEKIT_WITH_CUDA
        MOEKIT_REQUIRE(cuda::device_count() > 0, "--device cuda: no CUDA device is visible on this machine");
        return cuda::make_cuda_layer_runner(config);
#else
        throw UsageError("--device cuda: this moekit was built without CUDA (no nvcc at configure time)");
#endif
    }
    throw UsageError(str("--device ", device, ": must be one of cpu, cuda"));
}

}  // namespace moekit
