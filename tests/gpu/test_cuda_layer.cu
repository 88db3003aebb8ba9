// The whole CUDA layer (make_cuda_layer_runner) against the CPU oracle cpu::MoeLayer<float>, forward
// and backward, on the same bf16-rounded random weights and inputs: output, input gradient and every
// weight gradient within bf16 tolerance, tokens per expert exact, loss values within fp32 tolerance.
// Cases: routing variants, capacity modes, shared expert, padding mask, zero-token experts, E=1,
// input jitter, Sinkhorn routing; and a runner whose token shape changes between steps.
#include <cstdio>
#include <functional>

#include "cuda/cuda_check.h"
#include "cuda/gemm_tuning.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_cutlass.h"
#include "cuda/grouped_gemm_kernels.cuh"  // set_grouped_gemm_kernel
#include "cuda/moe_layer.h"
#include "gpu/cuda_layer_test_util.h"
#include "moekit/error.h"

namespace moekit::test {
namespace {

struct Case {
    std::string name;
    std::function<void(MoeConfig&)> edit;
    bool padding = false;
};

std::vector<Case> cases() {
    return {
        {"softmax_post_swiglu", [](MoeConfig&) {}},
        {"softmax_pre_k1_gelu",
         [](MoeConfig& c) {
             c.moe_router_topk = 1, c.moe_router_pre_softmax = true, c.gated_linear_unit = false;
             c.activation_func = "gelu";
         }},
        {"sigmoid_bias_groups_scaled_seqaux",
         [](MoeConfig& c) {
             c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
             c.moe_router_num_groups = 4, c.moe_router_group_topk = 2, c.moe_router_topk = 4;
             c.moe_router_topk_scaling_factor = 2.5;
             c.moe_router_load_balancing_type = {"seq_aux_loss"}, c.moe_aux_loss_coeff = {0.02};
         }},
        {"sqrtsoftplus_relu_global_aux_fp64",
         [](MoeConfig& c) {
             c.moe_router_score_function = "sqrtsoftplus", c.gated_linear_unit = false, c.activation_func = "relu";
             c.moe_router_load_balancing_type = {"global_aux_loss"}, c.moe_router_dtype = "fp64";
         }},
        {"geglu_shared_gate",
         [](MoeConfig& c) {
             c.activation_func = "gelu", c.moe_shared_expert_intermediate_size = 48, c.moe_shared_expert_gate = true;
         }},
        {"shared_no_gate_squared_relu",
         [](MoeConfig& c) {
             c.gated_linear_unit = false, c.activation_func = "squared_relu";
             c.moe_shared_expert_intermediate_size = 32;
         }},
        {"single_expert",
         [](MoeConfig& c) {
             c.num_moe_experts = 1, c.moe_router_topk = 1, c.moe_router_pre_softmax = true;
         }},
        {"all_tokens_to_expert0",  // sigmoid k=1 with a dominating bias: 7 zero-token experts
         [](MoeConfig& c) {
             c.moe_router_score_function = "sigmoid", c.moe_router_topk = 1, c.moe_router_enable_expert_bias = true;
         }},
        {"capacity_drop_probs", [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.5; }},
        {"capacity_drop_position",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 0.75, c.moe_token_drop_policy = "position"; }},
        {"capacity_pad",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 1.0, c.moe_pad_expert_input_to_capacity = true; }},
        {"capacity_pad_cf2_position",
         [](MoeConfig& c) {
             c.moe_expert_capacity_factor = 2.0, c.moe_pad_expert_input_to_capacity = true;
             c.moe_token_drop_policy = "position";
         }},
        {"padding_mask_all_losses",
         [](MoeConfig& c) {
             c.moe_router_load_balancing_type = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
             c.moe_aux_loss_coeff = {0.01, 0.02, 0.03};
         },
         true},
        {"padding_mask_capacity",
         [](MoeConfig& c) { c.moe_expert_capacity_factor = 1.0, c.moe_pad_expert_input_to_capacity = true; }, true},
        {"jitter_softmax_post", [](MoeConfig& c) { c.moe_input_jitter_eps = 0.1; }},
        {"jitter_sigmoid_bias_fp64",
         [](MoeConfig& c) {
             c.moe_input_jitter_eps = 0.05, c.moe_router_score_function = "sigmoid";
             c.moe_router_enable_expert_bias = true, c.moe_router_dtype = "fp64";
         }},
        {"sinkhorn_k1_jitter",
         [](MoeConfig& c) {
             c.moe_router_topk = 1, c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
             c.moe_input_jitter_eps = 0.1;
         }},
        {"sinkhorn_k2_fp64_padding",
         [](MoeConfig& c) {
             c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
             c.moe_router_dtype = "fp64";
         },
         true},
        {"sinkhorn_k1_sigmoid_bias",  // bias counted but never used in Sinkhorn's selection
         [](MoeConfig& c) {
             c.moe_router_topk = 1, c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
             c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
         }},
    };
}

