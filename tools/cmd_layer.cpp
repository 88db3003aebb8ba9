// `moekit layer`: one forward+backward of one MoE layer on tensors from safetensors files, for parity
// checks against Megatron-Core (weights with Megatron's state-dict names; input [S, B, H]). Writes
// output, grad_input, grad.<parameter>, probs, routing_map, tokens_per_expert and loss.* in the compute
// dtype, with the resolved config in the metadata. --device defaults to cuda where a GPU is present (else cpu).
// File contract: docs/usage.md. Tests: tests/cpu/test_cmd_layer.cpp, tests/gpu/test_cuda_cmd_layer.cpp (cpu vs cuda).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>

#include "command.h"
#include "core/finite.h"
#include "core/flags.h"
#include "core/host_memory.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "layer_ep.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::tools {
namespace {

constexpr uint64_t kStreamRandomInput = 0x1a7e'0001;  // rng stream of the input drawn without --input

struct LayerArgs {
    std::string weights, weights_prefix, input, grad_output, out, init, save_weights;
    std::string dtype = "fp32", device = "cpu";
    bool device_given = false;  // else picked: cuda when a GPU is present (falls back to cpu if cuda refuses the config)
    bool eval = false;
    bool micro_batch_size_given = false;  // then it must match the input's B
    int64_t virtual_ranks = 0;             // --virtual-ranks N: N ranks as threads of this process
};

bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16; }

std::string names_of(const std::map<std::string, HostTensor>& tensors) {
    std::string s;
    for (const auto& [name, t] : tensors) s += (s.empty() ? "" : ", ") + name;
    return s.empty() ? "nothing" : s;
}

// The prefix under which router.weight lives ("" or e.g. "decoder.layers.0.mlp."), for shape inference.
std::string find_prefix(const std::map<std::string, HostTensor>& tensors, const std::string& given) {
    if (!given.empty() || tensors.count("router.weight")) return given;
    std::string found;
    for (const auto& [name, t] : tensors)
        if (name.size() > 14 && name.compare(name.size() - 14, 14, ".router.weight") == 0) {
            if (!found.empty()) return "";  // several layers: weights_from_tensors reports it
            found = name.substr(0, name.size() - 13);
        }
    return found;
}

// Shapes the user did not give are read from the weight file (H, E, F, shared size, shared gate).
std::string infer_shapes(MoeConfig& c, const FlagParser& p, const std::map<std::string, HostTensor>& tensors,
                         const std::string& prefix) {
    std::string inferred;
    auto note = [&](const std::string& flag, int64_t v) { inferred += " " + flag + "=" + std::to_string(v); };
    auto shape_of = [&](const std::string& name) -> const std::vector<int64_t>* {
        auto it = tensors.find(prefix + name);
        return it == tensors.end() || it->second.shape.size() != 2 ? nullptr : &it->second.shape;
    };
    if (const auto* router = shape_of("router.weight")) {
        if (!p.was_set("--hidden-size")) c.hidden_size = (*router)[1], note("--hidden-size", c.hidden_size);
        if (!p.was_set("--num-experts")) c.num_moe_experts = (*router)[0], note("--num-experts", (*router)[0]);
    }
    const auto* fc2 = shape_of("experts.local_experts.0.linear_fc2.weight");
    if (!fc2) fc2 = shape_of("experts.linear_fc2.weight0");
    if (fc2 && !p.was_set("--moe-ffn-hidden-size") && !p.was_set("--ffn-hidden-size"))
        c.moe_ffn_hidden_size = (*fc2)[1], note("--moe-ffn-hidden-size", (*fc2)[1]);
    if (const auto* shared = shape_of("shared_experts.linear_fc2.weight");
        shared && !p.was_set("--moe-shared-expert-intermediate-size"))
        c.moe_shared_expert_intermediate_size = (*shared)[1],
        note("--moe-shared-expert-intermediate-size", (*shared)[1]);
    if (shape_of("shared_experts.gate_weight") && !p.was_set("--moe-shared-expert-gate") && !c.moe_shared_expert_gate)
        c.moe_shared_expert_gate = true, inferred += " --moe-shared-expert-gate";
    return inferred;
}

