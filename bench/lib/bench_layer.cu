// `moekit bench` on the whole CUDA MoE layer (CudaMoeLayer: router, permute, fc1, SwiGLU x probs, fc2, combine,
// forward and backward) for a preset: per-stage times, the step captured in one CUDA graph (sync-free path),
// the same layer with the synchronous cuBLAS expert GEMMs, and the floor (dense cuBLAS expert-shaped GEMMs).
// Routing comes from the layer's own router on random inputs; --skew adds a zipf bias through one input feature.
#include <nvtx3/nvToolsExt.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include "cuda/expert_gemm.h"
#include "cuda/gemm_tuning.h"
#include "cuda/grouped_gemm_sync.h"
#include "cuda/moe_layer.h"
#include "lib/bench_expert_mlp.h"
#include "lib/bench_util.cuh"
#include "lib/gpu_clocks.h"
#include "lib/gemm_tuning_report.h"
#include "lib/layer_variants.h"
#include "moekit/error.h"

namespace moekit::cuda::bench {
namespace {

// Bytes one fwd+bwd step of the expert MLP must move at least (SwiGLU, bf16 tensors, fp32 weight grads):
// every expert weight read in forward and again in dgrad, its fp32 grad written once in wgrad, and each
// routed row's activations written once and read once per use (fc1 in, h, act, fc2 out, and their grads).
double expert_step_bytes(const Preset& p) {
    const double H = double(p.hidden), F = double(p.ffn), W = double(p.experts) * 3.0 * H * F;
    const double R = double(p.tokens) * double(p.topk);
    const double weights = W * 2 * 2 + W * 4;
    const double fwd = R * 2 * (H + 2 * (2 * F) + 2 * F + H);                 // x in; h out+in; act out+in; y out
    const double bwd = R * 2 * (H + 2 * F + F + 2 * (2 * F) + H + (F + H) + (H + 2 * F));  // dy; dact; dh; dx; wgrad ins
    return weights + fwd + bwd;
}

// The roofline of a step: the larger of the compute floor (3 x dense cuBLAS, timed by the caller) and the
// memory floor (expert_step_bytes / device-to-device copy bandwidth measured now, bytes read + written).
nlohmann::json roofline(const Preset& p, double compute_floor_ms, cudaStream_t s, const Options& o) {
    const size_t n = size_t(1) << 30;  // 1 GiB copied: read + written
    void *a = nullptr, *b = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&a, n));
    MOEKIT_CUDA_CHECK(cudaMalloc(&b, n));
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(a, 1, n, s));
    const double copy_ms = time_ms([&] { MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); },
                                   s, o.warmup, o.iters);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaFree(a);
    cudaFree(b);
    const double gbps = 2.0 * double(n) / (copy_ms * 1e6), bytes = expert_step_bytes(p);
    const double memory_ms = bytes / (gbps * 1e6);
    return {{"bytes", bytes},
            {"copy_gb_per_s", gbps},
            {"memory_floor_ms", memory_ms},
            {"compute_floor_ms", compute_floor_ms},
            {"roofline_ms", std::max(memory_ms, compute_floor_ms)},
            {"bound", memory_ms > compute_floor_ms ? "memory" : "compute"}};
}

// The A/B switches of Options::variant: set(1) on, set(0) off, set(-1) back to the environment's default.
struct LayerVariant {
    const char* name;
    void (*set)(int);
};
constexpr LayerVariant kLayerVariants[] = {{"glu-forward", &set_glu_forward_fusion},
                                           {"glu-backward", &set_glu_backward_fusion},
                                           {"gather-fc1", &set_fc1_gather},
                                           {"tma-wgrad", &set_wgrad_own_kernel},
                                           {"pingpong-192", &set_pingpong_wide},
                                           {"swap-pingpong", &set_swap_pingpong},
                                           {"wgrad-192", &set_wgrad_wide},
                                           {"wgrad-192t", &set_wgrad_wide_transposed},
                                           {"wgrad-split", &set_wgrad_split},
                                           {"wgrad-overlap", &set_wgrad_overlap},
                                           {"pingpong-swapped", &set_pingpong_swapped},
                                           {"long-k-coop", &set_long_reduction_cooperative},
                                           {"gemm-tune", &set_gemm_tuning}};

