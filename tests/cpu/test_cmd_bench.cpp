// `moekit bench` flag rules (any build, no GPU needed: bad flags are named before the CUDA check): each
// bad combination exits 2 with a message naming the flag and the rule. The benchmarks themselves run on
// a GPU (docs/perf.md).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "run_tool.h"

namespace moekit {
namespace {

using testing_util::run_tool;
using testing_util::ToolResult;

TEST(CmdBench, BadFlagCombinationsAreNamedWithExitStatus2) {
    struct Case {
        std::string flags, message;
    };
    const std::vector<Case> cases = {
        {"bench", "--preset is required"},
        {"bench --preset mixtral --scope rows", "--scope=rows must be layer or mlp"},
        {"bench --preset mixtral --expert-model-parallel-size 4", "needs --virtual-ranks 4"},
        {"bench --preset mixtral --expert-model-parallel-size 4 --virtual-ranks 2", "--virtual-ranks=2 must equal"},
        {"bench --preset mixtral --moe-expert-rank-capacity-factor 1.25", "--moe-expert-rank-capacity-factor=1.25"},
        {"bench --preset mixtral --expert-model-parallel-size 4 --virtual-ranks 4 --moe-expert-rank-capacity-factor -1",
         "must be in (0, 64]"},
        {"bench --preset mixtral --moe-enable-echo --moe-num-echo-experts 8", "--moe-enable-echo needs"},
        {"bench --preset mixtral --expert-model-parallel-size 4 --virtual-ranks 4 --moe-enable-echo "
         "--moe-num-echo-experts 6",
         "divisible by EP (got 6)"},
        {"bench --preset mixtral --expert-model-parallel-size 4 --virtual-ranks 4 --moe-token-dispatcher-type "
         "allgather --moe-enable-echo --moe-num-echo-experts 8",
         "--moe-token-dispatcher-type alltoall"},
        {"bench --preset mixtral --moe-num-echo-experts 8", "--moe-num-echo-experts=8 goes with --moe-enable-echo"},
        {"bench --preset mixtral --variant fused",
         "--variant=fused: expected glu-forward, glu-backward, gather-fc1, tma-wgrad, pingpong-192, swap-pingpong, "
         "wgrad-192, wgrad-192t, wgrad-split, wgrad-overlap, pingpong-swapped, long-k-coop or gemm-tune"},
        {"bench --preset mixtral --variant glu-forward --scope mlp", "goes with --scope layer at EP=1"},
        {"bench --preset mixtral --gemm-tune yes", "--gemm-tune=yes must be on or off"},
        {"bench --preset mixtral --gemm-tune off --variant gemm-tune", "it needs --gemm-tune on"},
    };
    for (const Case& c : cases) {
        const ToolResult r = run_tool(c.flags);
        EXPECT_EQ(r.status, 2) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(c.message), std::string::npos) << c.flags << "\n" << r.output;
    }
}

}  // namespace
}  // namespace moekit
