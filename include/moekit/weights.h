// The parameters of one MoE layer, with Megatron-Core's state-dict names and [out, in] layouts.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moekit/config.h"
#include "moekit/tensor.h"

namespace moekit {

template <typename T>
struct MoeWeights {
    Matrix<T> router_weight;          // [E, H]               router.weight
    std::vector<double> expert_bias;  // [E] fp32 upstream     router.expert_bias (empty unless enabled)
    std::vector<Matrix<T>> fc1;       // E x [F*(2 if GLU), H] experts.local_experts.{i}.linear_fc1.weight (gate rows first)
    std::vector<Matrix<T>> fc2;       // E x [H, F]            experts.local_experts.{i}.linear_fc2.weight
    Matrix<T> shared_fc1;             // [Fs*(2 if GLU), H]    shared_experts.linear_fc1.weight (empty without shared expert)
    Matrix<T> shared_fc2;             // [H, Fs]               shared_experts.linear_fc2.weight
    Matrix<T> shared_gate;            // [1, H]                shared_experts.gate_weight (empty without gate)
};

// Same shapes, all zero (gradient accumulators); expert_bias stays empty.
template <typename T>
MoeWeights<T> zeros_like(const MoeWeights<T>& w);

// Megatron's initialisation: N(0, init_method_std^2) for router, fc1, shared fc1 and gate;
// N(0, (init_method_std / sqrt(2 * num_layers))^2) for fc2 (output_layer_init_method); bias zeros.
// Deterministic in (config, seed).
template <typename T>
MoeWeights<T> init_weights(const MoeConfig& config, uint64_t seed);

// Number of trainable parameters (router E*H + experts + shared), as Megatron counts them.
int64_t parameter_count(const MoeConfig& config);

// Megatron state-dict names -> tensors in `dtype` (expert_bias is always F32, as upstream).
template <typename T>
std::map<std::string, HostTensor> weights_to_tensors(const MoeWeights<T>& w, DType dtype, const std::string& prefix = "");

// Inverse of weights_to_tensors; any float dtype is accepted. Throws UsageError naming the
// missing tensor, or the tensor with the wrong shape/dtype and what was expected.
template <typename T>
MoeWeights<T> weights_from_tensors(const MoeConfig& config, const std::map<std::string, HostTensor>& tensors,
                                   const std::string& prefix = "");

}  // namespace moekit
