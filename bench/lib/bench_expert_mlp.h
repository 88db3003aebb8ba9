// Benchmarks of the expert GEMMs and the expert MLP (fc1, SwiGLU x probs, fc2, forward and backward) for the four
// issue-3 presets: sync-free grouped GEMMs vs the synchronous cuBLAS baseline vs the floor (dense cuBLAS GEMMs of
// the same shapes). Host-only header (no CUDA types). Used by tools/cmd_bench.cpp and bench/bench_grouped_gemm.cu.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moekit/config.h"

namespace moekit::cuda::bench {

struct Preset {
    std::string name;
    int64_t hidden, ffn, experts, topk, tokens;  // H, F, E, k, T (SwiGLU: fc1 has 2F outputs)
};
const std::vector<Preset>& presets();
int gpu_count();                                     // 0 when the driver or device is missing (never throws)
const Preset& find_preset(const std::string& name);  // UsageError naming the known presets

struct Options {
    double zipf_s = 0;  // 0: uniform random logits; s > 0: expert e's popularity proportional to 1/(e+1)^s
    int iters = 20;
    int warmup = 3;
    int rounds = 1;  // bench_gemms: interleaved rounds of every column, the median reported
    uint64_t seed = 1234;
    // Every expert exactly T·k / E rows (a multiple of 128 on every preset: no tile computes padding rows), so a
    // grouped GEMM against the dense one of the same total shape shows what the grouping costs beyond padding.
    bool even = false;
    std::string only_gemm;  // bench_gemms: this one GEMM (fc1_fwd ... fc1_wgrad) only, e.g. to profile it; empty: all
    // bench_gemms: time only the acceptance pair (the per-shape choice and dense cuBLAS) and the sync baseline, so a
    // round is three measurements within a few tens of milliseconds and a full balanced design (6 rounds) is cheap.
    bool acceptance_only = false;
    // bench_layer: a second graph of the step captured with this switch on, replayed in the same balanced rounds as
    // the graph with it off: "glu-forward" (the gated activation in fc1's epilogue), "glu-backward" (its backward in
    // fc2's dgrad epilogue), "gather-fc1" (fc1's loads gathering the token rows: no permute pass); empty: none.
    std::string variant;
    // The grouped GEMMs' configuration measured per shape on this device at its first eager launch
    // (src/cuda/gemm_tuning.h; `--gemm-tune on|off`), else choose_for_shape's rule alone. On by default, as in the
    // engine (docs/perf.md: the GPU suite with it on, its step A/B on an H100).
    bool gemm_tune = true;
};
// Parses "zipf:S" (S > 0) into Options::zipf_s; UsageError otherwise.
double parse_skew(const std::string& value);

// Per-expert row counts of top-k routing over T tokens: each token takes the k largest of (random Gumbel logits
// + zipf bias), i.e. k distinct experts drawn by popularity without replacement.
std::vector<int32_t> routing_counts(const Preset& p, double zipf_s, uint64_t seed);

// Per-GEMM timings (fc1/fc2 forward, dgrad, wgrad) for grouped wgmma, grouped mma.sync, sync baseline and dense.
nlohmann::json bench_gemms(const Preset& p, const Options& o);
// The expert MLP forward/backward, stage by stage, for the grouped path (captured in one CUDA graph: zero host
// syncs) and the sync baseline, with the floor = 3 x (dense fc1 + dense fc2) forward.
nlohmann::json bench_expert_mlp(const Preset& p, const Options& o);

// The whole CUDA layer (bench_layer.cu): router on random inputs (zipf skew through a per-expert logit bias),
// per-stage times, one-graph step for the sync-free path, the sync baseline, and the same floor.
nlohmann::json bench_layer(const Preset& p, const Options& o);

// The layer configuration of a preset (SwiGLU, softmax top-k, aux loss, fp32 router), one sequence of T tokens.
MoeConfig preset_config(const Preset& p);

// The CUDA layer under expert parallelism on ONE GPU (bench_layer_ep.cu): `ep` virtual ranks, each with
// T/ep of the preset's tokens and E/ep experts, eager fwd+bwd steps through `dispatcher` (allgather |
// alltoall; with receive_factor > 0 the budgeted sync-free one, also captured in one graph per rank):
// whole-step wall time, each rank's step and stage times, bytes each rank sends and a device copy of as many
// bytes, host syncs, against the EP = 1 layer on all T tokens timed in the same call.
// echo_slots > 0: ECHO with that many spare slots per rank (the budgeted dispatcher; with o.zipf_s the skew).
nlohmann::json bench_layer_ep(const Preset& p, const Options& o, int ep, const std::string& dispatcher,
                              double receive_factor = 0, int64_t echo_slots = 0);
std::string format_layer_ep_table(const nlohmann::json& r);

// Human-readable tables of the results above.
std::string format_gemm_table(const nlohmann::json& r);
std::string format_mlp_table(const nlohmann::json& r);
std::string format_layer_table(const nlohmann::json& r);

}  // namespace moekit::cuda::bench