// A float tensor of an exact shape from a file; messages name the file, the tensor and the expectation.
const HostTensor& require_tensor(const SafetensorsFile& f, const std::string& path, const std::string& name,
                                 const std::vector<int64_t>& shape, const std::string& shape_text) {
    auto it = f.tensors.find(name);
    MOEKIT_REQUIRE(it != f.tensors.end(), path, ": missing tensor '", name, "' (expected ", shape_text,
                   "; the file has ", names_of(f.tensors), ")");
    MOEKIT_REQUIRE(is_float(it->second.dtype), path, ": tensor '", name, "' has dtype ", dtype_name(it->second.dtype),
                   ", not a floating type (F32, F64, BF16, F16)");
    MOEKIT_REQUIRE(shape.empty() || it->second.shape == shape, path, ": tensor '", name, "' has shape ",
                   it->second.shape_string(), ", expected ", shape_text);
    return it->second;
}

void refuse_unknown(const SafetensorsFile& f, const std::string& path, std::initializer_list<const char*> known) {
    for (const auto& [name, t] : f.tensors) {
        bool ok = false;
        for (const char* k : known) ok = ok || name == k;
        std::string list;
        for (const char* k : known) list += (list.empty() ? "" : ", ") + std::string(k);
        MOEKIT_REQUIRE(ok, path, ": unexpected tensor '", name, "' (this file may hold ", list, ")");
    }
}

// Every float tensor of a file must hold finite values that fit the compute dtype T: a NaN/Inf (or a 3e38
// that overflows the router's logits) would otherwise come out as NaN results with exit 0.
// Only tensors under `prefix` (the layer read from a multi-layer file).
template <typename T>
void refuse_non_finite(const SafetensorsFile& f, const std::string& path, const std::string& prefix = "") {
    for (const auto& [name, t] : f.tensors) {
        if (!is_float(t.dtype) || name.compare(0, prefix.size(), prefix) != 0) continue;
        const std::vector<double> v = t.to_double();
        const int64_t i = first_non_finite(v);
        MOEKIT_REQUIRE(i < 0, path, ": tensor '", name, "' holds a non-finite value (", v[size_t(i >= 0 ? i : 0)],
                       ") at index ", i, " ", HostTensor{DType::f32, unflatten_index(i, t.shape), {}}.shape_string(),
                       ": moekit refuses NaN and Inf inputs");
        // A finite value beyond the compute dtype becomes Inf on conversion: same refusal, naming the dtype.
        for (size_t j = 0; j < v.size(); ++j)
            MOEKIT_REQUIRE(std::abs(v[j]) <= double(std::numeric_limits<T>::max()), path, ": tensor '", name,
                           "' holds ", v[j], " at index ", j, ", beyond the range of the compute dtype ",
                           sizeof(T) == 8 ? "fp64" : "fp32");
    }
}