class CudaLayerVsCpu : public ::testing::TestWithParam<Case> {};

std::vector<float> flat(const std::vector<Matrix<float>>& ms) {
    std::vector<float> v;
    for (const auto& m : ms) v.insert(v.end(), m.data.begin(), m.data.end());
    return v;
}

TEST_P(CudaLayerVsCpu, ForwardBackwardMatchOracle) {
    SKIP_WITHOUT_GPU();
    const Case& tc = GetParam();
    const uint64_t seed = 20261121;
    MoeConfig c = small_config();
    tc.edit(c);
    MoeWeights<float> w = bf16_weights(c, seed);
    if (tc.name == "all_tokens_to_expert0") w.expert_bias[0] = 100.0;
    LayerInput<float> in = bf16_input(c, seed);
    in.jitter_seed = seed ^ 0x5a5a;  // used by the jitter cases only
    if (tc.padding) {
        in.padding_mask.assign(size_t(in.hidden.rows), 0);
        for (int64_t t = 0; t < in.hidden.rows; ++t) in.padding_mask[size_t(t)] = (t % 5 == 3 || t >= 28);
    }
    Matrix<float> grad_out = random_matrix<float>(in.hidden.rows, in.hidden.cols, seed, 2, 1.0);
    round_bf16(grad_out);
    SCOPED_TRACE(tc.name + " seed=" + std::to_string(seed));

    cpu::MoeLayer<float> oracle(c);
    auto gpu = cuda::make_cuda_layer_runner(c);
    const Matrix<float> out_ref = oracle.forward(w, in);
    const Matrix<float> out = gpu->forward(w, in);
    ASSERT_GT(norm(out_ref.data), 0.0);
    // bf16 output of a bf16 MLP (fc1, act*p, fc2 rounded to bf16 on the GPU, float on the CPU).
    EXPECT_LT(rel_err(out.data, out_ref.data), 1e-2) << "output";

    const RoutingSummary s_ref = oracle.summary(), s = gpu->summary();
    EXPECT_EQ(s.tokens_per_expert, s_ref.tokens_per_expert) << "tokens per expert";
    // Loss values: fp32 sums in a different order.
    EXPECT_NEAR(s.losses.aux_loss, s_ref.losses.aux_loss, 1e-5 * std::abs(s_ref.losses.aux_loss) + 1e-9);
    EXPECT_NEAR(s.losses.seq_aux_loss, s_ref.losses.seq_aux_loss, 1e-5 * std::abs(s_ref.losses.seq_aux_loss) + 1e-9);
    EXPECT_NEAR(s.losses.global_aux_loss, s_ref.losses.global_aux_loss,
                1e-5 * std::abs(s_ref.losses.global_aux_loss) + 1e-9);
    EXPECT_NEAR(s.losses.z_loss, s_ref.losses.z_loss, 1e-5 * std::abs(s_ref.losses.z_loss) + 1e-9);

    MoeWeights<float> g_ref = zeros_like(w), g = zeros_like(w);
    const Matrix<float> dx_ref = oracle.backward(w, grad_out, g_ref);
    const Matrix<float> dx = gpu->backward(w, grad_out, g);
    ASSERT_GT(norm(dx_ref.data), 0.0);
    // Gradients pass through two more bf16 roundings (d act, d fc1 out) than the output.
    constexpr double kGradTol = 2e-2;
    EXPECT_LT(rel_err(dx.data, dx_ref.data), kGradTol) << "grad input";
    EXPECT_LT(rel_err(g.router_weight.data, g_ref.router_weight.data), kGradTol) << "grad router weight";
    if (norm(flat(g_ref.fc1)) > 0) {
        EXPECT_LT(rel_err(flat(g.fc1), flat(g_ref.fc1)), kGradTol) << "grad fc1";
        EXPECT_LT(rel_err(flat(g.fc2), flat(g_ref.fc2)), kGradTol) << "grad fc2";
    }
    if (!w.shared_fc1.empty()) {
        EXPECT_LT(rel_err(g.shared_fc1.data, g_ref.shared_fc1.data), kGradTol) << "grad shared fc1";
        EXPECT_LT(rel_err(g.shared_fc2.data, g_ref.shared_fc2.data), kGradTol) << "grad shared fc2";
    }
    if (!w.shared_gate.empty())
        EXPECT_LT(rel_err(g.shared_gate.data, g_ref.shared_gate.data), kGradTol) << "grad shared gate";

    std::printf("  %-36s rel err: out %.2e  dx %.2e  dW_router %.2e  dW_fc1 %.2e  dW_fc2 %.2e\n", tc.name.c_str(),
                rel_err(out.data, out_ref.data), rel_err(dx.data, dx_ref.data),
                rel_err(g.router_weight.data, g_ref.router_weight.data), rel_err(flat(g.fc1), flat(g_ref.fc1)),
                rel_err(flat(g.fc2), flat(g_ref.fc2)));

    // Expert-bias accumulator and update agree with the oracle.
    if (c.moe_router_enable_expert_bias) {
        MoeWeights<float> w_ref = w, w_gpu = w;
        oracle.update_expert_bias(w_ref);
        gpu->update_expert_bias(w_gpu);
        EXPECT_EQ(w_gpu.expert_bias, w_ref.expert_bias);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaLayerVsCpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Two forward+backward calls with the same inputs are bitwise equal (deterministic kernels only).
TEST(CudaLayer, RepeatedStepsAreBitwiseEqual) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.deterministic_mode = true;
    c.moe_shared_expert_intermediate_size = 32;
    const MoeWeights<float> w = bf16_weights(c, 7);
    const LayerInput<float> in = bf16_input(c, 7);
    const Matrix<float> go = random_matrix<float>(in.hidden.rows, in.hidden.cols, 7, 2, 1.0);
    auto gpu = cuda::make_cuda_layer_runner(c);
    MoeWeights<float> g1 = zeros_like(w), g2 = zeros_like(w);
    const Matrix<float> o1 = gpu->forward(w, in);
    const Matrix<float> d1 = gpu->backward(w, go, g1);
    const Matrix<float> o2 = gpu->forward(w, in);
    const Matrix<float> d2 = gpu->backward(w, go, g2);
    EXPECT_EQ(o1.data, o2.data);
    EXPECT_EQ(d1.data, d2.data);
    EXPECT_EQ(g1.router_weight.data, g2.router_weight.data);
    EXPECT_EQ(flat(g1.fc1), flat(g2.fc1));
}

// --deterministic-mode takes the grouped GEMMs' rule: with tuning on, such a layer tunes nothing and takes no measured
// choice, so every process computes the same bits (cuda/gemm_tuning.h); the same layer without it tunes its plain
// products (the check that the first half could fail).
TEST(CudaLayer, DeterministicModeTunesNoGemm) {
    SKIP_WITHOUT_SM90();
    MoeConfig c = small_config();
    const MoeWeights<float> w = bf16_weights(c, 9);
    const LayerInput<float> in = bf16_input(c, 9);
    const Matrix<float> go = random_matrix<float>(in.hidden.rows, in.hidden.cols, 9, 2, 1.0);
    cuda::set_gemm_tuning(1);
    for (const bool deterministic : {true, false}) {
        SCOPED_TRACE(deterministic ? "--deterministic-mode" : "default");
        cuda::clear_gemm_tuning();
        c.deterministic_mode = deterministic;
        auto gpu = cuda::make_cuda_layer_runner(c);
        MoeWeights<float> g = zeros_like(w);
        gpu->forward(w, in);
        gpu->backward(w, go, g);
        EXPECT_EQ(cuda::gemm_tuning_records().empty(), deterministic) << cuda::gemm_tuning_records().size()
                                                                       << " shapes tuned";
    }
    cuda::set_gemm_tuning(-1);
    cuda::clear_gemm_tuning();
}

// The fused-epilogue tests' layer: gated with the aux loss, bf16-rounded seeded weights, input and output gradient.
struct GluLayerCase {
    MoeConfig c;
    MoeWeights<float> w;
    LayerInput<float> in;
    Matrix<float> go;
};
GluLayerCase glu_layer_case(const char* act, uint64_t seed) {
    MoeConfig c = small_config();
    c.activation_func = act;
    c.moe_router_load_balancing_type = {"aux_loss"}, c.moe_aux_loss_coeff = {0.01};
    MoeWeights<float> w = bf16_weights(c, seed);
    LayerInput<float> in = bf16_input(c, seed);
    Matrix<float> go = random_matrix<float>(in.hidden.rows, in.hidden.cols, seed, 2, 1.0);
    round_bf16(go);
    return {c, std::move(w), std::move(in), std::move(go)};
}

// The gated activation's backward fused into fc2's dgrad epilogue (grouped_gemm_nn_glu_backward) against the
// unfused layer, on both kernels that have it (fusion forced on): the own TMA kernel and CUTLASS's ping-pong (each
// forced); GroupedGemm.GluBackwardEpilogueMatchesUnfused asserts that both launch it. Output
// and fc1 / fc2 weight gradients bitwise equal (the same d gate / d up), the input and router gradients equal up to
// the order d(prob) is summed in, and both against the CPU oracle.
TEST(CudaLayer, FusedActivationBackwardMatchesUnfused) {
    SKIP_WITHOUT_SM90();
    for (const bool cutlass : {false, true})
    for (const char* act : {"silu", "gelu"}) {
        if (cutlass && !cuda::cutlass_grouped_gemm_built()) continue;
        SCOPED_TRACE(::testing::Message() << act << (cutlass ? " cutlass ping-pong" : " own TMA kernel"));
        const auto [c, w, in, go] = glu_layer_case(act, 31);
        cuda::set_grouped_gemm_kernel(cutlass ? cuda::GroupedGemmKernel::kCutlass : cuda::GroupedGemmKernel::kTma);
        cuda::set_cutlass_config(cutlass ? cuda::CutlassConfig::kPingpong : cuda::CutlassConfig::kAuto);
        auto run = [&](int fuse, MoeWeights<float>& g) {
            cuda::set_glu_backward_fusion(fuse);
            auto gpu = cuda::make_cuda_layer_runner(c);
            const Matrix<float> out = gpu->forward(w, in);
            const Matrix<float> dx = gpu->backward(w, go, g);
            return std::make_pair(out, dx);
        };
        MoeWeights<float> g_fused = zeros_like(w), g_plain = zeros_like(w), g_ref = zeros_like(w);
        const auto [out_f, dx_f] = run(1, g_fused);
        const auto [out_p, dx_p] = run(0, g_plain);
        cuda::set_glu_backward_fusion(-1);
        cuda::set_grouped_gemm_kernel(cuda::GroupedGemmKernel::kAuto);
        cuda::set_cutlass_config(cuda::CutlassConfig::kAuto);
        EXPECT_EQ(out_f.data, out_p.data);
        EXPECT_EQ(flat(g_fused.fc1), flat(g_plain.fc1)) << "fc1 grads";
        EXPECT_EQ(flat(g_fused.fc2), flat(g_plain.fc2)) << "fc2 grads";
        EXPECT_LT(rel_err(dx_f.data, dx_p.data), 1e-5) << "grad input";
        EXPECT_LT(rel_err(g_fused.router_weight.data, g_plain.router_weight.data), 1e-5) << "grad router weight";
        cpu::MoeLayer<float> oracle(c);
        oracle.forward(w, in);
        const Matrix<float> dx_ref = oracle.backward(w, go, g_ref);
        EXPECT_LT(rel_err(dx_f.data, dx_ref.data), 2e-2) << "grad input vs oracle";
        EXPECT_LT(rel_err(g_fused.router_weight.data, g_ref.router_weight.data), 2e-2) << "router vs oracle";
        EXPECT_LT(rel_err(flat(g_fused.fc1), flat(g_ref.fc1)), 2e-2) << "fc1 vs oracle";
    }
}

// The gated activation fused into fc1's forward epilogue (grouped_gemm_nt_glu_forward, the own TMA kernel) against
// the unfused layer on the own kernel, with the fused run's kernel forced to the own one or left to the per-shape
// choice (which fuses on the own kernel): the same fc1 output and activation, so the output and every gradient
// bitwise equal, and against the CPU oracle; and with both epilogue fusions on.
TEST(CudaLayer, FusedActivationForwardMatchesUnfused) {
    SKIP_WITHOUT_SM90();
    for (const bool own : {true, false})
    for (const char* act : {"silu", "gelu"}) {
        SCOPED_TRACE(::testing::Message() << act << (own ? " own TMA kernel" : " per-shape choice"));
        const auto [c, w, in, go] = glu_layer_case(act, 37);
        auto run = [&](int fuse_forward, int fuse_backward, MoeWeights<float>& g, int gather = 1) {
            cuda::set_grouped_gemm_kernel(own || !fuse_forward ? cuda::GroupedGemmKernel::kTma
                                                               : cuda::GroupedGemmKernel::kAuto);
            cuda::set_glu_forward_fusion(fuse_forward);
            cuda::set_glu_backward_fusion(fuse_backward);
            cuda::set_fc1_gather(gather);  // fc1's loads gathering the token rows (no permute pass), or not
            auto gpu = cuda::make_cuda_layer_runner(c);
            const Matrix<float> out = gpu->forward(w, in);
            const Matrix<float> dx = gpu->backward(w, go, g);
            return std::make_pair(out, dx);
        };
        MoeWeights<float> g_fused = zeros_like(w), g_plain = zeros_like(w), g_both = zeros_like(w);
        MoeWeights<float> g_ref = zeros_like(w), g_permuted = zeros_like(w);
        const auto [out_f, dx_f] = run(1, 0, g_fused);
        const auto [out_p, dx_p] = run(0, 0, g_plain);
        const auto [out_b, dx_b] = run(1, 1, g_both);
        const auto [out_n, dx_n] = run(1, 0, g_permuted, 0);  // fused, rows permuted by dispatch
        cuda::set_glu_forward_fusion(-1);
        cuda::set_glu_backward_fusion(-1);
        cuda::set_fc1_gather(-1);
        cuda::set_grouped_gemm_kernel(cuda::GroupedGemmKernel::kAuto);
        EXPECT_EQ(out_n.data, out_p.data) << "output, not gathered";
        EXPECT_EQ(dx_n.data, dx_p.data) << "grad input, not gathered";
        EXPECT_EQ(flat(g_permuted.fc1), flat(g_plain.fc1)) << "fc1 grads, not gathered";
        EXPECT_EQ(out_f.data, out_p.data) << "output";
        EXPECT_EQ(dx_f.data, dx_p.data) << "grad input";
        EXPECT_EQ(flat(g_fused.fc1), flat(g_plain.fc1)) << "fc1 grads";
        EXPECT_EQ(flat(g_fused.fc2), flat(g_plain.fc2)) << "fc2 grads";
        EXPECT_EQ(g_fused.router_weight.data, g_plain.router_weight.data) << "grad router weight";
        EXPECT_EQ(out_b.data, out_p.data) << "output, both fusions";
        EXPECT_LT(rel_err(dx_b.data, dx_p.data), 1e-5) << "grad input, both fusions";
        cpu::MoeLayer<float> oracle(c);
        const Matrix<float> out_ref = oracle.forward(w, in);
        const Matrix<float> dx_ref = oracle.backward(w, go, g_ref);
        EXPECT_LT(rel_err(out_f.data, out_ref.data), 2e-2) << "output vs oracle";
        EXPECT_LT(rel_err(dx_f.data, dx_ref.data), 2e-2) << "grad input vs oracle";
        EXPECT_LT(rel_err(flat(g_fused.fc1), flat(g_ref.fc1)), 2e-2) << "fc1 vs oracle";
        EXPECT_LT(rel_err(flat(g_fused.fc2), flat(g_ref.fc2)), 2e-2) << "fc2 vs oracle";
    }
}

TEST(CudaLayer, UnsupportedOptionsAreClearErrors) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.add_bias_linear = true;
    EXPECT_THROW(cuda::CudaMoeLayer::create(c, 16, 2), ::moekit::UsageError);
}

