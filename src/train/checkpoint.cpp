// save_checkpoint / load_checkpoint (see checkpoint.h).
#include "train/checkpoint.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/flags.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "moekit/error.h"
#include "train/adam.h"

namespace moekit::train {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLatest = "latest_checkpointed_iteration.txt";

std::string layer_prefix(size_t l) { return "decoder.layers." + std::to_string(l) + ".mlp."; }

// State-dict names of one layer's trainable tensors in for_each_parameter order (Adam's slot order).
std::vector<std::string> parameter_names(const MoeWeights<float>& w) {
    std::vector<std::string> names;
    if (!w.router_weight.empty()) names.push_back("router.weight");
    for (size_t e = 0; e < w.fc1.size(); ++e)
        names.push_back("experts.local_experts." + std::to_string(e) + ".linear_fc1.weight");
    for (size_t e = 0; e < w.fc2.size(); ++e)
        names.push_back("experts.local_experts." + std::to_string(e) + ".linear_fc2.weight");
    if (!w.shared_fc1.empty()) names.push_back("shared_experts.linear_fc1.weight");
    if (!w.shared_fc2.empty()) names.push_back("shared_experts.linear_fc2.weight");
    if (!w.shared_gate.empty()) names.push_back("shared_experts.gate_weight");
    return names;
}

HostTensor f32_tensor(const std::vector<float>& v) {
    HostTensor t;
    t.dtype = DType::f32;
    t.shape = {int64_t(v.size())};
    t.bytes.resize(v.size() * sizeof(float));
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    return t;
}

std::vector<float> f32_values(const HostTensor& t, const std::string& what) {
    MOEKIT_REQUIRE(t.dtype == DType::f32, what, ": dtype ", dtype_name(t.dtype), ", expected F32");
    std::vector<float> v(t.bytes.size() / sizeof(float));
    std::memcpy(v.data(), t.bytes.data(), v.size() * sizeof(float));
    return v;
}

nlohmann::json record_json(const StepRecord& s) {
    return {{"step", s.step},         {"loss", s.loss},           {"eval_loss", s.eval_loss},
            {"aux_loss", s.aux_loss}, {"z_loss", s.z_loss},       {"tokens_per_s", s.tokens_per_s},
            {"grads_finite", s.grads_finite}, {"tokens_per_expert", s.tokens_per_expert}};
}

StepRecord record_of(const nlohmann::json& j) {
    StepRecord s;
    s.step = j.at("step"), s.loss = j.at("loss"), s.eval_loss = j.at("eval_loss"), s.aux_loss = j.at("aux_loss");
    s.z_loss = j.at("z_loss"), s.tokens_per_s = j.at("tokens_per_s"), s.grads_finite = j.at("grads_finite");
    s.tokens_per_expert = j.at("tokens_per_expert").get<std::vector<std::vector<int64_t>>>();
    return s;
}

// What must match for a checkpoint to continue this run: the model, the task and the data (the global batch
// included). Not the layout: the tensors are global, so a run saved on N ranks resumes on M.
nlohmann::json run_identity(const TrainOptions& o) {
    nlohmann::json j = moekit::to_json(o.config);
    j.erase("expert_model_parallel_size");
    j["teacher_gain"] = o.teacher_gain;
    j["global_batch_size"] = run_layout(o).global_batch_size;
    return j;
}

std::string iteration_folder(int64_t step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "iter_%07lld", (long long)step);
    return buf;
}

}  // namespace

std::string save_checkpoint(const std::string& dir, const TrainOptions& o, const TrainState& s,
                            const std::vector<StepRecord>& history) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    MOEKIT_REQUIRE(!ec && fs::is_directory(dir), "--save=", dir, ": cannot create the folder (", ec.message(), ")");
    const std::string final_dir = dir + "/" + iteration_folder(s.step);
    const std::string tmp = final_dir + ".partial." + std::to_string(::getpid());
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    MOEKIT_REQUIRE(!ec, "--save=", dir, ": cannot create ", tmp, " (", ec.message(), ")");

    std::map<std::string, HostTensor> model, optimizer;
    size_t slot = 0;
    for (size_t l = 0; l < s.weights.size(); ++l) {
        const MoeWeights<float>& w = s.weights[l];
        for (auto& [name, t] : weights_to_tensors(w, DType::f32, layer_prefix(l))) model[name] = std::move(t);
        if (!w.expert_bias.empty())
            model[layer_prefix(l) + "router.expert_bias"] =
                HostTensor::from_double(w.expert_bias, {int64_t(w.expert_bias.size())}, DType::f64);
        for (const std::string& name : parameter_names(w)) {
            if (slot < s.adam_m.size()) {
                optimizer["exp_avg." + layer_prefix(l) + name] = f32_tensor(s.adam_m[slot]);
                optimizer["exp_avg_sq." + layer_prefix(l) + name] = f32_tensor(s.adam_v[slot]);
            }
            ++slot;
        }
    }
    const std::vector<uint8_t> model_bytes = serialize_safetensors(model, {{"format", "moekit-megatron"}});
    io::write_file_atomically(tmp + "/model.safetensors",
                              std::string_view(reinterpret_cast<const char*>(model_bytes.data()), model_bytes.size()));
    const std::vector<uint8_t> opt_bytes = serialize_safetensors(optimizer, {{"format", "moekit-adam"}});
    io::write_file_atomically(tmp + "/optimizer.safetensors",
                              std::string_view(reinterpret_cast<const char*>(opt_bytes.data()), opt_bytes.size()));
    nlohmann::json state = {{"step", s.step},
                            {"seed", o.seed},
                            {"run", run_identity(o)},
                            {"adam", {{"lr", o.adam.lr}, {"beta1", o.adam.beta1}, {"beta2", o.adam.beta2},
                                      {"eps", o.adam.eps}}},
                            {"device", o.device}};
    const RunLayout layout = run_layout(o);  // how the saving run was laid out, for the reader only
    state["layout"] = {{"ranks", layout.ranks}, {"transport", layout.transport},
                       {"expert_model_parallel_size", layout.expert_model_parallel_size}};
    nlohmann::json records = nlohmann::json::array();
    for (const StepRecord& r : history)
        if (r.step <= s.step) records.push_back(record_json(r));
    state["history"] = std::move(records);
    io::write_file_atomically(tmp + "/state.json", state.dump(1));
    io::replace_directory(tmp, final_dir);
    io::write_file_atomically(dir + "/" + kLatest, std::to_string(s.step) + "\n");
    return final_dir;
}

