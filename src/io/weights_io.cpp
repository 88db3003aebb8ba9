// MoeWeights <-> named tensors with Megatron-Core's state-dict names and [out, in] layouts
// (megatron-moe.md header): router.weight [E, H], router.expert_bias [E] F32, experts.local_experts.{i}.
// linear_fc1.weight [F*(2 if GLU), H] / linear_fc2.weight [H, F], shared_experts.{linear_fc1,linear_fc2,
// gate_weight}. Loading names the missing / misshapen / non-float tensor and what was expected.
// Tests: tests/cpu/test_safetensors.cpp.
#include <set>

#include "moekit/error.h"
#include "moekit/weights.h"

namespace moekit {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
    HostTensor t;
    t.shape = shape;
    return t.shape_string();
}

bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16; }

std::string fc1_name(int64_t i) { return "experts.local_experts." + std::to_string(i) + ".linear_fc1.weight"; }
std::string fc2_name(int64_t i) { return "experts.local_experts." + std::to_string(i) + ".linear_fc2.weight"; }

// The prefix shared by a Megatron state dict exported from a model ("decoder.layers.0.mlp.").
std::string detect_prefix(const std::map<std::string, HostTensor>& tensors) {
    static const std::string kAnchor = "router.weight";
    if (tensors.count(kAnchor)) return "";
    std::vector<std::string> candidates;
    for (const auto& [name, t] : tensors)
        if (name.size() > kAnchor.size() && name.compare(name.size() - kAnchor.size(), kAnchor.size(), kAnchor) == 0 &&
            name[name.size() - kAnchor.size() - 1] == '.')
            candidates.push_back(name.substr(0, name.size() - kAnchor.size()));
    if (candidates.size() > 1) {
        std::string list;
        for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
        throw UsageError(str("several MoE layers in one file (prefixes ", list, "): choose one with --weights-prefix"));
    }
    return candidates.empty() ? "" : candidates[0];
}

template <typename T>
Matrix<T> to_matrix(const HostTensor& t) {
    Matrix<T> m(t.shape.at(0), t.shape.at(1));
    const auto values = t.to_double();
    for (size_t i = 0; i < values.size(); ++i) m.data[i] = T(values[i]);
    return m;
}

}  // namespace

template <typename T>
std::map<std::string, HostTensor> weights_to_tensors(const MoeWeights<T>& w, DType dtype, const std::string& prefix) {
    MOEKIT_CHECK(is_float(dtype), "weights are written in a floating dtype, not ", dtype_name(dtype));
    MOEKIT_CHECK(w.fc1.size() == w.fc2.size(), "fc1 and fc2 expert counts differ");
    std::map<std::string, HostTensor> out;
    out[prefix + "router.weight"] = HostTensor::from_matrix(w.router_weight, dtype);
    if (!w.expert_bias.empty())  // an fp32 buffer upstream, whatever the parameter dtype
        out[prefix + "router.expert_bias"] =
            HostTensor::from_double(w.expert_bias, {int64_t(w.expert_bias.size())}, DType::f32);
    for (size_t i = 0; i < w.fc1.size(); ++i) {
        out[prefix + fc1_name(int64_t(i))] = HostTensor::from_matrix(w.fc1[i], dtype);
        out[prefix + fc2_name(int64_t(i))] = HostTensor::from_matrix(w.fc2[i], dtype);
    }
    if (!w.shared_fc1.empty()) {
        out[prefix + "shared_experts.linear_fc1.weight"] = HostTensor::from_matrix(w.shared_fc1, dtype);
        out[prefix + "shared_experts.linear_fc2.weight"] = HostTensor::from_matrix(w.shared_fc2, dtype);
    }
    if (!w.shared_gate.empty())
        out[prefix + "shared_experts.gate_weight"] = HostTensor::from_matrix(w.shared_gate, dtype);
    return out;
}

