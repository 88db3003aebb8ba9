// The CUDA data/expert-parallel training engine (src/cuda/ep_train_engine.cu) on virtual ranks sharing one GPU:
// EP = 2 and 4 (and EP = 2 on 4 ranks, expert-data-parallel 2) train like EP = 1 on one GPU with the same global
// batch (DP-equivalence, both dispatchers, within the bf16 tolerance below); one rank with one micro-batch is the
// single-GPU engine bit for bit; a checkpoint saved at EP = 2 holds every expert and resumes at EP = 2 bit for bit
// and at EP = 1 and 4 on the same curve; Layer::create's EP form takes the local experts' views.
// The mpirun/NCCL case: tests/gpu/train_cuda_mpi_np2.sh (2 GPUs). Seeds are fixed and printed by the options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "cuda/cuda_check.h"
#include "cuda/ep_train_engine.h"
#include "cuda/train_engine.h"
#include "gpu/cuda_layer_test_util.h"
#include "moekit/comm.h"
#include "moekit/device_layer.h"
#include "moekit/error.h"
#include "train/checkpoint.h"
#include "train/train_engine.h"
#include "train/train_task.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace moekit::train {
namespace {

namespace fs = std::filesystem;

// Sizes where a near-tie routing flip is rare but every path runs: H 64, 8 experts, top-2, SwiGLU FFN 64,
// 2 layers, S 64 x B 2; sigmoid with expert bias (its counts are summed over data-parallel) and the aux loss.
// A global batch of 4 micro-batches: 4 per rank on one, 2 on two, 1 on four ranks.
TrainOptions ep_run(const std::string& dispatcher, int64_t steps) {
    TrainOptions o = small_training(64, 8, 64, 2, 64, 2, "cuda");
    o.config.moe_token_dispatcher_type = dispatcher;
    o.config.moe_router_score_function = "sigmoid", o.config.moe_router_enable_expert_bias = true;
    o.global_batch_size = 4 * o.config.micro_batch_size;
    o.steps = steps, o.eval_every = 10, o.log_interval = 5;
    o.seed = 11;
    return o;
}

// o on `ranks` virtual ranks of the current GPU at --expert-model-parallel-size ep (one rank: this process);
// rank 0's result.
TrainResult run_on_ranks(TrainOptions o, int ranks, int64_t ep) {
    o.config.expert_model_parallel_size = ep;
    if (ranks == 1) return run_training(o);
    TrainResult rank0;
    comm::run_virtual_ranks(ranks, [&](Communicator& world) {
        TrainOptions mine = o;
        mine.world = &world;
        TrainResult r = run_training(mine);
        if (world.rank() == 0) rank0 = std::move(r);
    });
    return rank0;
}

// Largest relative loss difference over the steps; every step within `tolerance`.
double compare_curves(const TrainResult& got, const TrainResult& want, double tolerance, const std::string& what) {
    EXPECT_EQ(got.steps.size(), want.steps.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < std::min(got.steps.size(), want.steps.size()); ++i) {
        const double rel = std::abs(got.steps[i].loss - want.steps[i].loss) / want.steps[i].loss;
        worst = std::max(worst, rel);
        EXPECT_LT(rel, tolerance) << what << ", step " << i + 1 << ": " << got.steps[i].loss << " vs "
                                  << want.steps[i].loss;
    }
    return worst;
}

// Each step's counts cover the whole global batch: S·B·k rows per micro-batch, G micro-batches, every layer.
void expect_whole_batch_counted(const TrainResult& r, const TrainOptions& o) {
    const int64_t rows = o.config.seq_length * o.global_batch_size * o.config.moe_router_topk;
    for (const StepRecord& s : r.steps)
        for (const auto& layer : s.tokens_per_expert) {
            int64_t sum = 0;
            for (int64_t c : layer) sum += c;
            EXPECT_EQ(sum, rows) << "step " << s.step;
        }
}

class CudaTrainEp : public ::testing::TestWithParam<std::string> {};

// The bf16 tolerance: EP changes the order in which an expert's weight gradient sums its rows (one GEMM over
// every rank's rows instead of one per micro-batch), a float-rounding difference that bf16 weights and near-tie
// routing flips carry through the steps. 1e-2 relative per step over 40 steps is the CPU-vs-GPU bound of
// tests/gpu/test_cuda_train.cu; the DP-equivalence difference is expected well below it (printed).
TEST_P(CudaTrainEp, EpTrainsLikeOneGpuWithTheSameGlobalBatch) {
    SKIP_WITHOUT_GPU();
    const TrainOptions o = ep_run(GetParam(), 40);
    const TrainResult one = run_on_ranks(o, 1, 1);
    EXPECT_NE(one.engine.find("data/expert-parallel, device-resident"), std::string::npos) << one.engine;
    expect_whole_batch_counted(one, o);
    EXPECT_LT(one.steps.back().loss, one.steps.front().loss);
    struct Layout {
        int ranks;
        int64_t ep;
    };
    for (const Layout l : {Layout{2, 2}, Layout{4, 4}, Layout{4, 2}}) {
        const std::string what = GetParam() + str(", ", l.ranks, " ranks, EP=", l.ep);
        const TrainResult r = run_on_ranks(o, l.ranks, l.ep);
        EXPECT_EQ(r.layout.transport, "local-gpu") << what;
        EXPECT_EQ(r.layout.ranks, l.ranks) << what;
        EXPECT_NE(r.engine.find(str("EP=", l.ep)), std::string::npos) << r.engine;
        expect_whole_batch_counted(r, o);
        const double worst = compare_curves(r, one, 1e-2, what);
        std::printf("%s vs EP=1 on one GPU (global batch %lld sequences), 40 steps: largest relative loss "
                    "difference %.2e; loss %.4f -> %.4f\n",
                    what.c_str(), (long long)o.global_batch_size, worst, r.steps.front().loss, r.steps.back().loss);
        ASSERT_EQ(r.steps.back().eval_loss >= 0, one.steps.back().eval_loss >= 0) << what;
        EXPECT_NEAR(r.steps.back().eval_loss, one.steps.back().eval_loss, 1e-2 * one.steps.back().eval_loss) << what;
    }
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, CudaTrainEp, ::testing::Values("allgather", "alltoall"));

// One rank with one micro-batch: the EP engine (eager) computes what the single-GPU engine's graph does, bit for
// bit: the same kernels, layout and order (the teacher on its own layer object, the mean over one micro-batch).
TEST(CudaTrainEpEngine, OneRankOneMicroBatchIsTheSingleGpuEngineBitForBit) {
    SKIP_WITHOUT_GPU();
    TrainOptions o = ep_run("alltoall", 12);
    o.global_batch_size = 0;  // one micro-batch per step
    auto single = cuda::make_cuda_train_engine(o);
    auto ep = cuda::make_cuda_ep_train_engine(o);
    EXPECT_EQ(single->identity_mse(), ep->identity_mse());
    std::vector<StepRecord> a, b;  // collected every 4 steps, as the trainer does (the record ring is finite)
    for (int64_t s = 1; s <= o.steps; ++s) {
        single->step(), ep->step();
        if (s % 4 == 0) {
            single->eval(), ep->eval();
            for (StepRecord& r : single->collect(true)) a.push_back(std::move(r));
            for (StepRecord& r : ep->collect(true)) b.push_back(std::move(r));
        }
    }
    ASSERT_EQ(a.size(), size_t(o.steps));
    ASSERT_EQ(b.size(), size_t(o.steps));
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i + 1;
        EXPECT_EQ(a[i].eval_loss, b[i].eval_loss) << "step " << i + 1;
        EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << "step " << i + 1;
        EXPECT_EQ(a[i].tokens_per_expert, b[i].tokens_per_expert) << "step " << i + 1;
    }
    const TrainState sa = single->state(), sb = ep->state();
    EXPECT_EQ(sa.step, sb.step);
    for (size_t l = 0; l < sa.weights.size(); ++l) {
        EXPECT_EQ(sa.weights[l].router_weight.data, sb.weights[l].router_weight.data) << "layer " << l;
        EXPECT_EQ(sa.weights[l].expert_bias, sb.weights[l].expert_bias) << "layer " << l;
        for (size_t e = 0; e < sa.weights[l].fc2.size(); ++e)
            EXPECT_EQ(sa.weights[l].fc2[e].data, sb.weights[l].fc2[e].data) << "layer " << l << " expert " << e;
    }
    EXPECT_EQ(sa.adam_m, sb.adam_m);
    EXPECT_EQ(sa.adam_v, sb.adam_v);
}

