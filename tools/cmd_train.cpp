// `moekit train`: the main job. A residual stack of moekit MoE layers learns to imitate a frozen random MoE teacher
// (MSE on fresh random tokens, Adam), on the CPU reference or, with --device cuda, device-resident on the GPU
// with one CUDA graph per iteration. Shows a progress bar, prints a summary and writes report.json + train.png;
// --save/--load checkpoints. Loop: src/train/trainer.cpp; docs: docs/train.md.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>

#include "command.h"
#include "core/flags.h"
#include "echo/trace.h"
#include "io/atomic_file.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "train/report.h"
#include "train/train_engine.h"
#include "train/trainer.h"

namespace moekit::tools {
namespace {

// The CPU demo's defaults: small enough for ~a minute on 2 CPU cores, large enough to show routing.
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

// The GPU's defaults (--device cuda): enough work per step to keep an H100 busy — 8192 tokens, 64 experts of
// FFN 512 (SwiGLU), top-8, hidden 1024, 4 layers: ~0.6 TFLOP of expert GEMMs per layer per step.
MoeConfig gpu_config() {
    MoeConfig c = demo_config();
    c.hidden_size = 1024;
    c.num_moe_experts = 64;
    c.moe_ffn_hidden_size = 512;
    c.moe_router_topk = 8;
    c.num_layers = 4;
    c.seq_length = 2048;
    c.micro_batch_size = 4;
    return c;
}

// Adam's step moves every weight by about lr, and a layer's output by about hidden x lr: the GPU size (hidden
// 1024) takes a smaller rate than the demo (hidden 64).
constexpr double kDemoLr = 3e-3;
constexpr double kGpuLr = 3e-4;

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

std::string balance_string(const train::StepRecord& rec) {
    std::string s;
    for (size_t l = 0; l < rec.tokens_per_expert.size(); ++l) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%s%.2f", l ? " " : "", train::load_imbalance(rec.tokens_per_expert[l]));
        s += buf;
    }
    return s;
}

struct TrainArgs {
    train::TrainOptions o;
    std::string out_dir = "moekit-train";
    std::string device;
    int64_t log_every = 10;
    bool overwrite = false;
    bool cuda_graph = true;
    std::string model_size;  // demo | gpu ("" = by device)
    int64_t virtual_ranks = 0;  // --virtual-ranks N: N ranks as threads of this process
    std::string routing_trace;  // --routing-trace FILE: the per-step, per-layer expert loads for `moekit plan`
    std::string skew;           // --skew zipf:S
};

// The run's routing as a trace for `moekit plan` (src/echo/trace.h): one source row per step and layer, the
// whole global batch's counts (the records sum them over the ranks; `moekit plan --expert-model-parallel-size`
// re-homes them onto EP source ranks).
void write_trace(const std::string& path, const MoeConfig& config, const train::TrainResult& r) {
    echo::RoutingTrace t;
    t.num_experts = config.num_experts(), t.ep = 1, t.topk = config.moe_router_topk;
    for (const train::StepRecord& rec : r.steps)
        for (size_t l = 0; l < rec.tokens_per_expert.size(); ++l)
            t.steps.push_back(echo::RoutingTraceStep{int64_t(l), rec.tokens_per_expert[l]});
    echo::write_routing_trace(path, t);
}

// Returns false when --help was printed.
bool parse(const std::vector<std::string>& args, const MoeConfig& defaults, double default_lr, TrainArgs& a) {
    a.o.config = defaults;
    a.o.adam.lr = default_lr;
    FlagParser p("moekit train [flags]: a residual MoE stack learns a frozen random MoE teacher (MSE, Adam)");
    add_moe_flags(p, a.o.config);
    p.section("training");
    p.add("--steps", &a.o.steps, "optimizer steps");
    p.add("--lr", &a.o.adam.lr, "Adam learning rate");
    p.add("--adam-beta1", &a.o.adam.beta1, "Adam beta1, in [0, 1)");
    p.add("--adam-beta2", &a.o.adam.beta2, "Adam beta2, in [0, 1)");
    p.add("--adam-eps", &a.o.adam.eps, "Adam epsilon, > 0");
    p.add("--eval-every", &a.o.eval_every, "held-out evaluation every N steps (0 = never)");
    p.add("--teacher-gain", &a.o.teacher_gain, "teacher expert weights = gain x Megatron init, in (0, 1000]");
    p.add("--device", &a.device, "cpu | cuda (default: cuda when a GPU is present)");
    p.add("--model-size", &a.model_size, "[moekit] demo | gpu: the defaults of the model and --lr (default: gpu on cuda, "
          "demo on cpu); flags override them");
    p.add("--out-dir", &a.out_dir, "where report.json and train.png go");
    p.add("--overwrite", &a.overwrite, "replace an earlier run's report in --out-dir");
    p.add("--log-every", &a.log_every, "records reach the host (and the log) every N steps");
    p.add("--save", &a.o.save_dir, "checkpoint folder (Megatron layout: iter_NNNNNNN/, latest_checkpointed_iteration.txt)");
    p.add("--save-interval", &a.o.save_interval, "steps between checkpoints (0: only at the end)");
    p.add("--load", &a.o.load_dir, "continue from the latest checkpoint in this folder");
    p.add("--cuda-graph", &a.cuda_graph, "cuda: replay one captured CUDA graph per iteration (--no-cuda-graph: eager)");
    p.add("--routing-trace", &a.routing_trace, "also write the per-step expert loads as a routing trace for moekit plan");
    p.add("--skew", &a.skew, "zipf:S, S in (0, 10]: expert popularity biased to a Zipf law (a constant token feature and "
          "per-expert router offsets, docs/train.md); empty: none");
    p.add("--host-loop", &a.o.host_loop, "[moekit] cuda: the old host loop (weights and activations copied every call)");
    p.section("parallelism (CPU ranks, or GPU ranks with --device cuda; --expert-model-parallel-size is among the MoE "
              "flags)");
    p.add("--virtual-ranks", &a.virtual_ranks,
          "run N ranks as threads of this process (data/expert parallelism without mpirun; 0 = off)");
    p.add("--global-batch-size", &a.o.global_batch_size,
          "sequences per step, in micro-batches of --micro-batch-size spread evenly over the ranks "
          "(0: one micro-batch per rank); keep it fixed to resume on another number of ranks");
    return p.parse(args);
}

void validate(const TrainArgs& a) {
    const train::TrainOptions& o = a.o;
    auto finite_in = [](double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; };
    MOEKIT_REQUIRE(o.steps >= 1 && o.steps <= 1'000'000'000, "--steps=", o.steps, ": must be in [1, 1e9]");
    MOEKIT_REQUIRE(finite_in(o.adam.lr, 0, 10) && o.adam.lr > 0, "--lr=", o.adam.lr, ": must be finite, in (0, 10]");
    MOEKIT_REQUIRE(finite_in(o.adam.beta1, 0, 1) && o.adam.beta1 < 1, "--adam-beta1=", o.adam.beta1,
                   ": must be in [0, 1)");
    MOEKIT_REQUIRE(finite_in(o.adam.beta2, 0, 1) && o.adam.beta2 < 1, "--adam-beta2=", o.adam.beta2,
                   ": must be in [0, 1)");
    MOEKIT_REQUIRE(finite_in(o.adam.eps, 0, 1) && o.adam.eps > 0, "--adam-eps=", o.adam.eps, ": must be in (0, 1]");
    MOEKIT_REQUIRE(o.eval_every >= 0, "--eval-every=", o.eval_every, ": must not be negative (0 = never)");
    MOEKIT_REQUIRE(finite_in(o.teacher_gain, 0, 1000) && o.teacher_gain > 0, "--teacher-gain=", o.teacher_gain,
                   ": must be in (0, 1000]");
    // The teacher's weights are gain x 10 x std (router): keep them far inside bf16's range.
    MOEKIT_REQUIRE(finite_in(o.config.init_method_std, 0, 10) && o.config.init_method_std > 0, "--init-method-std=",
                   o.config.init_method_std, ": must be in (0, 10] for moekit train");
    MOEKIT_REQUIRE(a.log_every >= 1, "--log-every=", a.log_every, ": must be positive");
    MOEKIT_REQUIRE(o.save_interval >= 0, "--save-interval=", o.save_interval, ": must not be negative");
    MOEKIT_REQUIRE(o.save_interval == 0 || !o.save_dir.empty(), "--save-interval=", o.save_interval, ": needs --save");
    MOEKIT_REQUIRE(a.device == "cpu" || a.device == "cuda", "--device=", a.device, ": must be cpu or cuda");
    MOEKIT_REQUIRE(!o.host_loop || a.device == "cuda", "--host-loop: only with --device cuda");
}

// --out-dir is usable before the first step: created, writable, and not holding an earlier run's report.
void check_out_dir(const TrainArgs& a) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(a.out_dir, ec);
    MOEKIT_REQUIRE(!ec && fs::is_directory(a.out_dir), "--out-dir=", a.out_dir, ": cannot create the folder (",
                   ec ? ec.message() : "a file of that name exists", ")");
    MOEKIT_REQUIRE(a.overwrite || !fs::exists(a.out_dir + "/report.json"), "--out-dir=", a.out_dir,
                   ": holds the report of an earlier run; give --overwrite to replace it, or another --out-dir");
    const std::string probe = a.out_dir + "/.moekit-write-probe";
    try {
        io::write_file_atomically(probe, "probe\n");
    } catch (const UsageError& e) {
        throw UsageError(str("--out-dir=", a.out_dir, ": not writable (", e.what(), ")"));
    }
    fs::remove(probe, ec);
    if (!a.routing_trace.empty()) {  // its folder must exist now, not after the run
        const fs::path folder = fs::absolute(a.routing_trace, ec).parent_path();
        MOEKIT_REQUIRE(fs::is_directory(folder, ec) && !fs::is_directory(a.routing_trace, ec), "--routing-trace=",
                       a.routing_trace, ": must name a file in an existing folder");
    }
    if (!a.o.save_dir.empty()) {
        MOEKIT_REQUIRE(fs::weakly_canonical(a.o.save_dir, ec) != fs::weakly_canonical(a.out_dir, ec), "--save=",
                       a.o.save_dir, " and --out-dir=", a.out_dir, " must be different folders");
    }
}

void print_perf(const train::EngineReport& r) {
    auto gib = [](int64_t b) { return double(b) / double(1 << 30); };
    if (r.device_bytes > 0)
        std::printf("  device memory: %.2f GiB allocated by moekit (%.2f GiB used incl. cuBLAS and graphs); "
                    "one layer's workspace %.1f MiB, saved activations %.0f bytes/token\n",
                    gib(r.device_bytes), gib(r.device_used_bytes), double(r.layer_workspace_bytes) / (1 << 20),
                    r.saved_bytes_per_token);
    if (r.iteration_ms > 0) {
        std::printf("  iteration (one CUDA graph) %.3f ms; its parts timed alone sum to %.3f ms (ratio %.3f)\n"
                    "    parts: %s\n",
                    r.iteration_ms, r.parts_ms, r.iteration_ms / r.parts_ms, r.parts.c_str());
        std::printf("  expert GEMMs %.1f TFLOP/s (%.3f ms per iteration) vs dense cuBLAS %.1f TFLOP/s in this run: "
                    "%.2f of dense; whole iteration %.1f TFLOP/s of expert GEMMs\n",
                    r.expert_gemm_tflops, r.expert_gemm_ms, r.dense_cublas_tflops,
                    r.expert_gemm_tflops / std::max(r.dense_cublas_tflops, 1e-9), r.model_tflops);
    }
}

int run_train(const std::vector<std::string>& args) {
    // From the start: a signal at any point stops the run after its current step (or before the first).
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    TrainArgs a;
    if (!parse(args, demo_config(), kDemoLr, a)) return 0;
    // Several ranks (data and expert parallelism): mpirun -np N, or --virtual-ranks N; CPU, or GPU with --device cuda.
    MOEKIT_REQUIRE(a.virtual_ranks >= 0 && a.virtual_ranks <= 1024, "--virtual-ranks=", a.virtual_ranks,
                   ": must be in [0, 1024]");
    Communicator* mpi = comm::mpi_launched() ? &comm::mpi_world() : nullptr;
    const int mpi_ranks = mpi ? mpi->size() : 1;
    MOEKIT_REQUIRE(a.virtual_ranks == 0 || mpi_ranks == 1, "--virtual-ranks=", a.virtual_ranks,
                   " cannot be combined with mpirun -np ", mpi_ranks, " (use one or the other)");
    const int64_t ranks = a.virtual_ranks > 0 ? a.virtual_ranks : mpi_ranks;
    const int64_t ep = a.o.config.expert_model_parallel_size;
    MOEKIT_REQUIRE(ep <= 1 || ranks > 1, "--expert-model-parallel-size=", ep,
                   " needs that many ranks: start them with mpirun -np ", ep, " or add --virtual-ranks ", ep);
    const bool multi_rank = ranks > 1;
    if (multi_rank) {
        // Several ranks run on the CPU unless --device cuda asks for GPUs (virtual ranks: one GPU; mpirun: one each).
        MOEKIT_REQUIRE(!a.o.host_loop, "--host-loop: not with several ranks (", ranks, ")");
        if (a.device.empty()) a.device = "cpu";
        MOEKIT_REQUIRE(a.device != "cuda" || cuda_device_available(), "--device cuda with ", ranks,
                       " ranks (--expert-model-parallel-size=", ep, "): no CUDA device is visible on this machine",
                       cuda_device_available() ? "" : " (or this moekit was built without CUDA); use --device cpu");
    }
    if (a.device.empty()) a.device = cuda_device_available() ? "cuda" : "cpu";
    if (a.model_size.empty()) a.model_size = a.device == "cuda" ? "gpu" : "demo";
    MOEKIT_REQUIRE(a.model_size == "demo" || a.model_size == "gpu", "--model-size=", a.model_size,
                   ": must be demo or gpu");
    if (a.model_size == "gpu") {  // parse again over the GPU size's defaults (explicit flags still win)
        const std::string device = a.device;
        a = TrainArgs{};
        parse(args, gpu_config(), kGpuLr, a);
        a.device = device, a.model_size = "gpu";
    }
    a.o.config.normalize();
    a.o.config.validate();
    if (!a.skew.empty()) {
        a.o.skew_zipf = echo::parse_zipf(a.skew, "--skew");
        MOEKIT_REQUIRE(a.o.skew_zipf > 0 && a.o.skew_zipf <= 10, "--skew=", a.skew, ": S must be in (0, 10]");
        MOEKIT_REQUIRE(a.o.config.hidden_size >= 2, "--skew=", a.skew, ": needs --hidden-size >= 2 (feature 0 "
                       "carries the per-expert offsets; got ", a.o.config.hidden_size, ")");
    }
    validate(a);
    const int64_t B = a.o.config.micro_batch_size;
    MOEKIT_REQUIRE(!a.o.host_loop || a.o.global_batch_size == 0 || a.o.global_batch_size == B, "--host-loop: not with "
                   "several micro-batches per step (--global-batch-size=", a.o.global_batch_size, " > --micro-batch-size=",
                   B, ")");
    a.o.device = a.device;
    a.o.seed = a.o.config.seed;
    a.o.log_interval = a.log_every;
    a.o.use_graph = a.cuda_graph;
    a.o.stop_signal = &g_stop_signal;

    // Every rank runs this with its own copy of the arguments; rank 0 alone prints, writes and saves.
    auto run_rank = [](TrainArgs a, Communicator* world) {
        a.o.world = world;
        const bool rank0 = !world || world->rank() == 0;
        const train::RunLayout layout = train::run_layout(a.o);  // refuses a layout that cannot be
        if (rank0) {
            print_config(a.o.config);
            std::printf("moekit train: %s, %lld layers, %lld tokens/step, %lld steps; task: imitate a random MoE "
                        "teacher\n",
                        a.device.c_str(), (long long)a.o.config.num_layers,
                        (long long)(a.o.config.seq_length * layout.global_batch_size), (long long)a.o.steps);
            if (layout.ranks > 1 || layout.micro_batches > 1)
                std::printf("  layout: %d rank(s) (%s), EP=%lld, expert-DP=%lld, DP=%d; global batch %lld sequences = "
                            "%lld micro-batch(es) of %lld, %lld per rank\n",
                            layout.ranks, layout.transport.c_str(), (long long)layout.expert_model_parallel_size,
                            (long long)(layout.ranks / layout.expert_model_parallel_size), layout.ranks,
                            (long long)layout.global_batch_size, (long long)layout.micro_batches,
                            (long long)a.o.config.micro_batch_size, (long long)layout.micro_batches_per_rank);
            std::fflush(stdout);
        }
        const bool tty = isatty(fileno(stderr));
        double tokens_per_s_avg = 0;
        int64_t shown = 0;
        auto progress = [&](const train::TrainOptions& opt, const train::StepRecord& rec) {
            tokens_per_s_avg = shown++ == 0 ? rec.tokens_per_s : 0.9 * tokens_per_s_avg + 0.1 * rec.tokens_per_s;
            const bool last = rec.step == opt.steps;
            if (!tty && rec.step % a.log_every != 0 && rec.step != 1 && !last) return;
            const int bar_width = 24, filled = int(bar_width * rec.step / opt.steps);
            std::string bar = std::string(size_t(filled), '#') + std::string(size_t(bar_width - filled), '.');
            std::fprintf(stderr, "%s[%s] %5lld/%lld  loss %.4f  aux %.4f  %7.0f tok/s  balance(max/mean) %s%s",
                         tty ? "\r" : "", bar.c_str(), (long long)rec.step, (long long)opt.steps, rec.loss,
                         rec.aux_loss, tokens_per_s_avg, balance_string(rec).c_str(), tty && !last ? "" : "\n");
            std::fflush(stderr);
        };
        const train::TrainResult r = train::run_training(a.o, progress);
        if (!rank0) return r.signal ? 128 + r.signal : 0;  // rank 0 reports a failure for all
        train::write_report(a.out_dir, a.o, r);
        if (!a.routing_trace.empty()) write_trace(a.routing_trace, a.o.config, r);

        if (tty) std::fprintf(stderr, "\n");
        if (r.steps.empty()) {
            std::printf("moekit train: no step finished; wrote %s/report.json\n", a.out_dir.c_str());
        } else {
            const auto& first = r.steps.front();
            const auto& last = r.steps.back();
            const int64_t run_steps = last.step - r.resumed_from;
            std::printf("\nsummary (%s)\n", r.engine.c_str());
            if (r.resumed_from > 0) std::printf("  resumed from the checkpoint of step %lld\n", (long long)r.resumed_from);
            std::printf("  loss (MSE / identity MSE): %.4f -> %.4f (%.1f%% of the start)\n", first.loss, last.loss,
                        100.0 * last.loss / first.loss);
            if (last.eval_loss >= 0) std::printf("  held-out loss: %.4f\n", last.eval_loss);
            std::printf("  %.2f s, %.0f tokens/s on %s\n", r.seconds,
                        double(r.tokens_per_step) * double(run_steps) / std::max(r.seconds, 1e-9), a.device.c_str());
            std::printf("  expert load max/mean per layer at the end: %s\n", balance_string(last).c_str());
            if (!last.echo_clones.empty()) {
                const train::EchoSummary es = train::echo_summary(r);
                std::printf("  ECHO: %.2f clones per step and layer; EP rank load max/mean %.3f before, %.3f after\n",
                            es.clones_per_step, es.max_over_mean_before, es.max_over_mean_after);
            }
            if (r.perf) print_perf(*r.perf);
            std::printf("  wrote %s/report.json and %s/train.png\n", a.out_dir.c_str(), a.out_dir.c_str());
        }
        if (!r.failure.empty()) throw Error(r.failure);
        if (r.signal) {
            std::printf("moekit train: stopped by signal %d after step %lld; the report says so\n", r.signal,
                        (long long)(r.steps.empty() ? 0 : r.steps.back().step));
            return 128 + r.signal;
        }
        return 0;
    };

    if (!mpi || mpi->rank() == 0) check_out_dir(a);
    int rc = 0;
    if (a.virtual_ranks > 1) {
        std::atomic<int> rank0_rc{0};
        comm::run_virtual_ranks(int(a.virtual_ranks), [&](Communicator& world) {
            const int code = run_rank(a, &world);
            if (world.rank() == 0) rank0_rc.store(code);
        });
        rc = rank0_rc.load();
    } else {
        rc = run_rank(a, multi_rank ? mpi : nullptr);
    }
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    return rc;
}

RegisterCommand reg("train", "train a small MoE model (teacher-student regression); report.json + train.png",
                    run_train);

}  // namespace
}  // namespace moekit::tools
