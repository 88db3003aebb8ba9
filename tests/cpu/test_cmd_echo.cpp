// ECHO through the tools (issue 9): `moekit layer --virtual-ranks N` (N = 2, 4) and mpirun -np 2 with
// --moe-enable-echo equal the run without it (outputs, input grads, probs, map, losses bitwise; expert
// grads within fp64 reordering), and mpirun equals virtual ranks bit for bit; `moekit train` on CPU
// ranks with ECHO follows the loss curve without it and reports clones and rank loads; bad ECHO flags
// exit 2 naming the flag. Engine-level exactness: tests/cpu/test_echo_virtual.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "run_tool.h"
#include "scratch_dir.h"
#include <nlohmann/json.hpp>

namespace moekit {
namespace {

using testing_util::moekit_binary;
using testing_util::run_shell;
using testing_util::run_tool;
using testing_util::ToolResult;

class CmdEcho : public testing_util::ScratchDirTest {
protected:
    CmdEcho() : ScratchDirTest("cmd_echo") {}
};

// The random init routes unevenly enough at 8 experts, top-2, for the planner to clone (checked).
const std::string kLayerModel =
    "layer --device cpu --dtype fp64 --hidden-size 12 --num-experts 8 --moe-ffn-hidden-size 8 --swiglu "
    "--moe-router-topk 2 --moe-aux-loss-coeff 0.05 --moe-z-loss-coeff 0.01 --moe-shared-expert-intermediate-size 6 "
    "--seq-length 8 --micro-batch-size 4 --init random --seed 77 ";
const std::string kLayer = kLayerModel + "--moe-token-dispatcher-type alltoall ";

// Every tensor of `on` equals `off`: expert grads (clone partial sums added at home) within 1e-12
// relative, everything else bit for bit.
void expect_same_results(const SafetensorsFile& on, const SafetensorsFile& off, const std::string& what) {
    ASSERT_EQ(on.tensors.size(), off.tensors.size()) << what;
    size_t checked = 0;
    for (const auto& [name, t] : off.tensors) {
        ASSERT_TRUE(on.tensors.count(name)) << what << ": " << name << " missing";
        const std::vector<double> a = on.tensors.at(name).to_double(), b = t.to_double();
        ASSERT_EQ(a.size(), b.size()) << what << ": " << name;
        const bool expert_grad = name.find("grad.") == 0 && name.find("local_experts") != std::string::npos;
        double scale = 1, worst = 0;
        for (double v : b) scale = std::max(scale, std::abs(v));
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
        EXPECT_LE(worst, expert_grad ? 1e-12 * scale : 0.0) << what << ": " << name;
        ++checked;
    }
    EXPECT_GT(checked, 10u) << what;
}

int64_t clones_in(const std::string& output) {
    const size_t at = output.find("ECHO (EP group 0): clones=");
    return at == std::string::npos ? -1 : std::stoll(output.substr(at + 26));
}

TEST_F(CmdEcho, LayerOnVirtualAndMpiRanksEqualsNoEcho) {
    for (int n : {2, 4}) {
        SCOPED_TRACE(n);
        const std::string ranks = " --expert-model-parallel-size " + std::to_string(n) + " --virtual-ranks " + std::to_string(n);
        ToolResult off = run_tool(kLayer + ranks + " --out " + path("off"));
        ASSERT_EQ(off.status, 0) << off.output;
        for (const std::string extra : {"", " --moe-echo-algorithm greedy --moe-echo-recompute-expert-dispatch",
                                        " --moe-echo-group-floor-rows 64"}) {
            ToolResult on = run_tool(kLayer + ranks + " --moe-enable-echo --moe-num-echo-experts " +
                                     std::to_string(2 * n) + extra + " --out " + path("on"));
            ASSERT_EQ(on.status, 0) << on.output;
            EXPECT_GT(clones_in(on.output), 0) << "the plan cloned nothing: the test would prove little\n" << on.output;
            expect_same_results(read_safetensors(path("on")), read_safetensors(path("off")),
                                "ECHO vs off, " + std::to_string(n) + " virtual ranks" + extra);
        }
    }
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI: the mpirun half is skipped";
    const std::string echo = " --expert-model-parallel-size 2 --moe-enable-echo --moe-num-echo-experts 2";
    ToolResult v = run_tool(kLayer + echo + " --virtual-ranks 2 --out " + path("v"));
    ASSERT_EQ(v.status, 0) << v.output;
    ToolResult m = run_shell(testing_util::mpirun_prefix(2) + moekit_binary() + " " + kLayer + echo + " --out " + path("m"));
    ASSERT_EQ(m.status, 0) << m.output;
    const SafetensorsFile a = read_safetensors(path("m")), b = read_safetensors(path("v"));
    for (const auto& [name, t] : b.tensors) EXPECT_EQ(a.tensors.at(name).bytes, t.bytes) << "mpirun vs virtual: " << name;
}

// A tight receive budget (--moe-expert-rank-capacity-factor 1.05): without ECHO the busiest rank is due
// more rows than the budget (overflow, re-run); with ECHO the plan flattens the loads and the budgeted
// one-sided dispatch holds them, and the file equals the run without ECHO.
TEST_F(CmdEcho, EchoKeepsATightReceiveBudgetWithoutOverflow) {
    const std::string run =
        "layer --device cpu --dtype fp64 --hidden-size 12 --num-experts 16 --moe-ffn-hidden-size 8 --moe-router-topk 2 "
        "--init random --seed 5 --seq-length 64 --micro-batch-size 4 --expert-model-parallel-size 4 --virtual-ranks 4 "
        "--moe-token-dispatcher-type alltoall ";
    ToolResult off = run_tool(run + "--moe-expert-rank-capacity-factor 1.05 --out " + path("off"));
    ASSERT_EQ(off.status, 0) << off.output;
    EXPECT_NE(off.output.find("EP receive budget overflow"), std::string::npos) << off.output;
    ToolResult on = run_tool(run + "--moe-expert-rank-capacity-factor 1.05 --moe-enable-echo --moe-num-echo-experts 8 "
                                   "--out " + path("on"));
    ASSERT_EQ(on.status, 0) << on.output;
    EXPECT_EQ(on.output.find("EP receive budget overflow"), std::string::npos) << on.output;
    EXPECT_NE(on.output.find("\"overflow_events\":0"), std::string::npos) << on.output;
    EXPECT_GT(clones_in(on.output), 0) << on.output;
    ToolResult plain = run_tool(run + "--out " + path("plain"));
    ASSERT_EQ(plain.status, 0) << plain.output;
    SafetensorsFile a = read_safetensors(path("on")), b = read_safetensors(path("plain"));
    a.metadata.clear(), b.metadata.clear();
    expect_same_results(a, b, "budgeted ECHO vs plain alltoall");
}

const std::string kTrain =
    "train --device cpu --hidden-size 16 --num-experts 8 --moe-ffn-hidden-size 16 --moe-router-topk 2 --num-layers 2 "
    "--seq-length 16 --micro-batch-size 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall --seed 404 "
    "--eval-every 3 --log-every 1 --steps 6 --expert-model-parallel-size 2 --virtual-ranks 2 ";

nlohmann::json report(const std::string& out_dir) {
    std::ifstream f(out_dir + "/report.json");
    return nlohmann::json::parse(f);
}

TEST_F(CmdEcho, TrainOnRanksFollowsTheSameLossCurveAndReportsClones) {
    ToolResult off = run_tool(kTrain + "--out-dir " + path("off"));
    ASSERT_EQ(off.status, 0) << off.output;
    ToolResult on = run_tool(kTrain + "--moe-enable-echo --moe-num-echo-experts 4 --out-dir " + path("on"));
    ASSERT_EQ(on.status, 0) << on.output;
    EXPECT_NE(on.output.find("ECHO: "), std::string::npos) << on.output;
    const nlohmann::json a = report(path("on")), b = report(path("off"));
    ASSERT_EQ(a["steps"].size(), b["steps"].size());
    // Step 1's forward runs on the same weights: the same bits. Later steps: the expert grads differ in
    // the last bits (clone partial sums), so the fp32 weights do after Adam.
    EXPECT_EQ(a["steps"][0]["loss"].get<double>(), b["steps"][0]["loss"].get<double>());
    double worst = 0, clones = 0;
    for (size_t i = 0; i < a["steps"].size(); ++i) {
        const double x = a["steps"][i]["loss"], y = b["steps"][i]["loss"];
        worst = std::max(worst, std::abs(x - y) / std::max(1.0, std::abs(y)));
        EXPECT_EQ(a["steps"][i]["tokens_per_expert"], b["steps"][i]["tokens_per_expert"]) << "step " << i + 1;
        const auto& e = a["steps"][i]["echo"];
        ASSERT_EQ(e["clones"].size(), 2u) << "one entry per layer";
        for (size_t l = 0; l < 2; ++l) {
            clones += e["clones"][l].get<double>();
            EXPECT_LE(e["max_over_mean_after"][l].get<double>(), e["max_over_mean_before"][l].get<double>());
            EXPECT_GE(e["max_over_mean_after"][l].get<double>(), 1.0);
        }
        EXPECT_FALSE(b["steps"][i].contains("echo"));
    }
    std::printf("ECHO vs off: largest relative loss difference %.3g over 6 steps, %.1f clones\n", worst, clones);
    EXPECT_LE(worst, 1e-5);
    EXPECT_GT(clones, 0);
    EXPECT_LT(a["summary"]["echo"]["max_over_mean_after"].get<double>(),
              a["summary"]["echo"]["max_over_mean_before"].get<double>());
}

TEST_F(CmdEcho, BadEchoFlagsExitTwoNamingTheFlag) {
    const struct {
        std::string flags, message;
    } cases[] = {
        {kLayer + "--moe-enable-echo --moe-num-echo-experts 3 --expert-model-parallel-size 2 --virtual-ranks 2 --out " +
             path("a"),
         "--moe-num-echo-experts=3 must be divisible by --expert-model-parallel-size=2"},
        {kLayerModel + "--moe-enable-echo --moe-num-echo-experts 2 --out " + path("b"),
         "--moe-enable-echo requires --moe-token-dispatcher-type=alltoall (got allgather"},
        {kLayer + "--moe-enable-echo --moe-num-echo-experts 2 --moe-expert-capacity-factor 1 --out " + path("c"),
         "dropless"},
        {kLayer + "--moe-enable-echo --out " + path("d"), "--moe-enable-echo requires --moe-num-echo-experts"},
        {kTrain + "--moe-echo-recompute-expert-dispatch --out-dir " + path("x"), "requires --moe-enable-echo"},
        {"train --device cuda --moe-token-dispatcher-type alltoall --moe-enable-echo --moe-num-echo-experts 2 "
         "--out-dir " + path("y"),
         "--moe-enable-echo: not supported yet on --device cuda"},
    };
    for (const auto& c : cases) {
        const ToolResult r = run_tool(c.flags);
        EXPECT_EQ(r.status, 2) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(c.message), std::string::npos) << c.flags << "\n" << r.output;
    }
}

}  // namespace
}  // namespace moekit
