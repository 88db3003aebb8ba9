// `moekit train` on several CPU ranks (src/train/ep_engine.cpp, tools/cmd_train.cpp): EP=2 on 2 ranks equals
// one process that computes the same two micro-batches one after the other and averages their grads
// (DP-equivalence, against an independent host-loop reference in this file); one rank with one micro-batch
// is the host loop bit for bit; mpirun -np 2 equals --virtual-ranks 2 bit for bit; a checkpoint saved at
// EP=2 resumes at EP=4 and at EP=1 (same global batch: the curve of an uninterrupted run, within float
// tolerance); what EP cannot do yet is refused with exit 2. The MPI cases skip in builds without MPI.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moekit/comm.h"
#include "run_tool.h"
#include "scratch_dir.h"
#include "train/adam.h"
#include "train/checkpoint.h"
#include "train/host_stack.h"
#include "train/train_engine.h"
#include "train/train_task.h"
#include "train/trainer.h"

namespace moekit::train {
namespace {

namespace fs = std::filesystem;
using testing_util::moekit_binary;
using testing_util::run_shell;
using testing_util::run_tool;
using testing_util::ToolResult;

// Two small configurations: allgather with softmax, aux + z loss and a gated shared expert; alltoall with
// sigmoid, the expert bias and capacity 1.0 (drops, per micro-batch as in Megatron).
TrainOptions tiny(int variant, uint64_t seed) {
    TrainOptions o;
    o.config.hidden_size = 16;
    o.config.num_moe_experts = 4;
    o.config.moe_ffn_hidden_size = 16;
    o.config.moe_router_topk = 2;
    o.config.gated_linear_unit = true;
    o.config.activation_func = "silu";
    o.config.num_layers = 2;
    o.config.seq_length = 16;
    o.config.micro_batch_size = 2;
    o.config.moe_aux_loss_coeff = {1e-2};
    if (variant == 0) {
        o.config.moe_z_loss_coeff = 1e-3;
        o.config.moe_shared_expert_intermediate_size = 8;
        o.config.moe_shared_expert_gate = true;
    } else {
        o.config.moe_token_dispatcher_type = "alltoall";
        o.config.moe_router_score_function = "sigmoid";
        o.config.moe_router_enable_expert_bias = true;
        o.config.moe_expert_capacity_factor = 1.0;
    }
    o.steps = 6;
    o.eval_every = 3;
    o.log_interval = 2;
    o.seed = seed;
    return o;
}

// The oracle, written without the EP engine: host LayerRunners, micro-batches 0..G-1 of each step one after
// the other (data_stream(step, m)), grads summed then divided by G, Adam, the expert bias from the counts of
// all G micro-batches. Returns the per-step loss (mean over micro-batches); `state` gets the final weights
// and Adam's moments (the first moment is an average of the grads: it shows their scale, which Adam hides).
std::vector<double> reference_losses(const TrainOptions& o, int64_t G, TrainState* state = nullptr) {
    MoeStack teacher(o.config, "cpu", teacher_weights(o)), student(o.config, "cpu", student_weights(o));
    Adam adam(o.adam);
    const int64_t T = o.config.seq_length * o.config.micro_batch_size, H = o.config.hidden_size;
    auto input = [&](Matrix<float> x, bool training, uint64_t jitter) {
        LayerInput<float> in;
        in.hidden = std::move(x);
        in.seq_length = o.config.seq_length;
        in.micro_batch_size = o.config.micro_batch_size;
        in.training = training;
        in.jitter_seed = jitter;
        return in;
    };
    std::vector<double> losses;
    for (int64_t step = 1; step <= o.steps; ++step) {
        std::vector<MoeWeights<float>> grads;
        for (const auto& w : student.weights) grads.push_back(zeros_like(w));
        double loss = 0;
        for (int64_t m = 0; m < G; ++m) {
            const uint64_t stream = data_stream(step, m);
            const Matrix<float> x = random_tokens(T, H, o.seed, stream);
            const Matrix<float> y = teacher.forward(input(x, false, 0));
            const double x_to_y = mse(x, y);
            const Matrix<float> pred = student.forward(input(x, true, stream));
            loss += mse(pred, y) / x_to_y;
            Matrix<float> grad(pred.rows, pred.cols);
            const double scale = 2.0 / (double(pred.data.size()) * x_to_y);
            for (size_t i = 0; i < grad.data.size(); ++i) grad.data[i] = float(scale * (pred.data[i] - y.data[i]));
            student.backward(std::move(grad), grads);
        }
        for (size_t l = 0; l < grads.size(); ++l)
            for_each_parameter(student.weights[l], grads[l], [&](float*, const float* g, size_t n) {
                float* d = const_cast<float*>(g);
                for (size_t i = 0; i < n; ++i) d[i] /= float(G);
            });
        adam.step(student.weights, grads);
        for (size_t l = 0; l < student.layers.size(); ++l) {
            student.layers[l]->update_expert_bias(student.weights[l]);
            student.layers[l]->reset_global_aux_loss_tracker();
        }
        losses.push_back(loss / double(G));
    }
    if (state) {
        state->weights = student.weights;
        state->adam_m = adam.first_moments();
        state->adam_v = adam.second_moments();
    }
    return losses;
}

// rank 0's result of run_training on n virtual ranks.
TrainResult on_virtual_ranks(int n, const TrainOptions& o) {
    TrainResult out;
    comm::run_virtual_ranks(n, [&](Communicator& world) {
        TrainOptions mine = o;
        mine.world = &world;
        TrainResult r = run_training(mine);
        if (world.rank() == 0) out = std::move(r);
    });
    return out;
}

void expect_close_curves(const std::vector<double>& got, const std::vector<double>& want, double tol,
                         const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << ", step " << i + 1;
        worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
    }
    std::printf("%s: largest relative loss difference %.3g over %zu steps\n", what.c_str(), worst, got.size());
}

// Every tensor of `got` within tol * (largest |value| of that tensor in `want`).
void expect_close_tensors(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                          double tol, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t t = 0; t < got.size(); ++t) {
        ASSERT_EQ(got[t].size(), want[t].size()) << what << " tensor " << t;
        double scale = 0, worst = 0;
        for (float v : want[t]) scale = std::max(scale, double(std::abs(v)));
        for (size_t i = 0; i < got[t].size(); ++i) worst = std::max(worst, double(std::abs(got[t][i] - want[t][i])));
        EXPECT_LE(worst, tol * scale) << what << " tensor " << t << " (largest |value| " << scale << ")";
    }
}