// Saved at EP = 2 after 10 steps (experts gathered from both ranks into Megatron's global tensors), then
// resumed for 10 more: at EP = 2 bit for bit like the uninterrupted run, at EP = 1 (one GPU, 4 micro-batches) and
// EP = 4 on the same curve within the tolerance above.
TEST(CudaTrainEpEngine, CheckpointAtEp2ResumesAtEp2Ep1AndEp4) {
    SKIP_WITHOUT_GPU();
    const std::string base = ::testing::TempDir() + "/moekit_cuda_train_ep_" + std::to_string(::getpid());
    TrainOptions o = ep_run("alltoall", 20);
    const TrainResult straight = run_on_ranks(o, 2, 2);
    TrainOptions first = o;
    first.steps = 10, first.save_dir = base + "_ck";
    const TrainResult head = run_on_ranks(first, 2, 2);
    ASSERT_EQ(head.steps.size(), 10u);

    // The checkpoint holds all 8 experts, each rank's trained (not the initial weights, not zeros).
    const Checkpoint ck = load_checkpoint(first.save_dir, o);
    ASSERT_EQ(ck.state.step, 10);
    const std::vector<MoeWeights<float>> init = student_weights(o);
    for (size_t l = 0; l < ck.state.weights.size(); ++l) {
        ASSERT_EQ(ck.state.weights[l].fc1.size(), 8u);
        for (size_t e = 0; e < 8; ++e) {
            EXPECT_NE(ck.state.weights[l].fc1[e].data, init[l].fc1[e].data) << "layer " << l << " expert " << e;
            double norm = 0;
            for (float v : ck.state.weights[l].fc2[e].data) norm += double(v) * v;
            EXPECT_GT(norm, 0.0) << "layer " << l << " expert " << e;
        }
    }

    TrainOptions second = o;
    second.load_dir = first.save_dir;
    const TrainResult at2 = run_on_ranks(second, 2, 2);
    EXPECT_EQ(at2.resumed_from, 10);
    ASSERT_EQ(at2.steps.size(), straight.steps.size());
    for (size_t i = 0; i < straight.steps.size(); ++i)
        EXPECT_EQ(at2.steps[i].loss, straight.steps[i].loss) << "EP=2 -> EP=2, step " << i + 1;
    for (const int ranks : {1, 4}) {
        const TrainResult r = run_on_ranks(second, ranks, ranks);
        EXPECT_EQ(r.resumed_from, 10);
        const double worst = compare_curves(r, straight, 1e-2, str("EP=2 -> EP=", ranks));
        std::printf("checkpoint of EP=2 at step 10 resumed at EP=%d: largest relative loss difference %.2e over "
                    "20 steps\n", ranks, worst);
    }
    std::error_code ec;
    if (!HasFailure()) fs::remove_all(first.save_dir, ec);
}

