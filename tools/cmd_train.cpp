// `moekit train`: the main job. A residual stack of moekit MoE layers learns to imitate a frozen random
// MoE teacher (MSE on fresh random tokens, Adam), on the CPU reference or the CUDA backend. Shows a
// progress bar, prints a summary and writes report.json + train.png. Loop: src/train/trainer.cpp.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "command.h"
#include "core/flags.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "train/report.h"
#include "train/trainer.h"

namespace moekit::tools {
namespace {

// The demo's defaults: small enough for ~a minute on 2 CPU cores, large enough to show routing.
MoeConfig demo_config() {
    MoeConfig c;
    c.hidden_size = 64;
    c.num_moe_experts = 8;
    c.moe_ffn_hidden_size = 128;
    c.moe_router_topk = 2;
    c.gated_linear_unit = true;  // SwiGLU
    c.activation_func = "silu";
    c.num_layers = 2;
    c.seq_length = 256;
    c.micro_batch_size = 4;
    c.moe_router_load_balancing_type = {"aux_loss"};
    c.moe_aux_loss_coeff = {1e-2};
    return c;
}

std::string balance_string(const train::StepRecord& rec) {
    std::string s;
    for (size_t l = 0; l < rec.tokens_per_expert.size(); ++l) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%s%.2f", l ? " " : "", train::load_imbalance(rec.tokens_per_expert[l]));
        s += buf;
    }
    return s;
}

int run_train(const std::vector<std::string>& args) {
    train::TrainOptions o;
    o.config = demo_config();
    std::string out_dir = "moekit-train";
    std::string device = cuda_device_available() ? "cuda" : "cpu";
    int64_t log_every = 10;
    FlagParser p("moekit train [flags]: a residual MoE stack learns a frozen random MoE teacher (MSE, Adam)");
    add_moe_flags(p, o.config);
    p.section("training");
    p.add("--steps", &o.steps, "optimizer steps");
    p.add("--lr", &o.adam.lr, "Adam learning rate");
    p.add("--adam-beta1", &o.adam.beta1, "Adam beta1");
    p.add("--adam-beta2", &o.adam.beta2, "Adam beta2");
    p.add("--adam-eps", &o.adam.eps, "Adam epsilon");
    p.add("--eval-every", &o.eval_every, "held-out evaluation every N steps (0 = never)");
    p.add("--teacher-gain", &o.teacher_gain, "teacher expert weights = gain x Megatron init");
    p.add("--device", &device, "cpu | cuda (default: cuda when a GPU is present)");
    p.add("--out-dir", &out_dir, "where report.json and train.png go");
    p.add("--log-every", &log_every, "progress line every N steps when stderr is not a terminal");
    if (!p.parse(args)) return 0;
    o.config.normalize();
    o.config.validate();
    o.device = device;
    o.seed = o.config.seed;
    MOEKIT_REQUIRE(log_every > 0, "--log-every=", log_every, ": must be positive");
    MOEKIT_REQUIRE(o.adam.lr > 0, "--lr=", o.adam.lr, ": must be positive");
    MOEKIT_REQUIRE(o.teacher_gain > 0, "--teacher-gain=", o.teacher_gain, ": must be positive");

    print_config(o.config);
    std::printf("moekit train: %s, %lld layers, %lld tokens/step, %lld steps; task: imitate a random MoE teacher\n",
                device.c_str(), (long long)o.config.num_layers,
                (long long)(o.config.seq_length * o.config.micro_batch_size), (long long)o.steps);
    std::fflush(stdout);

    const bool tty = isatty(fileno(stderr));
    double tokens_per_s_avg = 0;
    auto progress = [&](const train::TrainOptions& opt, const train::StepRecord& rec) {
        tokens_per_s_avg = rec.step == 1 ? rec.tokens_per_s : 0.9 * tokens_per_s_avg + 0.1 * rec.tokens_per_s;
        const bool last = rec.step == opt.steps;
        if (!tty && rec.step % log_every != 0 && rec.step != 1 && !last) return;
        const int bar_width = 24, filled = int(bar_width * rec.step / opt.steps);
        std::string bar = std::string(size_t(filled), '#') + std::string(size_t(bar_width - filled), '.');
        std::fprintf(stderr, "%s[%s] %5lld/%lld  loss %.4f  aux %.4f  %7.0f tok/s  balance(max/mean) %s%s",
                     tty ? "\r" : "", bar.c_str(), (long long)rec.step, (long long)opt.steps, rec.loss, rec.aux_loss,
                     tokens_per_s_avg, balance_string(rec).c_str(), tty && !last ? "" : "\n");
        std::fflush(stderr);
    };
    const train::TrainResult r = train::run_training(o, progress);
    train::write_report(out_dir, o, r);

    const auto& first = r.steps.front();
    const auto& last = r.steps.back();
    double tokens = double(r.tokens_per_step) * double(r.steps.size());
    std::printf("\nsummary\n");
    std::printf("  loss (MSE / identity MSE): %.4f -> %.4f (%.1f%% of the start)\n", first.loss, last.loss,
                100.0 * last.loss / first.loss);
    if (last.eval_loss >= 0) std::printf("  held-out loss: %.4f\n", last.eval_loss);
    std::printf("  %.1f s, %.0f tokens/s on %s\n", r.seconds, tokens / std::max(r.seconds, 1e-9), device.c_str());
    std::printf("  expert load max/mean per layer at the end: %s\n", balance_string(last).c_str());
    std::printf("  wrote %s/report.json and %s/train.png\n", out_dir.c_str(), out_dir.c_str());
    return 0;
}

RegisterCommand reg("train", "train a small MoE model (teacher-student regression); report.json + train.png",
                    run_train);

}  // namespace
}  // namespace moekit::tools