std::vector<double> losses_of(const TrainResult& r) {
    std::vector<double> v;
    for (const auto& s : r.steps) v.push_back(s.loss);
    return v;
}

TEST(TrainEp, TwoRanksEqualOneProcessAveragingTheSameTwoMicroBatches) {
    for (int variant = 0; variant < 2; ++variant) {
        const uint64_t seed = 101 + uint64_t(variant);
        SCOPED_TRACE("variant " + std::to_string(variant) + ", seed " + std::to_string(seed));
        TrainOptions o = tiny(variant, seed);
        o.config.expert_model_parallel_size = 2;
        const std::string ck = ::testing::TempDir() + "/moekit_train_ep_" + std::to_string(::getpid()) + "_" +
                               std::to_string(variant);
        fs::remove_all(ck);
        o.save_dir = ck;  // rank 0 writes the final state: global tensors, whatever the layout
        const TrainResult ep = on_virtual_ranks(2, o);
        EXPECT_EQ(ep.layout.ranks, 2);
        EXPECT_EQ(ep.layout.global_batch_size, 4);
        EXPECT_EQ(ep.tokens_per_step, 64);
        TrainState ref;
        const std::vector<double> want = reference_losses(tiny(variant, seed), 2, &ref);
        expect_close_curves(losses_of(ep), want, 2e-5, "EP=2 on 2 ranks vs the one-process reference");
        TrainOptions reader = tiny(variant, seed);  // one process reads it: the same global batch, no ranks
        reader.global_batch_size = 4;
        const TrainState got = load_checkpoint(ck, reader).state;
        fs::remove_all(ck);
        EXPECT_EQ(got.step, o.steps);
        expect_close_tensors(got.adam_m, ref.adam_m, 1e-4, "Adam's first moment (the averaged grads)");
        std::vector<std::vector<float>> wg, wr;
        for (size_t l = 0; l < ref.weights.size(); ++l) {
            for_each_parameter(const_cast<MoeWeights<float>&>(got.weights[l]), got.weights[l],
                               [&](float* p, const float*, size_t n) { wg.emplace_back(p, p + n); });
            for_each_parameter(ref.weights[l], ref.weights[l],
                               [&](float* p, const float*, size_t n) { wr.emplace_back(p, p + n); });
            if (o.config.moe_router_enable_expert_bias)
                EXPECT_EQ(got.weights[l].expert_bias.size(), size_t(o.config.num_experts()));
        }
        expect_close_tensors(wg, wr, 1e-4, "weights");
        EXPECT_LT(want.back(), want.front()) << "the run must learn something to compare";
        // The same global batch in one process through the engine (--global-batch-size 4, 2 micro-batches).
        TrainOptions one = tiny(variant, seed);
        one.global_batch_size = 4;
        expect_close_curves(losses_of(run_training(one)), want, 2e-5, "one process, 2 micro-batches");
    }
}

