// report.json and train.png of a training run (see report.h).
#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/flags.h"
#include "io/atomic_file.h"
#include "io/png.h"
#include "train/train_engine.h"
#include "moekit/error.h"

namespace moekit::train {
namespace {

nlohmann::json to_json(const TrainOptions& o, const TrainResult& r) {
    nlohmann::json j;
    j["task"] = "teacher-student regression: residual MoE stack imitates a frozen random MoE teacher (MSE)";
    j["config"] = moekit::to_json(o.config);
    j["train"] = {{"steps", o.steps},           {"lr", o.adam.lr},          {"device", o.device},
                  {"seed", o.seed},             {"teacher_gain", o.teacher_gain},
                  {"tokens_per_step", r.tokens_per_step}};
    if (o.skew_zipf > 0) j["train"]["skew_zipf"] = o.skew_zipf;
    j["engine"] = r.engine;
    const RunLayout& l = r.layout;
    j["layout"] = {{"ranks", l.ranks},
                   {"transport", l.transport},
                   {"expert_model_parallel_size", l.expert_model_parallel_size},
                   {"expert_data_parallel_size", l.ranks / std::max<int64_t>(l.expert_model_parallel_size, 1)},
                   {"data_parallel_size", l.ranks},
                   {"global_batch_size", l.global_batch_size},
                   {"micro_batch_size", o.config.micro_batch_size},
                   {"micro_batches_per_rank", l.micro_batches_per_rank},
                   {"device", o.device}};
    j["resumed_from"] = r.resumed_from;
    j["completed"] = r.signal == 0 && r.failure.empty() && !r.steps.empty() && r.steps.back().step == o.steps;
    if (r.signal) j["interrupted_by_signal"] = r.signal;
    if (!r.failure.empty()) j["failure"] = r.failure;
    if (r.perf) {
        const EngineReport& p = *r.perf;
        j["perf"] = {{"device_bytes", p.device_bytes},
                     {"device_used_bytes", p.device_used_bytes},
                     {"layer_workspace_bytes", p.layer_workspace_bytes},
                     {"saved_activation_bytes_per_token", p.saved_bytes_per_token},
                     {"iteration_ms", p.iteration_ms},
                     {"parts_ms", p.parts_ms},
                     {"parts", p.parts},
                     {"expert_gemm_ms", p.expert_gemm_ms},
                     {"expert_gemm_tflops", p.expert_gemm_tflops},
                     {"dense_cublas_tflops", p.dense_cublas_tflops},
                     {"iteration_expert_gemm_tflops", p.model_tflops}};
    }
    j["identity_mse"] = r.identity_mse;
    j["seconds"] = r.seconds;
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& s : r.steps) {
        nlohmann::json e = {{"step", s.step},         {"loss", s.loss},         {"aux_loss", s.aux_loss},
                            {"z_loss", s.z_loss},     {"tokens_per_s", s.tokens_per_s},
                            {"tokens_per_expert", s.tokens_per_expert}};
        if (s.eval_loss >= 0) e["eval_loss"] = s.eval_loss;
        if (!s.echo_clones.empty())
            e["echo"] = {{"clones", s.echo_clones},
                         {"max_over_mean_before", s.echo_max_over_mean_before},
                         {"max_over_mean_after", s.echo_max_over_mean_after}};
        steps.push_back(std::move(e));
    }
    j["steps"] = std::move(steps);
    if (!r.steps.empty()) {
        j["summary"] = {{"initial_loss", r.steps.front().loss},
                        {"final_loss", r.steps.back().loss},
                        {"final_eval_loss", r.steps.back().eval_loss}};
        if (!r.steps.back().echo_clones.empty()) {
            const EchoSummary es = echo_summary(r);
            j["summary"]["echo"] = {{"clones_per_step", es.clones_per_step},
                                    {"max_over_mean_before", es.max_over_mean_before},
                                    {"max_over_mean_after", es.max_over_mean_after}};
        }
    }
    return j;
}

// Left: training loss (and held-out points) over steps. Right: layer 0's share of tokens per expert
// over steps as a heat map (rows = experts), so routing collapse or balance is visible at a glance.
io::Image plot(const TrainOptions& o, const TrainResult& r) {
    const int width = 1200, height = 480;
    io::Image img(width, height);
    std::vector<double> xs, ys, exs, eys;
    double ymax = 0;
    for (const auto& s : r.steps) {
        xs.push_back(double(s.step));
        ys.push_back(s.loss);
        ymax = std::max(ymax, s.loss);
        if (s.eval_loss >= 0) {
            exs.push_back(double(s.step));
            eys.push_back(s.eval_loss);
        }
    }
    io::PlotArea loss{70, 50, 560, 420, 0.0, double(std::max<int64_t>(o.steps, 1)), 0.0, std::max(ymax * 1.05, 1e-3)};
    io::draw_axes(img, loss, "loss (MSE / identity MSE)", "step", "loss");
    io::draw_polyline(img, loss, xs, ys, {31, 119, 180}, 2);
    for (size_t i = 0; i < exs.size(); ++i)
        io::fill_rect(img, loss.px(exs[i]) - 3, loss.py(eys[i]) - 3, loss.px(exs[i]) + 3, loss.py(eys[i]) + 3,
                      {214, 39, 40});
    io::draw_text(img, 400, 60, "- train", {31, 119, 180}, 2);
    io::draw_text(img, 400, 82, "* held-out", {214, 39, 40}, 2);

    // Heat map of layer 0's per-expert share (E x steps), scaled so that a perfectly even share is mid-range.
    const int64_t num_experts = o.config.num_experts();
    std::vector<std::vector<double>> share(size_t(num_experts), std::vector<double>(r.steps.size(), 0.0));
    for (size_t t = 0; t < r.steps.size(); ++t) {
        const auto& counts = r.steps[t].tokens_per_expert.at(0);
        double total = 0;
        for (auto c : counts) total += double(c);
        for (int64_t e = 0; e < num_experts; ++e)  // expert 0 in the bottom row, like the y axis
            share[size_t(num_experts - 1 - e)][t] = total > 0 ? double(counts[size_t(e)]) / total : 0;
    }
    const int hx0 = 680, hy0 = 50, hx1 = 1150, hy1 = 420;
    // Expert e's row spans [e - 0.5, e + 0.5], so integer ticks sit at the row centres.
    io::PlotArea heat{hx0, hy0, hx1, hy1, 0.0, double(r.steps.size()), -0.5, double(num_experts) - 0.5};
    io::draw_axes(img, heat, "layer 0: share of tokens per expert", "step", "expert");
    io::draw_heatmap(img, hx0 + 1, hy0 + 1, hx1 - 1, hy1 - 1, share, 0.0, 2.0 / double(std::max<int64_t>(num_experts, 1)));
    io::draw_text(img, hx0, 462, "dark = 0, mid = 1/E (balanced), yellow = 2/E or more", {60, 60, 60}, 1);
    return img;
}

}  // namespace

void write_report(const std::string& out_dir, const TrainOptions& options, const TrainResult& result) {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    MOEKIT_REQUIRE(!ec, "--out-dir=", out_dir, ": cannot create the directory (", ec.message(), ")");
    // The plot first, then the report: a report.json always has its train.png beside it, and each file is
    // whole or absent (written beside, then renamed).
    io::write_png(out_dir + "/train.png", plot(options, result));
    io::write_file_atomically(out_dir + "/report.json", to_json(options, result).dump(1) + "\n");
}

}  // namespace moekit::train