static_assert(sizeof(kLayerVariants) / sizeof(kLayerVariants[0]) ==
                  sizeof(::moekit::bench::kLayerVariantNames) / sizeof(::moekit::bench::kLayerVariantNames[0]),
              "every --variant name (lib/layer_variants.h) has its switch here");

const LayerVariant* find_variant(const std::string& name) {
    for (const LayerVariant& v : kLayerVariants)
        if (name == v.name) return &v;
    return nullptr;
}

cudaGraphExec_t capture_step(CudaMoeLayer& layer, cudaStream_t s) {
    // Global capture mode: any host synchronisation inside forward/backward would fail the capture.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    layer.forward(s, true);
    layer.backward(s);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    return exec;
}

}  // namespace

MoeConfig preset_config(const Preset& p) {
    MoeConfig c;
    c.hidden_size = p.hidden;
    c.num_moe_experts = p.experts;
    c.moe_ffn_hidden_size = p.ffn;
    c.seq_length = p.tokens;
    c.micro_batch_size = 1;
    c.gated_linear_unit = true;
    c.activation_func = "silu";
    c.moe_router_topk = p.topk;
    c.moe_router_load_balancing_type = {"aux_loss"};
    c.moe_aux_loss_coeff = {0.01};
    c.moe_router_dtype = "fp32";
    c.validate();
    return c;
}