// Other layouts of Megatron's groups: pure data parallelism (EP = 1 on 2 ranks: expert grads over expert-DP =
// all ranks) and EP = 2 on 4 ranks (expert-DP groups of 2), each against the reference on as many micro-batches.
TEST(TrainEp, DataParallelAndExpertDataParallelLayoutsEqualTheReference) {
    struct Layout {
        int ranks;
        int64_t ep;
    };
    for (const Layout& lay : {Layout{2, 1}, Layout{4, 2}}) {
        const uint64_t seed = 121 + uint64_t(lay.ranks);
        SCOPED_TRACE("ranks " + std::to_string(lay.ranks) + ", EP " + std::to_string(lay.ep) + ", seed " +
                     std::to_string(seed));
        TrainOptions o = tiny(0, seed);
        o.config.expert_model_parallel_size = lay.ep;
        const TrainResult r = on_virtual_ranks(lay.ranks, o);
        EXPECT_EQ(r.layout.micro_batches, lay.ranks);
        expect_close_curves(losses_of(r), reference_losses(tiny(0, seed), lay.ranks), 2e-5, "vs the reference");
    }
}

TEST(TrainEp, OneRankOneMicroBatchIsTheHostLoopBitForBit) {
    const TrainOptions o = tiny(1, 211);
    auto host = make_host_engine(o), ep = make_ep_engine(o);
    EXPECT_EQ(host->identity_mse(), ep->identity_mse());
    for (int s = 0; s < 4; ++s) {
        host->step(), ep->step();
        host->eval(), ep->eval();
    }
    const auto a = host->collect(true), b = ep->collect(true);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i + 1;
        EXPECT_EQ(a[i].eval_loss, b[i].eval_loss) << "step " << i + 1;
        EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << "step " << i + 1;
        EXPECT_EQ(a[i].tokens_per_expert, b[i].tokens_per_expert) << "step " << i + 1;
    }
    const TrainState sa = host->state(), sb = ep->state();
    for (size_t l = 0; l < sa.weights.size(); ++l) {
        EXPECT_EQ(sa.weights[l].router_weight.data, sb.weights[l].router_weight.data) << "layer " << l;
        EXPECT_EQ(sa.weights[l].expert_bias, sb.weights[l].expert_bias) << "layer " << l;
        for (size_t e = 0; e < sa.weights[l].fc1.size(); ++e)
            EXPECT_EQ(sa.weights[l].fc1[e].data, sb.weights[l].fc1[e].data) << "layer " << l << " expert " << e;
    }
    EXPECT_EQ(sa.adam_v, sb.adam_v);
}

// ---- the tool ----

class TrainEpTool : public testing_util::ScratchDirTest {
protected:
    TrainEpTool() : ScratchDirTest("train_ep") {}
};


std::string mpirun(int np) { return testing_util::mpirun_prefix(np) + moekit_binary() + " "; }

const std::string kModel =
    "--hidden-size 16 --num-experts 4 --moe-ffn-hidden-size 16 --moe-router-topk 2 "
    "--num-layers 2 --seq-length 16 --micro-batch-size 2 --moe-aux-loss-coeff 0.01 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --seed 303 --eval-every 2 --log-every 1 ";
