// `moekit plan`: replays a routing trace (or a synthetic Zipf one) through the ECHO planner on the CPU
// and reports, per step and overall, max/mean rank load before and after, clones and the expert weight
// bytes they move. Trace format: src/echo/trace.h. Planner: src/echo/planner.h. Docs: docs/usage.md.
// Tests: tests/cpu/test_cmd_plan.cpp.
#include <cstdio>

#include "command.h"
#include "core/flags.h"
#include "echo/planner.h"
#include "echo/trace.h"
#include "io/atomic_file.h"
#include "moekit/config.h"
#include "moekit/error.h"

namespace moekit::tools {
namespace {

struct PlanArgs {
    std::string trace, synthetic, json, save_trace, algorithm;
    int64_t num_echo_experts = -1, group_floor_rows = 0, ep = 0, num_experts = 0, topk = 8, tokens_per_rank = 4096, steps = 4;
    int64_t hidden = 7168, ffn = 2048, param_bytes = 2;  // DeepSeek-V3's expert shape, bf16
    bool gated = true;
    uint64_t seed = 1234;
};

struct StepResult {
    int64_t step, layer, max_before, max_after, total, target, clones, weight_bytes;
    double before, after;
};

int plan_main(const std::vector<std::string>& argv) {
    PlanArgs a;
    const MoeConfig defaults;
    a.algorithm = defaults.moe_echo_algorithm;
    a.seed = defaults.seed;
    FlagParser p(
        "moekit plan (--trace FILE | --synthetic zipf:S --num-experts E --expert-model-parallel-size EP "
        "--moe-router-topk k --tokens-per-rank T --steps N) --moe-num-echo-experts S_TOTAL [--json OUT]");
    p.section("input");
    p.add("--trace", &a.trace, "routing trace JSON (src/echo/trace.h; written by --routing-trace)");
    p.add("--synthetic", &a.synthetic, "zipf:S: generate the trace (top-k without replacement, Zipf popularity)");
    p.add("--num-experts", &a.num_experts, "E (--synthetic)");
    p.add("--expert-model-parallel-size", &a.ep, "EP (--synthetic; with --trace: re-home the counts, 0 = the trace's)");
    p.add("--moe-router-topk", &a.topk, "k experts per token (--synthetic)");
    p.add("--tokens-per-rank", &a.tokens_per_rank, "tokens per source rank and step (--synthetic)");
    p.add("--steps", &a.steps, "steps to generate (--synthetic)");
    p.add("--seed", &a.seed, "seed of the synthetic trace (popularity permutation and draws)");
    p.add("--save-trace", &a.save_trace, "also write the (synthetic or re-homed) trace here");
    p.section("planner");
    p.add("--moe-num-echo-experts", &a.num_echo_experts, "S_TOTAL spare slots over all ranks, divisible by EP (required)");
    p.add("--moe-echo-algorithm", &a.algorithm, "waterfill | greedy (MoE Echo's one-shot greedy)");
    p.add("--moe-echo-group-floor-rows", &a.group_floor_rows,
          "[moekit] plan for expert time: an expert's weight gradient costs at least this many rows (0 = tokens)");
    p.section("expert size (weight bytes moved per clone)");
    p.add("--hidden-size", &a.hidden, "H");
    p.add("--moe-ffn-hidden-size", &a.ffn, "F");
    p.add("--gated-linear-unit", &a.gated, "gated experts: fc1 has 2F rows (SwiGLU)");
    p.add("--param-bytes", &a.param_bytes, "bytes per weight element (2 = bf16)");
    p.section("output");
    p.add("--json", &a.json, "write the results as JSON here");
    if (!p.parse(argv)) return 0;

    const EchoAlgorithm algorithm = echo::parse_algorithm(a.algorithm);
    MOEKIT_REQUIRE(a.trace.empty() != a.synthetic.empty(), "give exactly one of --trace FILE and --synthetic zipf:S");
    MOEKIT_REQUIRE(a.num_echo_experts >= 0, "--moe-num-echo-experts is required (spare slots over all ranks)");
    MOEKIT_REQUIRE(a.hidden > 0, "--hidden-size=", a.hidden, " must be > 0");
    MOEKIT_REQUIRE(a.ffn > 0, "--moe-ffn-hidden-size=", a.ffn, " must be > 0");
    MOEKIT_REQUIRE(a.param_bytes > 0, "--param-bytes=", a.param_bytes, " must be > 0");
    echo::RoutingTrace trace;
    std::string source;
    if (!a.trace.empty()) {
        for (const char* f : {"--num-experts", "--moe-router-topk", "--tokens-per-rank", "--steps", "--seed"})
            MOEKIT_REQUIRE(!p.was_set(f), f, " applies to --synthetic only (the trace gives it)");
        trace = echo::read_routing_trace(a.trace);
        if (a.ep != 0 && a.ep != trace.ep) trace = echo::rehome(trace, a.ep, "--expert-model-parallel-size");
        source = a.trace;
    } else {
        echo::ZipfRouting z;
        z.zipf_s = echo::parse_zipf(a.synthetic, "--synthetic");
        z.num_experts = a.num_experts, z.topk = a.topk, z.seed = a.seed;
        MOEKIT_REQUIRE(a.num_experts > 0, "--num-experts=", a.num_experts, " must be > 0 with --synthetic");
        if (a.ep == 0) a.ep = 1;
        MOEKIT_REQUIRE(a.ep >= 1, "--expert-model-parallel-size=", a.ep, " must be >= 1");
        MOEKIT_REQUIRE(a.num_experts % a.ep == 0, "--num-experts=", a.num_experts,
                       " must be divisible by --expert-model-parallel-size=", a.ep);
        MOEKIT_REQUIRE(a.topk >= 1 && a.topk <= a.num_experts, "--moe-router-topk=", a.topk,
                       " must be in [1, --num-experts=", a.num_experts, "]");
        MOEKIT_REQUIRE(a.tokens_per_rank > 0, "--tokens-per-rank=", a.tokens_per_rank, " must be > 0");
        MOEKIT_REQUIRE(a.steps > 0, "--steps=", a.steps, " must be > 0");
        trace = echo::synthetic_zipf_trace(z, a.ep, a.tokens_per_rank, a.steps);
        source = str(a.synthetic, " E=", a.num_experts, " k=", a.topk, " T=", a.tokens_per_rank, " seed=", a.seed);
    }
    MOEKIT_REQUIRE(!trace.steps.empty(), source, ": the trace has no steps");
    MOEKIT_REQUIRE(a.num_echo_experts % trace.ep == 0, "--moe-num-echo-experts=", a.num_echo_experts,
                   " must be divisible by the expert-parallel size EP=", trace.ep);
    if (!a.save_trace.empty()) echo::write_routing_trace(a.save_trace, trace);

    MOEKIT_REQUIRE(a.group_floor_rows >= 0 && a.group_floor_rows <= (int64_t(1) << 20),
                   "--moe-echo-group-floor-rows=", a.group_floor_rows, " must be in [0, 1048576]");
    const EchoDims dims{trace.ep, trace.num_experts, a.num_echo_experts / trace.ep, a.group_floor_rows};
    const int64_t expert_bytes = ((a.gated ? 2 : 1) * a.ffn * a.hidden + a.hidden * a.ffn) * a.param_bytes;
    std::printf("moekit plan: %s, %s, %s, %s, expert %lld bytes (H=%lld F=%lld%s, %lld B/param)\n", source.c_str(),
                echo::to_string(dims).c_str(), echo::algorithm_name(algorithm),
                str(trace.steps.size(), " steps").c_str(), (long long)expert_bytes, (long long)a.hidden,
                (long long)a.ffn, a.gated ? " gated" : "", (long long)a.param_bytes);
    std::printf("%6s %6s %12s %12s %14s %13s %7s %14s\n", "step", "layer", "max before", "max after", "max/mean before",
                "max/mean after", "clones", "weight bytes");
    std::vector<StepResult> results;
    double sum_before = 0, sum_after = 0, worst_before = 0, worst_after = 0, sum_clones = 0, sum_bytes = 0;
    for (size_t i = 0; i < trace.steps.size(); ++i) {
        const echo::EchoPlan plan = echo::plan(dims, trace.steps[i].counts, algorithm);
        StepResult r{int64_t(i),
                     trace.steps[i].layer,
                     plan.max_before(),
                     plan.max_after(),
                     plan.total_tokens(),
                     plan.target,
                     plan.num_clones,
                     plan.num_clones * expert_bytes,
                     plan.max_over_mean_before(),
                     plan.max_over_mean_after()};
        std::printf("%6lld %6lld %12lld %12lld %14.4f %13.4f %7lld %14lld\n", (long long)r.step, (long long)r.layer,
                    (long long)r.max_before, (long long)r.max_after, r.before, r.after, (long long)r.clones,
                    (long long)r.weight_bytes);
        sum_before += r.before, sum_after += r.after, sum_clones += double(r.clones),
            sum_bytes += double(r.weight_bytes);
        worst_before = std::max(worst_before, r.before), worst_after = std::max(worst_after, r.after);
        results.push_back(r);
    }
    const double n = double(results.size());
    std::printf(
        "overall (mean over %zu steps): max/mean before %.4f (worst %.4f), after %.4f (worst %.4f), "
        "clones %.2f, weight bytes %.0f per step and layer\n",
        results.size(), sum_before / n, worst_before, sum_after / n, worst_after, sum_clones / n, sum_bytes / n);

    if (!a.json.empty()) {
        nlohmann::json steps = nlohmann::json::array();
        for (const auto& r : results)
            steps.push_back({{"step", r.step},
                             {"layer", r.layer},
                             {"max_load_before", r.max_before},
                             {"max_load_after", r.max_after},
                             {"total_tokens", r.total},
                             {"target", r.target},
                             {"max_over_mean_before", r.before},
                             {"max_over_mean_after", r.after},
                             {"clones", r.clones},
                             {"weight_bytes", r.weight_bytes}});
        const nlohmann::json out = {{"source", source},
                                    {"algorithm", echo::algorithm_name(algorithm)},
                                    {"num_experts", dims.num_experts},
                                    {"expert_model_parallel_size", dims.ep},
                                    {"moe_num_echo_experts", a.num_echo_experts},
                                    {"slots_per_rank", dims.slots_per_rank},
                                    {"topk", trace.topk},
                                    {"expert_weight_bytes", expert_bytes},
                                    {"max_over_mean_before", sum_before / n},
                                    {"max_over_mean_after", sum_after / n},
                                    {"max_over_mean_before_worst", worst_before},
                                    {"max_over_mean_after_worst", worst_after},
                                    {"clones_per_step", sum_clones / n},
                                    {"weight_bytes_per_step", sum_bytes / n},
                                    {"steps", steps}};
        io::write_file_atomically(a.json, out.dump(1) + "\n");
        std::printf("wrote %s\n", a.json.c_str());
    }
    return 0;
}

RegisterCommand reg("plan", "replay a routing trace through the ECHO planner (max/mean load, clones)", plan_main);

}  // namespace
}  // namespace moekit::tools