// Layer::create's EP form: fc1/fc2 views hold the rank's L = E / EP experts; a view of all E is refused naming it.
TEST(CudaTrainEpEngine, LayerCreateWithAnEpGroupTakesTheLocalExperts) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = test::small_config();
    c.expert_model_parallel_size = 2;
    c.normalize();
    const int64_t E = c.num_experts(), H = c.hidden_size, F1 = c.fc1_rows(), F = c.expert_ffn();
    comm::run_virtual_ranks(2, [&](Communicator& world) {
        auto groups = make_process_groups(world, 2);
        auto layer = Layer::create(c, LayerBounds{16, 2}, Backend::cuda, *groups->ep);
        EXPECT_EQ(layer->local_experts(), E / 2);
        void* mem = nullptr;
        MOEKIT_CUDA_CHECK(cudaMalloc(&mem, size_t(E * (F1 * H + H * F + H)) * 2 + size_t(32 * H) * 4));
        auto* p = static_cast<char*>(mem);
        LayerParams params;
        params.router_weight = TensorView(p, DType::bf16, {E, H}, Backend::cuda, 0);
        params.fc1 = TensorView(p + E * H * 2, DType::bf16, {E, F1, H}, Backend::cuda, 0);  // all E: wrong at EP=2
        params.fc2 = TensorView(p + E * H * 2, DType::bf16, {E / 2, H, F}, Backend::cuda, 0);
        ForwardArgs a;
        a.input = TensorView(p, DType::bf16, {32, H}, Backend::cuda, 0);
        a.output = TensorView(p + 32 * H * 2, DType::bf16, {32, H}, Backend::cuda, 0);
        try {
            layer->forward(params, a, Stream{});
            ADD_FAILURE() << "an fc1 view of all experts was accepted at EP=2";
        } catch (const UsageError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find(str("fc1: got BF16[", E, ", ")), std::string::npos) << msg;
            EXPECT_NE(msg.find(str("expected BF16[", E / 2, ", ")), std::string::npos) << msg;
        }
        cudaFree(mem);
    });
}

}  // namespace
}  // namespace moekit::train
