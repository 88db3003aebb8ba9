// Skewed and forced-balanced routing (issue 9, deliver 6): `moekit train --skew zipf:S` makes expert
// popularity follow the seeded Zipf order (src/train/train_task.h), `--moe-router-force-load-balancing`
// (Megatron's RandomSTE, src/cpu/router.cpp) balances it again with the gradient passed straight through,
// and ECHO flattens the EP rank loads of a skewed run; bad values exit 2 naming the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/rng.h"
#include "echo/trace.h"
#include "moekit/layer.h"
#include "moekit/weights.h"
#include "run_tool.h"
#include "scratch_dir.h"
#include <nlohmann/json.hpp>

namespace moekit {
namespace {

using testing_util::run_tool;
using testing_util::ToolResult;

class TrainSkew : public testing_util::ScratchDirTest {
protected:
    TrainSkew() : ScratchDirTest("train_skew") {}
};

const std::string kModel =
    "train --hidden-size 16 --num-experts 16 --moe-ffn-hidden-size 8 --moe-router-topk 2 --num-layers 1 "
    "--seq-length 64 --micro-batch-size 4 --moe-aux-loss-coeff 0.01 --seed 909 --eval-every 0 --log-every 1 ";
const std::string kTrain = kModel + "--device cpu ";

nlohmann::json report(const std::string& out_dir) {
    std::ifstream f(out_dir + "/report.json");
    return nlohmann::json::parse(f);
}

std::vector<int64_t> step1_counts(const std::string& out_dir) {
    return report(out_dir)["steps"][0]["tokens_per_expert"][0].get<std::vector<int64_t>>();
}

double max_over_mean(const std::vector<int64_t>& c) {
    double sum = 0, most = 0;
    for (int64_t v : c) sum += double(v), most = std::max(most, double(v));
    return most * double(c.size()) / sum;
}

TEST_F(TrainSkew, ZipfSkewFollowsThePopularityOrderAndForcedBalanceUndoesIt) {
    ToolResult plain = run_tool(kTrain + "--steps 1 --out-dir " + path("plain"));
    ASSERT_EQ(plain.status, 0) << plain.output;
    ToolResult skew = run_tool(kTrain + "--steps 1 --skew zipf:1.2 --out-dir " + path("skew"));
    ASSERT_EQ(skew.status, 0) << skew.output;
    ToolResult forced =
        run_tool(kTrain + "--steps 1 --skew zipf:1.2 --moe-router-force-load-balancing --out-dir " + path("forced"));
    ASSERT_EQ(forced.status, 0) << forced.output;
    EXPECT_EQ(report(path("skew"))["train"]["skew_zipf"].get<double>(), 1.2);

    // The expected order: echo::zipf_popularity with the run's seed.
    echo::ZipfRouting z;
    z.num_experts = 16, z.zipf_s = 1.2, z.seed = 909;
    const std::vector<int32_t> popular = echo::zipf_popularity(z);
    const std::vector<int64_t> c = step1_counts(path("skew"));
    // Counts along the popularity order: the top quarter holds most tokens, and a rank correlation
    // (Spearman's, over popularity rank vs count) close to 1.
    std::vector<double> along;
    for (int32_t e : popular) along.push_back(double(c[size_t(e)]));
    double top = 0, bottom = 0;
    for (int i = 0; i < 4; ++i) top += along[size_t(i)], bottom += along[size_t(12 + i)];
    EXPECT_GT(top, 8 * bottom) << "popular experts should get far more tokens";
    std::vector<int> order(16);
    for (int i = 0; i < 16; ++i) order[size_t(i)] = i;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return along[size_t(a)] > along[size_t(b)]; });
    double d2 = 0;
    for (int r = 0; r < 16; ++r) d2 += double((order[size_t(r)] - r) * (order[size_t(r)] - r));
    const double spearman = 1 - 6 * d2 / (16.0 * (256 - 1));
    std::printf("zipf:1.2 step-1 max/mean %.2f (plain %.2f, forced balance %.2f), Spearman %.3f\n", max_over_mean(c),
                max_over_mean(step1_counts(path("plain"))), max_over_mean(step1_counts(path("forced"))), spearman);
    EXPECT_GT(spearman, 0.8);
    EXPECT_GT(max_over_mean(c), 3.0);
    EXPECT_LT(max_over_mean(step1_counts(path("plain"))), 2.5);
    // Forced balance: 512 tokens x 2 over 16 experts = 64 each; random logits keep every expert near it.
    EXPECT_LT(max_over_mean(step1_counts(path("forced"))), 1.5);
}