// The route, aux-score and routing-plan kernels' shared memory grows with the expert count: past the GPU's limit the
// layer is refused at creation with a usage error naming --num-experts (exit 2), before a launch could fail.
TEST(CudaLayer, TooManyExpertsForSharedMemoryIsAUsageError) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    auto refusal = [&](int64_t experts, const char* dtype) {
        c.num_moe_experts = experts;
        c.moe_router_dtype = dtype;
        try {
            cuda::CudaMoeLayer::create(c, 16, 2);
            return std::string();
        } catch (const ::moekit::UsageError& e) {
            return std::string(e.what());
        }
    };
    const std::string fp32 = refusal(8192, "fp32");  // 9 bytes an expert a warp, four warps a block: 295 KB
    EXPECT_NE(fp32.find("--num-experts=8192"), std::string::npos) << fp32;
    EXPECT_NE(fp32.find("fp32 router"), std::string::npos) << fp32;
    const std::string fp64 = refusal(4096, "fp64");
    EXPECT_NE(fp64.find("--num-experts=4096"), std::string::npos) << fp64;
    EXPECT_EQ(refusal(4096, "fp32"), "") << "4096 experts fit the fp32 router (147 KB a block)";
}

// `moekit train` with varying shapes: the runner rebuilds its CudaMoeLayer when the token count
// changes and must carry the expert-bias counts and the global_aux_loss tracker across, as the CPU
// oracle's RouterState does. Steps of T = 32, 12, 32 tokens; the global aux loss of every step
// (which reads the running sum) and the final bias update must match the oracle.
TEST(CudaLayer, ShapeChangeKeepsBiasCountsAndGlobalAuxTracker) {
    SKIP_WITHOUT_GPU();
    const uint64_t seed = 31337;
    SCOPED_TRACE("seed=" + std::to_string(seed));
    MoeConfig c = small_config();
    c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
    c.moe_router_load_balancing_type = {"global_aux_loss"}, c.moe_aux_loss_coeff = {0.05};
    const MoeWeights<float> w = bf16_weights(c, seed);
    cpu::MoeLayer<float> oracle(c);
    auto gpu = cuda::make_cuda_layer_runner(c);
    int step = 0;
    for (const int64_t S : {16, 6, 16}) {
        MoeConfig cs = c;
        cs.seq_length = S;
        const LayerInput<float> in = bf16_input(cs, seed + uint64_t(step));
        const Matrix<float> go = random_matrix<float>(in.hidden.rows, in.hidden.cols, seed, 3 + step, 1.0);
        oracle.forward(w, in);
        gpu->forward(w, in);
        const double ga_ref = oracle.summary().losses.global_aux_loss, ga = gpu->summary().losses.global_aux_loss;
        ASSERT_GT(ga_ref, 0.0);
        EXPECT_NEAR(ga, ga_ref, 1e-5 * ga_ref) << "global aux loss at step " << step << " (S=" << S << ")";
        MoeWeights<float> g_ref = zeros_like(w), g = zeros_like(w);
        oracle.backward(w, go, g_ref);
        gpu->backward(w, go, g);
        ++step;
    }
    MoeWeights<float> w_ref = w, w_gpu = w;
    oracle.update_expert_bias(w_ref);
    gpu->update_expert_bias(w_gpu);
    EXPECT_EQ(w_gpu.expert_bias, w_ref.expert_bias) << "bias update after three steps of two shapes";
    EXPECT_NE(w_gpu.expert_bias, w.expert_bias);
}

}  // namespace
}  // namespace moekit::test
