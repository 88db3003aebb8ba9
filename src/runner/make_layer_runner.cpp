// Picks the backend that runs a layer: "cpu" (reference) or "cuda" (CUDA builds only), for the view API
// (Layer::create) and the host-matrix adapter (make_layer_runner).
#include "cpu/device_layer.h"
#include "cpu/layer_runner.h"
#include "moekit/comm.h"
#include "moekit/device_layer.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#ifdef MOEKIT_WITH_CUDA
#include "cuda/device_layer.h"
#include "cuda/layer_runner.h"
#endif

namespace moekit {

namespace {
// The single-GPU runner has no ECHO (it needs other EP ranks: the GPU ECHO runs in the EP layer step,
// src/cuda/dispatch_echo.cuh) and no --moe-router-force-load-balancing (src/cpu/router.cpp only).
void refuse_echo_on_cuda(const MoeConfig& config) {
    MOEKIT_REQUIRE(!config.moe_enable_echo, "--moe-enable-echo: not supported yet on --device cuda at "
                   "--expert-model-parallel-size 1 (clones go to other EP ranks: run EP > 1 with --virtual-ranks or "
                   "mpirun; --device cpu runs it)");
    MOEKIT_REQUIRE(!config.moe_router_force_load_balancing, "--moe-router-force-load-balancing: not supported yet on "
                   "--device cuda (the CPU router has it; --device cpu runs it)");
}
}  // namespace

bool cuda_device_available() {
#ifdef MOEKIT_WITH_CUDA
    return cuda::device_count() > 0;
#else
    return false;
#endif
}

std::unique_ptr<Layer> Layer::create(const MoeConfig& config, const LayerBounds& bounds, Backend backend,
                                     int device) {
    if (backend == Backend::cpu) return cpu::make_cpu_layer(config, bounds);
    refuse_echo_on_cuda(config);
#ifdef MOEKIT_WITH_CUDA
    MOEKIT_REQUIRE(cuda::device_count() > 0, "Layer::create(cuda): no CUDA device is visible on this machine");
    return cuda::make_cuda_layer(config, bounds, device);
#else
    (void)device;
    throw UsageError("Layer::create(cuda): this moekit was built without CUDA (no nvcc at configure time)");
#endif
}

std::unique_ptr<Layer> Layer::create(const MoeConfig& config, const LayerBounds& bounds, Backend backend,
                                     Communicator& ep, int device) {
    MOEKIT_REQUIRE(config.expert_model_parallel_size == ep.size(), "Layer::create: --expert-model-parallel-size=",
                   config.expert_model_parallel_size, " but the EP group has ", ep.size(), " rank(s)");
    if (ep.size() == 1) return create(config, bounds, backend, device);
    MOEKIT_REQUIRE(backend == Backend::cuda, "Layer::create(cpu) with an EP group of ", ep.size(),
                   " ranks: the CPU backend's Layer runs one rank (the CPU pipeline on process groups is "
                   "cpu::MoePipeline)");
#ifdef MOEKIT_WITH_CUDA
    MOEKIT_REQUIRE(cuda::device_count() > 0, "Layer::create(cuda): no CUDA device is visible on this machine");
    return cuda::make_cuda_layer(config, bounds, device, ep);
#else
    (void)device;
    throw UsageError("Layer::create(cuda): this moekit was built without CUDA (no nvcc at configure time)");
#endif
}

std::unique_ptr<LayerRunner> make_layer_runner(const MoeConfig& config, const std::string& device) {
    if (device == "cpu") return cpu::make_cpu_layer_runner(config);
    if (device == "cuda") {
        refuse_echo_on_cuda(config);
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
