// `moekit train` checkpoints and the run's guard rails on the CPU: a run resumed from a checkpoint continues
// bit for bit like an uninterrupted one (losses, weights, Adam moments); a checkpoint of another model is
// refused naming the field; the tool refuses to overwrite an earlier report, checks --out-dir before the first
// step, and on SIGINT writes the report of the steps done and exits 130. Code: src/train/checkpoint.cpp,
// src/train/trainer.cpp, tools/cmd_train.cpp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "moekit/error.h"
#include "moekit/layer.h"
#include "run_tool.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace moekit::train {
namespace {

namespace fs = std::filesystem;
using testing_util::moekit_binary;
using testing_util::run_tool;

TrainOptions tiny_run(const std::string& device = "cpu") {
    TrainOptions o = small_training(32, 4, 32, 2, 32, 2, device);
    o.config.moe_router_score_function = "sigmoid";  // with the expert bias: router state that must survive a resume
    o.config.moe_router_enable_expert_bias = true;
    o.steps = 30;
    o.eval_every = 10;
    o.log_interval = 5;
    o.seed = 11;
    return o;
}

std::string bytes_of(const std::string& path) { return file_bytes(path); }

std::string fresh_dir(const std::string& name) {
    const std::string d = ::testing::TempDir() + "/moekit_ckpt_" + name + "_" + std::to_string(::getpid());
    fs::remove_all(d);
    return d;
}

TEST(Checkpoint, ResumeContinuesBitForBit) {
    const std::string straight = fresh_dir("straight"), split = fresh_dir("split");
    TrainOptions a = tiny_run();  // the case: 200 steps straight, or 100 + save + load + 100
    a.steps = 200, a.eval_every = 50, a.save_dir = straight;
    const TrainResult ra = run_training(a);

    TrainOptions first = tiny_run();
    first.steps = 100, first.eval_every = 50, first.save_dir = split;  // stops at 100 and saves there
    const TrainResult r1 = run_training(first);
    ASSERT_TRUE(fs::exists(split + "/iter_0000100/model.safetensors"));
    TrainOptions second = tiny_run();
    second.steps = 200, second.eval_every = 50, second.load_dir = split, second.save_dir = split;
    const TrainResult r2 = run_training(second);
    EXPECT_EQ(r2.resumed_from, 100);

    ASSERT_EQ(r2.steps.size(), ra.steps.size()) << "the resumed run's records include the steps before the checkpoint";
    for (size_t i = 0; i < ra.steps.size(); ++i) {
        EXPECT_EQ(r2.steps[i].step, ra.steps[i].step);
        EXPECT_EQ(r2.steps[i].loss, ra.steps[i].loss) << "step " << i + 1 << " (seed " << a.seed << ")";
        // The first half's run also evaluated at its last step (100); evaluation must not perturb training.
        if (ra.steps[i].step != 100) EXPECT_EQ(r2.steps[i].eval_loss, ra.steps[i].eval_loss) << "step " << i + 1;
        EXPECT_EQ(r2.steps[i].tokens_per_expert, ra.steps[i].tokens_per_expert) << "step " << i + 1;
    }
    EXPECT_LT(ra.steps[199].loss, ra.steps[99].loss) << "the run must move between the two halves";
    // Weights (expert bias included) and Adam's moments are bitwise the same files.
    const std::string fa = straight + "/iter_0000200/", fb = split + "/iter_0000200/";
    ASSERT_TRUE(fs::exists(fa + "model.safetensors") && fs::exists(fb + "model.safetensors"));
    EXPECT_TRUE(bytes_of(fa + "model.safetensors") == bytes_of(fb + "model.safetensors")) << "final weights differ";
    EXPECT_TRUE(bytes_of(fa + "optimizer.safetensors") == bytes_of(fb + "optimizer.safetensors")) << "Adam differs";
    std::ifstream latest(split + "/latest_checkpointed_iteration.txt");
    int64_t step = 0;
    latest >> step;
    EXPECT_EQ(step, 200);
}

TEST(Checkpoint, HoldsMegatronNamesAndAllState) {
    const std::string dir = fresh_dir("names");
    TrainOptions o = tiny_run();
    o.steps = 3, o.save_dir = dir;
    run_training(o);
    const Checkpoint ck = load_checkpoint(dir, o);
    EXPECT_EQ(ck.state.step, 3);
    ASSERT_EQ(ck.state.weights.size(), 2u);
    // Adam: one slot per tensor (router, 4 fc1, 4 fc2) per layer.
    EXPECT_EQ(ck.state.adam_m.size(), 2u * 9u);
    EXPECT_EQ(ck.history.size(), 3u);
    bool bias_moved = false;
    for (double b : ck.state.weights[0].expert_bias) bias_moved |= b != 0.0;
    EXPECT_TRUE(bias_moved) << "three bias updates must have moved the expert bias";
    const std::string model = bytes_of(dir + "/iter_0000003/model.safetensors");
    for (const char* name : {"decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.router.expert_bias",
                             "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"})
        EXPECT_NE(model.find(name), std::string::npos) << name;
}

TEST(Checkpoint, AnotherModelIsRefusedNamingTheField) {
    const std::string dir = fresh_dir("mismatch");
    TrainOptions o = tiny_run();
    o.steps = 2, o.save_dir = dir;
    run_training(o);
    TrainOptions other = tiny_run();
    other.config.hidden_size = 48;
    other.load_dir = dir;
    try {
        run_training(other);
        FAIL() << "a checkpoint of hidden 32 must not load into hidden 48";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("hidden_size"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("--load"), std::string::npos) << e.what();
    }
    TrainOptions missing = tiny_run();
    missing.load_dir = dir + "/nothing-here";
    EXPECT_THROW(run_training(missing), UsageError);
}

const std::string kTinyFlags =
    " --device cpu --hidden-size 32 --num-experts 4 --moe-ffn-hidden-size 32 --seq-length 32 --micro-batch-size 2";

TEST(TrainTool, RefusesToOverwriteAnEarlierReport) {
    const std::string dir = fresh_dir("overwrite");
    ASSERT_EQ(run_tool("train --steps 2" + kTinyFlags + " --out-dir " + dir).status, 0);
    const std::string before = bytes_of(dir + "/report.json");
    const auto again = run_tool("train --steps 3" + kTinyFlags + " --out-dir " + dir);
    EXPECT_EQ(again.status, 2) << again.output;
    EXPECT_NE(again.output.find("--overwrite"), std::string::npos) << again.output;
    EXPECT_EQ(bytes_of(dir + "/report.json"), before) << "the earlier report must be untouched";
    EXPECT_EQ(run_tool("train --steps 3 --overwrite" + kTinyFlags + " --out-dir " + dir).status, 0);
    EXPECT_NE(bytes_of(dir + "/report.json"), before);
}

TEST(TrainTool, OutDirIsCheckedBeforeTheFirstStep) {
    const std::string file = fresh_dir("notadir");
    std::ofstream(file) << "a file, not a folder\n";
    const auto start = std::chrono::steady_clock::now();
    const auto r = run_tool("train --steps 100000" + kTinyFlags + " --out-dir " + file);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--out-dir"), std::string::npos) << r.output;
    EXPECT_LT(secs, 20.0) << "refused only after training?";
}

TEST(TrainTool, BadOptimizerFlagsAreRefused) {
    for (const std::string flags : {"--adam-beta1 1", "--adam-beta2 -0.1", "--lr inf", "--lr nan", "--adam-eps nan",
                                    "--adam-eps 0", "--eval-every -1", "--teacher-gain 1e300", "--log-every 0",
                                    "--save-interval 5", "--host-loop", "--init-method-std 1e300"}) {
        const auto r = run_tool("train" + kTinyFlags + " " + flags + " --out-dir " + fresh_dir("badflags"));
        EXPECT_EQ(r.status, 2) << flags << ": " << r.output;
        const std::string flag = flags.substr(0, flags.find(' '));
        EXPECT_NE(r.output.find(flag), std::string::npos) << flags << ": the message must name " << flag << "\n"
                                                           << r.output;
    }
}

// --model-size picks the defaults of the model and --lr; explicit flags still win.
TEST(TrainTool, ModelSizePicksDefaultsThatFlagsOverride) {
    const std::string dir = fresh_dir("modelsize");
    const auto r = run_tool("train --model-size gpu --steps 2 --device cpu --hidden-size 32 --moe-ffn-hidden-size 16 "
                            "--seq-length 16 --micro-batch-size 1 --out-dir " + dir);
    ASSERT_EQ(r.status, 0) << r.output;
    std::ifstream f(dir + "/report.json");
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["config"]["num_layers"], 4) << "the GPU size's layer count";
    EXPECT_EQ(j["config"]["num_moe_experts"], 64);
    EXPECT_EQ(j["config"]["hidden_size"], 32) << "an explicit flag wins";
    EXPECT_DOUBLE_EQ(j["train"]["lr"].get<double>(), 3e-4) << "the GPU size's learning rate";
    EXPECT_EQ(run_tool("train --model-size huge --out-dir " + fresh_dir("modelsize2")).status, 2);
}

