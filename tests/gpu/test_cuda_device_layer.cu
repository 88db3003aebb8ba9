// moekit::Layer on the CUDA backend (src/cuda/device_layer.cu), beyond what the 19-configuration oracle
// comparison of test_cuda_layer.cu covers through the LayerRunner adapter: gradients accumulate like main_grad
// and grad_input like a residual stream (bitwise 2x on a second backward), the first call may come inside a
// global-mode graph capture, and misuse (host memory, wrong dtype, null gradient, another device's stream)
// is refused before any kernel runs, naming the tensor.
#include <gtest/gtest.h>

#include <string>

#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "gpu/cuda_layer_test_util.h"
#include "moekit/device_layer.h"

namespace moekit::test {
namespace {

using bf16 = __nv_bfloat16;

std::vector<bf16> to_bf16(const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __nv_bfloat16_raw{float_to_bf16_bits(v[i])};
    return out;
}
std::vector<float> stacked(const std::vector<Matrix<float>>& ms) {
    std::vector<float> v;
    for (const auto& m : ms) v.insert(v.end(), m.data.begin(), m.data.end());
    return v;
}

// A layer's device buffers with views over them (shared expert with gate: every tensor kind).
struct DeviceSetup {
    MoeConfig c;
    int64_t T, H, E, F, F1, Fs;
    cuda::DeviceBuffer<bf16> router, fc1, fc2, sfc1, sfc2, gate, x, y, gy;
    cuda::DeviceBuffer<float> g_router, g_fc1, g_fc2, g_sfc1, g_sfc2, g_gate, gx;