nlohmann::json bench_layer(const Preset& p, const Options& o) {
    const MoeConfig config = preset_config(p);
    const LayerVariant* variant = find_variant(o.variant);
    MOEKIT_REQUIRE(o.variant.empty() || variant, "--variant=", o.variant,
                   ": expected ", ::moekit::bench::layer_variant_list());
    // A variant's switch back to its default; the tuning's default is the run's (Options::gemm_tune).
    auto reset_variant = [&] {
        variant->set(-1);
        apply_gemm_tuning(o.gemm_tune);
    };
    apply_gemm_tuning(o.gemm_tune);
    // The fused activation backward's buffers are allocated at construction where the fusion may run.
    if (variant) variant->set(1);
    auto layer = CudaMoeLayer::create(config, p.tokens, 1);
    if (variant) reset_variant();
    const LayerBuffers& b = layer->buffers();
    const int64_t T = p.tokens, H = p.hidden, F = p.ffn, E = p.experts, rows = layer->shape().max_rows;
    // Inputs O(1), weights at init scale 0.02 (uniform with that std), never zeros.
    const float w = 0.02f * std::sqrt(3.f);
    fill_uniform(b.hidden, T * H, 1.f, o.seed + 11);
    fill_uniform(b.grad_output, T * H, 1.f, o.seed + 12);
    fill_uniform(b.router_weight, E * H, w, o.seed + 13);
    fill_uniform(b.fc1, E * 2 * F * H, w, o.seed + 14);
    fill_uniform(b.fc2, E * H * F, w, o.seed + 15);
    if (o.zipf_s > 0) apply_zipf_skew(b.hidden, T, b.router_weight, E, H, o.zipf_s);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    cudaStream_t s;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    cudaDeviceProp prop{};
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    nlohmann::json out{{"preset", p.name},
                       {"H", H},
                       {"F", F},
                       {"E", E},
                       {"topk", p.topk},
                       {"T", T},
                       {"rows", rows},
                       {"zipf_s", o.zipf_s},
                       {"iters", o.iters},
                       {"device", prop.name},
                       {"scope", "whole MoE layer (router, permute, fc1, SwiGLU x probs, fc2, combine; fwd + bwd)"}};
    const double flops = 3.0 * 2.0 * double(T * p.topk) * double(H) * double(3 * F);

    auto run_backend = [&](ExpertGemmKind kind, bool graph) {
        layer->set_expert_gemm(expert_gemm(kind));
        nlohmann::json r;
        std::vector<std::vector<double>> fwd(size_t(LayerStage::count)), bwd(size_t(LayerStage::count));
        std::vector<double> total;
        cudaEvent_t e0, e1;
        MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
        MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
        const int64_t syncs0 = sync_baseline::host_sync_count();
        // Eager steps without stage timing give the total; stage timing adds events but no sync inside a step.
        // NVTX ranges name the phases for profilers (nsys: kernel times per phase, graph replays vs eager steps).
        nvtxRangePushA(kind == ExpertGemmKind::grouped ? "eager" : "eager sync baseline");
        for (int it = 0; it < o.warmup + o.iters; ++it) {
            MOEKIT_CUDA_CHECK(cudaEventRecord(e0, s));
            layer->forward(s, true);
            layer->backward(s);
            MOEKIT_CUDA_CHECK(cudaEventRecord(e1, s));
            MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= o.warmup) total.push_back(ms);
        }
        nvtxRangePop();
        r["host_syncs_per_step"] = double(sync_baseline::host_sync_count() - syncs0) / (o.warmup + o.iters);
        r["eager_fwd_bwd_ms"] = median(total);
        layer->enable_stage_timing(true);
        // Stage times of graph replays too (the events are nodes of the graph), in the same rounds as the eager
        // steps': tells which stage a graph-vs-eager difference lives in.
        std::vector<std::vector<double>> gfwd(size_t(LayerStage::count)), gbwd(size_t(LayerStage::count));
        cudaGraphExec_t timed = graph ? capture_step(*layer, s) : nullptr;
        auto collect = [&](std::vector<std::vector<double>>& fv, std::vector<std::vector<double>>& bv) {
            auto f = layer->forward_times_ms();
            auto g = layer->backward_times_ms();
            for (size_t i = 0; i < f.size(); ++i) {
                fv[i].push_back(f[i]);
                bv[i].push_back(g[i]);
            }
        };
        for (int it = 0; it < o.iters; ++it) {
            layer->forward(s, true);
            layer->backward(s);
            collect(fwd, bwd);
            if (timed) {
                MOEKIT_CUDA_CHECK(cudaGraphLaunch(timed, s));
                collect(gfwd, gbwd);
            }
        }
        if (timed) {
            MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(timed));
            for (size_t i = 0; i < gfwd.size(); ++i) {
                const char* name = layer_stage_name(LayerStage(i));
                r["graph_fwd_stages_ms"][name] = median(gfwd[i]);
                r["graph_bwd_stages_ms"][name] = median(gbwd[i]);
            }
        }
        layer->enable_stage_timing(false);
        double fsum = 0, bsum = 0;
        for (size_t i = 0; i < fwd.size(); ++i) {
            const char* name = layer_stage_name(LayerStage(i));
            r["fwd_stages_ms"][name] = median(fwd[i]);
            r["bwd_stages_ms"][name] = median(bwd[i]);
            fsum += median(fwd[i]);
            bsum += median(bwd[i]);
        }
        r["fwd_ms"] = fsum;
        r["bwd_ms"] = bsum;
        r["fwd_bwd_ms"] = r["eager_fwd_bwd_ms"];
        if (graph) {
            cudaGraphExec_t ge = capture_step(*layer, s);
            nvtxRangePushA("graph");
            r["graph_fwd_bwd_ms"] = time_ms([&] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(ge, s)); }, s, o.warmup, o.iters);
            nvtxRangePop();
            r["captured_in_one_graph"] = true;
            r["fwd_bwd_ms"] = r["graph_fwd_bwd_ms"];
            MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(ge));
            // Eager again after the replays: tells clock/thermal drift apart from a graph-vs-eager difference.
            r["eager_after_graph_ms"] = time_ms(
                [&] {
                    layer->forward(s, true);
                    layer->backward(s);
                },
                s, 0, o.iters);
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        return r;
    };
    out["grouped"] = run_backend(ExpertGemmKind::grouped, true);
    out["grouped"]["kernel"] = grouped_gemm_kernel_name(grouped_gemm_kernel());
    out["sync"] = run_backend(ExpertGemmKind::sync_baseline, false);
    auto counts = layer->read_tokens_per_expert();
    out["max_count"] = *std::max_element(counts.begin(), counts.end());
    out["min_count"] = *std::min_element(counts.begin(), counts.end());
    out["counts"] = counts;

    // Floor: dense fc1 [rows,H]x[H,2F] + fc2 [rows,F]x[F,H] on the layer's own buffers (scratch after timing).
    using gemm_detail::Op;
    const int64_t R = T * p.topk;
    double fc1 = time_ms([&] { dense_gemm(Op::kNT, R, 2 * F, H, b.rows, b.fc1, b.fc1_out, s); }, s, o.warmup, o.iters);
    double fc2 =
        time_ms([&] { dense_gemm(Op::kNT, R, H, F, b.act_out, b.fc2, b.expert_out, s); }, s, o.warmup, o.iters);
    out["floor"] = {{"fc1_ms", fc1}, {"fc2_ms", fc2}, {"fwd_ms", fc1 + fc2}, {"fwd_bwd_ms", 3 * (fc1 + fc2)}};
    // The headline totals, measured INTERLEAVED: one eager sync-free step, one graph replay of it, one sync-baseline
    // step and one floor (3 x dense fc1 + fc2) per round, so that all four see the same clocks. (Measured phase
    // after phase, the first phase ran at boost clocks before the 700 W power cap pulled the SM clock down to
    // 1.1-1.5 GHz: H100, 2026-11-23, nvidia-smi clocks_event_reasons 0x4 during the mixtral bench.)
    // With a variant, two more graphs, the switch on and off (the default graph may be either, per shape), are the
    // fifth and sixth measurements of each round.
    {
        layer->set_expert_gemm(expert_gemm(ExpertGemmKind::grouped));
        cudaGraphExec_t exec = capture_step(*layer, s), variant_exec[2] = {nullptr, nullptr};
        if (variant) {
            for (int on = 0; on < 2; ++on) {
                variant->set(1 - on);
                variant_exec[on] = capture_step(*layer, s);
            }
            reset_variant();
        }
        auto step = [&](ExpertGemmKind kind) {
            layer->set_expert_gemm(expert_gemm(kind));
            layer->forward(s, true);
            layer->backward(s);
        };
        std::vector<double> eager, replay, sync, dense, variant_on, variant_off;
        // Warm-up rounds: o.warmup, and at least 2 s of them, so that the rounds timed see the power cap's steady
        // clocks, as the peers of scripts/device_anchors.sh do (bench/anchors/peer_timing.py).
        const auto warm_start = std::chrono::steady_clock::now();
        int warm = 0;
        auto warming = [&] {
            return warm < o.warmup || std::chrono::steady_clock::now() - warm_start < std::chrono::seconds(2);
        };
        // The four in a balanced order (balanced_order: each directly after each other one equally often): a
        // measurement's place in the round moved it by up to 4 % (mixtral's eager step, always first after the
        // floor, read 3.6 % under its replay, which timed phase by phase equals it: H200, 2026-11-26), and with the
        // rounds merely rotated the floor always ran right after the sync baseline's host waits.
        std::vector<std::function<void()>> runs = {
            [&] { step(ExpertGemmKind::grouped); },
            [&] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, s)); },
            [&] { step(ExpertGemmKind::sync_baseline); },
            [&] {
                for (int i = 0; i < 3; ++i) {
                    dense_gemm(Op::kNT, R, 2 * F, H, b.rows, b.fc1, b.fc1_out, s);
                    dense_gemm(Op::kNT, R, H, F, b.act_out, b.fc2, b.expert_out, s);
                }
            }};
        for (cudaGraphExec_t e : variant_exec)
            if (e) runs.push_back([&s, e] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(e, s)); });
        const int n = int(runs.size());
        int device = 0;
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
        moekit::bench::ClockSampler clocks(device, n);
        for (int it = 0; warming() || it < warm + o.iters; ++it) {
            const std::vector<int> order = balanced_order(n, it);
            double t[6] = {};
            const bool timed = !warming();
            for (int j = 0; j < n; ++j) {
                const int which = order[j];
                if (timed) clocks.begin(which);
                t[which] = time_ms(runs[size_t(which)], s, 0, 1);
                clocks.end();
            }
            if (warming()) {
                ++warm;
                continue;
            }
            eager.push_back(t[0]), replay.push_back(t[1]), sync.push_back(t[2]), dense.push_back(t[3]);
            if (variant) variant_on.push_back(t[4]), variant_off.push_back(t[5]);
        }
        layer->set_expert_gemm(expert_gemm(ExpertGemmKind::grouped));
        MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
        for (cudaGraphExec_t e : variant_exec)
            if (e) MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(e));
        out["interleaved"] = {{"eager_ms", median(eager)},
                              {"graph_ms", median(replay)},
                              {"sync_ms", median(sync)},
                              {"floor_ms", median(dense)}};
        // The SM clock of each measurement: under the power cap the step and the floor may run at different clocks.
        out["clocks"] =
            moekit::bench::clock_json(clocks, {"eager", "graph", "sync", "floor", "variant_on", "variant_off"}, n);
        if (variant)
            out["variant"] = {{"name", variant->name},
                              {"on_graph_ms", median(variant_on)},
                              {"off_graph_ms", median(variant_off)},
                              {"on_vs_off", median(variant_on) / median(variant_off)}};
    }
    const auto& il = out["interleaved"];
    // The interleaved totals are the headline ones (what the table, the ratios and bench/anchors read); the
    // phase-by-phase ones stay under phase_*.
    out["grouped"]["phase_fwd_bwd_ms"] = out["grouped"]["fwd_bwd_ms"];
    out["grouped"]["phase_eager_fwd_bwd_ms"] = out["grouped"]["eager_fwd_bwd_ms"];
    out["sync"]["phase_fwd_bwd_ms"] = out["sync"]["fwd_bwd_ms"];
    out["floor"]["phase_fwd_bwd_ms"] = out["floor"]["fwd_bwd_ms"];
    out["grouped"]["fwd_bwd_ms"] = il["graph_ms"];
    out["grouped"]["eager_fwd_bwd_ms"] = il["eager_ms"];
    out["sync"]["fwd_bwd_ms"] = il["sync_ms"];
    out["floor"]["fwd_bwd_ms"] = il["floor_ms"];
    const double floor_ms = il["floor_ms"].get<double>();
    out["roofline"] = roofline(p, floor_ms, s, o);
    const double g = il["graph_ms"].get<double>(), sb = il["sync_ms"].get<double>();
    const double ge = il["eager_ms"].get<double>();
    out["roofline"]["grouped_vs_roofline"] = g / out["roofline"]["roofline_ms"].get<double>();
    out["roofline"]["sync_vs_roofline"] = sb / out["roofline"]["roofline_ms"].get<double>();
    out["ratios"] = {{"grouped_vs_floor", g / floor_ms},
                     {"grouped_eager_vs_floor", ge / floor_ms},
                     {"sync_vs_floor", sb / floor_ms},
                     {"grouped_vs_sync", g / sb}};
    out["tflops"] = {{"grouped", flops / g / 1e9}, {"sync", flops / sb / 1e9}, {"floor", flops / floor_ms / 1e9}};
    // Memory of one layer step, from the layer's own allocations (its I/O buffers included here).
    const LayerMemory mem = layer->memory();
    out["memory"] = {{"workspace_bytes", mem.workspace_bytes},
                     {"saved_activation_bytes", mem.saved_activation_bytes},
                     {"saved_activation_bytes_per_token", mem.saved_bytes_per_token()}};
    out["gemm_tuning"] = gemm_tuning_json();
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
    return out;
}

