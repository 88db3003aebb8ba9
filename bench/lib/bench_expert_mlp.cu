// Expert-GEMM and expert-MLP benchmarks (bench_expert_mlp.h): the sync-free grouped GEMMs (whole MLP step captured
// in one CUDA graph in global capture mode, so any host sync would fail it) vs the synchronous cuBLAS baseline
// (host syncs counted) vs the floor (dense cuBLAS GEMMs of the expert GEMMs' shapes, same run).
#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <iterator>
#include <numeric>
#include <utility>

#include "lib/bench_expert_mlp.h"
#include "core/rng.h"
#include "core/tile_padding_math.h"
#include "cuda/activation.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_cutlass.h"
#include "cuda/grouped_gemm_sync.h"
#include "lib/bench_util.cuh"
#include "lib/gemm_tuning_report.h"
#include "lib/gpu_clocks.h"
#include "moekit/error.h"

namespace moekit::cuda::bench {

const std::vector<Preset>& presets() {
    static const std::vector<Preset> kPresets = {
        {"mixtral", 4096, 14336, 8, 2, 8192},
        {"dsv3-ep8", 7168, 2048, 32, 8, 4096},
        {"dsv3-e256", 7168, 2048, 256, 8, 4096},
        {"qwen3-30b", 2048, 768, 128, 8, 16384},
    };
    return kPresets;
}

int gpu_count() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

const Preset& find_preset(const std::string& name) {
    std::string known;
    for (auto& p : presets()) {
        if (p.name == name) return p;
        known += (known.empty() ? "" : "|") + p.name;
    }
    throw UsageError(str("--preset=", name, " is not a preset (", known, ")"));
}

double parse_skew(const std::string& value) {
    double s = 0;
    if (value.rfind("zipf:", 0) == 0) {
        try {
            s = std::stod(value.substr(5));
        } catch (...) {
            s = -1;
        }
    }
    MOEKIT_REQUIRE(value.rfind("zipf:", 0) == 0 && s > 0 && std::isfinite(s), "--skew=", value,
                   " must be zipf:S with S > 0 (e.g. zipf:1.2)");
    return s;
}

std::vector<int32_t> routing_counts(const Preset& p, double zipf_s, uint64_t seed) {
    std::vector<int32_t> counts(p.experts, 0);
    std::vector<std::pair<double, int>> logits(p.experts);
    for (int64_t t = 0; t < p.tokens; ++t) {
        for (int64_t e = 0; e < p.experts; ++e) {
            // Gumbel noise + log popularity: top-k = k distinct experts sampled by popularity.
            double u = std::max(uniform01(seed, 7, uint64_t(t * p.experts + e)), 1e-300);
            logits[e] = {-std::log(-std::log(u)) - zipf_s * std::log(double(e + 1)), int(e)};
        }
        std::partial_sort(logits.begin(), logits.begin() + p.topk, logits.end(), std::greater<>());
        for (int64_t j = 0; j < p.topk; ++j) ++counts[logits[j].second];
    }
    return counts;
}

namespace {

using gemm_detail::Op;

struct Problem {
    Preset p;
    int64_t rows, H, F, E;
    std::vector<int32_t> counts, offsets;
    DevBuf<int32_t> d_off;
    DevBuf<bf16> x, w1, w2, h, act, y;
    DevBuf<float> dw1, dw2, prob;
    Problem(const Preset& pr, const Options& o)
        : p(pr),
          rows(pr.tokens * pr.topk),
          H(pr.hidden),
          F(pr.ffn),
          E(pr.experts),
          counts(o.even ? std::vector<int32_t>(pr.experts, int32_t(pr.tokens * pr.topk / pr.experts))
                        : routing_counts(pr, o.zipf_s, o.seed)),
          offsets(pr.experts + 1, 0),
          d_off(pr.experts + 1),
          x(rows * H),
          w1(E * 2 * F * H),
          w2(E * H * F),
          h(rows * 2 * F),
          act(rows * F),
          y(rows * H),
          dw1(E * 2 * F * H),
          dw2(E * H * F),
          prob(rows) {
        std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
        MOEKIT_CUDA_CHECK(
            cudaMemcpy(d_off.ptr, offsets.data(), sizeof(int32_t) * offsets.size(), cudaMemcpyHostToDevice));
        // Activations O(1), weights at init scale: realistic magnitudes, never zeros.
        fill_uniform(x.ptr, rows * H, 1.f, o.seed + 1);
        fill_uniform(w1.ptr, E * 2 * F * H, 0.02f, o.seed + 2);
        fill_uniform(w2.ptr, E * H * F, 0.02f, o.seed + 3);
        fill_uniform(h.ptr, rows * 2 * F, 1.f, o.seed + 4);
        fill_uniform(act.ptr, rows * F, 1.f, o.seed + 5);
        fill_uniform(y.ptr, rows * H, 1.f, o.seed + 6);
        fill_uniform(prob.ptr, rows, 0.05f, 1.f, o.seed + 7);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    }
};

struct GemmFns {
    decltype(&grouped_gemm_nt) nt;
    decltype(&grouped_gemm_nn) nn;
    decltype(&grouped_gemm_tn) tn;
};
const GemmFns kGrouped{grouped_gemm_nt, grouped_gemm_nn, grouped_gemm_tn};
const GemmFns kSync{sync_baseline::grouped_gemm_nt, sync_baseline::grouped_gemm_nn, sync_baseline::grouped_gemm_tn};

// The six expert GEMMs of one MLP step, each as (name, op, n, k-or-m, A, B, C) with the grouped conventions.
struct GemmCase {
    const char* name;
    Op op;
    int64_t n, k;
    const bf16 *A, *B;
    void* C;
};
const char* const kGemmNames[] = {"fc1_fwd", "fc2_fwd", "fc2_dgrad", "fc2_wgrad", "fc1_dgrad", "fc1_wgrad"};
std::vector<GemmCase> gemm_cases(Problem& q, bf16* dy, bf16* dact, bf16* dh, bf16* dx) {
    return {
        {kGemmNames[0], Op::kNT, 2 * q.F, q.H, q.x.ptr, q.w1.ptr, q.h.ptr},
        {kGemmNames[1], Op::kNT, q.H, q.F, q.act.ptr, q.w2.ptr, q.y.ptr},
        {kGemmNames[2], Op::kNN, q.F, q.H, dy, q.w2.ptr, dact},
        {kGemmNames[3], Op::kTN, q.F, q.H, dy, q.act.ptr, q.dw2.ptr},
        {kGemmNames[4], Op::kNN, q.H, 2 * q.F, dh, q.w1.ptr, dx},
        {kGemmNames[5], Op::kTN, q.H, 2 * q.F, dh, q.x.ptr, q.dw1.ptr},
    };
}

void run_case(const GemmFns& f, const Problem& q, const GemmCase& c, cudaStream_t s) {
    GroupedGemmShape shape{q.E, q.rows, c.n, c.k};
    if (c.op == Op::kNT) f.nt(shape, c.A, c.B, static_cast<bf16*>(c.C), q.d_off.ptr, s);
    if (c.op == Op::kNN) f.nn(shape, c.A, c.B, static_cast<bf16*>(c.C), q.d_off.ptr, s);
    if (c.op == Op::kTN) f.tn(shape, c.A, c.B, static_cast<float*>(c.C), q.d_off.ptr, WgradWrite::overwrite, s);
}

double gemm_flops(const Problem& q, const GemmCase& c) { return 2.0 * double(q.rows) * double(c.n) * double(c.k); }

bool is_hopper() {
    int dev = 0, major = 0, minor = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
}

nlohmann::json header(const Problem& q, const Options& o) {
    cudaDeviceProp prop{};
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    int maxc = *std::max_element(q.counts.begin(), q.counts.end());
    int minc = *std::min_element(q.counts.begin(), q.counts.end());
    return {{"preset", q.p.name}, {"H", q.H},          {"F", q.F},           {"E", q.E},         {"topk", q.p.topk},
            {"T", q.p.tokens},    {"rows", q.rows},    {"zipf_s", o.zipf_s}, {"iters", o.iters}, {"device", prop.name},
            {"max_count", maxc},  {"min_count", minc}, {"counts", q.counts},
            // The grouped GEMMs' math on 128-row tiles over the routed rows' (their padding rows, not in the dense floor).
            {"rows_on_128_row_tiles", q.rows > 0 ? double(rows_on_row_tiles(q.counts, 128)) / double(q.rows) : 1.0}};
}

}  // namespace

nlohmann::json bench_gemms(const Preset& pr, const Options& o) {
    if (!o.only_gemm.empty()) {  // before any allocation: a bad name is a usage error, also without a GPU
        const bool known = std::find(std::begin(kGemmNames), std::end(kGemmNames), o.only_gemm) != std::end(kGemmNames);
        MOEKIT_REQUIRE(known, "--gemm=", o.only_gemm,
                       ": expected fc1_fwd, fc2_fwd, fc2_dgrad, fc2_wgrad, fc1_dgrad or fc1_wgrad");
    }
    apply_gemm_tuning(o.gemm_tune);
    Problem q(pr, o);
    DevBuf<bf16> dy(q.rows * q.H), dact(q.rows * q.F), dh(q.rows * 2 * q.F), dx(q.rows * q.H);
    fill_uniform(dy.ptr, q.rows * q.H, 1.f, o.seed + 8);
    fill_uniform(dh.ptr, q.rows * 2 * q.F, 1.f, o.seed + 9);
    cudaStream_t s;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    nlohmann::json out = header(q, o);
    out["rounds"] = o.rounds;
    out["gemms"] = nlohmann::json::array();
    for (auto& c : gemm_cases(q, dy.ptr, dact.ptr, dh.ptr, dx.ptr)) {
        if (!o.only_gemm.empty() && o.only_gemm != c.name) continue;
        nlohmann::json r{{"name", c.name},
                         {"op", c.op == Op::kNT   ? "nt"
                                : c.op == Op::kNN ? "nn"
                                                  : "tn"},
                         {"n", c.n},
                         {"k", c.k},
                         {"gflop", gemm_flops(q, c) / 1e9}};
        // Every column of a GEMM, timed once a round, the rounds in balanced orders (balanced_order), the median
        // reported: single runs of one column drift by up to ~10 % between calls, which must not decide
        // a per-shape rule. The sync-free columns are timed as the layer runs them, by graph replays (two CUTLASS
        // launches of a split wgrad then cost no host time on the GPU's clock); the sync baseline cannot be captured.
        struct Column {
            const char* key;
            std::function<double()> time;
        };
        std::vector<Column> columns;
        // A named ping-pong or split column is the 128x128 tile's (a wgrad's ping-pong may take 128x192, cl-pp192).
        auto graph = [&](GroupedGemmKernel kernel, CutlassConfig config) {
            return [&, kernel, config] {
                const bool square = config == CutlassConfig::kPingpong || config == CutlassConfig::kSplitBySize;
                set_grouped_gemm_kernel(kernel);
                set_cutlass_config(config);
                if (square) set_wgrad_wide(0);
                const double ms = graph_time_ms([&] { run_case(kGrouped, q, c, s); }, s, o.warmup, o.iters);
                if (square) set_wgrad_wide(-1);
                set_cutlass_config(CutlassConfig::kAuto);
                set_grouped_gemm_kernel(GroupedGemmKernel::kAuto);
                return ms;
            };
        };
        columns.push_back({"auto_ms", graph(GroupedGemmKernel::kAuto, CutlassConfig::kAuto)});  // the layer's choice
        if (c.op == Op::kTN && is_hopper() && cutlass_grouped_gemm_built()) {
            // The layer's choice with one switch set for the measurement and restored after it.
            auto switched = [&](auto set, auto get, auto value) {
                auto run = graph(GroupedGemmKernel::kAuto, CutlassConfig::kAuto);
                return [run, set, get, value] {
                    const auto was = get();
                    set(value);
                    const double ms = run();
                    set(was);
                    return ms;
                };
            };
            // Every gradient store plain (WgradStores::kPlain), for A/B against auto's evict-first stores on small
            // groups; elsewhere the same kernel as auto (a measure of the noise).
            columns.push_back({"auto_plain_stores_ms", switched(set_wgrad_stores, wgrad_stores, WgradStores::kPlain)});
            // CUTLASS's tiles walked along M, the order before the wgrad's own rule (CutlassRaster); where the rule
            // walks M as well, the same kernel as auto.
            columns.push_back(
                {"auto_along_m_ms", switched(set_cutlass_raster, cutlass_raster, CutlassRaster::kAlongM)});
        }
        if (is_hopper()) {
            if (c.op == Op::kTN) {
                // The own kernel's wgrad, cooperative and ping-pong (set_tn_pingpong), each on single CTAs and on
                // CTA pairs; the ping-pong also with four staging buffers a warpgroup (set_tn_pingpong_buffers).
                const struct {
                    const char* key;
                    int pingpong, cluster, buffers;
                } own[] = {{"tma_ms", 0, 1, -1},    {"tma2_ms", 0, 2, -1}, {"tma_pp_ms", 1, 1, 2},
                           {"tma_pp2_ms", 1, 2, 2}, {"tma_pp4_ms", 1, 1, 4}};
                for (const auto& v : own) {
                    auto run = graph(GroupedGemmKernel::kTma, CutlassConfig::kAuto);
                    columns.push_back({v.key, [run, v] {
                                           set_tn_pingpong(v.pingpong);
                                           set_grouped_gemm_cluster(v.cluster);
                                           set_tn_pingpong_buffers(v.buffers);
                                           const double ms = run();
                                           set_tn_pingpong(-1);
                                           set_grouped_gemm_cluster(0);
                                           set_tn_pingpong_buffers(-1);
                                           return ms;
                                       }});
                }
            } else {
                columns.push_back({"tma_ms", graph(GroupedGemmKernel::kTma, CutlassConfig::kAuto)});
            }
            if (cutlass_grouped_gemm_built()) {
                columns.push_back({"cutlass_coop_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kCooperative)});
                columns.push_back(
                    {"cutlass_tall_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kCooperativeTall)});
                columns.push_back(
                    {"cutlass_pingpong_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kPingpong)});
                if (c.op != Op::kTN) {  // computed transposed (the small groups' choice); ping-pong 128x192
                    columns.push_back({"cutlass_swap_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kSwapAB)});
                    columns.push_back(
                        {"cutlass_pp192_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kPingpongWide)});
                    columns.push_back(
                        {"cutlass_swap_pp_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kSwapPingpong)});
                }
                if (c.op == Op::kTN) {  // on a 2x2 cluster; ping-pong 128x192
                    columns.push_back(
                        {"cutlass_2x2_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kCooperative2x2)});
                    columns.push_back(
                        {"cutlass_pp192_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kPingpongWide)});
                    columns.push_back({"cutlass_pp192t_ms",
                                       graph(GroupedGemmKernel::kCutlass, CutlassConfig::kPingpongWideTransposed)});
                }
                if (c.op == Op::kTN && wgrad_split_on())  // wgrad groups split by size between the two
                    columns.push_back(
                        {"cutlass_split_ms", graph(GroupedGemmKernel::kCutlass, CutlassConfig::kSplitBySize)});
            }
        } else {
            columns.push_back({"mma_ms", graph(GroupedGemmKernel::kMmaSync, CutlassConfig::kAuto)});
        }
        if (c.op == Op::kTN) {  // the floor of a write-bound wgrad: filling its fp32 gradients once
            const size_t bytes = size_t(q.E) * size_t(c.n) * size_t(c.k) * sizeof(float);
            columns.push_back({"fill_ms", [&, bytes] {
                                   return graph_time_ms([&] { MOEKIT_CUDA_CHECK(cudaMemsetAsync(c.C, 0, bytes, s)); },
                                                        s, o.warmup, o.iters);
                               }});
        }
        columns.push_back(
            {"sync_ms", [&] { return time_ms([&] { run_case(kSync, q, c, s); }, s, o.warmup, o.iters); }});
        columns.push_back({"dense_ms", [&] {
                               return graph_time_ms([&] { dense_gemm(c.op, q.rows, c.n, c.k, c.A, c.B, c.C, s); }, s,
                                                    o.warmup, o.iters);
                           }});
        if (o.acceptance_only)
            std::erase_if(columns, [](const Column& col) {
                const std::string key = col.key;
                return key != "auto_ms" && key != "sync_ms" && key != "dense_ms";
            });
        const int rounds = std::max(o.rounds, 1), n = int(columns.size());
        std::vector<std::vector<double>> ms(n);
        int device = 0;
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
        moekit::bench::ClockSampler clocks(device, n);  // the SM clock each column ran at (the power cap moves it)
        // Warm-up rounds, untimed, for at least 2 s (as bench_layer): without them the first columns of the first
        // round ran on a GPU not yet at its power cap's clocks (H200, 2026-11-28: dsv3-e256 fc1 forward `auto` 4.835
        // ms against 5.136 for the identical cl-swap column, its samples 69 % power-capped against 100 %).
        const auto warm_start = std::chrono::steady_clock::now();
        for (int round = 0; round == 0 || std::chrono::steady_clock::now() - warm_start < std::chrono::seconds(2);
             ++round)
            for (int col : balanced_order(n, round)) columns[col].time();
        for (int round = 0; round < rounds; ++round)
            for (int col : balanced_order(n, round)) {
                clocks.begin(col);
                ms[col].push_back(columns[col].time());
                clocks.end();
            }
        std::vector<std::string> keys;
        for (int col = 0; col < n; ++col) {
            r[columns[col].key] = median(ms[col]);
            if (rounds > 1) r[std::string(columns[col].key) + "_rounds"] = ms[col];
            keys.push_back(columns[col].key);
        }
        // The acceptance ratio round by round: both columns of one round ran within seconds of each other, so their
        // ratio is less moved by the power cap's clock drift than the ratio of two medians (two columns running the
        // same kernels read up to 9 % apart, H200, 2026-11-28: docs/perf.md).
        if (rounds > 1 && r.contains("auto_ms") && r.contains("dense_ms")) {
            const int a = int(std::find(keys.begin(), keys.end(), "auto_ms") - keys.begin());
            const int d = int(std::find(keys.begin(), keys.end(), "dense_ms") - keys.begin());
            std::vector<double> ratio;
            for (int round = 0; round < rounds; ++round) ratio.push_back(ms[d][round] / ms[a][round]);
            r["dense_over_auto_rounds"] = ratio;
            r["dense_over_auto_median"] = median(ratio);
        }
        r["clocks"] = moekit::bench::clock_json(clocks, keys, n);
        out["gemms"].push_back(r);
    }
    out["gemm_tuning"] = gemm_tuning_json();
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
    return out;
}

std::string format_gemm_table(const nlohmann::json& r) {
    char padded[32];
    std::snprintf(padded, sizeof padded, "%.3f", r.value("rows_on_128_row_tiles", 1.0));
    std::string out = str(r["preset"].get<std::string>(), " (rows ", r["rows"].get<int64_t>(), ", counts ",
                          r["min_count"].get<int>(), "..", r["max_count"].get<int>(), " (",
                          padded, "x computed on 128-row tiles), zipf ",
                          r["zipf_s"].get<double>(), ", median of ", r.value("rounds", 1),
                          " rounds in balanced order) on ", r["device"].get<std::string>(), "\n");
    // auto = the per-shape choice the layer runs; auto pl (wgrad) = the same with plain gradient stores (auto marks
    // them evict-first in L2 on small groups: WgradStores); auto rm (wgrad) = the same with the tiles walked along M
    // (CutlassRaster: auto walks N for a wgrad whose [rows, M] operand overflows half the L2); tma = own kernel
    // (wgrad: its cooperative 128x256 tile); tma2 (wgrad) = the same on CTA pairs; tma pp / pp2 (wgrad) = the own
    // kernel's ping-pong (set_tn_pingpong) on single CTAs / CTA pairs; tma pp4 = its ping-pong with four staging
    // buffers a warpgroup and five ring stages;
    // cl-coop / cl-tall / cl-pp = CUTLASS 128x256 / 256x128 / ping-pong 128x128 (sm_90); cl-split = wgrad groups
    // split between cooperative and ping-pong by size (wgrad_split()); cl-swap = CUTLASS computing Cᵀ = W·Aᵀ, 128
    // weight rows x 192 token rows (nt/nn); cl-pp192 = CUTLASS ping-pong on 128x192 tiles (cl-pp192t: a wgrad
    // computed transposed on them, the 192 along its m); cl-swpp = cl-swap's product and tile on ping-pong (nt/nn);
    // cl-2x2 (wgrad) = cooperative on a 2x2 cluster; mma = mma.sync (other GPUs); best = the fastest grouped
    // (sync-free) column; dense/auto = dense cuBLAS time over the chosen kernel's (the per-GEMM acceptance ratio),
    // and the same ratio taken in each round (median, least and greatest); fill (wgrad only) = cudaMemsetAsync of the
    // fp32 gradients, a write-bound wgrad's floor (bench_wgrad_stores says what else bounds it).
    struct Col {
        const char *key, *head;
    };
    const Col grouped[] = {{"auto_ms", "auto ms"},
                           {"auto_plain_stores_ms", "auto pl"},
                           {"auto_along_m_ms", "auto rm"},
                           {"tma_ms", "tma ms"},
                           {"tma2_ms", "tma2"},
                           {"tma_pp_ms", "tma pp"},
                           {"tma_pp2_ms", "tma pp2"},
                           {"tma_pp4_ms", "tma pp4"},
                           {"cutlass_coop_ms", "cl-coop"},
                           {"cutlass_tall_ms", "cl-tall"},
                           {"cutlass_pingpong_ms", "cl-pp"},
                           {"cutlass_split_ms", "cl-split"},
                           {"cutlass_swap_ms", "cl-swap"},
                           {"cutlass_pp192_ms", "cl-pp192"},
                           {"cutlass_swap_pp_ms", "cl-swpp"},
                           {"cutlass_pp192t_ms", "cl-pp192t"},
                           {"cutlass_2x2_ms", "cl-2x2"},
                           {"mma_ms", "mma ms"}};
    char cell[64];
    auto add = [&](const char* fmt, auto v) {
        std::snprintf(cell, sizeof cell, fmt, v);
        out += cell;
    };
    add("  %-10s", "gemm");
    add(" %4s", "op");
    add(" %8s |", "GFLOP");
    for (const Col& c : grouped) add(" %8s", c.head);
    out += " | sync ms dense ms | TFLOP/s   dense | dns/au dns/bs | a round:  median  min-max |     fill\n";
    auto ms = [](const nlohmann::json& g, const char* key) { return g.contains(key) ? g[key].get<double>() : NAN; };
    for (auto& g : r["gemms"]) {
        double best = INFINITY;
        for (const Col& c : grouped)
            if (g.contains(c.key)) best = std::min(best, g[c.key].get<double>());
        const double dense = g["dense_ms"].get<double>(), gf = g["gflop"].get<double>(), chosen = ms(g, "auto_ms");
        add("  %-10s", g["name"].get<std::string>().c_str());
        add(" %4s", g["op"].get<std::string>().c_str());
        add(" %8.1f |", gf);
        for (const Col& c : grouped) add(" %8.3f", ms(g, c.key));
        add(" | %7.3f", g["sync_ms"].get<double>());
        add(" %8.3f |", dense);
        add(" %7.0f", gf / chosen);
        add(" %7.0f |", gf / dense);
        add(" %5.2fx", dense / chosen);
        add(" %5.2fx |", dense / best);
        if (g.contains("dense_over_auto_rounds")) {  // dns/au round by round (bench_gemms)
            const auto rr = g["dense_over_auto_rounds"].get<std::vector<double>>();
            add("          %5.2fx", g["dense_over_auto_median"].get<double>());
            add(" %4.2f", *std::min_element(rr.begin(), rr.end()));
            add("-%4.2f |", *std::max_element(rr.begin(), rr.end()));
        } else {
            add(" %24s |", "");
        }
        add(" %8.3f\n", ms(g, "fill_ms"));
    }
    // Timed columns the table has no head for (one added for an A/B and not yet given one): listed after it, so a
    // measurement is never only in the JSON.
    for (auto& g : r["gemms"]) {
        std::string extra;
        for (auto it = g.begin(); it != g.end(); ++it) {
            const std::string& key = it.key();
            const bool timed = key.size() > 3 && key.compare(key.size() - 3, 3, "_ms") == 0 && it->is_number();
            const bool shown = key == "sync_ms" || key == "dense_ms" || key == "fill_ms" ||
                               std::any_of(std::begin(grouped), std::end(grouped),
                                           [&](const Col& c) { return key == c.key; });
            if (!timed || shown) continue;
            std::snprintf(cell, sizeof cell, " %s %.3f", key.c_str(), it->get<double>());
            extra += cell;
        }
        if (!extra.empty()) out += "  " + g["name"].get<std::string>() + " other columns (ms):" + extra + "\n";
    }
    // The SM clock of the acceptance pair (the layer's choice and dense cuBLAS), where NVML was there to read it.
    for (auto& g : r["gemms"]) {
        if (!g.contains("clocks") || !g["clocks"].contains("auto_ms") || !g["clocks"].contains("dense_ms")) continue;
        const auto &a = g["clocks"]["auto_ms"], &d = g["clocks"]["dense_ms"];
        std::snprintf(cell, sizeof cell, "  %-10s SM clock auto / dense: %.0f / %.0f MHz",
                      g["name"].get<std::string>().c_str(), a["sm_mhz"].get<double>(), d["sm_mhz"].get<double>());
        out += cell;
        std::snprintf(cell, sizeof cell, " (power cap %.0f / %.0f %% of samples)\n",
                      100 * a["power_capped"].get<double>(), 100 * d["power_capped"].get<double>());
        out += cell;
    }
    if (r.contains("gemm_tuning")) out += format_gemm_tuning_lines(r["gemm_tuning"]);
    return out;
}

namespace {

const char* const kStageNames[] = {"fc1",       "swiglu_probs", "fc2",       "fc2_dgrad",
                                   "fc2_wgrad", "swiglu_bwd",   "fc1_dgrad", "fc1_wgrad"};
constexpr int kNumStages = 8, kNumFwdStages = 3;

// One forward+backward of the expert MLP with the given GEMM backend; ev (kNumStages + 1 events, or null) marks
// the stage boundaries.
void mlp_step(const GemmFns& f, Problem& q, bf16* dy, bf16* dact, bf16* dh, bf16* dx, cudaEvent_t* ev, cudaStream_t s) {
    auto mark = [&](int i) {
        if (ev) MOEKIT_CUDA_CHECK(cudaEventRecord(ev[i], s));
    };
    // The layer's own activation kernels (src/cuda/activation.cu), so this measures what the layer runs.
    const ActivationShape act_shape{q.rows, q.F, true, Activation::silu};
    const int32_t* num_rows = q.d_off.ptr + q.E;  // offsets[G], read on the device
    mark(0);
    f.nt({q.E, q.rows, 2 * q.F, q.H}, q.x.ptr, q.w1.ptr, q.h.ptr, q.d_off.ptr, s);
    mark(1);
    activation_forward<float>(act_shape, num_rows, q.h.ptr, q.prob.ptr, q.act.ptr, s);
    mark(2);
    f.nt({q.E, q.rows, q.H, q.F}, q.act.ptr, q.w2.ptr, q.y.ptr, q.d_off.ptr, s);
    mark(3);
    f.nn({q.E, q.rows, q.F, q.H}, dy, q.w2.ptr, dact, q.d_off.ptr, s);
    mark(4);
    f.tn({q.E, q.rows, q.F, q.H}, dy, q.act.ptr, q.dw2.ptr, q.d_off.ptr, WgradWrite::overwrite, s);
    mark(5);
    activation_backward<float>(act_shape, num_rows, q.h.ptr, q.prob.ptr, dact, dh, nullptr, s);
    mark(6);
    f.nn({q.E, q.rows, q.H, 2 * q.F}, dh, q.w1.ptr, dx, q.d_off.ptr, s);
    mark(7);
    f.tn({q.E, q.rows, q.H, 2 * q.F}, dh, q.x.ptr, q.dw1.ptr, q.d_off.ptr, WgradWrite::overwrite, s);
    mark(8);
}

// Per-stage medians (ms) of eager steps, plus the median of the whole step.
nlohmann::json stage_times(const GemmFns& f, Problem& q, bf16* dy, bf16* dact, bf16* dh, bf16* dx, const Options& o,
                           cudaStream_t s) {
    cudaEvent_t ev[kNumStages + 1];
    for (auto& e : ev) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
    std::vector<std::vector<double>> t(kNumStages + 1);
    for (int it = 0; it < o.warmup + o.iters; ++it) {
        mlp_step(f, q, dy, dact, dh, dx, ev, s);
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(ev[kNumStages]));
        if (it < o.warmup) continue;
        for (int i = 0; i < kNumStages; ++i) {
            float ms = 0;
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
            t[i].push_back(ms);
        }
        float fwd = 0, all = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&fwd, ev[0], ev[kNumFwdStages]));
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&all, ev[0], ev[kNumStages]));
        t[kNumStages].push_back(all);
        (void)fwd;
    }
    for (auto& e : ev) cudaEventDestroy(e);
    nlohmann::json r{{"stages_ms", nlohmann::json::object()}};
    double fwd = 0, bwd = 0;
    for (int i = 0; i < kNumStages; ++i) {
        double m = median(t[i]);
        r["stages_ms"][kStageNames[i]] = m;
        (i < kNumFwdStages ? fwd : bwd) += m;
    }
    r["fwd_ms"] = fwd;  // sums of stage medians
    r["bwd_ms"] = bwd;
    r["eager_fwd_bwd_ms"] = median(t[kNumStages]);
    return r;
}

}  // namespace

nlohmann::json bench_expert_mlp(const Preset& pr, const Options& o) {
    apply_gemm_tuning(o.gemm_tune);
    Problem q(pr, o);
    DevBuf<bf16> dy(q.rows * q.H), dact(q.rows * q.F), dh(q.rows * 2 * q.F), dx(q.rows * q.H);
    fill_uniform(dy.ptr, q.rows * q.H, 1.f, o.seed + 8);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    cudaStream_t s;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    nlohmann::json out = header(q, o);
    out["scope"] = "expert MLP (fc1, SwiGLU x probs, fc2; dgrad + wgrad); router/permute/combine not included";
    const double flops = 3.0 * 2.0 * double(q.rows) * double(q.H) * double(3 * q.F);
    out["gemm_tflop_fwd_bwd"] = flops / 1e12;

    // Floor: dense cuBLAS fc1 [rows,H]x[H,2F] + fc2 [rows,F]x[F,H]; forward+backward = 3 x forward.
    double fc1 = time_ms([&] { dense_gemm(Op::kNT, q.rows, 2 * q.F, q.H, q.x.ptr, q.w1.ptr, q.h.ptr, s); }, s, o.warmup,
                         o.iters);
    double fc2 =
        time_ms([&] { dense_gemm(Op::kNT, q.rows, q.H, q.F, q.act.ptr, q.w2.ptr, q.y.ptr, s); }, s, o.warmup, o.iters);
    out["floor"] = {{"fc1_ms", fc1}, {"fc2_ms", fc2}, {"fwd_ms", fc1 + fc2}, {"fwd_bwd_ms", 3 * (fc1 + fc2)}};

    // Sync-free grouped path: eager per-stage times, then the whole step captured in one graph (global capture
    // mode: a host sync anywhere inside would make the capture fail) and timed by replays.
    nlohmann::json grouped = stage_times(kGrouped, q, dy.ptr, dact.ptr, dh.ptr, dx.ptr, o, s);
    const GroupedGemmKernel kernel = grouped_gemm_kernel();
    grouped["kernel"] = grouped_gemm_kernel_name(kernel);
    int64_t syncs0 = sync_baseline::host_sync_count();
    grouped["graph_fwd_bwd_ms"] = graph_time_ms(
        [&] { mlp_step(kGrouped, q, dy.ptr, dact.ptr, dh.ptr, dx.ptr, nullptr, s); }, s, o.warmup, o.iters);
    grouped["host_syncs_per_step"] = sync_baseline::host_sync_count() - syncs0;  // 0: captured in one graph
    grouped["captured_in_one_graph"] = true;
    grouped["fwd_bwd_ms"] = grouped["graph_fwd_bwd_ms"];
    out["grouped"] = grouped;

    // Synchronous baseline: offsets to the host before every GEMM, one cuBLAS GEMM per expert.
    syncs0 = sync_baseline::host_sync_count();
    nlohmann::json sync = stage_times(kSync, q, dy.ptr, dact.ptr, dh.ptr, dx.ptr, o, s);
    sync["host_syncs_per_step"] = double(sync_baseline::host_sync_count() - syncs0) / (o.warmup + o.iters);
    sync["fwd_bwd_ms"] = sync["eager_fwd_bwd_ms"];
    out["sync"] = sync;

    const double floor_ms = out["floor"]["fwd_bwd_ms"].get<double>();
    const double g = grouped["fwd_bwd_ms"].get<double>(), b = sync["fwd_bwd_ms"].get<double>();
    out["ratios"] = {{"grouped_vs_floor", g / floor_ms}, {"sync_vs_floor", b / floor_ms}, {"grouped_vs_sync", g / b}};
    out["tflops"] = {{"grouped", flops / g / 1e9}, {"sync", flops / b / 1e9}, {"floor", flops / floor_ms / 1e9}};
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
    return out;
}

std::string format_mlp_table(const nlohmann::json& r) {
    std::string out = str("moekit bench --preset ", r["preset"].get<std::string>(), "  (H ", r["H"].get<int64_t>(),
                          ", F ", r["F"].get<int64_t>(), ", E ", r["E"].get<int64_t>(), ", k ",
                          r["topk"].get<int64_t>(), ", T ", r["T"].get<int64_t>(), ", zipf ", r["zipf_s"].get<double>(),
                          ", counts ", r["min_count"].get<int>(), "..", r["max_count"].get<int>(), ") on ",
                          r["device"].get<std::string>(), "\n  scope: ", r["scope"].get<std::string>(), "\n");
    char line[320];
    std::snprintf(line, sizeof line, "  %-14s %12s %12s\n", "stage (ms)", "sync-free", "sync-cuBLAS");
    out += line;
    for (int i = 0; i < kNumStages; ++i) {
        std::snprintf(line, sizeof line, "  %-14s %12.3f %12.3f\n", kStageNames[i],
                      r["grouped"]["stages_ms"][kStageNames[i]].get<double>(),
                      r["sync"]["stages_ms"][kStageNames[i]].get<double>());
        out += line;
    }
    auto row = [&](const char* name, double a, double b, const char* fmt) {
        std::snprintf(line, sizeof line, fmt, name, a, b);
        out += line;
    };
    const char* f3 = "  %-14s %12.3f %12.3f\n";
    row("forward", r["grouped"]["fwd_ms"].get<double>(), r["sync"]["fwd_ms"].get<double>(), f3);
    row("backward", r["grouped"]["bwd_ms"].get<double>(), r["sync"]["bwd_ms"].get<double>(), f3);
    row("fwd+bwd", r["grouped"]["fwd_bwd_ms"].get<double>(), r["sync"]["fwd_bwd_ms"].get<double>(), f3);
    row("TFLOP/s", r["tflops"]["grouped"].get<double>(), r["tflops"]["sync"].get<double>(), "  %-14s %12.0f %12.0f\n");
    row("host syncs", r["grouped"]["host_syncs_per_step"].get<double>(), r["sync"]["host_syncs_per_step"].get<double>(),
        "  %-14s %12.0f %12.0f\n");
    row("x floor", r["ratios"]["grouped_vs_floor"].get<double>(), r["ratios"]["sync_vs_floor"].get<double>(),
        "  %-14s %11.2fx %11.2fx\n");
    out += str("  floor (dense cuBLAS, 3 x fwd): ", r["floor"]["fwd_bwd_ms"].get<double>(), " ms, ",
               r["tflops"]["floor"].get<double>(),
               " TFLOP/s; sync-free / sync = ", r["ratios"]["grouped_vs_sync"].get<double>(), "; grouped kernel ",
               r["grouped"]["kernel"].get<std::string>(), "\n");
    return out;
}

}  // namespace moekit::cuda::bench
