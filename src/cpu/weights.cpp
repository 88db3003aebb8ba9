// MoeWeights helpers (include/moekit/weights.h): zeros_like, Megatron's initialisation with one
// counter-based normal stream per tensor (src/core/rng.h, so float and double draws agree up to
// rounding, and a tensor's values do not depend on which other tensors exist), parameter_count.
// Tests: tests/cpu/test_layer.cpp (C12 counts, init statistics, determinism).
#include "moekit/weights.h"

#include <cmath>

#include "core/rng.h"
#include "moekit/error.h"

namespace moekit {

namespace {
// Stream ids: fixed per tensor name, experts spread out so that E never collides with the others.
constexpr uint64_t kStreamRouter = 1;
constexpr uint64_t kStreamSharedFc1 = 2;
constexpr uint64_t kStreamSharedFc2 = 3;
constexpr uint64_t kStreamSharedGate = 4;
constexpr uint64_t kStreamExpertBase = 1000;  // fc1 of expert e: base + 2e, fc2: base + 2e + 1

template <typename T>
Matrix<T> zeros_of(const Matrix<T>& m) {
    return Matrix<T>(m.rows, m.cols);
}

template <typename T>
Matrix<T> normal_matrix(int64_t rows, int64_t cols, double std, uint64_t seed, uint64_t stream) {
    Matrix<T> m(rows, cols);
    for (int64_t i = 0; i < m.size(); ++i) m.data[size_t(i)] = T(std * normal01(seed, stream, uint64_t(i)));
    return m;
}
}  // namespace

template <typename T>
MoeWeights<T> zeros_like(const MoeWeights<T>& w) {
    MoeWeights<T> z;
    z.router_weight = zeros_of(w.router_weight);
    for (const auto& m : w.fc1) z.fc1.push_back(zeros_of(m));
    for (const auto& m : w.fc2) z.fc2.push_back(zeros_of(m));
    z.shared_fc1 = zeros_of(w.shared_fc1);
    z.shared_fc2 = zeros_of(w.shared_fc2);
    z.shared_gate = zeros_of(w.shared_gate);
    return z;
}

template <typename T>
MoeWeights<T> init_weights(const MoeConfig& config, uint64_t seed) {
    const int64_t hidden = config.hidden_size, num_experts = config.num_experts();
    const int64_t ffn = config.expert_ffn(), fc1_rows = config.fc1_rows(), shared_ffn = config.shared_ffn();
    MOEKIT_REQUIRE(hidden > 0 && num_experts > 0 && ffn > 0, "init_weights: --hidden-size=", hidden,
                   ", --num-experts=", num_experts, " and the expert FFN size ", ffn, " must all be > 0");
    MOEKIT_REQUIRE(config.num_layers > 0, "--num-layers=", config.num_layers, " must be > 0");
    const double std = config.init_method_std;
    const double out_std = std / std::sqrt(2.0 * double(config.num_layers));  // output_layer_init_method
    MoeWeights<T> w;
    w.router_weight = normal_matrix<T>(num_experts, hidden, std, seed, kStreamRouter);
    if (config.moe_router_enable_expert_bias) w.expert_bias.assign(size_t(num_experts), 0.0);
    for (int64_t e = 0; e < num_experts; ++e) {
        w.fc1.push_back(normal_matrix<T>(fc1_rows, hidden, std, seed, kStreamExpertBase + 2 * uint64_t(e)));
        w.fc2.push_back(normal_matrix<T>(hidden, ffn, out_std, seed, kStreamExpertBase + 2 * uint64_t(e) + 1));
    }
    if (shared_ffn > 0) {
        const int64_t shared_fc1_rows = shared_ffn * (config.gated_linear_unit ? 2 : 1);
        w.shared_fc1 = normal_matrix<T>(shared_fc1_rows, hidden, std, seed, kStreamSharedFc1);
        w.shared_fc2 = normal_matrix<T>(hidden, shared_ffn, out_std, seed, kStreamSharedFc2);
        if (config.moe_shared_expert_gate) w.shared_gate = normal_matrix<T>(1, hidden, std, seed, kStreamSharedGate);
    }
    return w;
}

int64_t parameter_count(const MoeConfig& config) {
    const int64_t hidden = config.hidden_size, num_experts = config.num_experts();
    int64_t count = num_experts * hidden;                                                // router.weight
    count += num_experts * (config.fc1_rows() * hidden + hidden * config.expert_ffn());  // fc1 + fc2
    const int64_t shared_ffn = config.shared_ffn();
    if (shared_ffn > 0) {
        count += shared_ffn * (config.gated_linear_unit ? 2 : 1) * hidden + hidden * shared_ffn;
        if (config.moe_shared_expert_gate) count += hidden;  // gate_weight [1, H]
    }
    return count;
}

template MoeWeights<float> zeros_like<float>(const MoeWeights<float>&);
template MoeWeights<double> zeros_like<double>(const MoeWeights<double>&);
template MoeWeights<float> init_weights<float>(const MoeConfig&, uint64_t);
template MoeWeights<double> init_weights<double>(const MoeConfig&, uint64_t);

}  // namespace moekit
