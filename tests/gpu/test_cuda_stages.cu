// CUDA layer stage by stage against the CPU stage functions on the same inputs: router logits/probs
// (fp32 tolerance), routing map and top-k (exact), the routing plan and permuted rows (exact), the
// activation and combine (one bf16 rounding), loss values, the dense probs gradient (exact) and the
// router backward (fp32 tolerance). The GPU stage's own inputs are fed to the CPU stage, so each
// comparison isolates one stage. Jitter draws are checked through the logits (exact draws or the
// logits would differ by ~eps), Sinkhorn through its matrix against cpu::sinkhorn.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cpu/losses.h"
#include "cpu/experts.h"
#include "cpu/permute.h"
#include "cpu/router.h"
#include "core/activation_math.h"
#include "core/rng.h"
#include "cuda/activation.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/moe_layer.h"
#include "cuda/permute.cuh"
#include "cuda/router.cuh"
#include "cuda/sinkhorn.cuh"
#include "gpu/cuda_layer_test_util.h"

namespace moekit::test {
namespace {

using bf16 = __nv_bfloat16;

std::vector<bf16> bf16_of(const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __nv_bfloat16_raw{float_to_bf16_bits(v[i])};
    return out;
}
std::vector<float> float_of(const std::vector<bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_bits_to_float(__nv_bfloat16_raw(v[i]).x);
    return out;
}
std::vector<float> download_r(const void* p, int64_t n, bool fp64) {
    if (!fp64) return cuda::download(static_cast<const float*>(p), n);
    const std::vector<double> d = cuda::download(static_cast<const double*>(p), n);
    return std::vector<float>(d.begin(), d.end());
}
// n values uniform in [-scale, scale), each rounded to bf16 (so the CPU reference sees the kernels' inputs exactly).
std::vector<float> uniform_bf16(Rng& rng, int64_t n, double scale) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = round_to_bf16(float(scale * (2 * rng.uniform() - 1)));
    return v;
}
std::vector<int64_t> as_i64(const std::vector<int32_t>& v) {
    return std::vector<int64_t>(v.begin(), v.end());
}

void check_stages(MoeConfig c, bool padding) {
    const uint64_t seed = 4242;
    SCOPED_TRACE("seed=" + std::to_string(seed));
    c.normalize();
    c.validate();
    const int64_t S = c.seq_length, B = c.micro_batch_size, T = S * B, H = c.hidden_size, E = c.num_experts();
    const int64_t k = c.moe_router_topk;
    const MoeWeights<float> w = bf16_weights(c, seed);
    LayerInput<float> in = bf16_input(c, seed);
    in.jitter_seed = 777;
    in.padding_mask.assign(size_t(T), 0);
    if (padding)
        for (int64_t t = 0; t < T; ++t) in.padding_mask[size_t(t)] = t % 4 == 1;

    auto layer = cuda::CudaMoeLayer::create(c, S, B);
    const cuda::LayerBuffers& b = layer->buffers();
    const bool fp64 = layer->shape().router_fp64;
    cuda::upload(b.hidden, bf16_of(in.hidden.data));
    cuda::upload(b.padding_mask, in.padding_mask);
    cuda::upload(b.jitter_seed, std::vector<uint64_t>{in.jitter_seed});
    cuda::upload(b.router_weight, bf16_of(w.router_weight.data));
    std::vector<float> fc1, fc2;
    for (int64_t e = 0; e < E; ++e) {
        fc1.insert(fc1.end(), w.fc1[size_t(e)].data.begin(), w.fc1[size_t(e)].data.end());
        fc2.insert(fc2.end(), w.fc2[size_t(e)].data.begin(), w.fc2[size_t(e)].data.end());
    }
    cuda::upload(b.fc1, bf16_of(fc1));
    cuda::upload(b.fc2, bf16_of(fc2));
    if (c.moe_router_enable_expert_bias) {
        if (fp64) cuda::upload(static_cast<double*>(b.expert_bias), w.expert_bias);
        else cuda::upload(static_cast<float*>(b.expert_bias), std::vector<float>(w.expert_bias.begin(), w.expert_bias.end()));
    }
    const Matrix<float> grad_out = random_matrix<float>(T, H, seed, 2, 1.0);
    cuda::upload(b.grad_output, bf16_of(grad_out.data));
    layer->forward(nullptr, true);
    layer->backward(nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());

    // ---- router ----
    cpu::RouterState state;
    cpu::RouterContext<float> rc;
    cpu::router_forward(c, w.router_weight, w.expert_bias, in, state, rc);
    EXPECT_LT(rel_err(download_r(b.logits, T * E, fp64), rc.logits.data), 1e-5) << "logits";
    EXPECT_LT(rel_err(download_r(b.probs, T * E, fp64), rc.probs.data), 1e-5) << "probs";
    const std::vector<uint8_t> map = cuda::download(b.routing_map, T * E);
    ASSERT_EQ(map, rc.routing_map) << "routing map";
    EXPECT_EQ(as_i64(cuda::download(b.topk_idx, T * k)), rc.topk_idx) << "top-k indices";
    if (b.sinkhorn) {
        // Valid rows of the device matrix vs cpu::sinkhorn on the same (CPU) logits, both fp32.
        std::vector<float> got, want;
        Matrix<float> valid_logits(0, E);
        const std::vector<float> all = cuda::download(b.sinkhorn, T * E);
        for (int64_t t = 0; t < T; ++t) {
            if (in.padding_mask[size_t(t)]) continue;
            got.insert(got.end(), all.begin() + t * E, all.begin() + (t + 1) * E);
            valid_logits.data.insert(valid_logits.data.end(), rc.logits.row(t), rc.logits.row(t) + E);
            ++valid_logits.rows;
        }
        want = cpu::sinkhorn(valid_logits).data;
        // Same iteration, fp32 column sums in another order: ~1e-6; one iteration more or less
        // would still be within the 1e-4 convergence tolerance.
        const double err = rel_err(got, want);
        EXPECT_LT(err, 1e-3) << "sinkhorn matrix";
        std::printf("  sinkhorn matrix rel err %.2e (T=%lld E=%lld)\n", err, (long long)T, (long long)E);
    }
    const LossValues lv = layer->read_losses();
    EXPECT_NEAR(lv.aux_loss, rc.losses.aux_loss, 1e-5 * std::abs(rc.losses.aux_loss) + 1e-9);
    EXPECT_NEAR(lv.seq_aux_loss, rc.losses.seq_aux_loss, 1e-5 * std::abs(rc.losses.seq_aux_loss) + 1e-9);
    EXPECT_NEAR(lv.z_loss, rc.losses.z_loss, 1e-5 * std::abs(rc.losses.z_loss) + 1e-9);

    // ---- plan and permute (exact) ----
    const cpu::RoutingPlan<float> plan = cpu::build_routing_plan(rc.routing_map, rc.probs, T, E);
    const int64_t N = plan.num_rows();
    EXPECT_EQ(as_i64(cuda::download(b.counts, E)), plan.tokens_per_expert);
    EXPECT_EQ(as_i64(cuda::download(b.offsets, E + 1)), plan.offsets);
    EXPECT_EQ(as_i64(cuda::download(b.row_token, N)), plan.row_token);
    EXPECT_EQ(as_i64(cuda::download(b.token_offsets, T + 1)), plan.token_offsets);
    EXPECT_EQ(as_i64(cuda::download(b.token_rows, N)), plan.token_rows);
    EXPECT_LT(rel_err(download_r(b.row_prob, N, fp64), plan.permuted_probs), 1e-5) << "permuted probs";
    const Matrix<float> rows_ref = cpu::permute(in.hidden, plan);
    EXPECT_EQ(float_of(cuda::download(b.rows, N * H)), rows_ref.data) << "permuted rows";

    // ---- activation x probs on the GPU's fc1 output: one bf16 rounding apart ----
    const cpu::MlpShape ms = cpu::expert_mlp_shape(c);
    const std::vector<float> h1 = float_of(cuda::download(b.fc1_out, N * ms.fc1_rows()));
    const std::vector<float> gpu_p = download_r(b.row_prob, N, fp64);
    std::vector<float> act_ref(size_t(N * ms.ffn));
    for (int64_t r = 0; r < N; ++r)
        for (int64_t f = 0; f < ms.ffn; ++f) {
            const float g = h1[size_t(r * ms.fc1_rows() + f)];
            const float a = ms.gated ? glu_forward(ms.activation, g, h1[size_t(r * ms.fc1_rows() + ms.ffn + f)])
                                     : activation_forward(ms.activation, g);
            act_ref[size_t(r * ms.ffn + f)] = a * gpu_p[size_t(r)];
        }
    EXPECT_LT(rel_err(float_of(cuda::download(b.act_out, N * ms.ffn)), act_ref), 4e-3) << "activation";

    // ---- combine of the GPU's expert rows ----
    Matrix<float> y(N, H);
    y.data = float_of(cuda::download(b.expert_out, N * H));
    const Matrix<float> out_ref = cpu::unpermute(y, plan);
    EXPECT_LT(rel_err(float_of(cuda::download(b.output, T * H)), out_ref.data), 4e-3) << "combine";

    // ---- backward: dense probs gradient (exact) and router backward (fp32) ----
    const std::vector<float> grow = download_r(b.grad_row_probs, N, fp64);
    const Matrix<float> gp_ref = cpu::permute_probs_backward(grow, plan);
    const std::vector<float> gp = download_r(b.grad_probs, T * E, fp64);
    EXPECT_EQ(gp, gp_ref.data) << "dense probs gradient";
    ASSERT_GT(norm(gp), 0.0);
    Matrix<float> gh, gw;
    cpu::router_backward(c, w.router_weight, rc, gp_ref, gh, gw);
    EXPECT_LT(rel_err(cuda::download(b.grad_router_weight, E * H), gw.data), 1e-4) << "router weight grad";
}

// The activation backward and forward on their own against a double reference on the same bf16 inputs, at output
// widths that take each row mapping and vector width of the kernels (a warp a row: 40, 520, 768 and 1024 with the
// forward loading one to four 8-wide vectors a lane first, 520 leaving most lanes' last one out, the backward
// looping 8-wide; 1030 scalar; a block a row: 2048 and 4104 4-wide, 6150 scalar), gated SwiGLU / GeGLU with and
// without probs, ungated GELU; rows past *num_rows untouched.
void check_activation_backward(int64_t F, bool gated, Activation act, bool with_probs, uint64_t seed) {
    SCOPED_TRACE(::testing::Message() << "F=" << F << " gated=" << gated << " act=" << activation_name(act)
                                      << " probs=" << with_probs);
    const int64_t N = 37, rows = 33, in_cols = gated ? 2 * F : F;
    Rng rng(seed);
    const std::vector<float> fc1 = uniform_bf16(rng, N * in_cols, 2.0), go = uniform_bf16(rng, N * F, 2.0);
    std::vector<float> probs(static_cast<size_t>(N));
    for (auto& p : probs) p = float(rng.uniform());
    cuda::DeviceBuffer<bf16> d_fc1(N * in_cols), d_go(N * F), d_grad(N * in_cols);
    cuda::DeviceBuffer<float> d_probs(N), d_dp(N);
    cuda::DeviceBuffer<int32_t> d_rows(1);
    d_fc1.upload(bf16_of(fc1)), d_go.upload(bf16_of(go)), d_probs.upload(probs);
    d_rows.upload({int32_t(rows)});
    const std::vector<float> sentinel(size_t(N * in_cols), 5.0f);
    d_grad.upload(bf16_of(sentinel));
    d_dp.upload(std::vector<float>(size_t(N), 9.0f));
    cuda::activation_backward<float>(cuda::ActivationShape{N, F, gated, act}, d_rows.get(), d_fc1.get(),
                                     with_probs ? d_probs.get() : nullptr, d_go.get(), d_grad.get(), d_dp.get(),
                                     nullptr);
    cuda::DeviceBuffer<bf16> d_out(N * F);
    d_out.upload(bf16_of(std::vector<float>(size_t(N * F), 5.0f)));
    cuda::activation_forward<float>(cuda::ActivationShape{N, F, gated, act}, d_rows.get(), d_fc1.get(),
                                    with_probs ? d_probs.get() : nullptr, d_out.get(), nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = float_of(cuda::download(d_out.get(), N * F));
    std::vector<float> out_ref(static_cast<size_t>(rows * F));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t f = 0; f < F; ++f) {
            const double g = fc1[size_t(r * in_cols + f)], p = with_probs ? probs[size_t(r)] : 1.0;
            const double a = gated ? glu_forward(act, g, double(fc1[size_t(r * in_cols + F + f)]))
                                   : activation_forward(act, g);
            out_ref[size_t(r * F + f)] = float(a * p);
        }
    EXPECT_LT(rel_err(std::vector<float>(out.begin(), out.begin() + rows * F), out_ref), 4e-3) << "forward";
    for (int64_t i = rows * F; i < N * F; ++i) ASSERT_EQ(out[size_t(i)], 5.0f) << "forward row past num_rows written";
    const std::vector<float> grad = float_of(cuda::download(d_grad.get(), N * in_cols));
    const std::vector<float> dp = cuda::download(d_dp.get(), N);
    std::vector<float> grad_ref(static_cast<size_t>(rows * in_cols)), dp_ref(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
        const double p = with_probs ? probs[size_t(r)] : 1.0;
        double dpr = 0;
        for (int64_t f = 0; f < F; ++f) {
            const double g = fc1[size_t(r * in_cols + f)], o = go[size_t(r * F + f)], da = o * p;
            if (gated) {
                const double u = fc1[size_t(r * in_cols + F + f)];
                double dg, du;
                glu_backward(act, g, u, da, &dg, &du);
                grad_ref[size_t(r * in_cols + f)] = float(dg), grad_ref[size_t(r * in_cols + F + f)] = float(du);
                dpr += glu_forward(act, g, u) * o;
            } else {
                grad_ref[size_t(r * in_cols + f)] = float(da * activation_grad(act, g));
                dpr += activation_forward(act, g) * o;
            }
        }
        dp_ref[size_t(r)] = float(dpr);
    }
    const std::vector<float> got(grad.begin(), grad.begin() + rows * in_cols), got_dp(dp.begin(), dp.begin() + rows);
    EXPECT_LT(rel_err(got, grad_ref), 4e-3) << "d fc1 (one bf16 rounding)";
    EXPECT_LT(rel_err(got_dp, dp_ref), 2e-5) << "d prob (fp32 sums of up to 2048 terms)";
    for (int64_t i = rows * in_cols; i < N * in_cols; ++i) ASSERT_EQ(grad[size_t(i)], 5.0f) << "row past num_rows written";
    for (int64_t r = rows; r < N; ++r) ASSERT_EQ(dp[size_t(r)], 9.0f) << "d prob past num_rows written";
}

// The fp32 router's gating linear on bf16 tensor cores (RouterShape::tensor_core_linear) and on fp32 cuBLAS GEMMs
// of upcast copies, each against a double reference on the same bf16 x, W and fp32 grad logits: logits, dW
// (overwritten and accumulated) and dX (+=). Grad logits span 2^-20..2^20 with full 24-bit significands, so a
// split that dropped its mid or lo part would miss by 2^-9 or 2^-17 relative; both paths must sit at fp32 rounding.
// E = 24, H = 136: the split four experts a thread and W copied 16 bytes at a time; E = 23, H = 130: one by one.
void check_gating_linear(bool tensor_cores, bool accumulate, uint64_t seed, int64_t E, int64_t H) {
    SCOPED_TRACE(::testing::Message() << "tensor cores " << tensor_cores << " accumulate " << accumulate << " E " << E
                                      << " H " << H);
    const int64_t T = 300;
    cuda::RouterShape s;
    s.num_tokens = T, s.seq_length = T, s.num_experts = E, s.hidden = H, s.topk = 2;
    s.tensor_core_linear = tensor_cores;
    Rng rng(seed);
    const std::vector<float> x = uniform_bf16(rng, T * H, 1.0), w = uniform_bf16(rng, E * H, 1.0);
    std::vector<float> gl(static_cast<size_t>(T * E)), gx0(static_cast<size_t>(T * H)), gw0(static_cast<size_t>(E * H));
    for (auto& v : gl) v = std::ldexp(float(2 * rng.uniform() - 1), int(rng.uniform() * 40) - 20);
    for (auto& v : gx0) v = float(2 * rng.uniform() - 1);
    for (auto& v : gw0) v = float(2 * rng.uniform() - 1);
    cuda::DeviceBuffer<bf16> d_x(T * H), d_w(E * H), d_split(T * 3 * E), d_w3(3 * E * H);
    cuda::DeviceBuffer<float> d_xr(T * H), d_wr(E * H), d_logits(T * E), d_probs(T * E), d_gl(T * E), d_gx(T * H);
    cuda::DeviceBuffer<float> d_gw(E * H), d_gw3(3 * E * H);
    cuda::DeviceBuffer<int32_t> d_topk(T * 2);
    cuda::DeviceBuffer<uint8_t> d_map(T * E), d_pad(T);
    d_x.upload(bf16_of(x)), d_w.upload(bf16_of(w)), d_gl.upload(gl), d_gx.upload(gx0), d_gw.upload(gw0);
    d_pad.upload(std::vector<uint8_t>(size_t(T), 0));
    cuda::RouterTensors<float> t;
    t.hidden = d_x.get(), t.weight = d_w.get(), t.hidden_r = d_xr.get(), t.weight_r = d_wr.get();
    t.logits = d_logits.get(), t.topk_idx = d_topk.get(), t.probs = d_probs.get(), t.routing_map = d_map.get();
    t.padding_mask = d_pad.get();
    t.grad_logits_split = d_split.get(), t.weight3 = d_w3.get(), t.grad_weight3 = d_gw3.get();
    cublasHandle_t h = nullptr;
    MOEKIT_CUBLAS_CHECK(cublasCreate(&h));
    cuda::router_forward<float>(s, t, h, nullptr);
    cuda::router_backward_linear<float>(s, t, d_gl.get(), d_gw.get(), d_gx.get(), d_xr.get(), h, nullptr, accumulate);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    MOEKIT_CUBLAS_CHECK(cublasDestroy(h));
    std::vector<float> logits_ref(static_cast<size_t>(T * E)), gw_ref(static_cast<size_t>(E * H)),
        gx_ref(static_cast<size_t>(T * H));
    for (int64_t i = 0; i < T; ++i)
        for (int64_t e = 0; e < E; ++e) {
            double acc = 0;
            for (int64_t k = 0; k < H; ++k) acc += double(x[size_t(i * H + k)]) * w[size_t(e * H + k)];
            logits_ref[size_t(i * E + e)] = float(acc);
        }
    for (int64_t e = 0; e < E; ++e)
        for (int64_t k = 0; k < H; ++k) {
            double acc = accumulate ? gw0[size_t(e * H + k)] : 0.0;
            for (int64_t i = 0; i < T; ++i) acc += double(gl[size_t(i * E + e)]) * x[size_t(i * H + k)];
            gw_ref[size_t(e * H + k)] = float(acc);
        }
    for (int64_t i = 0; i < T; ++i)
        for (int64_t k = 0; k < H; ++k) {
            double acc = gx0[size_t(i * H + k)];
            for (int64_t e = 0; e < E; ++e) acc += double(gl[size_t(i * E + e)]) * w[size_t(e * H + k)];
            gx_ref[size_t(i * H + k)] = float(acc);
        }
    const double e_logits = rel_err(cuda::download(d_logits.get(), T * E), logits_ref);
    const double e_gw = rel_err(cuda::download(d_gw.get(), E * H), gw_ref);
    const double e_gx = rel_err(cuda::download(d_gx.get(), T * H), gx_ref);
    std::printf("  gating linear (%s%s): rel err logits %.2e dW %.2e dX %.2e\n", tensor_cores ? "tensor cores" : "fp32",
                accumulate ? ", accumulate" : "", e_logits, e_gw, e_gx);
    EXPECT_LT(e_logits, 2e-6) << "logits";
    EXPECT_LT(e_gw, 2e-6) << "router weight grad";
    EXPECT_LT(e_gx, 2e-6) << "grad input";
}

TEST(CudaStages, GatingLinearOnTensorCoresAtFp32Accuracy) {
    SKIP_WITHOUT_GPU();
    uint64_t seed = 900;
    for (bool tc : {true, false})
        for (bool acc : {false, true}) check_gating_linear(tc, acc, ++seed, 24, 136);
    for (bool acc : {false, true}) check_gating_linear(true, acc, ++seed, 23, 130);
}

TEST(CudaStages, ActivationBackwardAtEveryVectorWidth) {
    SKIP_WITHOUT_GPU();
    uint64_t seed = 500;
    for (int64_t F : {40, 520, 768, 1030, 1024, 2048, 4104, 6150}) {
        check_activation_backward(F, true, Activation::silu, true, ++seed);
        check_activation_backward(F, true, Activation::gelu, false, ++seed);
        check_activation_backward(F, false, Activation::gelu, true, ++seed);
    }
}

TEST(CudaStages, SoftmaxPostAuxZ) {
    SKIP_WITHOUT_GPU();
    check_stages(small_config(), false);
}

TEST(CudaStages, SigmoidBiasGroupsSeqAuxFp64) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
    c.moe_router_num_groups = 4, c.moe_router_group_topk = 2, c.moe_router_topk = 4;
    c.moe_router_topk_scaling_factor = 2.5, c.moe_router_dtype = "fp64";
    c.moe_router_load_balancing_type = {"seq_aux_loss"}, c.moe_aux_loss_coeff = {0.02};
    check_stages(c, false);
}