// Inputs and outputs are different files: an output path equal to an input (same file by canonical path,
// or a hard link to it) would overwrite the input with results. Outputs must not be folders either, and
// their folder must exist: checked before any work, so a typo costs nothing.
void check_paths(const LayerArgs& a) {
    namespace fs = std::filesystem;
    const std::pair<const char*, const std::string*> inputs[] = {
        {"--weights", &a.weights}, {"--input", &a.input}, {"--grad-output", &a.grad_output}};
    const std::pair<const char*, const std::string*> outputs[] = {{"--out", &a.out}, {"--save-weights", &a.save_weights}};
    auto same = [](const std::string& x, const std::string& y) {
        std::error_code ec1, ec2, ec3;
        if (fs::weakly_canonical(x, ec1) == fs::weakly_canonical(y, ec2) && !ec1 && !ec2) return true;
        return fs::exists(x, ec1) && fs::exists(y, ec2) && fs::equivalent(x, y, ec3) && !ec3;
    };
    for (size_t o = 0; o < std::size(outputs); ++o) {
        const auto& [oflag, opath] = outputs[o];
        if (opath->empty()) continue;
        std::error_code ec;
        MOEKIT_REQUIRE(!fs::is_directory(*opath, ec), oflag, " ", *opath, ": is a directory; give a file name");
        const fs::path parent = fs::path(*opath).parent_path();
        MOEKIT_REQUIRE(parent.empty() || fs::is_directory(parent, ec), oflag, " ", *opath, ": the folder ",
                       parent.string(), " does not exist");
        for (const auto& [iflag, ipath] : inputs)
            MOEKIT_REQUIRE(ipath->empty() || !same(*opath, *ipath), oflag, " and ", iflag, " name the same file (",
                           *opath, "): the ", oflag == std::string("--out") ? "results" : "weights",
                           " would overwrite an input; give another ", oflag);
        for (size_t p = o + 1; p < std::size(outputs); ++p)
            MOEKIT_REQUIRE(outputs[p].second->empty() || !same(*opath, *outputs[p].second), oflag, " and ",
                           outputs[p].first, " name the same file (", *opath, "): one would overwrite the other");
    }
}

template <typename T>
Matrix<T> as_matrix(const HostTensor& t, int64_t rows, int64_t cols) {
    Matrix<T> m(rows, cols);
    const auto v = t.to_double();
    for (size_t i = 0; i < v.size(); ++i) m.data[i] = T(v[i]);
    return m;
}

template <typename T>
HostTensor tensor_of(const Matrix<T>& m, std::vector<int64_t> shape, DType dtype) {
    return HostTensor::from_double(std::vector<double>(m.data.begin(), m.data.end()), std::move(shape), dtype);
}

double norm(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s);
}

HostTensor bool_tensor(const std::vector<uint8_t>& bytes, std::vector<int64_t> shape) {
    HostTensor t;
    t.dtype = DType::boolean;
    t.shape = std::move(shape);
    t.bytes.assign(bytes.begin(), bytes.end());
    for (auto& b : t.bytes) b = b != 0;
    return t;
}

// One eager step on the GPU: its grouped GEMMs take their rule, as under --deterministic-mode, not a configuration
// measured per shape (src/cuda/gemm_tuning.h): one step cannot win back the tuning's time, and two processes given
// the same files write the same bits. The CPU reference ignores the flag.
MoeConfig one_step_config(MoeConfig c) {
    c.deterministic_mode = true;
    return c;
}

