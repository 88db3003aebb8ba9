// moekit::Layer on the CUDA backend (include/moekit/device_layer.h). Every call checks its views (shape, dtype,
// null) with the CPU backend's rules, and each pointer's memory once (cudaPointerGetAttributes: device memory of
// this layer's GPU), and the stream's device, before anything is enqueued; then binds them into the
// CudaMoeLayer and enqueues. No allocation, copy or wait: capturable. Twin: src/cpu/device_layer.cpp.
// Tests: tests/gpu/test_cuda_device_layer.cu.
#include <unordered_set>

#include "core/layer_views.h"
#include "core/loss_math.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/device_layer.h"
#include "cuda/moe_layer.h"
#include "comm/device_comm.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

__global__ void update_expert_bias_kernel(int64_t E, double rate, double* __restrict__ counts, float* bias_f32,
                                          double* bias_f64) {
    // One block: bias += rate * sign(mean(c) - c), then the counts restart (cpu::update_expert_bias).
    __shared__ double total;
    if (threadIdx.x == 0) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += counts[e];
        total = s;
    }
    __syncthreads();
    const double mean = total / double(E);
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        if (bias_f32) bias_f32[e] = float(expert_bias_step(double(bias_f32[e]), counts[e], mean, rate));
        if (bias_f64) bias_f64[e] = expert_bias_step(bias_f64[e], counts[e], mean, rate);
        counts[e] = 0;
    }
}

// The checks below are host queries that neither enqueue nor wait; this thread's capture mode is relaxed
// around them so that a first call made while the caller captures a graph in global mode may run them.
struct RelaxedCapture {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
    ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
};

// Makes the layer's GPU current for a call and gives the caller's back after it (no call when they agree).
struct DeviceGuard {
    int previous = -1, wanted;
    explicit DeviceGuard(int device) : wanted(device) {
        const RelaxedCapture relaxed;  // the first call may come inside the caller's global-mode capture
        MOEKIT_CUDA_CHECK(cudaGetDevice(&previous));
        if (previous != wanted) MOEKIT_CUDA_CHECK(cudaSetDevice(wanted));
    }
    ~DeviceGuard() {
        if (previous < 0 || previous == wanted) return;
        const RelaxedCapture relaxed;
        cudaSetDevice(previous);
    }
};

class CudaLayerImpl final : public CudaLayer {
public:
    CudaLayerImpl(const MoeConfig& config, const LayerBounds& bounds, int device, DeviceComm* ep,
                  std::unique_ptr<DeviceComm> owned_ep = nullptr)
        : owned_ep_(std::move(owned_ep)), bounds_(bounds), device_(device) {
        MOEKIT_REQUIRE(bounds.seq_length > 0 && bounds.micro_batch_size > 0, "layer bounds: seq_length=",
                       bounds.seq_length, " and micro_batch_size=", bounds.micro_batch_size, " must be positive");
        int count = 0;
        MOEKIT_CUDA_CHECK(cudaGetDeviceCount(&count));
        MOEKIT_REQUIRE(device >= 0 && device < count, "Layer::create: CUDA device ", device, " does not exist (",
                       count, " visible)");
        const DeviceGuard on(device);
        if (owned_ep_) ep = owned_ep_.get();
        MOEKIT_REQUIRE(ep || config.expert_model_parallel_size <= 1, "Layer::create: --expert-model-parallel-size=",
                       config.expert_model_parallel_size, " needs the EP group: use the form of Layer::create that "
                       "takes one (include/moekit/device_layer.h)");
        MOEKIT_REQUIRE(!ep || ep->device() == device, "Layer::create: the EP group's rank ", ep ? ep->rank() : 0,
                       " runs on cuda:", ep ? ep->device() : 0, " but the layer was asked for cuda:", device);
        // The budgeted dispatcher needs its end-of-step overflow check and re-run (src/cuda/budget_step.h), which
        // this API does not run yet: an over-budget step would go unnoticed, so it is refused here.
        MOEKIT_REQUIRE(!((config.moe_expert_rank_capacity_factor || config.moe_enable_echo) &&
                         config.expert_model_parallel_size > 1),
                       "--moe-expert-rank-capacity-factor or --moe-enable-echo with --expert-model-parallel-size > 1: "
                       "the budgeted dispatcher is not available through moekit::Layer (nor moekit train) yet; it "
                       "runs in moekit layer and moekit bench");
        layer_ = CudaMoeLayer::create(config, bounds.seq_length, bounds.micro_batch_size, /*own_io=*/false, ep);
        config_ = config;
        config_.normalize();
        rules_ = ViewRules{Backend::cuda, device, DType::bf16, router_dtype(), DType::bf16, DType::f32};
        rules_.local_experts = layer_->shape().local_experts();
    }

