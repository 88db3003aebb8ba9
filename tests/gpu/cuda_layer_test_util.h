// Helpers of the CUDA layer tests (test_cuda_stages, test_cuda_layer, test_cuda_graph): GPU
// presence, small configs, bf16-rounded seeded weights/inputs shared by the CUDA layer and the
// CPU oracle, and relative error norms.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "cpu/layer_test_util.h"
#include "cuda/cuda_check.h"
#include "cuda/layer_runner.h"
#include "moekit/config.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::test {

#define SKIP_WITHOUT_GPU()                                                                              \
    if (::moekit::cuda::device_count() == 0)                                                           \
    GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or returned 0): GPU test skipped"

// The fused GLU epilogues are in the sm_90 kernels: their tests skip on any other GPU.
inline int device_major() {
    int major = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    return major;
}
#define SKIP_WITHOUT_SM90()                                                                             \
    SKIP_WITHOUT_GPU();                                                                                 \
    if (::moekit::test::device_major() != 9) GTEST_SKIP() << "the fused epilogues are sm_90 kernels"

// The base small config: S=16, B=2 (T=32), H=64, F=32, E=8, k=2, SwiGLU, softmax, aux + z loss.
inline MoeConfig small_config() {
    MoeConfig c;
    c.hidden_size = 64;
    c.num_moe_experts = 8;
    c.moe_ffn_hidden_size = 32;
    c.seq_length = 16;
    c.micro_batch_size = 2;
    c.gated_linear_unit = true;
    c.activation_func = "silu";
    c.moe_router_topk = 2;
    c.moe_router_load_balancing_type = {"aux_loss"};
    c.moe_aux_loss_coeff = {0.01};
    c.moe_z_loss_coeff = 0.001;
    c.moe_router_dtype = "fp32";
    return c;
}

inline void round_bf16(Matrix<float>& m) {
    for (float& v : m.data) v = round_to_bf16(v);
}

// Weights with larger-than-default std so that routing has clear winners; every matrix bf16-exact.
inline MoeWeights<float> bf16_weights(const MoeConfig& c, uint64_t seed) {
    MoeWeights<float> w = init_weights<float>(c, seed);
    w.router_weight = random_matrix<float>(w.router_weight.rows, w.router_weight.cols, seed, 11, 0.5);
    round_bf16(w.router_weight);
    for (size_t e = 0; e < w.fc1.size(); ++e) {
        w.fc1[e] = random_matrix<float>(w.fc1[e].rows, w.fc1[e].cols, seed, 100 + e, 0.15);
        w.fc2[e] = random_matrix<float>(w.fc2[e].rows, w.fc2[e].cols, seed, 200 + e, 0.15);
        round_bf16(w.fc1[e]);
        round_bf16(w.fc2[e]);
    }
    if (!w.shared_fc1.empty()) {
        w.shared_fc1 = random_matrix<float>(w.shared_fc1.rows, w.shared_fc1.cols, seed, 300, 0.15);
        w.shared_fc2 = random_matrix<float>(w.shared_fc2.rows, w.shared_fc2.cols, seed, 301, 0.15);
        round_bf16(w.shared_fc1);
        round_bf16(w.shared_fc2);
    }
    if (!w.shared_gate.empty()) {
        w.shared_gate = random_matrix<float>(1, w.shared_gate.cols, seed, 302, 0.2);
        round_bf16(w.shared_gate);
    }
    if (c.moe_router_enable_expert_bias) {
        w.expert_bias.assign(size_t(c.num_experts()), 0.0);
        for (size_t e = 0; e < w.expert_bias.size(); ++e) w.expert_bias[e] = 0.05 * normal01(seed, 400, e);
    }
    return w;
}

inline LayerInput<float> bf16_input(const MoeConfig& c, uint64_t seed) {
    LayerInput<float> in;
    in.seq_length = c.seq_length;
    in.micro_batch_size = c.micro_batch_size;
    in.hidden = random_matrix<float>(c.seq_length * c.micro_batch_size, c.hidden_size, seed, 1, 1.0);
    round_bf16(in.hidden);
    return in;
}

// ||a - b|| / ||b||; b must be non-trivial (checked by the caller's ASSERT on the norm).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double d = double(a[i]) - double(b[i]);
        num += d * d;
        den += double(b[i]) * double(b[i]);
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
inline double norm(const std::vector<float>& a) {
    double s = 0;
    for (float v : a) s += double(v) * v;
    return std::sqrt(s);
}

}  // namespace moekit::test