    explicit DeviceSetup(uint64_t seed) : c(small_config()) {
        c.moe_shared_expert_intermediate_size = 16;
        c.moe_shared_expert_gate = true;
        c.normalize();
        T = c.seq_length * c.micro_batch_size, H = c.hidden_size, E = c.num_experts(), F = c.expert_ffn();
        F1 = c.fc1_rows(), Fs = c.shared_ffn();
        const MoeWeights<float> w = bf16_weights(c, seed);
        upload(router, w.router_weight.data), upload(fc1, stacked(w.fc1)), upload(fc2, stacked(w.fc2));
        upload(sfc1, w.shared_fc1.data), upload(sfc2, w.shared_fc2.data), upload(gate, w.shared_gate.data);
        upload(x, bf16_input(c, seed).hidden.data);
        upload(gy, random_matrix<float>(T, H, seed, 9, 1.0).data);
        y.resize(T * H);
        for (auto* g : {&g_router, &g_fc1, &g_fc2, &g_sfc1, &g_sfc2, &g_gate}) g->resize(1);
        g_router.resize(E * H), g_fc1.resize(E * F1 * H), g_fc2.resize(E * H * F), g_sfc1.resize(2 * Fs * H);
        g_sfc2.resize(H * Fs), g_gate.resize(H), gx.resize(T * H);
    }
    static void upload(cuda::DeviceBuffer<bf16>& b, const std::vector<float>& v) {
        b.resize(int64_t(v.size()));
        b.upload(to_bf16(v));
    }
    TensorView dv(void* p, DType d, std::initializer_list<int64_t> dims) { return TensorView(p, d, dims, Backend::cuda, 0); }
    LayerParams params() {
        LayerParams p;
        p.router_weight = dv(router.get(), DType::bf16, {E, H}), p.fc1 = dv(fc1.get(), DType::bf16, {E, F1, H});
        p.fc2 = dv(fc2.get(), DType::bf16, {E, H, F}), p.shared_fc1 = dv(sfc1.get(), DType::bf16, {2 * Fs, H});
        p.shared_fc2 = dv(sfc2.get(), DType::bf16, {H, Fs}), p.shared_gate = dv(gate.get(), DType::bf16, {1, H});
        return p;
    }
    LayerGrads grads() {
        return LayerGrads{dv(g_router.get(), DType::f32, {E, H}),      dv(g_fc1.get(), DType::f32, {E, F1, H}),
                          dv(g_fc2.get(), DType::f32, {E, H, F}),      dv(g_sfc1.get(), DType::f32, {2 * Fs, H}),
                          dv(g_sfc2.get(), DType::f32, {H, Fs}),       dv(g_gate.get(), DType::f32, {1, H})};
    }
    ForwardArgs fwd() {
        ForwardArgs a;
        a.input = dv(x.get(), DType::bf16, {T, H}), a.output = dv(y.get(), DType::bf16, {T, H});
        return a;
    }
    BackwardArgs bwd(bool accumulate_input) {
        BackwardArgs a;
        a.grad_output = dv(gy.get(), DType::bf16, {T, H}), a.grad_input = dv(gx.get(), DType::f32, {T, H});
        a.accumulate_grad_input = accumulate_input;
        return a;
    }
};

TEST(CudaLayerApi, GradientsAccumulateLikeMainGrad) {
    SKIP_WITHOUT_GPU();
    const uint64_t seed = 2718;
    SCOPED_TRACE("seed=" + std::to_string(seed));
    DeviceSetup d(seed);
    auto layer = Layer::create(d.c, LayerBounds{d.c.seq_length, d.c.micro_batch_size}, Backend::cuda);
    layer->forward(d.params(), d.fwd(), Stream{});
    layer->backward(d.params(), d.grads(), d.bwd(false), Stream{});
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto fc1_once = d.g_fc1.download(), router_once = d.g_router.download(), gate_once = d.g_gate.download();
    const auto sfc2_once = d.g_sfc2.download(), gx_once = d.gx.download();
    ASSERT_GT(norm(fc1_once), 0.0);
    ASSERT_GT(norm(router_once), 0.0);
    ASSERT_GT(norm(gate_once), 0.0);
    layer->backward(d.params(), d.grads(), d.bwd(true), Stream{});
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    auto expect_doubled = [](const std::vector<float>& once, const std::vector<float>& twice, const char* what) {
        for (size_t i = 0; i < once.size(); ++i) ASSERT_EQ(twice[i], 2.0f * once[i]) << what << " element " << i;
    };
    expect_doubled(fc1_once, d.g_fc1.download(), "grad fc1");
    expect_doubled(router_once, d.g_router.download(), "grad router.weight");
    expect_doubled(gate_once, d.g_gate.download(), "grad shared gate");
    expect_doubled(sfc2_once, d.g_sfc2.download(), "grad shared fc2");
    // grad_input += routed + shared + router terms one after another: 2x up to float rounding of those sums.
    const std::vector<float> gx_twice = d.gx.download();
    double scale = 0;
    for (float v : gx_once) scale = std::max(scale, double(std::abs(v)));
    for (size_t i = 0; i < gx_once.size(); ++i)
        ASSERT_NEAR(gx_twice[i], 2.0 * gx_once[i], 4e-7 * scale) << "grad_input (accumulate_grad_input) element " << i;
}

// The layer's first call happens while the caller captures in global mode: the view checks must not break
// the capture, and the replayed graph must compute what an eager call computes.
TEST(CudaLayerApi, FirstCallInsideAGlobalCapture) {
    SKIP_WITHOUT_GPU();
    DeviceSetup d(99);
    auto layer = Layer::create(d.c, LayerBounds{d.c.seq_length, d.c.micro_batch_size}, Backend::cuda);
    cudaStream_t s;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    layer->forward(d.params(), d.fwd(), Stream{s});
    layer->backward(d.params(), d.grads(), d.bwd(false), Stream{s});
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec = nullptr;
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    const auto y_graph = d.y.download();
    const auto gx_graph = d.gx.download();
    MOEKIT_CUDA_CHECK(cudaMemset(d.g_fc1.get(), 0, d.g_fc1.bytes()));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());  // the memset went on the legacy stream; s does not wait
    layer->forward(d.params(), d.fwd(), Stream{s});
    layer->backward(d.params(), d.grads(), d.bwd(false), Stream{s});
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    const auto y_eager = d.y.download();
    EXPECT_EQ(0, std::memcmp(y_graph.data(), y_eager.data(), y_eager.size() * sizeof(bf16)));
    EXPECT_EQ(gx_graph, d.gx.download());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
}

TEST(CudaLayerApi, MisuseIsRefusedBeforeAnyKernel) {
    SKIP_WITHOUT_GPU();
    DeviceSetup d(5);
    auto layer = Layer::create(d.c, LayerBounds{d.c.seq_length, d.c.micro_batch_size}, Backend::cuda);
    std::vector<bf16> host_x(size_t(d.T * d.H));
    MOEKIT_CUDA_CHECK(cudaMemset(d.y.get(), 0x7f, d.y.bytes()));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());  // the memset went on the legacy stream; s does not wait
    const auto y_before = d.y.download();
    auto refused = [&](const std::string& what, const std::string& name, auto&& call) {
        try {
            call();
            MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
            ADD_FAILURE() << what << ": accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << what << ": " << e.what();
        }
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto y = d.y.download();
        EXPECT_EQ(0, std::memcmp(y.data(), y_before.data(), y.size() * sizeof(bf16))) << what << ": output written";
    };
    refused("host memory as input", "input", [&] {
        ForwardArgs a = d.fwd();
        a.input.data = host_x.data();
        layer->forward(d.params(), a, Stream{});
    });
    refused("fp32 parameters", "fc2", [&] {
        LayerParams p = d.params();
        p.fc2.dtype = DType::f32;
        layer->forward(p, d.fwd(), Stream{});
    });
    refused("a view said to be on another GPU", "router.weight", [&] {
        LayerParams p = d.params();
        p.router_weight.device = 1;
        layer->forward(p, d.fwd(), Stream{});
    });
    layer->forward(d.params(), d.fwd(), Stream{});  // backward needs a forward; y is reset below
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    MOEKIT_CUDA_CHECK(cudaMemset(d.y.get(), 0x7f, d.y.bytes()));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());  // the memset went on the legacy stream; s does not wait
    refused("a null gradient buffer", "grad fc1", [&] {
        LayerGrads g = d.grads();
        g.fc1 = TensorView();
        layer->backward(d.params(), g, d.bwd(false), Stream{});
    });
    int devices = 0;
    MOEKIT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices > 1) {
        cudaStream_t other;
        MOEKIT_CUDA_CHECK(cudaSetDevice(1));
        MOEKIT_CUDA_CHECK(cudaStreamCreate(&other));
        MOEKIT_CUDA_CHECK(cudaSetDevice(0));
        refused("a stream of another GPU", "stream", [&] { layer->forward(d.params(), d.fwd(), Stream{other}); });
        cudaStreamDestroy(other);
    } else {
        std::printf("one GPU: the other-device stream case needs two and was not run\n");
    }
}

}  // namespace
}  // namespace moekit::test