const std::string kTrain = "train --device cpu " + kModel;

nlohmann::json report(const std::string& out_dir) {
    std::ifstream f(out_dir + "/report.json");
    return nlohmann::json::parse(f);
}

std::vector<double> report_losses(const nlohmann::json& j) {
    std::vector<double> v;
    for (const auto& s : j.at("steps")) v.push_back(s.at("loss").get<double>());
    return v;
}

TEST_F(TrainEpTool, MpirunEqualsVirtualRanksBitwiseAndOneProcessWithinTolerance) {
    const std::string run = kTrain + "--steps 4 --expert-model-parallel-size 2 ";
    ToolResult v = run_tool(run + "--virtual-ranks 2 --out-dir " + path("v"));
    ASSERT_EQ(v.status, 0) << v.output;
    const nlohmann::json jv = report(path("v"));
    EXPECT_EQ(jv["layout"]["ranks"], 2);
    EXPECT_EQ(jv["layout"]["transport"], "local");
    EXPECT_EQ(jv["layout"]["expert_model_parallel_size"], 2);
    EXPECT_EQ(jv["layout"]["global_batch_size"], 4);
    EXPECT_EQ(v.output.find("2/4  loss"), v.output.rfind("2/4  loss")) << "only rank 0 prints progress\n" << v.output;

    ToolResult one = run_tool(kTrain + "--steps 4 --global-batch-size 4 --out-dir " + path("one"));
    ASSERT_EQ(one.status, 0) << one.output;
    expect_close_curves(report_losses(jv), report_losses(report(path("one"))), 2e-5, "2 ranks vs one process");

    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI: the mpirun half is skipped";
    ToolResult m = run_shell(mpirun(2) + run + "--out-dir " + path("m"));
    ASSERT_EQ(m.status, 0) << m.output;
    const nlohmann::json jm = report(path("m"));
    EXPECT_EQ(jm["layout"]["transport"], "mpi");
    EXPECT_EQ(report_losses(jm), report_losses(jv)) << "mpirun -np 2 must equal --virtual-ranks 2 bit for bit";
    for (size_t i = 0; i < jm["steps"].size(); ++i)
        EXPECT_EQ(jm["steps"][i]["tokens_per_expert"], jv["steps"][i]["tokens_per_expert"]) << "step " << i + 1;
    EXPECT_FALSE(fs::exists(path("m") + "/.moekit-write-probe"));
}

// The receive budget in training: each micro-batch of the stack is one budgeted step. A generous factor never
// overflows and a tiny one overflows every micro-batch (and the held-out evaluation) and re-runs it through
// alltoall; either way the losses, evaluations and routing counts are bitwise those of the run without it.
TEST_F(TrainEpTool, ReceiveBudgetReRunsOverflowsAndKeepsTheCurveBitwise) {
    const std::string run = kTrain + "--steps 4 --global-batch-size 8 --expert-model-parallel-size 2 --virtual-ranks 2 "
                                     "--moe-token-dispatcher-type alltoall ";
    const ToolResult plain = run_tool(run + "--out-dir " + path("plain"));
    ASSERT_EQ(plain.status, 0) << plain.output;
    const nlohmann::json jp = report(path("plain"));
    for (const auto& [factor, overflows] : std::vector<std::pair<std::string, bool>>{{"2.0", false}, {"0.05", true}}) {
        SCOPED_TRACE("--moe-expert-rank-capacity-factor " + factor);
        const ToolResult r = run_tool(run + "--moe-expert-rank-capacity-factor " + factor + " --out-dir " + path(factor));
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_EQ(r.output.find("EP receive budget overflow") != std::string::npos, overflows) << r.output;
        const nlohmann::json jb = report(path(factor));
        EXPECT_EQ(report_losses(jb), report_losses(jp));
        for (size_t i = 0; i < jp["steps"].size(); ++i) {
            EXPECT_EQ(jb["steps"][i]["tokens_per_expert"], jp["steps"][i]["tokens_per_expert"]) << "step " << i + 1;
            EXPECT_EQ(jb["steps"][i].value("eval_loss", -1.0), jp["steps"][i].value("eval_loss", -1.0)) << "step " << i + 1;
        }
    }
}

