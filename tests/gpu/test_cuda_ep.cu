// Expert parallelism on ONE GPU with virtual ranks (the local-gpu DeviceComm): on every rank the CUDA EP
// layer (src/cuda/ep_rank_step.h) is compared with the CPU oracle cpu::MoeLayer at EP = 1 on the same
// micro-batch: output and input gradient per rank, router/shared gradients summed over ranks, each
// rank's local experts' gradients against the sum over all micro-batches, tokens per expert exact,
// losses per micro-batch; EP = 2, 4, 8, both dispatchers, routing variants. Also the device
// transport's own collectives (all-gather, uneven all-to-all-v, deterministic all-reduce).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>

#include "comm/device_comm.h"
#include "cuda/device_buffer.h"
#include "cuda/ep_rank_step.h"
#include "cuda/moe_layer.h"
#include "core/dispatch_math.h"
#include "gpu/cuda_layer_test_util.h"
#include "gpu/ep_test_util.h"
#include "moekit/comm.h"

namespace moekit::test {
namespace {

std::vector<float> flat(const std::vector<Matrix<float>>& ms, int64_t first, int64_t count) {
    std::vector<float> v;
    for (int64_t e = first; e < first + count; ++e) v.insert(v.end(), ms[size_t(e)].data.begin(), ms[size_t(e)].data.end());
    return v;
}

void all_reduce(Communicator& c, Matrix<float>& m) {
    if (!m.data.empty()) c.all_reduce(m.data.data(), m.size());
}

struct EpGpuCase {
    std::string name;
    std::function<void(MoeConfig&)> edit;
    bool padding = false;
};

std::vector<EpGpuCase> ep_cases() {
    return {
        {"softmax_post_swiglu", [](MoeConfig&) {}},
        {"sigmoid_bias_groups_seqaux",
         [](MoeConfig& c) {
             c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
             c.moe_router_num_groups = 4, c.moe_router_group_topk = 2, c.moe_router_topk = 4;
             c.moe_router_load_balancing_type = {"seq_aux_loss"}, c.moe_aux_loss_coeff = {0.02};
         }},
        {"shared_gate_gelu_fp64",
         [](MoeConfig& c) {
             c.activation_func = "gelu", c.moe_shared_expert_intermediate_size = 48, c.moe_shared_expert_gate = true;
             c.moe_router_dtype = "fp64";
         }},
        {"capacity_drop_position",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.75, c.moe_token_drop_policy = "position"; }},
        {"capacity_pad", [](MoeConfig& c) { c.moe_expert_capacity_factor = 1.0, c.moe_pad_expert_input_to_capacity = true; }},
        {"padding_mask_aux_z", [](MoeConfig&) {}, true},
        {"uneven_empty_experts",  // sigmoid k=1 with a dominating bias on expert 0: most experts get nothing
         [](MoeConfig& c) {
             c.moe_router_score_function = "sigmoid", c.moe_router_topk = 1, c.moe_router_enable_expert_bias = true;
         }},
    };
}

// Every rank: its micro-batch (seeded by rank) through the CUDA EP layer and the CPU oracle at EP = 1.
void run_case(const EpGpuCase& tc, int ranks, const std::string& dispatcher) {
    const uint64_t seed = 20261123;
    std::mutex print;
    if (dispatcher == "budgeted" && tc.name.find("capacity_pad") != std::string::npos)
        GTEST_SKIP() << "--moe-pad-expert-input-to-capacity already gives static shapes: the receive factor is refused";
    on_ranks(ranks, [&](Communicator& world) {
        const int r = world.rank();
        MoeConfig c = small_config();
        tc.edit(c);
        MoeWeights<float> w = bf16_weights(c, seed);
        if (tc.name == "uneven_empty_experts") w.expert_bias[0] = 100.0;
        LayerInput<float> in = bf16_input(c, seed + 1000 * uint64_t(r + 1));
        if (tc.padding) {
            in.padding_mask.assign(size_t(in.hidden.rows), 0);
            for (int64_t t = 0; t < in.hidden.rows; ++t) in.padding_mask[size_t(t)] = ((t + r) % 5 == 3 || t >= 28);
        }
        Matrix<float> grad_out = random_matrix<float>(in.hidden.rows, in.hidden.cols, seed + uint64_t(r), 2, 1.0);
        round_bf16(grad_out);
        SCOPED_TRACE(tc.name + " " + dispatcher + " EP=" + std::to_string(ranks) + " rank " + std::to_string(r) +
                     " seed=" + std::to_string(seed));

        cpu::MoeLayer<float> oracle(c);
        MoeWeights<float> g_ref = zeros_like(w);
        const Matrix<float> out_ref = oracle.forward(w, in);
        const RoutingSummary s_ref = oracle.summary();
        const Matrix<float> dx_ref = oracle.backward(w, grad_out, g_ref);

        MoeConfig ce = c;
        ce.expert_model_parallel_size = ranks;
        ce.moe_token_dispatcher_type = dispatcher == "budgeted" ? "alltoall" : dispatcher;
        if (dispatcher == "budgeted") ce.moe_expert_rank_capacity_factor = 2.0;  // room for the skew of 32 tokens
        const auto groups = make_process_groups(world, ranks);
        cuda::EpRankStep got = cuda::run_ep_rank_step(ce, *groups, w, in, grad_out);

        ASSERT_GT(norm(out_ref.data), 0.0);
        EXPECT_LT(rel_err(got.output.data, out_ref.data), 1e-2) << "output";
        EXPECT_LT(rel_err(got.grad_input.data, dx_ref.data), 2e-2) << "grad input";
        EXPECT_EQ(got.summary.tokens_per_expert, s_ref.tokens_per_expert) << "tokens per expert";
        EXPECT_EQ(got.routing_map, oracle.routing_map()) << "routing map";
        EXPECT_NEAR(got.summary.losses.aux_loss, s_ref.losses.aux_loss, 1e-5 * std::abs(s_ref.losses.aux_loss) + 1e-9);
        EXPECT_NEAR(got.summary.losses.seq_aux_loss, s_ref.losses.seq_aux_loss,
                    1e-5 * std::abs(s_ref.losses.seq_aux_loss) + 1e-9);
        EXPECT_NEAR(got.summary.losses.z_loss, s_ref.losses.z_loss, 1e-5 * std::abs(s_ref.losses.z_loss) + 1e-9);
        if (ranks > 1) EXPECT_EQ(got.host_syncs, dispatcher == "alltoall" ? 1 : 0) << "host syncs per step";
        if (dispatcher == "budgeted") {
            EXPECT_TRUE(got.budgeted) << "the receive factor selects the budgeted dispatcher";
            // All tokens on expert 0: rank 0 is due EP x 32 rows, past the budget from EP = 4 on (then re-run).
            const bool must_fit = tc.name != "uneven_empty_experts";
            if (must_fit) EXPECT_FALSE(got.overflow) << "peak " << got.peak_rows << " budget " << got.budget_rows;
        }

        // Gradients summed over the micro-batches: the oracle's by an all-reduce, the EP layer's router and
        // shared grads by the data-parallel reduction; its local experts' grads already hold every rank's rows.
        for (auto* g : {&g_ref.router_weight, &g_ref.shared_fc1, &g_ref.shared_fc2, &g_ref.shared_gate,
                        &got.grads.router_weight, &got.grads.shared_fc1, &got.grads.shared_fc2, &got.grads.shared_gate})
            all_reduce(world, *g);
        for (size_t e = 0; e < g_ref.fc1.size(); ++e) all_reduce(world, g_ref.fc1[e]), all_reduce(world, g_ref.fc2[e]);
        constexpr double kGradTol = 2e-2;
        EXPECT_LT(rel_err(got.grads.router_weight.data, g_ref.router_weight.data), kGradTol) << "grad router";
        const int64_t L = c.num_experts() / ranks, first = int64_t(r) * L;
        const std::vector<float> f1_ref = flat(g_ref.fc1, first, L), f2_ref = flat(g_ref.fc2, first, L);
        if (norm(f1_ref) > 0) {
            EXPECT_LT(rel_err(flat(got.grads.fc1, first, L), f1_ref), kGradTol) << "grad fc1 (local experts)";
            EXPECT_LT(rel_err(flat(got.grads.fc2, first, L), f2_ref), kGradTol) << "grad fc2 (local experts)";
        } else {
            EXPECT_EQ(norm(flat(got.grads.fc1, first, L)), 0.0) << "experts without tokens have no gradient";
        }
        if (!w.shared_fc1.empty()) {
            EXPECT_LT(rel_err(got.grads.shared_fc1.data, g_ref.shared_fc1.data), kGradTol) << "grad shared fc1";
            EXPECT_LT(rel_err(got.grads.shared_fc2.data, g_ref.shared_fc2.data), kGradTol) << "grad shared fc2";
        }
        if (!w.shared_gate.empty())
            EXPECT_LT(rel_err(got.grads.shared_gate.data, g_ref.shared_gate.data), kGradTol) << "grad shared gate";
        std::lock_guard<std::mutex> lock(print);
        std::printf("  %-28s %-9s EP=%d rank %d: out %.2e dx %.2e dW_router %.2e dW_fc1 %.2e sent %lld B\n",
                    tc.name.c_str(), dispatcher.c_str(), ranks, r, rel_err(got.output.data, out_ref.data),
                    rel_err(got.grad_input.data, dx_ref.data),
                    rel_err(got.grads.router_weight.data, g_ref.router_weight.data),
                    norm(f1_ref) > 0 ? rel_err(flat(got.grads.fc1, first, L), f1_ref) : 0.0,
                    static_cast<long long>(got.bytes_sent));
    });
}

class CudaEpVsCpu : public ::testing::TestWithParam<std::tuple<EpGpuCase, int, std::string>> {};

TEST_P(CudaEpVsCpu, VirtualRanksMatchOracle) {
    SKIP_WITHOUT_GPU();
    const auto& [tc, ranks, dispatcher] = GetParam();
    run_case(tc, ranks, dispatcher);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaEpVsCpu,
                         ::testing::Combine(::testing::ValuesIn(ep_cases()), ::testing::Values(2, 4, 8),
                                            ::testing::Values(std::string("allgather"), std::string("alltoall"),
                                                              std::string("budgeted"))),
                         [](const auto& info) {
                             return std::get<0>(info.param).name + "_ep" + std::to_string(std::get<1>(info.param)) +
                                    "_" + std::get<2>(info.param);
                         });

// The budgeted (sync-free) dispatcher against the alltoall one on the same micro-batches: the same rows in
// the same order reach the same GEMMs, so every result is bitwise equal; with a tiny factor every step
// overflows, is flagged on every rank, and its re-run through alltoall is bitwise the dropless result.
void run_budgeted_vs_alltoall(const EpGpuCase& tc, int ranks, double factor, bool expect_overflow) {
    const uint64_t seed = 777;
    on_ranks(ranks, [&](Communicator& world) {
        const int r = world.rank();
        MoeConfig c = small_config();
        tc.edit(c);
        c.expert_model_parallel_size = ranks, c.moe_token_dispatcher_type = "alltoall";
        MoeWeights<float> w = bf16_weights(c, seed);
        if (tc.name == "uneven_empty_experts") w.expert_bias[0] = 100.0;
        LayerInput<float> in = bf16_input(c, seed + 97 * uint64_t(r + 1));
        Matrix<float> grad_out = random_matrix<float>(in.hidden.rows, in.hidden.cols, seed + uint64_t(r), 5, 1.0);
        round_bf16(grad_out);
        SCOPED_TRACE(tc.name + " EP=" + std::to_string(ranks) + " rank " + std::to_string(r) + " factor " +
                     std::to_string(factor));
        const auto groups = make_process_groups(world, ranks);
        const cuda::EpRankStep a = cuda::run_ep_rank_step(c, *groups, w, in, grad_out);
        const cuda::EpRankStep a2 = cuda::run_ep_rank_step(c, *groups, w, in, grad_out);
        EXPECT_EQ(first_difference(a.output.data, a2.output.data), "") << "alltoall twice: output";
        EXPECT_EQ(first_difference(a.grad_input.data, a2.grad_input.data), "") << "alltoall twice: grad input";
        MoeConfig cb = c;
        cb.moe_expert_rank_capacity_factor = factor;
        const cuda::EpRankStep b = cuda::run_ep_rank_step(cb, *groups, w, in, grad_out);
        EXPECT_TRUE(b.budgeted);
        EXPECT_EQ(b.overflow, expect_overflow) << "peak " << b.peak_rows << " budget " << b.budget_rows;
        if (!expect_overflow) EXPECT_EQ(b.host_syncs, 0);
        EXPECT_EQ(first_difference(a.output.data, b.output.data), "") << "output";
        EXPECT_EQ(first_difference(a.grad_input.data, b.grad_input.data), "") << "grad input";
        EXPECT_EQ(first_difference(a.grads.router_weight.data, b.grads.router_weight.data), "") << "grad router";
        const int64_t L = c.num_experts() / ranks;
        for (int64_t e = int64_t(r) * L; e < int64_t(r + 1) * L; ++e) {
            EXPECT_EQ(first_difference(a.grads.fc1[size_t(e)].data, b.grads.fc1[size_t(e)].data), "") << "fc1 " << e;
            EXPECT_EQ(first_difference(a.grads.fc2[size_t(e)].data, b.grads.fc2[size_t(e)].data), "") << "fc2 " << e;
        }
        EXPECT_EQ(first_difference(a.grads.shared_fc1.data, b.grads.shared_fc1.data), "") << "grad shared fc1";
        EXPECT_EQ(a.summary.tokens_per_expert, b.summary.tokens_per_expert);
        EXPECT_EQ(a.routing_map, b.routing_map);
        // The same rows leave each rank; the budgeted one also sends each row's 4-byte source index.
        if (!expect_overflow) EXPECT_GE(b.bytes_sent, a.bytes_sent);
    });
}

TEST(CudaEpBudgeted, EqualsAlltoallBitwise) {
    SKIP_WITHOUT_GPU();
    for (int ranks : {2, 4, 8})
        for (const EpGpuCase& tc : ep_cases())
            if (tc.name.find("capacity_pad") == std::string::npos && tc.name != "uneven_empty_experts")
                run_budgeted_vs_alltoall(tc, ranks, 2.0, false);
}

TEST(CudaEpBudgeted, OverflowIsFlaggedAndReRunEqualsDropless) {
    SKIP_WITHOUT_GPU();
    for (int ranks : {2, 4, 8}) {
        run_budgeted_vs_alltoall(ep_cases()[0], ranks, 0.05, true);
        run_budgeted_vs_alltoall(ep_cases().back(), ranks, 0.5, true);  // everything to expert 0: rank 0 overflows
    }
}

// Virtual ranks' device barriers need a hardware queue each (src/comm/local_device_comm.cu): with fewer
// than ranks + 1 queues the symmetric allocation is refused, naming the variable, before anything spins.
// Runs under CUDA_DEVICE_MAX_CONNECTIONS=4 as the ctest case budgeted_too_few_hardware_queues.
TEST(CudaEpBudgeted, TooFewHardwareQueuesIsRefused) {
    SKIP_WITHOUT_GPU();
    const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    if (!queues || std::atoi(queues) > 4) GTEST_SKIP() << "runs with CUDA_DEVICE_MAX_CONNECTIONS=4 (ctest)";
    on_ranks(8, [&](Communicator& world) {
        const auto groups = make_process_groups(world, 8);
        auto dc = cuda::make_device_comm(*groups->ep);
        MoeConfig c = small_config();
        c.expert_model_parallel_size = 8, c.moe_token_dispatcher_type = "alltoall";
        c.moe_expert_rank_capacity_factor = 1.5;
        try {
            (void)cuda::CudaMoeLayer::create(c, c.seq_length, c.micro_batch_size, true, dc.get());
            ADD_FAILURE() << "rank " << world.rank() << ": 8 virtual ranks on 4 hardware queues were accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("CUDA_DEVICE_MAX_CONNECTIONS=4"), std::string::npos) << e.what();
        }
    });
}

// The rows the budgeted dispatcher delivers are the alltoall dispatcher's expert rows, bit for bit, and the
// receive buffer past them stays as it was (nothing written beyond what arrived).
TEST(CudaEpBudgeted, ReceiveBufferHoldsTheAlltoallRowsAndSlackIsUntouched) {
    SKIP_WITHOUT_GPU();
    for (int ranks : {2, 4, 8}) {
        on_ranks(ranks, [&](Communicator& world) {
            const int r = world.rank();
            MoeConfig c = small_config();
            c.expert_model_parallel_size = ranks, c.moe_token_dispatcher_type = "alltoall";
            const MoeWeights<float> w = bf16_weights(c, 31);
            const LayerInput<float> in = bf16_input(c, 31 + uint64_t(r));
            const auto groups = make_process_groups(world, ranks);
            auto dc = cuda::make_device_comm(*groups->ep);
            std::vector<std::vector<uint16_t>> rows(2);
            int64_t held = 0, budget = 0;
            cudaStream_t s;  // each virtual rank its own stream (the legacy stream would serialise the ranks)
            ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
            for (int k = 0; k < 2; ++k) {
                MoeConfig ck = c;
                if (k == 1) ck.moe_expert_rank_capacity_factor = 1.5;
                auto layer = cuda::CudaMoeLayer::create(ck, c.seq_length, c.micro_batch_size, true, dc.get());
                const cuda::LayerBuffers& b = layer->buffers();
                const int64_t H = c.hidden_size, L = layer->shape().local_experts();
                std::vector<__nv_bfloat16> hb(in.hidden.data.size()), wr(w.router_weight.data.size());
                for (size_t i = 0; i < hb.size(); ++i) hb[i] = __float2bfloat16(in.hidden.data[i]);
                for (size_t i = 0; i < wr.size(); ++i) wr[i] = __float2bfloat16(w.router_weight.data[i]);
                cuda::upload(b.hidden, hb);
                cuda::upload(b.router_weight, wr);
                budget = k == 1 ? budget_rows(in.hidden.rows, c.moe_router_topk, 1.5) : 0;
                if (k == 1) {  // the budgeted layer's first step is its synchronous warm-up
                    layer->forward(s, true);
                    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                    (void)layer->end_dispatch_step();
                    world.barrier();  // nobody writes into a receive buffer any more
                    ASSERT_EQ(cudaMemset(b.rows, 0xFF, size_t(budget * H * 2)), cudaSuccess);
                    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // legacy-stream memset: s would not wait
                    world.barrier();
                }
                layer->forward(s, true);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                // Rows due here: every rank's counts of my local experts.
                const std::vector<int64_t> mine = layer->read_tokens_per_expert();
                const std::vector<int64_t> all = world.all_gather(mine);
                held = 0;
                for (int s = 0; s < ranks; ++s)
                    for (int64_t l = 0; l < L; ++l) held += all[size_t(s * c.num_experts() + r * L + l)];
                const int64_t n = k == 1 ? budget : held;
                std::vector<__nv_bfloat16> got = cuda::download(b.rows, n * H);
                rows[size_t(k)].resize(got.size());
                std::memcpy(rows[size_t(k)].data(), got.data(), got.size() * 2);
                if (k == 1) EXPECT_FALSE(layer->end_dispatch_step().overflow);
            }
            const int64_t H = c.hidden_size;
            ASSERT_LE(held, budget);
            EXPECT_TRUE(std::equal(rows[0].begin(), rows[0].begin() + held * H, rows[1].begin()))
                << "rank " << r << ": the budgeted receive buffer differs from the alltoall expert rows";
            EXPECT_TRUE(std::all_of(rows[1].begin() + held * H, rows[1].end(), [](uint16_t v) { return v == 0xFFFF; }))
                << "rank " << r << ": the slack past the " << held << " received rows was written";
            cudaStreamDestroy(s);
        });
    }
}

// The whole EP layer step (forward + backward through the budgeted dispatcher; with `echo`, also the
// planner, clone weights and clone grads, under zipf-skewed routing) captured in one CUDA graph per rank:
// replays on fresh inputs equal eager steps bit for bit.
void check_graph_equals_eager(bool echo) {
    for (int ranks : {2, 4, 8}) {
        on_ranks(ranks, [&](Communicator& world) {
            const int r = world.rank();
            MoeConfig c = small_config();
            c.expert_model_parallel_size = ranks, c.moe_token_dispatcher_type = "alltoall";
            c.moe_expert_rank_capacity_factor = 2.0;
            if (echo) c.moe_enable_echo = true, c.moe_num_echo_experts = 2 * ranks;
            MoeWeights<float> w = bf16_weights(c, 55);
            const auto skewed = [&](LayerInput<float> in) {
                if (echo) zipf_skew(w, in, 1.2, 2.0);
                return in;
            };
            (void)skewed(bf16_input(c, 1));  // the router weights' skew column
            const auto groups = make_process_groups(world, ranks);
            auto dc = cuda::make_device_comm(*groups->ep);
            auto layer = cuda::CudaMoeLayer::create(c, c.seq_length, c.micro_batch_size, true, dc.get());
            const cuda::LayerBuffers& b = layer->buffers();
            const int64_t T = c.seq_length * c.micro_batch_size, H = c.hidden_size, L = layer->shape().local_experts();
            const auto up = [](__nv_bfloat16* dst, const std::vector<float>& v) {
                std::vector<__nv_bfloat16> h(v.size());
                for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]);
                cuda::upload(dst, h);
            };
            up(b.router_weight, w.router_weight.data);
            std::vector<float> f1, f2;
            for (int64_t e = r * L; e < (r + 1) * L; ++e) {
                f1.insert(f1.end(), w.fc1[size_t(e)].data.begin(), w.fc1[size_t(e)].data.end());
                f2.insert(f2.end(), w.fc2[size_t(e)].data.begin(), w.fc2[size_t(e)].data.end());
            }
            up(b.fc1, f1), up(b.fc2, f2);
            cudaStream_t s;
            ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
            const auto set_inputs = [&](uint64_t step) {
                up(b.hidden, skewed(bf16_input(c, 1000 * step + uint64_t(r))).hidden.data);
                up(b.grad_output, random_matrix<float>(T, H, 1000 * step + uint64_t(r), 9, 1.0).data);
            };
            const auto results = [&] {
                std::vector<float> o(size_t(T * H));
                const std::vector<__nv_bfloat16> ob = cuda::download(b.output, T * H);
                for (size_t i = 0; i < o.size(); ++i) o[i] = __bfloat162float(ob[i]);
                std::vector<float> g = cuda::download(b.grad_input, T * H), gw = cuda::download(b.grad_fc1, f1.size());
                o.insert(o.end(), g.begin(), g.end());
                o.insert(o.end(), gw.begin(), gw.end());
                return o;
            };
            set_inputs(0);  // the first eager step is the synchronous warm-up (kernels loaded)
            layer->forward(s, true);
            layer->backward(s);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            EXPECT_FALSE(layer->end_dispatch_step().overflow);
            // Capture (thread-local: every rank captures its own stream at the same time).
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            layer->forward(s, true);
            layer->backward(s);
            ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
            ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            world.barrier();  // no rank replays (and spins) while another still instantiates (loads kernels)
            for (uint64_t step = 1; step <= 3; ++step) {
                set_inputs(step);
                ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                EXPECT_FALSE(layer->end_dispatch_step().overflow);
                const std::vector<float> replay = results();
                world.barrier();
                layer->forward(s, true);
                layer->backward(s);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                EXPECT_FALSE(layer->end_dispatch_step().overflow);
                EXPECT_EQ(replay, results()) << "rank " << r << " step " << step << ": graph replay != eager step";
                world.barrier();
            }
            EXPECT_EQ(layer->traffic().host_syncs, 0);
            if (echo) EXPECT_GT(layer->echo_summary().clones, 0) << "the skew should make ECHO clone";
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            cudaStreamDestroy(s);
        });
    }
}