    CudaMoeLayer& inner() override { return *layer_; }
    Backend backend() const override { return Backend::cuda; }
    int device() const override { return device_; }
    const MoeConfig& config() const override { return config_; }
    const LayerBounds& bounds() const override { return bounds_; }
    DType param_dtype() const override { return DType::bf16; }
    DType activation_dtype() const override { return DType::bf16; }
    DType router_dtype() const override { return layer_->shape().router_fp64 ? DType::f64 : DType::f32; }
    int64_t local_experts() const override { return layer_->shape().local_experts(); }

    void forward(const LayerParams& p, const ForwardArgs& a, Stream stream) override {
        check_params(config_, p, rules_);
        check_forward_args(config_, bounds_, a, rules_);
        for_each_view(p, [&](const char* name, const TensorView& v) { check_memory(name, v); });
        check_memory("input", a.input), check_memory("output", a.output);
        check_memory("padding_mask", a.padding_mask), check_memory("jitter_seed", a.jitter_seed);
        check_stream(stream);
        const DeviceGuard on(device_);
        io_.hidden = a.input.as<bf16>(), io_.output = a.output.as<bf16>();
        io_.padding_mask = a.padding_mask.as<uint8_t>(), io_.jitter_seed = a.jitter_seed.as<uint64_t>();
        bind_params(p);
        layer_->bind(io_);
        layer_->forward(cuda_stream(stream), a.training);
        forwarded_ = true;
    }

    void backward(const LayerParams& p, const LayerGrads& g, const BackwardArgs& a, Stream stream) override {
        MOEKIT_REQUIRE(forwarded_, "Layer::backward: no forward to differentiate (call forward first)");
        check_params(config_, p, rules_);
        check_grads(config_, g, rules_);
        check_backward_args(config_, bounds_, a, rules_);
        for_each_view(p, [&](const char* name, const TensorView& v) { check_memory(name, v); });
        for_each_view(g, [&](const char* name, const TensorView& v) { check_memory(name, v); });
        check_memory("grad_output", a.grad_output), check_memory("grad_input", a.grad_input);
        check_stream(stream);
        const DeviceGuard on(device_);
        bind_params(p);
        io_.grad_output = a.grad_output.as<bf16>(), io_.grad_input = a.grad_input.as<float>();
        io_.grad_router_weight = g.router_weight.as<float>(), io_.grad_fc1 = g.fc1.as<float>();
        io_.grad_fc2 = g.fc2.as<float>(), io_.grad_shared_fc1 = g.shared_fc1.as<float>();
        io_.grad_shared_fc2 = g.shared_fc2.as<float>(), io_.grad_shared_gate = g.shared_gate.as<float>();
        layer_->bind(io_);
        layer_->backward(cuda_stream(stream), BackwardOptions{true, a.accumulate_grad_input});
    }

    void update_expert_bias(const TensorView& bias, Stream stream) override {
        if (!config_.moe_router_enable_expert_bias) return;
        check_view("router.expert_bias", bias, router_dtype(), {config_.num_experts()}, rules_);
        check_memory("router.expert_bias", bias);
        check_stream(stream);
        const DeviceGuard on(device_);
        const bool f64 = bias.dtype == DType::f64;
        update_expert_bias_kernel<<<1, 256, 0, cuda_stream(stream)>>>(
            config_.num_experts(), config_.moe_router_bias_update_rate, layer_->buffers().local_tokens_per_expert,
            f64 ? nullptr : bias.as<float>(), f64 ? bias.as<double>() : nullptr);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
    void reset_global_aux_loss_tracker(Stream stream) override {
        check_stream(stream);
        const DeviceGuard on(device_);
        const LayerBuffers& b = layer_->buffers();
        const size_t E = size_t(config_.num_experts());
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(b.global_tokens_per_expert, 0, E * sizeof(double), cuda_stream(stream)));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(b.ga_steps, 0, sizeof(int32_t), cuda_stream(stream)));
    }

    LayerResults results() const override {
        const int64_t T = bounds_.num_tokens(), E = config_.num_experts();
        const LayerBuffers& b = layer_->buffers();
        const DType r = router_dtype();
        LayerResults out;
        out.tokens_per_expert = TensorView(b.counts, DType::i32, {E}, Backend::cuda, device_);
        out.losses = TensorView(b.losses, r, {4}, Backend::cuda, device_);
        out.probs = TensorView(b.probs, r, {T, E}, Backend::cuda, device_);
        out.routing_map = TensorView(b.routing_map, DType::u8, {T, E}, Backend::cuda, device_);
        return out;
    }
    LayerMemory memory() const override { return layer_->memory(); }