// Global batch 8 sequences = 4 micro-batches of 2: 2 per rank at EP=2, 1 at EP=4, 4 at EP=1. The checkpoint
// holds global tensors, so each resume continues the same global batches: the curve of an uninterrupted EP=2
// run within float tolerance (the sums of the micro-batch grads are taken in another order).
TEST_F(TrainEpTool, CheckpointSavedAtEp2ResumesAtEp4AndAtEp1) {
    const std::string run = kTrain + "--global-batch-size 8 ";
    ToolResult straight = run_tool(run + "--steps 6 --expert-model-parallel-size 2 --virtual-ranks 2 --out-dir " +
                                   path("straight"));
    ASSERT_EQ(straight.status, 0) << straight.output;
    const std::vector<double> want = report_losses(report(path("straight")));

    const std::string ck = " --save " + path("ck");
    ToolResult a = run_tool(run + "--steps 2 --expert-model-parallel-size 2 --virtual-ranks 2 --out-dir " + path("a") + ck);
    ASSERT_EQ(a.status, 0) << a.output;
    ToolResult b = run_tool(run + "--steps 4 --expert-model-parallel-size 4 --virtual-ranks 4 --out-dir " + path("b") +
                            ck + " --load " + path("ck"));
    ASSERT_EQ(b.status, 0) << b.output;
    EXPECT_NE(b.output.find("resumed from the checkpoint of step 2"), std::string::npos) << b.output;
    ToolResult c = run_tool(run + "--steps 6 --out-dir " + path("c") + ck + " --load " + path("ck"));
    ASSERT_EQ(c.status, 0) << c.output;
    const nlohmann::json jc = report(path("c"));
    EXPECT_EQ(jc["resumed_from"], 4);
    EXPECT_EQ(jc["layout"]["ranks"], 1);
    EXPECT_EQ(jc["layout"]["micro_batches_per_rank"], 4);
    expect_close_curves(report_losses(jc), want, 1e-4, "EP=2 -> 4 -> 1 vs uninterrupted EP=2");
    EXPECT_LT(want.back(), want.front());

    // The same checkpoint without the global batch (2 ranks: 4 sequences by default): refused, naming what to give.
    ToolResult d = run_tool(kTrain + "--steps 6 --expert-model-parallel-size 2 --virtual-ranks 2 --out-dir " +
                            path("d") + " --load " + path("ck"));
    EXPECT_EQ(d.status, 2) << d.output;
    EXPECT_NE(d.output.find("--global-batch-size 8"), std::string::npos) << d.output;

    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI: the mpirun case is skipped";
    // Saved by mpirun -np 2 at step 2, continued on 4 virtual ranks: bitwise the chain above up to step 4.
    ToolResult m = run_shell(mpirun(2) + run + "--steps 2 --expert-model-parallel-size 2 --out-dir " + path("m") +
                             " --save " + path("ckm"));
    ASSERT_EQ(m.status, 0) << m.output;
    ToolResult mb = run_tool(run + "--steps 4 --expert-model-parallel-size 4 --virtual-ranks 4 --out-dir " +
                             path("mb") + " --save " + path("ckm") + " --load " + path("ckm"));
    ASSERT_EQ(mb.status, 0) << mb.output;
    EXPECT_EQ(report_losses(report(path("mb"))), report_losses(report(path("b"))));
}

