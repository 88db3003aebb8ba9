// The CUDA router's warp top-k on non-finite scores (issue 11), against the CPU twin: with a NaN in
// router.weight (every token's logit of one expert is NaN) and an Inf input row, every selected index is
// in [0, E) (never INT32_MAX or -1 into the permute) and equals the CPU's (NaN ranks last, ties by index:
// core/router_math.h), for softmax post/pre, sigmoid with groups and bias, and capacity dropping by probs.
// Skips without a GPU. Run under compute-sanitizer by scripts/device_check.sh with the other GPU tests.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/bf16.h"
#include "cpu/layer_test_util.h"
#include "cpu/router.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/router.cuh"

namespace moekit::test {
namespace {

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<__nv_bfloat16> bf16_of(const std::vector<float>& v) {
    std::vector<__nv_bfloat16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __nv_bfloat16_raw{float_to_bf16_bits(v[i])};
    return out;
}

void check_non_finite_routing(MoeConfig c, const char* what) {
    SCOPED_TRACE(what);
    const uint64_t seed = 1301;
    std::printf("%s: seed %llu\n", what, (unsigned long long)seed);
    c.normalize();
    c.validate();
    const int64_t T = c.seq_length * c.micro_batch_size, H = c.hidden_size, E = c.num_experts(), k = c.moe_router_topk;
    // bf16-exact values, so both backends see the same numbers.
    Matrix<float> x = random_matrix<float>(T, H, seed, 1, 1.0), w = random_matrix<float>(E, H, seed, 2, 0.5);
    for (auto& v : x.data) v = round_to_bf16(v);
    for (auto& v : w.data) v = round_to_bf16(v);
    w(3, 1) = std::numeric_limits<float>::quiet_NaN();  // expert 3: NaN logit for every token
    x(5, 2) = std::numeric_limits<float>::infinity();   // token 5: +-Inf logits
    std::vector<double> bias;
    if (c.moe_router_enable_expert_bias) bias.assign(size_t(E), 0.01);

    const cuda::RouterShape s = cuda::RouterShape::from_config(c, c.seq_length, c.micro_batch_size);
    cuda::DeviceBuffer<__nv_bfloat16> hidden(T * H), weight(E * H);
    cuda::DeviceBuffer<float> hidden_r(T * H), weight_r(E * H), logits(T * E), probs(T * E), dbias(E);
    cuda::DeviceBuffer<uint8_t> padding(T), map(T * E);
    cuda::DeviceBuffer<int32_t> topk(T * k);
    cuda::DeviceBuffer<uint64_t> jitter_seed(1);
    hidden.upload(bf16_of(x.data));
    weight.upload(bf16_of(w.data));
    if (!bias.empty()) dbias.upload(std::vector<float>(bias.begin(), bias.end()));
    cuda::RouterTensors<float> t;
    t.hidden = hidden.get(), t.weight = weight.get(), t.expert_bias = bias.empty() ? nullptr : dbias.get();
    t.padding_mask = padding.get(), t.hidden_r = hidden_r.get(), t.weight_r = weight_r.get();
    t.logits = logits.get(), t.topk_idx = topk.get(), t.probs = probs.get(), t.routing_map = map.get();
    t.jitter_seed = jitter_seed.get();
    cublasHandle_t cublas;
    ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
    cuda::router_forward<float>(s, t, cublas, nullptr, true);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    cublasDestroy(cublas);

    const std::vector<int32_t> got = topk.download();
    for (int64_t i = 0; i < T * k; ++i) {
        ASSERT_GE(got[size_t(i)], 0) << "entry " << i;
        ASSERT_LT(got[size_t(i)], E) << "entry " << i;
    }
    cpu::RouterState state;
    cpu::RouterContext<float> rc;
    LayerInput<float> in;
    in.hidden = x;
    in.seq_length = c.seq_length;
    in.micro_batch_size = c.micro_batch_size;
    cpu::router_forward(c, w, bias, in, state, rc);
    EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), rc.topk_idx) << "top-k differs from the CPU twin";
    EXPECT_EQ(map.download(), rc.routing_map) << "routing map differs from the CPU twin";
}

MoeConfig base() {
    MoeConfig c;
    c.hidden_size = 16;
    c.num_moe_experts = 8;
    c.moe_ffn_hidden_size = 8;
    c.seq_length = 12;
    c.micro_batch_size = 2;
    c.moe_router_topk = 2;
    c.moe_router_dtype = "fp32";
    return c;
}

TEST(CudaRouterNonFinite, SoftmaxPost) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    check_non_finite_routing(base(), "softmax post");
}

TEST(CudaRouterNonFinite, SoftmaxPreK1) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    MoeConfig c = base();
    c.moe_router_topk = 1;
    c.moe_router_pre_softmax = true;
    check_non_finite_routing(c, "softmax pre k=1");
}

TEST(CudaRouterNonFinite, SigmoidGroupsBias) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    MoeConfig c = base();
    c.moe_router_topk = 4;
    c.moe_router_score_function = "sigmoid";
    c.moe_router_num_groups = 4;
    c.moe_router_group_topk = 2;
    c.moe_router_enable_expert_bias = true;
    check_non_finite_routing(c, "sigmoid groups bias");
}

TEST(CudaRouterNonFinite, CapacityByProbs) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
    MoeConfig c = base();
    c.moe_router_topk = 3;
    c.moe_expert_capacity_factor = 1.0;
    check_non_finite_routing(c, "capacity probs");
}

}  // namespace
}  // namespace moekit::test