private:
    static cudaStream_t cuda_stream(Stream s) { return static_cast<cudaStream_t>(s.handle); }

    void bind_params(const LayerParams& p) {
        io_.router_weight = p.router_weight.as<bf16>(), io_.expert_bias = p.expert_bias.data;
        io_.fc1 = p.fc1.as<bf16>(), io_.fc2 = p.fc2.as<bf16>();
        io_.shared_fc1 = p.shared_fc1.as<bf16>(), io_.shared_fc2 = p.shared_fc2.as<bf16>();
        io_.shared_gate = p.shared_gate.as<bf16>();
    }

    // Device memory of this layer's GPU (or managed memory). Checked once per pointer: a host call that
    // neither enqueues nor waits, so it is allowed while a stream is being captured.
    void check_memory(const char* name, const TensorView& v) {
        if (v.empty() || checked_.count(v.data)) return;
        cudaPointerAttributes attr{};
        const RelaxedCapture relaxed;
        const cudaError_t err = cudaPointerGetAttributes(&attr, v.data);
        if (err != cudaSuccess) cudaGetLastError();
        MOEKIT_REQUIRE(err == cudaSuccess && (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged),
                       name, ": ", v.to_string(), " points to host memory, expected device memory of cuda:", device_);
        MOEKIT_REQUIRE(attr.type == cudaMemoryTypeManaged || attr.device == device_, name, ": ", v.to_string(),
                       " lives on cuda:", attr.device, ", but this layer runs on cuda:", device_);
        checked_.insert(v.data);
    }
    // The stream's device, once per stream. NOTE: CUDA refuses cudaStreamGetDevice on a capturing stream, so a
    // stream first seen while it captures is checked at its first eager use (a launch on another device's
    // stream inside the capture fails there, with an error, not silently).
    void check_stream(Stream s) {
        if (s.handle == nullptr || checked_streams_.count(s.handle)) return;
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(cuda_stream(s), &capturing));
        if (capturing != cudaStreamCaptureStatusNone) return;
        int dev = -1;
        MOEKIT_CUDA_CHECK(cudaStreamGetDevice(cuda_stream(s), &dev));
        MOEKIT_REQUIRE(dev == device_, "stream: belongs to cuda:", dev, ", but this layer runs on cuda:", device_);
        checked_streams_.insert(s.handle);
    }

    std::unique_ptr<DeviceComm> owned_ep_;  // Layer::create's EP form: the layer's own communicator
    std::unique_ptr<CudaMoeLayer> layer_;
    MoeConfig config_;
    LayerBounds bounds_;
    int device_ = 0;
    ViewRules rules_;
    LayerBuffers io_;
    bool forwarded_ = false;
    std::unordered_set<const void*> checked_, checked_streams_;
};

}  // namespace

MoeConfig train_layer_config(MoeConfig config) {
    config.deterministic_mode = true;
    return config;
}

std::unique_ptr<CudaLayer> make_cuda_layer(const MoeConfig& config, const LayerBounds& bounds, int device,
                                           DeviceComm* ep) {
    return std::make_unique<CudaLayerImpl>(config, bounds, device, ep);
}

std::unique_ptr<CudaLayer> make_cuda_layer(const MoeConfig& config, const LayerBounds& bounds, int device,
                                           Communicator& ep) {
    int count = 0;
    MOEKIT_CUDA_CHECK(cudaGetDeviceCount(&count));
    MOEKIT_REQUIRE(device >= 0 && device < count, "Layer::create: CUDA device ", device, " does not exist (", count,
                   " visible)");
    std::unique_ptr<DeviceComm> comm;
    {
        const DeviceGuard on(device);  // virtual ranks: on this GPU; NCCL picks the process's GPU itself
        comm = make_device_comm(ep);
    }
    return std::make_unique<CudaLayerImpl>(config, bounds, device, nullptr, std::move(comm));
}

}  // namespace moekit::cuda