template <typename T>
int run_layer(MoeConfig& cfg, LayerArgs& a, const std::vector<std::string>& argv, const std::string& inferred,
              const SafetensorsFile* weight_file, const std::string& weights_prefix, Communicator* world) {
    const bool rank0 = !world || world->rank() == 0;  // under EP every rank computes, rank 0 reports
    constexpr DType kDtype = sizeof(T) == 8 ? DType::f64 : DType::f32;
    std::map<std::string, std::string> meta;

    // ---- input [S, B, H], padding_mask [B, S], grad_output [S, B, H] ----
    const int64_t H = cfg.hidden_size;
    Matrix<T> hidden;
    std::vector<uint8_t> padding;
    SafetensorsFile in_file;
    int64_t S = cfg.seq_length, B = cfg.micro_batch_size;
    if (!a.input.empty()) {
        in_file = read_safetensors(a.input);
        refuse_unknown(in_file, a.input, {"input", "padding_mask", "grad_output"});
        refuse_non_finite<T>(in_file, a.input);
        const HostTensor& x = require_tensor(in_file, a.input, "input", {}, str("[S, B, ", H, "]"));
        MOEKIT_REQUIRE(x.shape.size() == 3 && x.shape[2] == H, a.input, ": tensor 'input' has shape ", x.shape_string(),
                       ", expected [S, B, ", H, "] (--hidden-size=", H, ")");
        MOEKIT_REQUIRE(x.shape[0] > 0 && x.shape[1] > 0, a.input, ": tensor 'input' has shape ", x.shape_string(),
                       ": S and B must be > 0");
        MOEKIT_REQUIRE(cfg.seq_length == 0 || cfg.seq_length == x.shape[0], a.input,
                       ": tensor 'input' has S=", x.shape[0], " but --seq-length=", cfg.seq_length);
        MOEKIT_REQUIRE(!a.micro_batch_size_given || cfg.micro_batch_size == x.shape[1], a.input,
                       ": tensor 'input' has B=", x.shape[1], " but --micro-batch-size=", cfg.micro_batch_size);
        S = x.shape[0], B = x.shape[1];
        hidden = as_matrix<T>(x, S * B, H);
        meta["input"] = a.input;
        if (auto it = in_file.tensors.find("padding_mask"); it != in_file.tensors.end()) {
            const HostTensor& m = it->second;
            MOEKIT_REQUIRE(m.dtype == DType::boolean || m.dtype == DType::u8, a.input,
                           ": tensor 'padding_mask' has dtype ", dtype_name(m.dtype),
                           ", expected BOOL or U8 (True = padding)");
            MOEKIT_REQUIRE(m.shape == std::vector<int64_t>({B, S}), a.input, ": tensor 'padding_mask' has shape ",
                           m.shape_string(), ", expected [", B, ", ", S, "] (Megatron's [B, S] layout)");
            padding.assign(size_t(S * B), 0);
            for (int64_t b = 0; b < B; ++b)
                for (int64_t s = 0; s < S; ++s) padding[size_t(s * B + b)] = m.bytes[size_t(b * S + s)] != 0;
        }
    } else {
        MOEKIT_REQUIRE(S > 0, "--input is required (or give --seq-length to draw a random N(0, 1) input)");
        hidden = Matrix<T>(S * B, H);
        Rng rng(cfg.seed, kStreamRandomInput);
        for (auto& v : hidden.data) v = T(rng.normal());
        meta["input"] = str("random N(0, 1), seed ", cfg.seed, " (written as 'input')");
    }
    cfg.seq_length = S, cfg.micro_batch_size = B;
    require_fits_in_host_memory(cfg, S * B, 1, sizeof(T));  // the input file's tokens x E, k, F: before any step
    MOEKIT_REQUIRE(!world || B % world->size() == 0, "the input has B=", B, " sequences, not divisible by the ",
                   world ? world->size() : 1, " ranks: the batch is split along B into one micro-batch per rank");

    Matrix<T> grad_out;
    const std::vector<int64_t> sbh = {S, B, H};
    const std::string sbh_text = str("[", S, ", ", B, ", ", H, "]");
    if (!a.grad_output.empty()) {
        const SafetensorsFile g = read_safetensors(a.grad_output);
        refuse_unknown(g, a.grad_output, {"grad_output"});
        refuse_non_finite<T>(g, a.grad_output);
        grad_out = as_matrix<T>(require_tensor(g, a.grad_output, "grad_output", sbh, sbh_text), S * B, H);
        meta["grad_output"] = a.grad_output;
    } else if (in_file.tensors.count("grad_output")) {
        grad_out = as_matrix<T>(require_tensor(in_file, a.input, "grad_output", sbh, sbh_text), S * B, H);
        meta["grad_output"] = a.input;
    } else {
        grad_out = Matrix<T>(S * B, H, T(1));  // = output.sum().backward() in PyTorch
        meta["grad_output"] = "ones (as output.sum().backward())";
    }

    // ---- weights ----
    MoeWeights<T> w;
    if (weight_file) {
        try {
            w = weights_from_tensors<T>(cfg, weight_file->tensors, weights_prefix);
        } catch (const UsageError& e) {
            throw UsageError(str(a.weights, ": ", e.what()));
        }
        meta["weights"] = a.weights;
    } else {
        w = init_weights<T>(cfg, cfg.seed);
        meta["weights"] = str("random init (Megatron's), seed ", cfg.seed);
        SafetensorsFile init;
        init.tensors = weights_to_tensors(w, kDtype);
        try {
            refuse_non_finite<T>(init, "--init random");
        } catch (const UsageError& e) {
            throw UsageError(str(e.what(), " (--init-method-std=", cfg.init_method_std, " is too large for ", a.dtype,
                                 ")"));
        }
    }
    if (!a.save_weights.empty() && rank0) {
        // The compute dtype, so that reloading reproduces this run bit for bit.
        write_safetensors(a.save_weights, weights_to_tensors(w, kDtype),
                          {{"format", "pt"}, {"moekit_config", to_json(cfg).dump()}});
    }

    // ---- one forward + backward ----
    if (rank0) print_config(cfg);
    LayerInput<T> in;
    in.hidden = hidden;
    in.seq_length = S;
    in.micro_batch_size = B;
    in.padding_mask = padding;
    in.training = !a.eval;
    in.jitter_seed = cfg.seed;
    const int64_t E = cfg.num_experts();
    std::map<std::string, HostTensor> out;
    MoeWeights<T> grads = zeros_like(w);
    Matrix<T> output, grad_input;
    RoutingSummary summary;
    if constexpr (std::is_same_v<T, float>) {
        if (a.device != "cpu" && !world) {
            // The GPU runner takes fp32 at its interface (bf16 inside) and hands probs/map back to the host.
            std::unique_ptr<LayerRunner> runner = make_layer_runner(one_step_config(cfg), a.device);
            try {
                output = runner->forward(w, in);
            } catch (const UsageError& e) {
                if (a.device_given) throw;
                // A picked (not asked-for) cuda that refuses this config: the reference runs it instead.
                std::printf("moekit layer: --device cuda does not run this config (%s); using --device cpu\n",
                            e.what());
                a.device = "cpu";
            }
            if (a.device != "cpu") {
                grad_input = runner->backward(w, grad_out, grads);
                summary = runner->summary();
                out["probs"] = tensor_of(runner->probs(), {S * B, E}, kDtype);
                out["routing_map"] = bool_tensor(runner->routing_map(), {S * B, E});
            }
        }
    } else {
        MOEKIT_REQUIRE(a.device == "cpu", "--dtype fp64 runs on --device cpu only (got --device ", a.device, ")");
    }
    if (world) {
        // Expert parallelism: micro-batch r on rank r, results back in the original order (layer_ep.h).
        const auto digest = [](const Matrix<T>& m) { return digest_bytes(m.data.data(), m.data.size() * sizeof(T)); };
        uint64_t weights_digest = digest(w.router_weight) ^ digest(w.shared_fc1) ^ digest(w.shared_fc2) ^
                                  digest(w.shared_gate) ^
                                  digest_bytes(w.expert_bias.data(), w.expert_bias.size() * sizeof(double));
        for (size_t e = 0; e < w.fc1.size(); ++e) weights_digest = weights_digest * 31 + digest(w.fc1[e]) + digest(w.fc2[e]);
        std::string fingerprint;  // one "name=value" per line, so a mismatch names its field
        const nlohmann::json config_json = to_json(cfg);
        for (const auto& [key, value] : config_json.items()) fingerprint += str(key, "=", value.dump(), "\n");
        fingerprint +=
            str("dtype=", a.dtype, "\neval=", a.eval, "\nweights=", weights_digest,
                "\ninput=", digest(hidden), "\npadding_mask=", digest_bytes(padding.data(), padding.size()),
                "\ngrad_output=", digest(grad_out), "\nranks=", world->size());
        LayerResults<T> r = run_layer_ranks(*world, one_step_config(cfg), w, in, grad_out, fingerprint, a.device);
        output = std::move(r.output);
        grad_input = std::move(r.grad_input);
        grads = std::move(r.grads);
        summary.tokens_per_expert = r.tokens_per_expert;
        out["probs"] = tensor_of(r.probs, {S * B, E}, kDtype);
        out["routing_map"] = bool_tensor(r.routing_map, {S * B, E});
        // Each rank's loss values: loss.<name> is [ranks], entry r from micro-batch r.
        std::map<std::string, std::vector<double>> rank_losses;
        for (const LossValues& l : r.rank_losses) {
            rank_losses["aux_loss"].push_back(l.aux_loss);
            rank_losses["seq_aux_loss"].push_back(l.seq_aux_loss);
            rank_losses["global_aux_loss"].push_back(l.global_aux_loss);
            rank_losses["z_loss"].push_back(l.z_loss);
        }
        for (const auto& [name, v] : rank_losses)
            out["loss." + name] = HostTensor::from_double(v, {int64_t(v.size())}, kDtype);
        summary.losses = r.rank_losses[0];
        meta["ranks"] = str(world->size(), " (", world->transport(), "), --expert-model-parallel-size=",
                            cfg.expert_model_parallel_size, ", micro-batch r = columns [r*", B / world->size(),
                            ", (r+1)*", B / world->size(), ") of B");
        if (r.budgeted) {
            // The budgeted dispatcher's step: its budget, and whether an overflow made it re-run (docs/usage.md).
            nlohmann::json b = {{"budget_rows", r.budget.budget_rows},
                                {"factor", r.budget.factor},
                                {"peak_rows", r.budget.peak_rows},
                                {"overflow_events", r.overflow_events},
                                {"overflowed_ranks", r.budget.overflowed_ranks},
                                {"rerun", r.budget.overflow ? "alltoall" : "none"},
                                {"sufficient_factor", r.budget.sufficient_factor}};
            meta["ep_receive_budget"] = b.dump();
            if (r.budget.overflow && rank0)
                std::printf("moekit layer: %s\n", r.budget.message().c_str());
        }
    }
    if (a.device == "cpu" && !world) {
        cpu::MoeLayer<T> layer(cfg);
        output = layer.forward(w, in);
        grad_input = layer.backward(w, grad_out, grads);
        summary = layer.summary();
        out["probs"] = tensor_of(layer.probs(), {S * B, E}, kDtype);
        out["routing_map"] = bool_tensor(layer.routing_map(), {S * B, E});
    }

    out["output"] = tensor_of(output, sbh, kDtype);
    out["grad_input"] = tensor_of(grad_input, sbh, kDtype);
    out["grad_output"] = tensor_of(grad_out, sbh, kDtype);
    if (a.input.empty()) out["input"] = tensor_of(hidden, sbh, kDtype);
    for (auto& [name, t] : weights_to_tensors(grads, kDtype, "grad.")) out[name] = std::move(t);
    out["tokens_per_expert"] =
        HostTensor::from_double(std::vector<double>(summary.tokens_per_expert.begin(), summary.tokens_per_expert.end()),
                                {int64_t(summary.tokens_per_expert.size())}, DType::i64);
    const LossValues& l = summary.losses;
    for (const auto& [name, v] : std::map<std::string, double>{{"aux_loss", l.aux_loss},
                                                               {"seq_aux_loss", l.seq_aux_loss},
                                                               {"global_aux_loss", l.global_aux_loss},
                                                               {"z_loss", l.z_loss}})
        if (!world) out["loss." + name] = HostTensor::from_double({v}, {}, kDtype);
    if (!rank0) return 0;

    // Finite inputs can still overflow inside the layer (fp32 logits of large inputs): refuse, not write NaN.
    for (const auto& [name, t] : out) {
        if (!is_float(t.dtype)) continue;
        const std::vector<double> v = t.to_double();
        const int64_t i = first_non_finite(v);
        MOEKIT_REQUIRE(i < 0, "result '", name, "' is not finite (", v[size_t(i >= 0 ? i : 0)],
                       ") at index ", i, ": the input or weights overflow ", a.dtype,
                       " inside the layer (try smaller values or --dtype fp64); nothing was written");
    }

    std::string command = "moekit layer";
    for (const auto& s : argv) command += " " + s;
    meta["command"] = command;
    meta["config"] = to_json(cfg).dump();
    meta["dtype"] = a.dtype;
    meta["device"] = a.device;
    meta["format"] = "pt";
    write_safetensors(a.out, out, meta);

    std::printf("moekit layer: %s, %s, S=%lld B=%lld H=%lld E=%lld k=%lld%s%s\n", a.device.c_str(), a.dtype.c_str(),
                (long long)S, (long long)B, (long long)H, (long long)E, (long long)cfg.moe_router_topk,
                inferred.empty() ? "" : "; from the weights:", inferred.c_str());
    std::printf("  weights: %s\n  input: %s\n  grad_output: %s\n", meta["weights"].c_str(), meta["input"].c_str(),
                meta["grad_output"].c_str());
    std::printf("  |output| = %.6g  |grad_input| = %.6g\n", norm(out["output"].to_double()),
                norm(out["grad_input"].to_double()));
    std::printf("  losses%s: aux %.6g  seq_aux %.6g  global_aux %.6g  z %.6g\n", world ? " (rank 0)" : "", l.aux_loss,
                l.seq_aux_loss, l.global_aux_loss, l.z_loss);
    if (world) std::printf("  ranks: %s\n", meta["ranks"].c_str());
    if (meta.count("ep_receive_budget")) std::printf("  receive budget: %s\n", meta["ep_receive_budget"].c_str());
    std::printf("  tokens per expert:");
    for (auto n : summary.tokens_per_expert) std::printf(" %lld", (long long)n);
    std::printf("\n  wrote %zu tensors to %s%s%s\n", out.size(), a.out.c_str(),
                a.save_weights.empty() ? "" : ", weights to ", a.save_weights.c_str());
    return 0;
}