TEST(CudaStages, PreSoftmaxK1Gelu) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_router_topk = 1, c.moe_router_pre_softmax = true, c.gated_linear_unit = false, c.activation_func = "gelu";
    check_stages(c, false);
}

TEST(CudaStages, CapacityDropAndPadWithPaddingMask) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_expert_capacity_factor = 0.5;
    check_stages(c, true);
    c.moe_pad_expert_input_to_capacity = true, c.moe_token_drop_policy = "position";
    check_stages(c, true);
}

TEST(CudaStages, JitterSoftmaxPost) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_input_jitter_eps = 0.1;
    check_stages(c, true);
}

TEST(CudaStages, SinkhornK1WithPaddingAndJitter) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_router_topk = 1, c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
    c.moe_input_jitter_eps = 0.02;
    check_stages(c, true);
}

TEST(CudaStages, SinkhornK2Fp64ManyTokensAndExperts) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.moe_router_topk = 2, c.moe_router_load_balancing_type = {"sinkhorn"}, c.moe_aux_loss_coeff = {0.0};
    c.moe_router_dtype = "fp64", c.num_moe_experts = 48, c.seq_length = 300;  // T = 600 > 1024 / E row groups
    check_stages(c, false);
}

// The device Sinkhorn kernel alone on shapes the layer tests do not reach: many rows (column
// partial sums over row groups), more experts than threads (the one-thread-per-column branch),
// padding rows left out. Logits drawn at logit scale ~2 so the iteration takes many steps.
TEST(CudaStages, SinkhornKernelMatchesCpu) {
    SKIP_WITHOUT_GPU();
    struct Shape {
        int64_t T, E;
    };
    for (const Shape sh : {Shape{4096, 8}, Shape{37, 1500}, Shape{1000, 1}}) {
        const uint64_t seed = 99 + uint64_t(sh.T);
        SCOPED_TRACE("T=" + std::to_string(sh.T) + " E=" + std::to_string(sh.E) + " seed=" + std::to_string(seed));
        const Matrix<float> logits = random_matrix<float>(sh.T, sh.E, seed, 5, 2.0);
        std::vector<uint8_t> mask(size_t(sh.T), 0);
        for (int64_t t = 0; t < sh.T; ++t) mask[size_t(t)] = t % 7 == 2;
        cuda::DeviceBuffer<float> d_logits(sh.T * sh.E), d_out(sh.T * sh.E), d_d0(sh.T);
        cuda::DeviceBuffer<uint8_t> d_mask(sh.T);
        d_logits.upload(logits.data);
        d_mask.upload(mask);
        cuda::sinkhorn_forward<float>(sh.T, sh.E, d_logits.get(), d_mask.get(), d_out.get(), d_d0.get(), nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> all = d_out.download();
        Matrix<float> valid(0, sh.E);
        std::vector<float> got;
        for (int64_t t = 0; t < sh.T; ++t) {
            if (mask[size_t(t)]) {
                for (int64_t e = 0; e < sh.E; ++e) EXPECT_EQ(all[size_t(t * sh.E + e)], 0.0f) << "padding row " << t;
                continue;
            }
            got.insert(got.end(), all.begin() + t * sh.E, all.begin() + (t + 1) * sh.E);
            valid.data.insert(valid.data.end(), logits.row(t), logits.row(t) + sh.E);
            ++valid.rows;
        }
        const std::vector<float> want = cpu::sinkhorn(valid).data;
        ASSERT_GT(norm(want), 0.0);
        const double err = rel_err(got, want);
        EXPECT_LT(err, 1e-3) << "sinkhorn matrix (tolerance: see check_stages)";
        std::printf("  sinkhorn kernel T=%lld E=%lld rel err %.2e\n", (long long)sh.T, (long long)sh.E, err);
    }
}

// The routing plan against cpu::build_routing_plan on random maps, exactly: token counts on either side of the
// plan's chunks (32, 64 and 128 tokens), experts fewer and more than a block's threads and not a multiple of the
// 16-byte loads, so many experts that the staged slice shrinks the chunk (2500: 8 tokens) or needs more than the
// default 48 KB of shared memory (20000), tokens routed nowhere (padding, dropped) and to every expert, one expert
// taking all tokens.
TEST(CudaStages, RoutingPlanMatchesCpuAcrossChunks) {
    SKIP_WITHOUT_GPU();
    struct Shape {
        int64_t T, E, k;
        bool hot;  // every token also routed to expert 0
    };
    for (const Shape sh : {Shape{1, 1, 1, false}, Shape{127, 8, 2, false}, Shape{128, 16, 16, false},
                           Shape{129, 3, 1, true}, Shape{1000, 128, 8, false}, Shape{5000, 300, 6, true},
                           Shape{9000, 40, 4, true}, Shape{16384, 128, 8, false}, Shape{777, 64, 0, false},
                           Shape{4096, 256, 8, true}, Shape{200, 7, 3, true}, Shape{300, 2500, 8, false},
                           Shape{40, 20000, 8, true}}) {
        const uint64_t seed = 7 + uint64_t(sh.T * 31 + sh.E);
        SCOPED_TRACE("T=" + std::to_string(sh.T) + " E=" + std::to_string(sh.E) + " seed=" + std::to_string(seed));
        Rng rng(seed);
        std::vector<uint8_t> map(size_t(sh.T * sh.E), 0);
        Matrix<float> probs(sh.T, sh.E);
        for (auto& p : probs.data) p = float(rng.uniform());
        for (int64_t t = 0; t < sh.T; ++t) {
            const int64_t k = t % 11 == 3 ? 0 : sh.k;  // some tokens routed nowhere
            for (int64_t j = 0; j < k; ++j) map[size_t(t * sh.E + int64_t(rng.uniform() * double(sh.E)) % sh.E)] = 1;
            if (sh.hot) map[size_t(t * sh.E)] = 1;
        }
        const cpu::RoutingPlan<float> want = cpu::build_routing_plan(map, probs, sh.T, sh.E);
        const int64_t N = want.num_rows(), M = std::max<int64_t>(N, 1);
        cuda::DeviceBuffer<uint8_t> d_map(sh.T * sh.E);
        cuda::DeviceBuffer<float> d_probs(sh.T * sh.E), row_prob(M);
        cuda::DeviceBuffer<int32_t> counts(sh.E), offsets(sh.E + 1), rank(sh.T * sh.E), row_token(M),
            token_offsets(sh.T + 1), token_rows(M), token_counts(sh.T),
            scratch(cuda::routing_plan_scratch_elems(sh.T, sh.E));
        d_map.upload(map);
        d_probs.upload(probs.data);
        cuda::RoutingPlan<float> p;
        p.num_tokens = sh.T, p.num_experts = sh.E, p.max_rows = M;
        p.counts = counts.get(), p.offsets = offsets.get(), p.rank = rank.get(), p.row_token = row_token.get();
        p.row_prob = row_prob.get(), p.token_offsets = token_offsets.get(), p.token_rows = token_rows.get();
        p.token_counts = token_counts.get(), p.chunk_scratch = scratch.get();
        cuda::build_routing_plan<float>(d_map.get(), d_probs.get(), p, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_EQ(as_i64(counts.download()), want.tokens_per_expert);
        ASSERT_EQ(as_i64(offsets.download()), want.offsets);
        ASSERT_EQ(as_i64(token_offsets.download()), want.token_offsets);
        std::vector<int32_t> rt = row_token.download(), tr = token_rows.download();
        rt.resize(size_t(N)), tr.resize(size_t(N));
        EXPECT_EQ(as_i64(rt), want.row_token);
        EXPECT_EQ(as_i64(tr), want.token_rows);
        std::vector<float> rp = row_prob.download();
        rp.resize(size_t(N));
        EXPECT_EQ(rp, want.permuted_probs);
        // rank[t, e] (where routed) = the row's place inside its expert
        const std::vector<int32_t> rk = rank.download();
        for (int64_t t = 0; t < sh.T; ++t)
            for (int64_t j = want.token_offsets[size_t(t)]; j < want.token_offsets[size_t(t + 1)]; ++j) {
                const int64_t row = want.token_rows[size_t(j)];
                const int64_t e = std::upper_bound(want.offsets.begin(), want.offsets.end(), row) - want.offsets.begin() - 1;
                ASSERT_TRUE(map[size_t(t * sh.E + e)]);
                ASSERT_EQ(rk[size_t(t * sh.E + e)], row - want.offsets[size_t(e)]) << "t=" << t << " e=" << e;
            }
    }
}

// The permuted rows against cpu::permute, exactly, at row widths of less than one 16-byte vector a thread, one,
// two and more (a thread walking its vectors), rows not made of 16-byte vectors (the element-wise kernel), tokens
// routed nowhere, and a row buffer shorter than the plan (rows past it are not written).
TEST(CudaStages, PermuteRowsAtEveryRowWidth) {
    SKIP_WITHOUT_GPU();
    for (const int64_t H : {int64_t(24), int64_t(2048), int64_t(2056), int64_t(4096), int64_t(7168), int64_t(8200),
                            int64_t(20)}) {
        const int64_t T = 3001, E = 16, k = 3;
        SCOPED_TRACE("H=" + std::to_string(H));
        Rng rng(uint64_t(91 + H));
        std::vector<uint8_t> map(size_t(T * E), 0);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < (t % 7 == 2 ? 0 : k); ++j)
                map[size_t(t * E + int64_t(rng.uniform() * double(E)) % E)] = 1;
        Matrix<float> probs(T, E), tokens(T, H);
        for (auto& v : probs.data) v = float(rng.uniform());
        for (auto& v : tokens.data) v = float(rng.uniform() * 2.0 - 1.0);
        tokens.data = float_of(bf16_of(tokens.data));  // as the device holds them
        const cpu::RoutingPlan<float> want = cpu::build_routing_plan(map, probs, T, E);
        const Matrix<float> rows_ref = cpu::permute(tokens, want);
        const int64_t N = want.num_rows(), M = N - 5;  // the last 5 rows fall past the buffer
        cuda::DeviceBuffer<uint8_t> d_map(T * E);
        cuda::DeviceBuffer<float> d_probs(T * E), row_prob(N);
        cuda::DeviceBuffer<int32_t> counts(E), offsets(E + 1), rank(T * E), row_token(N), token_offsets(T + 1),
            token_rows(N), token_counts(T), scratch(cuda::routing_plan_scratch_elems(T, E));
        cuda::DeviceBuffer<bf16> d_tokens(T * H), d_rows(N * H);
        d_map.upload(map);
        d_probs.upload(probs.data);
        d_tokens.upload(bf16_of(tokens.data));
        const std::vector<bf16> sentinel(size_t(N * H), __float2bfloat16(-7.0f));
        d_rows.upload(sentinel);
        cuda::RoutingPlan<float> p;
        p.num_tokens = T, p.num_experts = E, p.max_rows = N;
        p.counts = counts.get(), p.offsets = offsets.get(), p.rank = rank.get(), p.row_token = row_token.get();
        p.row_prob = row_prob.get(), p.token_offsets = token_offsets.get(), p.token_rows = token_rows.get();
        p.token_counts = token_counts.get(), p.chunk_scratch = scratch.get();
        cuda::build_routing_plan<float>(d_map.get(), d_probs.get(), p, nullptr);
        p.max_rows = M;
        cuda::permute_rows<float>(p, H, d_tokens.get(), d_rows.get(), nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> got = float_of(d_rows.download());
        for (int64_t r = 0; r < N; ++r)
            for (int64_t h = 0; h < H; ++h) {
                const float w = r < M ? rows_ref.data[size_t(r * H + h)] : -7.0f;
                ASSERT_EQ(got[size_t(r * H + h)], w) << "row " << r << " column " << h;
            }
    }
}

// Device time of the one-block Sinkhorn loop at preset-like shapes (not a correctness test: run with
// --gtest_also_run_disabled_tests). Router-like logits (std 1).
TEST(CudaStages, DISABLED_SinkhornTiming) {
    SKIP_WITHOUT_GPU();
    struct Shape {
        int64_t T, E;
    };
    for (const Shape sh : {Shape{8192, 8}, Shape{4096, 32}, Shape{16384, 128}}) {
        const Matrix<float> logits = random_matrix<float>(sh.T, sh.E, 5, 5, 1.0);
        cuda::DeviceBuffer<float> d_logits(sh.T * sh.E), d_out(sh.T * sh.E), d_d0(sh.T);
        cuda::DeviceBuffer<uint8_t> d_mask(sh.T);
        d_logits.upload(logits.data);
        auto run = [&] {
            cuda::sinkhorn_forward<float>(sh.T, sh.E, d_logits.get(), d_mask.get(), d_out.get(), d_d0.get(), nullptr);
        };
        run();
        cudaEvent_t a, b;
        MOEKIT_CUDA_CHECK(cudaEventCreate(&a));
        MOEKIT_CUDA_CHECK(cudaEventCreate(&b));
        MOEKIT_CUDA_CHECK(cudaEventRecord(a));
        for (int i = 0; i < 3; ++i) run();
        MOEKIT_CUDA_CHECK(cudaEventRecord(b));
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        std::printf("  sinkhorn kernel T=%lld E=%lld: %.3f ms\n", (long long)sh.T, (long long)sh.E, ms / 3);
        cudaEventDestroy(a), cudaEventDestroy(b);
    }
}

TEST(CudaStages, SqrtSoftplusAllExpertsOneToken) {
    SKIP_WITHOUT_GPU();
    MoeConfig c = small_config();
    c.seq_length = 1, c.micro_batch_size = 1;  // T = 1: E - k experts get zero tokens
    c.moe_router_score_function = "sqrtsoftplus";
    check_stages(c, false);
}

}  // namespace
}  // namespace moekit::test