TEST_F(TrainSkew, EchoFlattensTheRankLoadsOfASkewedRun) {
    ToolResult r = run_tool(kTrain + "--steps 2 --skew zipf:1.2 --moe-token-dispatcher-type alltoall "
                                     "--expert-model-parallel-size 4 --virtual-ranks 4 --moe-enable-echo "
                                     "--moe-num-echo-experts 8 --out-dir " + path("echo"));
    ASSERT_EQ(r.status, 0) << r.output;
    const nlohmann::json j = report(path("echo"));
    const nlohmann::json& e = j.at("summary").at("echo");
    std::printf("zipf:1.2 EP=4 S=2: rank load max/mean %.3f -> %.3f, %.2f clones per step\n",
                e["max_over_mean_before"].get<double>(), e["max_over_mean_after"].get<double>(),
                e["clones_per_step"].get<double>());
    EXPECT_GT(e["max_over_mean_before"].get<double>(), 1.3);
    EXPECT_LT(e["max_over_mean_after"].get<double>(), 1.05);
}

// The router with --moe-router-force-load-balancing: N(0, 1) logits (deterministic in the jitter seed),
// balanced whatever the weights; the gradient reaches the router weight (straight through).
TEST(ForceLoadBalancing, RandomLogitsAreBalancedDeterministicAndPassGradients) {
    MoeConfig c;
    c.hidden_size = 8, c.num_moe_experts = 8, c.moe_ffn_hidden_size = 4, c.moe_router_topk = 2;
    c.seq_length = 256, c.micro_batch_size = 2, c.seed = 31;
    c.moe_router_force_load_balancing = true;
    MoeWeights<double> w = init_weights<double>(c, 31);
    for (int64_t h = 0; h < 8; ++h) w.router_weight(0, h) = 5.0;  // a router that would send everything to 0
    LayerInput<double> in;
    in.hidden = Matrix<double>(512, 8);
    for (size_t i = 0; i < in.hidden.data.size(); ++i) in.hidden.data[i] = 1.0 + normal01(31, 3, i) * 0.1;
    in.seq_length = 256, in.micro_batch_size = 2, in.training = true, in.jitter_seed = 5;
    cpu::MoeLayer<double> a(c), b(c);
    (void)a.forward(w, in);
    (void)b.forward(w, in);
    EXPECT_EQ(a.routing_map(), b.routing_map());
    std::vector<int64_t> counts(8, 0);
    for (size_t i = 0; i < a.routing_map().size(); ++i) counts[i % 8] += a.routing_map()[i];
    EXPECT_LT(max_over_mean(counts), 1.3) << "forced-balance routing is not balanced";
    MoeConfig plain = c;
    plain.moe_router_force_load_balancing = false;
    cpu::MoeLayer<double> p(plain);
    (void)p.forward(w, in);
    std::vector<int64_t> pc(8, 0);
    for (size_t i = 0; i < p.routing_map().size(); ++i) pc[i % 8] += p.routing_map()[i];
    EXPECT_GT(max_over_mean(pc), 3.0) << "the weights should route to expert 0 without the flag";
    LayerInput<double> other = in;
    other.jitter_seed = 6;
    (void)b.forward(w, other);
    EXPECT_NE(a.routing_map(), b.routing_map()) << "a new seed draws new logits";
    Matrix<double> g(512, 8);
    for (size_t i = 0; i < g.data.size(); ++i) g.data[i] = normal01(31, 4, i);
    MoeWeights<double> grads = zeros_like(w);
    (void)a.backward(w, g, grads);
    double norm = 0;
    for (double v : grads.router_weight.data) {
        EXPECT_TRUE(std::isfinite(v));
        norm += v * v;
    }
    EXPECT_GT(norm, 0) << "the straight-through gradient must reach the router weight";
}

TEST_F(TrainSkew, BadValuesExitTwoNamingTheFlag) {
    const struct {
        std::string flags, message;
    } cases[] = {
        {"--skew zipf:0", "--skew=zipf:0: S must be in (0, 10]"},
        {"--skew zipf:-1", "--skew=zipf:-1"},
        {"--skew zipf:nan", "--skew=zipf:nan"},
        {"--skew pareto:1", "--skew=pareto:1: expected zipf:S"},
        {"--skew zipf:11", "S must be in (0, 10]"},
        {"--skew zipf:1 --device cuda", "--skew: not supported yet by the device-resident CUDA engine"},
        {"--moe-router-force-load-balancing --device cuda", "--moe-router-force-load-balancing: not supported yet on --device cuda"},
    };
    for (const auto& k : cases) {
        const bool cuda = k.flags.find("--device") != std::string::npos;
        const ToolResult r = run_tool((cuda ? kModel : kTrain) + "--steps 1 " + k.flags + " --out-dir " + path("x"));
        EXPECT_EQ(r.status, 2) << k.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(k.message), std::string::npos) << k.flags << "\n" << r.output;
    }
    const ToolResult r = run_tool("layer --device cuda --moe-router-force-load-balancing --init random --out " + path("y"));
    EXPECT_EQ(r.status, 2) << r.output;
}

}  // namespace
}  // namespace moekit
