// `moekit train` on the CPU: the loss falls clearly, runs are deterministic, and the report and plot are
// written with sane contents. Trainer: src/train/trainer.cpp; tool: tools/cmd_train.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/rng.h"
#include "train/adam.h"
#include "train/report.h"
#include "run_tool.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace moekit::train {
namespace {

using testing_util::moekit_binary;

TrainOptions small_run() {
    TrainOptions o = small_training(32, 4, 64, 2, 64, 2);
    o.steps = 300;
    o.adam.lr = 3e-3;
    o.eval_every = 100;
    o.seed = 7;
    return o;
}

// Adam's first bias-corrected step is lr * g / (|g| + eps): lr in the direction of -sign(g), whatever |g|.
TEST(Adam, FirstStepIsLrTimesSign) {
    std::vector<MoeWeights<float>> w(1), g(1);
    w[0].router_weight = Matrix<float>(1, 3, 1.0f);
    g[0].router_weight = Matrix<float>(1, 3);
    g[0].router_weight.data = {1e-3f, -5.0f, 200.0f};
    Adam adam({.lr = 0.01});
    adam.step(w, g);
    EXPECT_NEAR(w[0].router_weight(0, 0), 1.0f - 0.01f, 1e-6f);
    EXPECT_NEAR(w[0].router_weight(0, 1), 1.0f + 0.01f, 1e-6f);
    EXPECT_NEAR(w[0].router_weight(0, 2), 1.0f - 0.01f, 1e-6f);
    EXPECT_EQ(adam.steps(), 1);
}

// Toy quadratic f = sum_i a_i (x_i - c_i)^2 with curvatures over three decades (Adam's per-coordinate scaling
// must handle all of them); router, fc1 and fc2 of two layers are all updated; the expert bias is a buffer.
TEST(Adam, MinimisesToyQuadratic) {
    constexpr uint64_t kSeed = 11;
    Rng rng(kSeed);
    std::vector<MoeWeights<float>> w(2);
    std::vector<Matrix<float>*> params;
    for (auto& layer : w) {
        layer.router_weight = Matrix<float>(2, 3);
        layer.fc1 = {Matrix<float>(4, 3)};
        layer.fc2 = {Matrix<float>(3, 2)};
        layer.expert_bias = {0.5, -0.5};
        params.insert(params.end(), {&layer.router_weight, &layer.fc1[0], &layer.fc2[0]});
    }
    std::vector<std::vector<double>> a, c;
    for (auto* p : params) {
        a.emplace_back(), c.emplace_back();
        for (int64_t i = 0; i < p->size(); ++i) {
            a.back().push_back(std::pow(10.0, 3 * rng.uniform() - 1));  // 0.1 .. 100
            c.back().push_back(4 * rng.uniform() - 2);
        }
    }
    std::vector<MoeWeights<float>> g(2);
    for (size_t l = 0; l < 2; ++l) g[l] = zeros_like(w[l]);
    auto objective = [&] {
        double f = 0;
        for (size_t t = 0; t < params.size(); ++t)
            for (int64_t i = 0; i < params[t]->size(); ++i) {
                const double d = params[t]->data[size_t(i)] - c[t][size_t(i)];
                f += a[t][size_t(i)] * d * d;
            }
        return f;
    };
    const double f0 = objective();
    Adam adam({.lr = 0.02});
    for (int step = 0; step < 1500; ++step) {
        std::vector<Matrix<float>*> grads = {&g[0].router_weight, &g[0].fc1[0], &g[0].fc2[0],
                                             &g[1].router_weight, &g[1].fc1[0], &g[1].fc2[0]};
        for (size_t t = 0; t < params.size(); ++t)
            for (int64_t i = 0; i < params[t]->size(); ++i)
                grads[t]->data[size_t(i)] = float(2 * a[t][size_t(i)] * (params[t]->data[size_t(i)] - c[t][size_t(i)]));
        adam.step(w, g);
    }
    // Constant-lr Adam ends oscillating within about lr of the minimum: allow 2 lr per coordinate.
    for (size_t t = 0; t < params.size(); ++t)
        for (int64_t i = 0; i < params[t]->size(); ++i)
            EXPECT_NEAR(params[t]->data[size_t(i)], c[t][size_t(i)], 0.04) << "tensor " << t << " elem " << i << ", seed " << kSeed;
    EXPECT_LT(objective(), 1e-3 * f0) << "seed " << kSeed;
    EXPECT_EQ(w[0].expert_bias, (std::vector<double>{0.5, -0.5})) << "Adam must not touch the expert bias";
}

TEST(Train, LossFallsClearly) {
    const TrainOptions o = small_run();
    const TrainResult r = run_training(o);
    ASSERT_EQ(r.steps.size(), size_t(o.steps));
    const double first = r.steps.front().loss, last_eval = r.steps.back().eval_loss;
    // The student starts near the identity (normalised loss ~1) and must learn a clear part of the teacher.
    EXPECT_GT(first, 0.8) << "seed " << o.seed;
    EXPECT_LT(last_eval, 0.7 * first) << "held-out loss " << last_eval << " vs start " << first << ", seed " << o.seed;
    for (const auto& s : r.steps) {
        ASSERT_EQ(s.tokens_per_expert.size(), 2u);
        int64_t total = 0;
        for (auto c : s.tokens_per_expert[0]) total += c;
        EXPECT_EQ(total, 64 * 2 * 2) << "dropless: every token reaches k experts (step " << s.step << ")";
        EXPECT_GT(s.aux_loss, 0.0);
    }
}

TEST(Train, SameSeedGivesIdenticalLosses) {
    TrainOptions o = small_run();
    o.steps = 15;
    const TrainResult a = run_training(o), b = run_training(o);
    for (size_t i = 0; i < a.steps.size(); ++i) EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    o.seed = 8;
    const TrainResult c = run_training(o);
    EXPECT_NE(a.steps.back().loss, c.steps.back().loss) << "another seed must give another run";
}

TEST(Train, ToolWritesReportAndPlot) {
    const std::string dir = testing::TempDir() + "/moekit_train_test";
    std::filesystem::remove_all(dir);
    const std::string cmd = moekit_binary() +
                            " train --device cpu --steps 20 --hidden-size 32 --num-experts 4 --moe-ffn-hidden-size 32"
                            " --seq-length 32 --micro-batch-size 2 --eval-every 10 --out-dir " + dir + " > /dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream f(dir + "/report.json");
    ASSERT_TRUE(f.good());
    const nlohmann::json j = nlohmann::json::parse(f);
    ASSERT_EQ(j["steps"].size(), 20u);
    EXPECT_EQ(j["config"]["num_moe_experts"], 4);
    EXPECT_EQ(j["steps"][0]["tokens_per_expert"].size(), 2u);  // two layers (the default)
    EXPECT_TRUE(j["steps"][9].contains("eval_loss"));
    EXPECT_LT(j["summary"]["final_loss"].get<double>(), j["summary"]["initial_loss"].get<double>());
    std::ifstream png(dir + "/train.png", std::ios::binary);
    char sig[8] = {};
    png.read(sig, 8);
    EXPECT_EQ(std::string(sig + 1, 3), "PNG");
    EXPECT_GT(std::filesystem::file_size(dir + "/train.png"), 100000u) << "1200x480 RGB, stored blocks";
}

TEST(Train, BadFlagsExitWithStatus2) {
    for (const std::string flags : {"--steps 0", "--lr -1", "--device tpu", "--num-experts 4 --moe-router-topk 5",
                                    "--stpes 3"}) {
        const std::string cmd = moekit_binary() + " train " + flags + " --out-dir " + testing::TempDir() +
                                "/moekit_bad > /dev/null 2>&1";
        const int status = std::system(cmd.c_str());
        ASSERT_TRUE(WIFEXITED(status)) << flags;
        EXPECT_EQ(WEXITSTATUS(status), 2) << flags;
    }
}

}  // namespace
}  // namespace moekit::train
