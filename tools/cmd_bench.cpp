// `moekit bench`: times one MoE layer step forward+backward on the GPU for a preset (mixtral, dsv3-ep8, dsv3-e256,
// qwen3-30b): per-stage times, TFLOP/s, host syncs, ratios to the floor (dense cuBLAS GEMMs of the expert shapes)
// and to the synchronous baseline. Compiles without CUDA (then it exits 2). Benchmarks: bench/lib (moekit_bench).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "command.h"
#include "core/flags.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "lib/layer_variants.h"

#ifdef MOEKIT_WITH_CUDA
#include "lib/bench_expert_mlp.h"
#endif

namespace {

constexpr const char* kUsage =
    "moekit bench --preset mixtral|dsv3-ep8|dsv3-e256|qwen3-30b [--skew zipf:S] [--json FILE] [--iters N]\n"
    "                    [--device cuda] [--scope layer|mlp] [--variant NAME] [--gemm-tune on|off]\n"
    "             [--expert-model-parallel-size N --virtual-ranks N [--moe-token-dispatcher-type allgather|alltoall]\n"
    "              [--moe-expert-rank-capacity-factor f] [--moe-enable-echo --moe-num-echo-experts S]]\n"
    "Times one MoE layer step forward+backward (--scope layer, the default: router, permute, expert MLP, combine;\n"
    "--scope mlp: the expert MLP alone on top-k routing counts) with the sync-free grouped GEMMs (the step captured "
    "in\n"
    "one CUDA graph: no host sync) and with the synchronous cuBLAS baseline (host syncs counted), against the floor:\n"
    "dense cuBLAS GEMMs of the expert shapes (forward = fc1 [T*k,H]x[H,2F] + fc2 [T*k,F]x[F,H]; fwd+bwd = 3 x fwd).\n"
    "With --expert-model-parallel-size N --virtual-ranks N: the layer at EP=N on this one GPU (N virtual ranks of T/N\n"
    "tokens and E/N experts each): per-rank stage times, bytes sent, host syncs, the whole step vs EP=1 on all T.";

int run_bench(const std::vector<std::string>& args) {
    std::string preset, skew, json_path, device = "cuda", scope = "layer", dispatcher = "alltoall", variant;
    std::string gemm_tune = "on";
    int64_t iters = 20, ep = 1, virtual_ranks = 0, echo_experts = 0;
    double receive_factor = 0;
    bool enable_echo = false;
    // The project's flag table: --help lists these, unknown flags get a suggestion, bad values name the flag.
    moekit::FlagParser p(kUsage);
    p.section("bench");
    p.add("--preset", &preset, "mixtral | dsv3-ep8 | dsv3-e256 | qwen3-30b (required)");
    p.add("--skew", &skew, "expert load skew zipf:S with S > 0 (empty: uniform top-k routing)");
    p.add("--json", &json_path, "also write the results as JSON to this file");
    p.add("--iters", &iters, "timed iterations per measurement (>= 1)");
    p.add("--device", &device, "cuda (the only device moekit bench times)");
    p.add("--scope", &scope, "layer: the whole layer step | mlp: the expert MLP alone");
    p.add("--variant", &variant,
          "glu-forward | glu-backward | gather-fc1 | tma-wgrad (the wgrads on the own kernel's ping-pong) | "
          "pingpong-192 (CUTLASS's ping-pong nt / nn on 128x192 tiles where they pad little) | swap-pingpong "
          "(small groups' swapped nt / nn on ping-pong) | wgrad-192 (CUTLASS's ping-pong wgrads on 128x192 tiles where "
          "they pad little) | wgrad-192t (where only the gradient's m does: the wgrad computed transposed) | "
          "wgrad-split (mid-sized groups' wgrads split by size) | wgrad-overlap (the wgrads on a stream of their own "
          "beside the dgrad chain's memory passes) | pingpong-swapped (nt / nn where 128x192 pads over 4 %: computed "
          "transposed on ping-pong) | long-k-coop (nt / nn with a reduction over 2048 on CUTLASS's cooperative "
          "128x256 instead of ping-pong) | gemm-tune (the grouped GEMMs' configurations measured per shape on this "
          "device, against the per-shape rule): also "
          "time the step's graph with that switch on, in the same rounds as with it off (--scope layer, EP=1)");
    p.add("--gemm-tune", &gemm_tune,
          "on (default): each grouped GEMM shape's configuration measured on this device at its first eager launch | "
          "off: the per-shape rule alone");
    p.add("--expert-model-parallel-size", &ep, "EP: time the layer at EP=N (needs --virtual-ranks N)");
    p.add("--virtual-ranks", &virtual_ranks, "N virtual ranks on this one GPU (the EP benchmark)");
    p.add("--moe-token-dispatcher-type", &dispatcher, "allgather | alltoall (the EP benchmark; default alltoall)");
    p.add("--moe-expert-rank-capacity-factor", &receive_factor,
          "f > 0: the budgeted sync-free dispatcher with ceil(T*k*f) receive rows (the EP benchmark, alltoall)");
    p.add("--moe-enable-echo", &enable_echo, "ECHO: clone hot experts into spare slots (the EP benchmark, alltoall)");
    p.add("--moe-num-echo-experts", &echo_experts, "S_TOTAL spare slots over all EP ranks, divisible by EP (with ECHO)");
    if (!p.parse(args)) return 0;  // --help was printed
    MOEKIT_REQUIRE(iters >= 1 && iters <= 1'000'000, "--iters=", iters, " must be a positive integer (at most 1000000)");
    MOEKIT_REQUIRE(!preset.empty(), "--preset is required (mixtral, dsv3-ep8, dsv3-e256 or qwen3-30b; --help lists the "
                   "flags)");
    MOEKIT_REQUIRE(device == "cuda", "--device=", device, ": moekit bench runs on cuda only");
    MOEKIT_REQUIRE(scope == "layer" || scope == "mlp", "--scope=", scope, " must be layer or mlp");
    MOEKIT_REQUIRE(ep >= 1 && ep <= 64, "--expert-model-parallel-size=", ep, " must be in [1, 64]");
    MOEKIT_REQUIRE(virtual_ranks == 0 || virtual_ranks == ep, "--virtual-ranks=", virtual_ranks,
                   " must equal --expert-model-parallel-size=", ep, " (one virtual rank per EP rank)");
    const bool under_mpirun = moekit::comm::mpi_launched();
    MOEKIT_REQUIRE(ep == 1 || virtual_ranks == ep || (under_mpirun && virtual_ranks == 0), "--expert-model-parallel-size=",
                   ep, " needs --virtual-ranks ", ep, " (the ranks on this one GPU) or mpirun -np ", ep,
                   " (one GPU per process, NCCL)");
    MOEKIT_REQUIRE(ep == 1 || scope == "layer", "--scope=", scope, ": the EP benchmark times the whole layer");
    MOEKIT_REQUIRE(variant.empty() || moekit::bench::is_layer_variant(variant), "--variant=", variant, ": expected ",
                   moekit::bench::layer_variant_list());
    MOEKIT_REQUIRE(variant.empty() || (scope == "layer" && ep == 1), "--variant=", variant,
                   " goes with --scope layer at EP=1");
    MOEKIT_REQUIRE(gemm_tune == "on" || gemm_tune == "off", "--gemm-tune=", gemm_tune, " must be on or off");
    MOEKIT_REQUIRE(variant != "gemm-tune" || gemm_tune == "on", "--variant=gemm-tune compares the measured choices "
                   "with the rule: it needs --gemm-tune on");
    MOEKIT_REQUIRE(dispatcher == "allgather" || dispatcher == "alltoall", "--moe-token-dispatcher-type=", dispatcher,
                   " must be allgather or alltoall");
    MOEKIT_REQUIRE(receive_factor == 0 || (receive_factor > 0 && receive_factor <= 64 && dispatcher == "alltoall" && ep > 1),
                   "--moe-expert-rank-capacity-factor=", receive_factor,
                   " must be in (0, 64] and goes with --moe-token-dispatcher-type alltoall and EP > 1");
    MOEKIT_REQUIRE(!enable_echo || (ep > 1 && dispatcher == "alltoall" && echo_experts > 0 && echo_experts % ep == 0),
                   "--moe-enable-echo needs --expert-model-parallel-size > 1, --moe-token-dispatcher-type alltoall and "
                   "--moe-num-echo-experts > 0 divisible by EP (got ", echo_experts, ")");
    MOEKIT_REQUIRE(enable_echo || echo_experts == 0, "--moe-num-echo-experts=", echo_experts,
                   " goes with --moe-enable-echo");
// Bad flags are named on any build; only then does a build without CUDA say so.
#ifndef MOEKIT_WITH_CUDA
    throw moekit::UsageError("moekit bench needs a CUDA build and a GPU (this build has no CUDA backend)");
#endif
#ifdef MOEKIT_WITH_CUDA
    namespace b = moekit::cuda::bench;
    MOEKIT_REQUIRE(b::gpu_count() > 0, "moekit bench needs a CUDA build and a GPU (no GPU found)");
    b::Options o;
    o.iters = int(iters);
    o.variant = variant;
    o.gemm_tune = gemm_tune == "on";
    if (!skew.empty()) o.zipf_s = b::parse_skew(skew);
    const b::Preset& chosen = b::find_preset(preset);
    nlohmann::json r;
    if (ep > 1) {
        r = b::bench_layer_ep(chosen, o, int(ep), dispatcher, receive_factor, enable_echo ? echo_experts / ep : 0);
        if (under_mpirun && virtual_ranks == 0 && moekit::comm::mpi_world().rank() != 0) return 0;  // rank 0 reports
        std::printf("%s", b::format_layer_ep_table(r).c_str());
    } else {
        r = scope == "layer" ? b::bench_layer(chosen, o) : b::bench_expert_mlp(chosen, o);
        std::printf("%s", (scope == "layer" ? b::format_layer_table(r) : b::format_mlp_table(r)).c_str());
    }
    if (!json_path.empty()) {
        std::ofstream f(json_path);
        MOEKIT_REQUIRE(f.good(), "--json=", json_path, ": cannot open for writing");
        f << r.dump(1) << "\n";
    }
    return 0;
#else
    (void)skew;
    (void)json_path;
    (void)iters;
    (void)gemm_tune;
    return 2;  // not reached: thrown above
#endif
}

moekit::tools::RegisterCommand reg("bench", "time the MoE layer forward+backward on the GPU (presets)", run_bench);

}  // namespace