int layer_main(const std::vector<std::string>& argv) {
    MoeConfig cfg;
    LayerArgs a;
    FlagParser p(
        "moekit layer (--weights W.safetensors | --init random) [--input X.safetensors] "
        "[--grad-output G.safetensors] --out R.safetensors [MoE flags]");
    add_moe_flags(p, cfg);
    p.section("layer tool");
    p.add("--weights", &a.weights, "weights with Megatron's state-dict names (safetensors)");
    p.add("--weights-prefix", &a.weights_prefix,
          "name prefix in --weights, e.g. decoder.layers.0.mlp. (auto-detected)");
    p.add("--init", &a.init, "random: Megatron's init from --seed instead of --weights");
    p.add("--save-weights", &a.save_weights, "write the weights used (compute dtype) to this file");
    p.add("--input", &a.input, "input [S, B, H], optional padding_mask [B, S] and grad_output [S, B, H]");
    p.add("--grad-output", &a.grad_output, "grad_output [S, B, H] (default: from --input, else ones)");
    p.add("--out", &a.out, "results file (safetensors)");
    p.add("--dtype", &a.dtype, "compute dtype of the CPU reference: fp32 | fp64");
    const bool have_gpu = cuda_device_available();
    a.device = have_gpu ? "cuda" : "cpu";
    p.add("--device", &a.device, "cpu | cuda (default: cuda when a GPU is present, else cpu)");
    p.add("--eval", &a.eval, "forward in eval mode (no losses, no expert-bias counts)");
    p.add("--virtual-ranks", &a.virtual_ranks,
          "run N ranks as threads of this process (expert parallelism without mpirun; 0 = off)");
    if (!p.parse(argv)) return 0;
    a.micro_batch_size_given = p.was_set("--micro-batch-size");
    a.device_given = p.was_set("--device");

    MOEKIT_REQUIRE(!a.out.empty(), "--out is required (the results file)");
    MOEKIT_REQUIRE(a.init.empty() || a.init == "random", "--init=", a.init, ": must be random");
    MOEKIT_REQUIRE(a.weights.empty() != a.init.empty(), a.weights.empty()
                                                            ? "give --weights W.safetensors or --init random"
                                                            : "--weights and --init random exclude each other");
    MOEKIT_REQUIRE(a.dtype == "fp32" || a.dtype == "fp64", "--dtype=", a.dtype, ": must be fp32 or fp64");
    MOEKIT_REQUIRE(a.device == "cpu" || a.device == "cuda", "--device=", a.device, ": must be cpu or cuda");
    if (!a.device_given && a.dtype == "fp64") a.device = "cpu";  // fp64 is the CPU reference's alone
    MOEKIT_REQUIRE(a.device == "cpu" || a.dtype == "fp32", "--dtype fp64 runs on --device cpu only");
    check_paths(a);
    // Several ranks (expert parallelism): mpirun -np N, or --virtual-ranks N; the CPU backend only for now.
    MOEKIT_REQUIRE(a.virtual_ranks >= 0, "--virtual-ranks=", a.virtual_ranks, " must be >= 0");
    Communicator* mpi = comm::mpi_launched() ? &comm::mpi_world() : nullptr;
    const int mpi_ranks = mpi ? mpi->size() : 1;
    MOEKIT_REQUIRE(a.virtual_ranks == 0 || mpi_ranks == 1, "--virtual-ranks=", a.virtual_ranks,
                   " cannot be combined with mpirun -np ", mpi_ranks, " (use one or the other)");
    const int64_t ranks = a.virtual_ranks > 0 ? a.virtual_ranks : mpi_ranks;
    const bool multi_rank = ranks > 1 || cfg.expert_model_parallel_size > 1;
    MOEKIT_REQUIRE(cfg.expert_model_parallel_size == 1 || ranks > 1, "--expert-model-parallel-size=",
                   cfg.expert_model_parallel_size, " needs that many ranks: start them with mpirun -np ",
                   cfg.expert_model_parallel_size, " or add --virtual-ranks ", cfg.expert_model_parallel_size);
    // Several ranks default to the CPU reference; --device cuda puts every rank on the GPU layer.
    if (multi_rank && !a.device_given) a.device = "cpu";
    // An asked-for cuda that cannot run says why (no CUDA build / no GPU) before any file is read.
    if (a.device == "cuda" && !have_gpu) (void)make_layer_runner(cfg, a.device);
    if (!a.device_given && (!mpi || mpi->rank() == 0))
        std::printf("moekit layer: --device %s (default: %s)\n", a.device.c_str(),
                    a.dtype == "fp64" ? "--dtype fp64 runs on cpu only"
                    : multi_rank      ? "several ranks run on cpu unless --device cuda is given"
                    : have_gpu        ? "a GPU is present"
                                      : "no GPU found");

    std::optional<SafetensorsFile> weight_file;
    std::string prefix, inferred;
    if (!a.weights.empty()) {
        weight_file = read_safetensors(a.weights);
        prefix = find_prefix(weight_file->tensors, a.weights_prefix);
        if (a.dtype == "fp64")
            refuse_non_finite<double>(*weight_file, a.weights, prefix);
        else
            refuse_non_finite<float>(*weight_file, a.weights, prefix);
        inferred = infer_shapes(cfg, p, weight_file->tensors, prefix);
    }
    cfg.normalize();
    cfg.validate();
    // Input files bound their own size; a drawn input of --seq-length tokens and the weights are checked here.
    require_fits_in_host_memory(cfg, a.input.empty() ? cfg.seq_length * cfg.micro_batch_size : 0, 1,
                                a.dtype == "fp64" ? 8 : 4);
    const SafetensorsFile* wf = weight_file ? &*weight_file : nullptr;
    const auto run = [&](MoeConfig& c, LayerArgs& args, Communicator* world) {
        return args.dtype == "fp64" ? run_layer<double>(c, args, argv, inferred, wf, args.weights_prefix, world)
                                    : run_layer<float>(c, args, argv, inferred, wf, args.weights_prefix, world);
    };
    if (a.virtual_ranks > 0) {
        comm::run_virtual_ranks(int(a.virtual_ranks), [&](Communicator& world) {
            MoeConfig c = cfg;  // each rank its own copies, as separate processes would have
            LayerArgs args = a;
            run(c, args, &world);
        });
        return 0;
    }
    return run(cfg, a, multi_rank ? mpi : nullptr);
}

RegisterCommand reg("layer", "one forward+backward of a MoE layer on safetensors files (parity tool)", layer_main);

}  // namespace
}  // namespace moekit::tools