Checkpoint load_checkpoint(const std::string& dir, const TrainOptions& o) {
    std::ifstream latest(dir + "/" + kLatest);
    MOEKIT_REQUIRE(latest.good(), "--load=", dir, ": no ", kLatest, " (not a moekit train checkpoint folder)");
    int64_t step = -1;
    latest >> step;
    MOEKIT_REQUIRE(latest && step >= 0, "--load=", dir, ": ", kLatest, " does not hold a step number");
    const std::string folder = dir + "/" + iteration_folder(step);

    std::ifstream sf(folder + "/state.json");
    MOEKIT_REQUIRE(sf.good(), "--load=", dir, ": ", folder, "/state.json is missing");
    nlohmann::json state;
    try {
        state = nlohmann::json::parse(sf);
    } catch (const std::exception& e) {
        throw UsageError(str("--load=", dir, ": ", folder, "/state.json is not valid JSON (", e.what(), ")"));
    }
    MOEKIT_REQUIRE(state.value("step", int64_t(-1)) == step, "--load=", dir, ": ", folder,
                   "/state.json is for another step");
    MOEKIT_REQUIRE(state.value("seed", uint64_t(0)) == o.seed, "--load=", dir, ": saved with --seed=",
                   state.value("seed", uint64_t(0)), ", this run has --seed=", o.seed);
    const nlohmann::json saved = state.at("run"), now = run_identity(o);
    for (auto it = now.begin(); it != now.end(); ++it) {
        // Checkpoints from before --global-batch-size had one micro-batch per step.
        const bool older = it.key() == "global_batch_size" && !saved.contains(it.key());
        const nlohmann::json* had = older ? (saved.contains("micro_batch_size") ? &saved.at("micro_batch_size") : nullptr)
                                          : (saved.contains(it.key()) ? &saved.at(it.key()) : nullptr);
        MOEKIT_REQUIRE(had && *had == it.value(), "--load=", dir, ": the checkpoint has ", it.key(), "=",
                       had ? had->dump() : "(absent)", ", this run has ", it.value().dump(),
                       "; resume needs the same model and task",
                       it.key() == "global_batch_size" && had ? str(" (give --global-batch-size ", had->dump(),
                                                                    " to continue it on any number of ranks)")
                                                              : std::string());
    }

    Checkpoint ck;
    ck.state.step = step;
    const SafetensorsFile model = read_safetensors(folder + "/model.safetensors");
    const SafetensorsFile optimizer = read_safetensors(folder + "/optimizer.safetensors");
    for (int64_t l = 0; l < o.config.num_layers; ++l) {
        MoeWeights<float> w = weights_from_tensors<float>(o.config, model.tensors, layer_prefix(size_t(l)));
        ck.state.weights.push_back(std::move(w));
    }
    if (step > 0) {
        for (size_t l = 0; l < ck.state.weights.size(); ++l) {
            for (const std::string& name : parameter_names(ck.state.weights[l])) {
                for (auto [key, moments] : {std::pair{"exp_avg.", &ck.state.adam_m}, {"exp_avg_sq.", &ck.state.adam_v}}) {
                    const std::string full = std::string(key) + layer_prefix(l) + name;
                    const auto t = optimizer.tensors.find(full);
                    MOEKIT_REQUIRE(t != optimizer.tensors.end(), "--load=", dir, ": optimizer.safetensors has no ", full);
                    moments->push_back(f32_values(t->second, full));
                }
            }
        }
    }
    for (const auto& r : state.at("history")) ck.history.push_back(record_of(r));
    return ck;
}

}  // namespace moekit::train