TEST(CudaEpBudgeted, WholeStepCapturedInOneGraphEqualsEager) {
    SKIP_WITHOUT_GPU();
    check_graph_equals_eager(false);
}

TEST(CudaEcho, WholeStepCapturedInOneGraphEqualsEager) {
    SKIP_WITHOUT_GPU();
    check_graph_equals_eager(true);
}

// The transport's collectives on `world` (local-gpu for virtual ranks, NCCL for MPI ranks).
void check_device_collectives(Communicator& world, const std::string& transport) {
    const int r = world.rank(), n = world.size();
    auto dc = cuda::make_device_comm(world);
    EXPECT_EQ(dc->transport(), transport);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    // all_gather of 5 floats per rank.
    cuda::DeviceBuffer<float> a(5), all(5 * n);
    std::vector<float> mine(5);
    for (int i = 0; i < 5; ++i) mine[size_t(i)] = float(100 * r + i);
    a.upload(mine);
    dc->all_gather(a.get(), 5 * sizeof(float), all.get(), s);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const std::vector<float> got = all.download();
    for (int p = 0; p < n; ++p)
        for (int i = 0; i < 5; ++i) EXPECT_EQ(got[size_t(p * 5 + i)], float(100 * p + i));
    // all_to_all_v: rank r sends (r + p + 1) ints valued 1000 r + 10 p + i to peer p.
    std::vector<int64_t> sb(static_cast<size_t>(n)), rb(static_cast<size_t>(n));
    std::vector<int32_t> send;
    for (int p = 0; p < n; ++p) {
        sb[size_t(p)] = int64_t(r + p + 1) * 4, rb[size_t(p)] = int64_t(p + r + 1) * 4;
        for (int i = 0; i < r + p + 1; ++i) send.push_back(1000 * r + 10 * p + i);
    }
    int64_t total = 0;
    for (int64_t b : rb) total += b / 4;
    cuda::DeviceBuffer<int32_t> sd(int64_t(send.size())), rd(total);
    sd.upload(send);
    dc->all_to_all_v(sd.get(), sb.data(), rd.get(), rb.data(), s);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const std::vector<int32_t> recv = rd.download();
    size_t at = 0;
    for (int p = 0; p < n; ++p)
        for (int i = 0; i < p + r + 1; ++i) EXPECT_EQ(recv[at++], 1000 * p + 10 * r + i) << "from " << p;
    // Deterministic all-reduce: every rank ends with the same bits (rank-order sums).
    cuda::DeviceBuffer<float> x(7), scratch(7 * n);
    std::vector<float> xv(7);
    for (int i = 0; i < 7; ++i) xv[size_t(i)] = 0.1f * float(r + 1) + 1e-3f * float(i);
    x.upload(xv);
    cuda::all_reduce_sum(*dc, x.get(), 7, scratch.get(), s);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const std::vector<float> sum = x.download();
    for (int i = 0; i < 7; ++i) {
        float expect = 0.1f + 1e-3f * float(i);
        for (int p = 1; p < n; ++p) expect += 0.1f * float(p + 1) + 1e-3f * float(i);
        EXPECT_EQ(sum[size_t(i)], expect);
    }
    cudaStreamDestroy(s);
}

TEST(LocalDeviceComm, CollectivesMoveTheRightBytes) {
    SKIP_WITHOUT_GPU();
    comm::run_virtual_ranks(3, [&](Communicator& world) { check_device_collectives(world, "local-gpu"); });
}

// Run under mpirun (scripts/device_ep.sh: -np 1 on a one-GPU machine; -np 2 where two GPUs exist).
TEST(NcclDeviceComm, CollectivesUnderMpirun) {
    SKIP_WITHOUT_GPU();
    if (!cuda::nccl_available()) GTEST_SKIP() << "built without NCCL";
    if (!comm::mpi_launched()) GTEST_SKIP() << "not started by mpirun (scripts/device_ep.sh runs it so)";
    check_device_collectives(comm::mpi_world(), "nccl");
}

}  // namespace
}  // namespace moekit::test
