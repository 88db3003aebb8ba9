// `moekit plan` end to end (tools/cmd_plan.cpp) and the routing traces (src/echo/trace.cpp): trace parsing
// errors exit 2 naming the file and key, the JSON keys and values against loads computed here from the
// trace, re-homing, and the synthetic Zipf generator (k distinct experts per token, T*k per rank).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "echo/planner.h"
#include "echo/trace.h"
#include "run_tool.h"

namespace moekit {
namespace {

using testing_util::run_tool;

std::string temp_path(const std::string& name) {
    return ::testing::TempDir() + "/moekit_plan_" + std::to_string(::getpid()) + "_" + name;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

nlohmann::json read_json(const std::string& path) {
    std::ifstream in(path);
    return nlohmann::json::parse(in);
}

// A skewed random trace: each step one random expert gets many more tokens.
echo::RoutingTrace random_trace(int64_t E, int64_t EP, int64_t steps, uint64_t seed) {
    Rng rng(seed, 7);
    echo::RoutingTrace t;
    t.num_experts = E, t.ep = EP, t.topk = 2;
    for (int64_t s = 0; s < steps; ++s) {
        echo::RoutingTraceStep st;
        st.layer = s % 2;
        const int64_t hot = rng.below(E);
        for (int64_t r = 0; r < EP; ++r)
            for (int64_t e = 0; e < E; ++e) st.counts.push_back(rng.below(50) + (e == hot ? 400 + rng.below(400) : 0));
        t.steps.push_back(st);
    }
    return t;
}

// max rank load / mean rank load with experts homed E/ep per rank, from the counts alone.
double max_over_mean(const std::vector<int64_t>& counts, int64_t E, int64_t ep) {
    const int64_t L = E / ep;
    std::vector<int64_t> load(ep, 0);
    int64_t total = 0;
    for (size_t i = 0; i < counts.size(); ++i) load[(int64_t(i) % E) / L] += counts[i], total += counts[i];
    int64_t mx = 0;
    for (int64_t v : load) mx = std::max(mx, v);
    return double(mx) * double(ep) / double(total);
}

TEST(CmdPlan, TraceJsonAgainstIndependentLoads) {
    const uint64_t seed = 4242;
    SCOPED_TRACE("seed " + std::to_string(seed));
    const echo::RoutingTrace t = random_trace(12, 4, 3, seed);
    const std::string trace = temp_path("trace.json"), out = temp_path("out.json");
    echo::write_routing_trace(trace, t);
    auto r = run_tool("plan --trace " + trace + " --moe-num-echo-experts 8 --json " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    const nlohmann::json j = read_json(out);
    for (const char* key :
         {"max_over_mean_before", "max_over_mean_after", "clones_per_step", "weight_bytes_per_step", "steps"})
        ASSERT_TRUE(j.contains(key)) << key;
    ASSERT_EQ(j["steps"].size(), 3u);
    const double expert_bytes = 3.0 * 2048 * 7168 * 2;  // defaults: H=7168, F=2048, gated, bf16
    double before = 0, after = 0, clones = 0;
    for (size_t s = 0; s < 3; ++s) {
        const auto& js = j["steps"][s];
        const double b = max_over_mean(t.steps[s].counts, 12, 4);
        EXPECT_NEAR(js["max_over_mean_before"].get<double>(), b, 1e-12);
        const double a = js["max_over_mean_after"].get<double>();
        EXPECT_LT(a, b) << "a skewed step must get better with 2 slots per rank";
        EXPECT_GE(a, 1.0);
        EXPECT_EQ(js["weight_bytes"].get<double>(), js["clones"].get<double>() * expert_bytes);
        EXPECT_EQ(js["layer"].get<int64_t>(), t.steps[s].layer);
        before += b, after += a, clones += js["clones"].get<double>();
    }
    EXPECT_NEAR(j["max_over_mean_before"].get<double>(), before / 3, 1e-12);
    EXPECT_NEAR(j["max_over_mean_after"].get<double>(), after / 3, 1e-12);
    EXPECT_NEAR(j["clones_per_step"].get<double>(), clones / 3, 1e-12);
    EXPECT_NEAR(j["weight_bytes_per_step"].get<double>(), clones / 3 * expert_bytes, 1e-3);
    EXPECT_NE(r.output.find("overall"), std::string::npos) << r.output;
    std::remove(trace.c_str()), std::remove(out.c_str());
}

TEST(CmdPlan, RehomesCountsOntoAnotherEp) {
    const uint64_t seed = 4343;
    SCOPED_TRACE("seed " + std::to_string(seed));
    const echo::RoutingTrace t = random_trace(16, 4, 2, seed);
    const std::string trace = temp_path("rehome.json"), out = temp_path("rehome_out.json");
    echo::write_routing_trace(trace, t);
    for (int64_t ep : {2, 8}) {
        auto r = run_tool("plan --trace " + trace + " --expert-model-parallel-size " + std::to_string(ep) +
                          " --moe-num-echo-experts " + std::to_string(ep) + " --json " + out);
        ASSERT_EQ(r.status, 0) << r.output;
        const nlohmann::json j = read_json(out);
        EXPECT_EQ(j["expert_model_parallel_size"].get<int64_t>(), ep);
        for (size_t s = 0; s < 2; ++s)
            EXPECT_NEAR(j["steps"][s]["max_over_mean_before"].get<double>(), max_over_mean(t.steps[s].counts, 16, ep),
                        1e-12);
    }
    // Re-homed counts keep every expert's total.
    const echo::RoutingTrace up = echo::rehome(t, 8, "--expert-model-parallel-size");
    for (int64_t e = 0; e < 16; ++e) {
        int64_t a = 0, b = 0;
        for (int64_t r = 0; r < 4; ++r) a += t.steps[0].counts[r * 16 + e];
        for (int64_t r = 0; r < 8; ++r) b += up.steps[0].counts[r * 16 + e];
        EXPECT_EQ(a, b) << "expert " << e;
    }
    std::remove(trace.c_str()), std::remove(out.c_str());
}

TEST(CmdPlan, BadTracesExit2NamingFileAndKey) {
    const std::string f = temp_path("bad.json");
    struct Case {
        std::string text, expect;
    };
    const std::vector<Case> cases = {
        {"{not json", "not valid JSON"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": 1})", "missing key 'steps'"},
        {R"({"expert_model_parallel_size": 2, "topk": 1, "steps": []})", "missing key 'num_experts'"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": 1, "steps": [{"layer": 0, "counts": [[1,2,3,4],[1,2,3]]}]})",
         "steps[0].counts[1] must be an array of num_experts=4"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": 1, "steps": [{"layer": 0, "counts": [[1,2,3,4]]}]})",
         "steps[0].counts must be an array of expert_model_parallel_size=2 rows"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": 1, "steps": [{"layer": 0, "counts": [[1,2,3,4],[1,-2,3,4]]}]})",
         "steps[0].counts[1][1]=-2"},
        {R"({"num_experts": 5, "expert_model_parallel_size": 2, "topk": 1, "steps": []})",
         "num_experts=5 must be divisible by expert_model_parallel_size=2"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": 1, "steps": [{"counts": [[1,2,3,4],[1,2,3,4]]}]})",
         "steps[0]: missing key 'layer'"},
        {R"({"num_experts": 4, "expert_model_parallel_size": 2, "topk": "two", "steps": []})",
         "'topk' must be an integer"},
    };
    for (const auto& c : cases) {
        write_text(f, c.text);
        auto r = run_tool("plan --trace " + f + " --moe-num-echo-experts 2");
        EXPECT_EQ(r.status, 2) << c.text << "\n" << r.output;
        EXPECT_NE(r.output.find(f), std::string::npos) << r.output;
        EXPECT_NE(r.output.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << r.output;
    }
    auto r = run_tool("plan --trace " + temp_path("missing.json") + " --moe-num-echo-experts 2");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("missing.json: cannot open"), std::string::npos) << r.output;
    std::remove(f.c_str());
}

TEST(CmdPlan, BadFlagsExit2NamingTheFlag) {
    const std::string f = temp_path("flags.json");
    echo::write_routing_trace(f, random_trace(8, 4, 1, 77));
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"--trace " + f + " --moe-num-echo-experts 6", "--moe-num-echo-experts=6 must be divisible"},
        {"--trace " + f, "--moe-num-echo-experts is required"},
        {"--trace " + f + " --moe-num-echo-experts 4 --moe-echo-algorithm ilp", "--moe-echo-algorithm=ilp"},
        {"--trace " + f + " --moe-num-echo-experts 4 --moe-echo-group-floor-rows 2000000",
         "--moe-echo-group-floor-rows=2000000 must be in"},
        {"--trace " + f + " --moe-num-echo-experts 4 --expert-model-parallel-size 3", "--expert-model-parallel-size=3"},
        {"--trace " + f + " --moe-num-echo-experts 4 --steps 3", "--steps applies to --synthetic only"},
        {"--moe-num-echo-experts 4", "give exactly one of --trace FILE and --synthetic"},
        {"--synthetic zipf:x --num-experts 8 --moe-num-echo-experts 4", "--synthetic=zipf:x"},
        {"--synthetic uniform --num-experts 8 --moe-num-echo-experts 4", "expected zipf:S"},
        {"--synthetic zipf:1 --num-experts 10 --expert-model-parallel-size 4 --moe-num-echo-experts 4",
         "--num-experts=10 must be divisible by --expert-model-parallel-size=4"},
        {"--synthetic zipf:1 --num-experts 8 --moe-router-topk 9 --moe-num-echo-experts 4", "--moe-router-topk=9"},
        {"--trace " + f + " --moe-num-echo-experts 4 --hidden-size 0", "--hidden-size=0"},
        {"--trace " + f + " --moe-num-echo-experts 4 --bogus", "unknown flag --bogus"},
    };
    for (const auto& [args, expect] : cases) {
        auto r = run_tool("plan " + args);
        EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
        EXPECT_NE(r.output.find(expect), std::string::npos) << "expected '" << expect << "' in: " << r.output;
    }
    std::remove(f.c_str());
}

TEST(CmdPlan, SyntheticTokensHaveKDistinctExperts) {
    echo::ZipfRouting z;
    z.num_experts = 37, z.topk = 6, z.zipf_s = 1.2, z.seed = 555;
    SCOPED_TRACE("seed 555");
    const int64_t T = 3000;
    const auto tokens = echo::sample_zipf_tokens(z, 0, 1, T);
    ASSERT_EQ(int64_t(tokens.size()), T * z.topk);
    std::vector<int64_t> hist(z.num_experts, 0);
    for (int64_t t = 0; t < T; ++t) {
        std::set<int32_t> row(tokens.begin() + t * z.topk, tokens.begin() + (t + 1) * z.topk);
        EXPECT_EQ(int64_t(row.size()), z.topk) << "token " << t << " repeats an expert";
        for (int32_t e : row) {
            ASSERT_GE(e, 0);
            ASSERT_LT(e, z.num_experts);
            ++hist[e];
        }
    }
    // The most popular expert (by the generator's permutation) is picked by most tokens, the least by few.
    const auto popular = echo::zipf_popularity(z);
    EXPECT_GT(hist[popular.front()], 2 * T * z.topk / z.num_experts);
    EXPECT_LT(hist[popular.back()], hist[popular.front()] / 4);
    // Deterministic in the seed; another seed or rank draws differently.
    EXPECT_EQ(echo::sample_zipf_tokens(z, 0, 1, T), tokens);
    EXPECT_NE(echo::sample_zipf_tokens(z, 0, 2, T), tokens);
    z.seed = 556;
    EXPECT_NE(echo::sample_zipf_tokens(z, 0, 1, T), tokens);
    // Extreme skew (k = E): every token takes every expert, the exact fallback included.
    z.zipf_s = 8, z.topk = z.num_experts;
    for (int32_t e : echo::sample_zipf_tokens(z, 0, 0, 3)) EXPECT_LT(e, z.num_experts);
    const auto all = echo::sample_zipf_tokens(z, 0, 0, 3);
    EXPECT_EQ(std::set<int32_t>(all.begin(), all.begin() + z.num_experts).size(), size_t(z.num_experts));
}

TEST(CmdPlan, SyntheticTraceCountsSumToTokensTimesK) {
    const std::string saved = temp_path("synthetic.json"), out = temp_path("synthetic_out.json");
    auto r = run_tool(
        "plan --synthetic zipf:1.2 --num-experts 32 --expert-model-parallel-size 4 --moe-router-topk 4 "
        "--tokens-per-rank 500 --steps 2 --seed 99 --moe-num-echo-experts 8 --save-trace " +
        saved + " --json " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    const echo::RoutingTrace t = echo::read_routing_trace(saved);
    EXPECT_EQ(t.num_experts, 32);
    EXPECT_EQ(t.ep, 4);
    EXPECT_EQ(t.topk, 4);
    ASSERT_EQ(t.steps.size(), 2u);
    for (const auto& s : t.steps)
        for (int64_t rank = 0; rank < 4; ++rank) {
            int64_t sum = 0;
            for (int64_t e = 0; e < 32; ++e) sum += s.counts[rank * 32 + e];
            EXPECT_EQ(sum, 500 * 4) << "rank " << rank;
        }
    const nlohmann::json j = read_json(out);
    EXPECT_GT(j["max_over_mean_before"].get<double>(), 1.2) << "zipf 1.2 must be skewed";
    EXPECT_LT(j["max_over_mean_after"].get<double>(), j["max_over_mean_before"].get<double>());
    // The same seed gives the same trace.
    const std::string saved2 = temp_path("synthetic2.json");
    ASSERT_EQ(run_tool("plan --synthetic zipf:1.2 --num-experts 32 --expert-model-parallel-size 4 --moe-router-topk 4 "
                       "--tokens-per-rank 500 --steps 2 --seed 99 --moe-num-echo-experts 8 --save-trace " +
                       saved2)
                  .status,
              0);
    EXPECT_EQ(echo::to_json(echo::read_routing_trace(saved2)), echo::to_json(t));
    std::remove(saved.c_str()), std::remove(saved2.c_str()), std::remove(out.c_str());
}

}  // namespace
}  // namespace moekit