template <typename T>
MoeWeights<T> weights_from_tensors(const MoeConfig& config, const std::map<std::string, HostTensor>& tensors,
                                   const std::string& prefix_arg) {
    const std::string prefix = prefix_arg.empty() ? detect_prefix(tensors) : prefix_arg;
    const int64_t E = config.num_experts(), H = config.hidden_size, F = config.expert_ffn();
    const int64_t glu = config.gated_linear_unit ? 2 : 1;
    std::set<std::string> used;

    // Finds `name` (or its TE GroupedMLP alias) and checks dtype and shape.
    auto get = [&](const std::string& name, const std::vector<int64_t>& expected,
                   const std::string& alias = "") -> const HostTensor& {
        auto it = tensors.find(prefix + name);
        if (it == tensors.end() && !alias.empty()) it = tensors.find(prefix + alias);
        MOEKIT_REQUIRE(it != tensors.end(), "missing tensor '", prefix + name, "' (expected ", shape_str(expected),
                       ")");
        const HostTensor& t = it->second;
        used.insert(it->first);
        MOEKIT_REQUIRE(is_float(t.dtype), "tensor '", it->first, "' has dtype ", dtype_name(t.dtype),
                       ", not a floating type (F32, F64, BF16, F16)");
        if (t.shape != expected) {
            std::string hint;
            if (expected.size() == 2 && t.shape.size() == 2 && t.shape[1] == expected[1] &&
                name.find("fc1") != name.npos) {
                if (t.shape[0] == 2 * expected[0])
                    hint = "; the file looks gated: pass --swiglu or --geglu";
                else if (2 * t.shape[0] == expected[0])
                    hint = "; the file looks non-gated: drop --swiglu / --geglu";
            }
            throw UsageError(
                str("tensor '", it->first, "' has shape ", t.shape_string(), ", expected ", shape_str(expected), hint));
        }
        return t;
    };

    MoeWeights<T> w;
    w.router_weight = to_matrix<T>(get("router.weight", {E, H}));
    if (config.moe_router_enable_expert_bias) w.expert_bias = get("router.expert_bias", {E}).to_double();
    for (int64_t i = 0; i < E; ++i) {
        w.fc1.push_back(to_matrix<T>(get(fc1_name(i), {glu * F, H}, "experts.linear_fc1.weight" + std::to_string(i))));
        w.fc2.push_back(to_matrix<T>(get(fc2_name(i), {H, F}, "experts.linear_fc2.weight" + std::to_string(i))));
    }
    if (const int64_t fs = config.shared_ffn(); fs > 0) {
        w.shared_fc1 = to_matrix<T>(get("shared_experts.linear_fc1.weight", {glu * fs, H}));
        w.shared_fc2 = to_matrix<T>(get("shared_experts.linear_fc2.weight", {H, fs}));
        if (config.moe_shared_expert_gate) w.shared_gate = to_matrix<T>(get("shared_experts.gate_weight", {1, H}));
    }

    // Anything else under the prefix would be silently dropped: refuse it, saying which flag it suggests.
    for (const auto& [name, t] : tensors) {
        if (used.count(name) || name.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string local = name.substr(prefix.size());
        if (local.size() >= 12 && local.compare(local.size() - 12, 12, "_extra_state") == 0) continue;  // TE fp8 state
        std::string hint = "not a parameter of the configured layer";
        if (local == "router.expert_bias")
            hint = "expert bias is off: pass --moe-router-enable-expert-bias";
        else if (local.rfind("experts.", 0) == 0)
            hint = str("only ", E, " experts are configured (--num-experts)");
        else if (local.rfind("shared_experts.gate", 0) == 0)
            hint = "pass --moe-shared-expert-gate";
        else if (local.rfind("shared_experts.", 0) == 0)
            hint = "pass --moe-shared-expert-intermediate-size";
        else if (local == "router.bias")
            hint = "router bias (--add-bias-linear) is not supported yet by moekit";
        throw UsageError(str("unexpected tensor '", name, "' ", t.shape_string(), ": ", hint));
    }
    return w;
}

template std::map<std::string, HostTensor> weights_to_tensors<float>(const MoeWeights<float>&, DType,
                                                                     const std::string&);
template std::map<std::string, HostTensor> weights_to_tensors<double>(const MoeWeights<double>&, DType,
                                                                      const std::string&);
template MoeWeights<float> weights_from_tensors<float>(const MoeConfig&, const std::map<std::string, HostTensor>&,
                                                       const std::string&);
template MoeWeights<double> weights_from_tensors<double>(const MoeConfig&, const std::map<std::string, HostTensor>&,
                                                         const std::string&);

}  // namespace moekit