std::string format_layer_table(const nlohmann::json& r) {
    std::string out = str("moekit bench --preset ", r["preset"].get<std::string>(), "  (H ", r["H"].get<int64_t>(),
                          ", F ", r["F"].get<int64_t>(), ", E ", r["E"].get<int64_t>(), ", k ",
                          r["topk"].get<int64_t>(), ", T ", r["T"].get<int64_t>(), ", zipf ", r["zipf_s"].get<double>(),
                          ", tokens/expert ", r["min_count"].get<int64_t>(), "..", r["max_count"].get<int64_t>(),
                          ") on ", r["device"].get<std::string>(), "\n  scope: ", r["scope"].get<std::string>(), "\n");
    char line[256];
    const bool graph_stages = r["grouped"].contains("graph_fwd_stages_ms");
    std::snprintf(line, sizeof line, "  %-16s %10s %10s   %10s %10s%s\n", "stage (ms)", "fwd", "bwd", "sync fwd",
                  "sync bwd", graph_stages ? "   graph fwd  graph bwd" : "");
    out += line;
    for (auto& [name, v] : r["grouped"]["fwd_stages_ms"].items()) {
        std::snprintf(line, sizeof line, "  %-16s %10.3f %10.3f   %10.3f %10.3f", name.c_str(), v.get<double>(),
                      r["grouped"]["bwd_stages_ms"][name].get<double>(), r["sync"]["fwd_stages_ms"][name].get<double>(),
                      r["sync"]["bwd_stages_ms"][name].get<double>());
        out += line;
        if (graph_stages) {
            std::snprintf(line, sizeof line, "   %10.3f %10.3f", r["grouped"]["graph_fwd_stages_ms"][name].get<double>(),
                          r["grouped"]["graph_bwd_stages_ms"][name].get<double>());
            out += line;
        }
        out += "\n";
    }
    auto& g = r["grouped"];
    auto& sb = r["sync"];
    out += str("  forward / backward (stage sums): sync-free ", g["fwd_ms"].get<double>(), " / ",
               g["bwd_ms"].get<double>(), " ms; sync ", sb["fwd_ms"].get<double>(), " / ", sb["bwd_ms"].get<double>(),
               " ms\n");
    std::snprintf(line, sizeof line,
                  "  phase by phase: sync-free %.3f ms (one graph; eager %.3f before, %.3f after), sync-cuBLAS %.3f ms, "
                  "floor %.3f ms\n",
                  g["phase_fwd_bwd_ms"].get<double>(), g["phase_eager_fwd_bwd_ms"].get<double>(),
                  g.value("eager_after_graph_ms", 0.0), sb["phase_fwd_bwd_ms"].get<double>(),
                  r["floor"]["phase_fwd_bwd_ms"].get<double>());
    out += line;
    const auto& il = r["interleaved"];
    std::snprintf(line, sizeof line,
                  "  fwd+bwd (interleaved rounds): sync-free %.3f ms one graph, %.3f ms eager; sync-cuBLAS %.3f ms; "
                  "floor %.3f ms\n",
                  il["graph_ms"].get<double>(), il["eager_ms"].get<double>(), il["sync_ms"].get<double>(),
                  il["floor_ms"].get<double>());
    out += line;
    std::snprintf(line, sizeof line,
                  "  TFLOP/s (expert GEMMs): sync-free %.0f, sync %.0f, floor %.0f | host syncs/step: %.0f vs %.0f\n",
                  r["tflops"]["grouped"].get<double>(), r["tflops"]["sync"].get<double>(),
                  r["tflops"]["floor"].get<double>(), g["host_syncs_per_step"].get<double>(),
                  sb["host_syncs_per_step"].get<double>());
    out += line;
    std::snprintf(line, sizeof line,
                  "  x floor: sync-free %.2fx (eager %.2fx), sync %.2fx; sync-free / sync %.2f; kernel %s\n",
                  r["ratios"]["grouped_vs_floor"].get<double>(), r["ratios"]["grouped_eager_vs_floor"].get<double>(),
                  r["ratios"]["sync_vs_floor"].get<double>(), r["ratios"]["grouped_vs_sync"].get<double>(),
                  g["kernel"].get<std::string>().c_str());
    out += line;
    if (r.contains("roofline")) {
        const auto& f = r["roofline"];
        std::snprintf(line, sizeof line,
                      "  roofline %.3f ms (%s-bound: compute floor %.3f ms, memory floor %.3f ms = %.2f GB at %.0f GB/s "
                      "copy): sync-free %.2fx, sync %.2fx\n",
                      f["roofline_ms"].get<double>(), f["bound"].get<std::string>().c_str(),
                      f["compute_floor_ms"].get<double>(), f["memory_floor_ms"].get<double>(),
                      f["bytes"].get<double>() / 1e9, f["copy_gb_per_s"].get<double>(),
                      f["grouped_vs_roofline"].get<double>(), f["sync_vs_roofline"].get<double>());
        out += line;
    }
    if (r.contains("variant")) {
        const auto& v = r["variant"];
        std::snprintf(line, sizeof line,
                      "  variant %s: on %.3f ms, off %.3f ms one graph (same rounds as the default): on / off %.3f\n",
                      v["name"].get<std::string>().c_str(), v["on_graph_ms"].get<double>(),
                      v["off_graph_ms"].get<double>(), v["on_vs_off"].get<double>());
        out += line;
    }
    if (r.contains("clocks")) out += moekit::bench::format_clocks(r["clocks"]);
    if (r.contains("gemm_tuning")) out += format_gemm_tuning_lines(r["gemm_tuning"]);
    if (r.contains("memory")) {
        std::snprintf(line, sizeof line, "  memory: layer %.1f MiB (I/O and parameters included), saved activations "
                      "%.0f bytes/token\n", double(r["memory"]["workspace_bytes"].get<int64_t>()) / (1 << 20),
                      r["memory"]["saved_activation_bytes_per_token"].get<double>());
        out += line;
    }
    return out;
}

}  // namespace moekit::cuda::bench