TEST_F(TrainEpTool, RefusesWhatItCannotDoNamingTheFlag) {
    const std::string run = "train " + kModel + "--steps 2 --out-dir " + path("r") + " ";
    struct Case {
        std::string flags, says;
    };
    const std::vector<Case> cases = {
        {"--expert-model-parallel-size 2", "--expert-model-parallel-size=2 needs that many ranks"},
        {"--virtual-ranks 2 --expert-model-parallel-size 4", "--expert-model-parallel-size=4: must divide the 2 rank"},
        {"--device cpu --virtual-ranks 2 --global-batch-size 6", "--global-batch-size=6: must be a multiple of --micro-batch-size x"},
        {"--virtual-ranks 2 --expert-model-parallel-size 2 --host-loop", "--host-loop"},
        {"--virtual-ranks -1", "--virtual-ranks=-1"},
        {"--device cuda --host-loop --global-batch-size 4", "--host-loop: not with several micro-batches per step"},
    };
    for (const Case& c : cases) {
        const ToolResult r = run_tool(run + c.flags);
        EXPECT_EQ(r.status, 2) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
        EXPECT_FALSE(fs::exists(path("r") + "/report.json")) << c.flags;
    }
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI";
    // Ranks started with different flags are refused at start-up.
    const ToolResult r = run_shell(std::string(MOEKIT_MPIEXEC) + " --allow-run-as-root --oversubscribe -np 1 " +
                                   moekit_binary() + " " + run + "--device cpu --expert-model-parallel-size 2 : -np 1 " +
                                   moekit_binary() + " " + kTrain + "--steps 3 --out-dir " + path("r") +
                                   " --expert-model-parallel-size 2");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("rank(s) 1 were started with other flags than rank 0"), std::string::npos) << r.output;
}

// --device cuda on several ranks or micro-batches runs the CUDA EP engine (tests/gpu/test_cuda_train_ep.cu); where
// no GPU is visible (CI) it is a usage error naming the flag, before any step, on virtual ranks and under mpirun.
TEST_F(TrainEpTool, CudaRanksWithoutAGpuAreRefusedNamingTheFlag) {
    if (cuda_device_available()) GTEST_SKIP() << "a GPU is visible: tests/gpu/test_cuda_train_ep.cu runs these";
    const std::string run = "train " + kModel + "--steps 2 --device cuda --out-dir " + path("r") + " ";
    struct Case {
        std::string flags, says;
    };
    const std::vector<Case> cases = {
        {"--expert-model-parallel-size 2 --virtual-ranks 2", "--device cuda with 2 ranks (--expert-model-parallel-size=2): "
                                                             "no CUDA device is visible"},
        {"--virtual-ranks 4 --expert-model-parallel-size 2", "--device cuda with 4 ranks"},
        {"--global-batch-size 4", "--device cuda: no CUDA device is visible"},
    };
    for (const Case& c : cases) {
        const ToolResult r = run_tool(run + c.flags);
        EXPECT_EQ(r.status, 2) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
        EXPECT_FALSE(fs::exists(path("r") + "/report.json")) << c.flags;
    }
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI: the mpirun case is skipped";
    const ToolResult m = run_shell(mpirun(2) + run + "--expert-model-parallel-size 2");
    EXPECT_EQ(m.status, 2) << m.output;
    EXPECT_NE(m.output.find("--device cuda with 2 ranks"), std::string::npos) << m.output;
    EXPECT_FALSE(fs::exists(path("r") + "/report.json"));
}

// SIGINT reaches the virtual ranks' threads at different steps; they agree on one (the all-reduced stop flag):
// exit 130, rank 0's report holds the steps done, and the checkpoint of the last one resumes in one process.
TEST_F(TrainEpTool, SigintStopsEveryRankAfterTheSameStep) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        freopen("/dev/null", "w", stderr);
        const std::string cmd = std::string("exec ") + moekit_binary() + " " + kTrain +
                                "--steps 1000000 --expert-model-parallel-size 2 --virtual-ranks 2 --out-dir " +
                                path("s") + " --save " + path("ck");
        execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
        _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_EQ(kill(pid, SIGINT), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    EXPECT_EQ(WEXITSTATUS(status), 130);
    const nlohmann::json j = report(path("s"));
    EXPECT_EQ(j["interrupted_by_signal"], 2);
    ASSERT_GE(j["steps"].size(), 1u);
    const int64_t last = j["steps"].back()["step"];
    std::ifstream latest(path("ck") + "/latest_checkpointed_iteration.txt");
    int64_t saved = 0;
    latest >> saved;
    EXPECT_EQ(saved, last);
    const ToolResult r = run_tool(kTrain + "--global-batch-size 4 --steps " + std::to_string(last + 1) +
                                  " --out-dir " + path("r") + " --load " + path("ck"));
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(report(path("r"))["resumed_from"], last);
}

}  // namespace
}  // namespace moekit::train