// --device cuda where no GPU is visible (CI) is a usage error naming the flag, not an internal error.
TEST(TrainTool, CudaWithoutAGpuIsRefused) {
    if (cuda_device_available()) GTEST_SKIP() << "a GPU is present: this checks the machine without one";
    const auto r = run_tool("train --device cuda --steps 1 --out-dir " + fresh_dir("nogpu"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--device cuda"), std::string::npos) << r.output;
}

// --routing-trace writes the run's per-step, per-layer loads in the format `moekit plan` reads, and plan reads it.
TEST(TrainTool, RoutingTraceFeedsMoekitPlan) {
    const std::string dir = fresh_dir("trace"), trace = dir + "/trace.json";
    fs::create_directories(dir);
    ASSERT_EQ(run_tool("train --steps 3" + kTinyFlags + " --out-dir " + dir + " --routing-trace " + trace).status, 0);
    std::ifstream f(trace);
    ASSERT_TRUE(f.good());
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["num_experts"], 4);
    EXPECT_EQ(j["topk"], 2);
    ASSERT_EQ(j["steps"].size(), 3u * 2u) << "3 steps x 2 layers";
    std::ifstream rf(dir + "/report.json");
    const nlohmann::json report = nlohmann::json::parse(rf);
    for (size_t i = 0; i < 6; ++i) {
        EXPECT_EQ(j["steps"][i]["layer"], int(i % 2));
        EXPECT_EQ(j["steps"][i]["counts"][0], report["steps"][i / 2]["tokens_per_expert"][i % 2]) << "entry " << i;
    }
    const auto plan = run_tool("plan --trace " + trace + " --moe-num-echo-experts 2 --expert-model-parallel-size 2");
    EXPECT_EQ(plan.status, 0) << plan.output;
    const auto bad = run_tool("train --steps 3" + kTinyFlags + " --out-dir " + dir + " --overwrite --routing-trace " +
                              dir + "/no/such/folder/t.json");
    EXPECT_EQ(bad.status, 2) << bad.output;
    EXPECT_NE(bad.output.find("--routing-trace"), std::string::npos) << bad.output;
}

// SIGINT mid-run: exit 130, and report.json holds the steps done so far, marked as interrupted.
TEST(TrainTool, SigintWritesTheReportSoFar) {
    const std::string dir = fresh_dir("sigint"), binary = moekit_binary();
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const std::string out = dir;
        freopen("/dev/null", "w", stdout);
        freopen("/dev/null", "w", stderr);
        execl(binary.c_str(), binary.c_str(), "train", "--steps", "1000000", "--device", "cpu", "--hidden-size", "32",
              "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
              "--log-every", "1", "--out-dir", out.c_str(), (char*)nullptr);
        _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_EQ(kill(pid, SIGINT), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    EXPECT_EQ(WEXITSTATUS(status), 130);
    std::ifstream f(dir + "/report.json");
    ASSERT_TRUE(f.good()) << "no report after SIGINT";
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["interrupted_by_signal"], 2);
    EXPECT_EQ(j["completed"], false);
    EXPECT_GE(j["steps"].size(), 1u);
    EXPECT_TRUE(fs::exists(dir + "/train.png"));
}

}  // namespace
}  // namespace moekit::train
