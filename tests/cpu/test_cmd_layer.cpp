// `moekit layer` end to end (tools/cmd_layer.cpp), running the built binary MOEKIT_BINARY in a temp dir:
// --init random + --save-weights then --weights gives bitwise-identical results (fp32 and fp64); the
// results equal calling cpu::MoeLayer directly; bad flags, files and shapes exit with status 2 and say why;
// --device defaults to cuda only where a GPU is present (cpu vs cuda: tests/gpu/test_cuda_cmd_layer.cpp).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "core/rng.h"
#include "io/safetensors.h"
#include "moekit/layer.h"
#include "run_tool.h"
#include "scratch_dir.h"
#include "moekit/weights.h"

namespace moekit {
namespace {

using Result = testing_util::ToolResult;
Result run(const std::string& args) { return testing_util::run_tool("layer " + args); }

class CmdLayer : public testing_util::ScratchDirTest {
protected:
    CmdLayer() : ScratchDirTest("cmd_layer") {}
};

// --device cpu: these compare against the CPU reference bit for bit (the default would be cuda on a GPU host).
const std::string kShape = "--device cpu --hidden-size 16 --num-experts 4 --moe-ffn-hidden-size 8 ";
const std::string kMoe = "--swiglu --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-router-topk 2 ";

void expect_same_tensors(const SafetensorsFile& a, const SafetensorsFile& b, const std::set<std::string>& skip) {
    size_t compared = 0;
    for (const auto& [name, t] : a.tensors) {
        if (skip.count(name)) continue;
        ASSERT_TRUE(b.tensors.count(name)) << "missing " << name;
        const HostTensor& u = b.tensors.at(name);
        EXPECT_EQ(u.dtype, t.dtype) << name;
        EXPECT_EQ(u.shape, t.shape) << name;
        EXPECT_TRUE(u.bytes == t.bytes) << name << " differs";
        ++compared;
    }
    EXPECT_EQ(compared + skip.size(), std::max(a.tensors.size(), b.tensors.size()));
}

double abs_sum(const HostTensor& t) {
    double s = 0;
    for (double v : t.to_double()) s += std::abs(v);
    return s;
}

TEST_F(CmdLayer, InitSaveThenReloadIsBitwiseIdentical) {
    for (const char* dtype : {"fp32", "fp64"}) {
        SCOPED_TRACE(dtype);
        const std::string d = dtype;
        Result r1 = run("--init random --seed 3 --seq-length 6 --micro-batch-size 2 " + kShape + kMoe + "--dtype " + d +
                        " --save-weights " + path("w_" + d) + " --out " + path("r1_" + d));
        ASSERT_EQ(r1.status, 0) << r1.output;
        const SafetensorsFile first = read_safetensors(path("r1_" + d));
        // The generated input goes to a file of its own; the second run infers H, E, F from the weights.
        write_safetensors(path("x_" + d), {{"input", first.tensors.at("input")}});
        Result r2 = run("--weights " + path("w_" + d) + " --input " + path("x_" + d) + " --device cpu " + kMoe +
                        "--dtype " + d +
                        " --seed 3 --out " + path("r2_" + d));
        ASSERT_EQ(r2.status, 0) << r2.output;
        EXPECT_NE(r2.output.find("from the weights: --hidden-size=16 --num-experts=4 --moe-ffn-hidden-size=8"),
                  std::string::npos)
            << r2.output;
        const SafetensorsFile second = read_safetensors(path("r2_" + d));
        expect_same_tensors(first, second, {"input"});
        const DType want = d == "fp32" ? DType::f32 : DType::f64;
        EXPECT_EQ(second.tensors.at("output").dtype, want);
        EXPECT_EQ(second.tensors.at("output").shape, (std::vector<int64_t>{6, 2, 16}));
        EXPECT_EQ(second.tensors.at("probs").shape, (std::vector<int64_t>{12, 4}));
        EXPECT_EQ(second.tensors.at("routing_map").dtype, DType::boolean);
        EXPECT_EQ(second.tensors.at("tokens_per_expert").dtype, DType::i64);
        EXPECT_EQ(second.tensors.at("grad.experts.local_experts.3.linear_fc1.weight").shape,
                  (std::vector<int64_t>{16, 16}));
        EXPECT_GT(abs_sum(second.tensors.at("output")), 0.0);
        EXPECT_GT(abs_sum(second.tensors.at("grad.router.weight")), 0.0);
        EXPECT_GT(abs_sum(second.tensors.at("loss.aux_loss")), 0.0);
        EXPECT_NE(second.metadata.at("config").find("\"moe_router_topk\":2"), std::string::npos);
    }
}

TEST_F(CmdLayer, MatchesCallingTheLayerDirectly) {
    MoeConfig c;
    c.hidden_size = 12, c.num_moe_experts = 6, c.moe_ffn_hidden_size = 10, c.moe_router_topk = 3;
    c.moe_router_score_function = "sigmoid", c.moe_router_enable_expert_bias = true;
    c.moe_shared_expert_intermediate_size = 8, c.moe_shared_expert_gate = true;
    c.moe_router_load_balancing_type = {"seq_aux_loss"}, c.moe_aux_loss_coeff = {0.1};
    const int64_t S = 5, B = 3, H = 12;
    MoeWeights<float> w = init_weights<float>(c, 11);
    w.expert_bias = {0.01, -0.02, 0.0, 0.03, -0.01, 0.02};
    Rng rng(77);
    Matrix<float> x(S * B, H), g(S * B, H);
    for (auto& v : x.data) v = float(rng.normal());
    for (auto& v : g.data) v = float(rng.normal());
    std::vector<uint8_t> mask_bs(size_t(B * S), 0), mask_sb(size_t(S * B), 0);
    mask_bs[size_t(1 * S + 4)] = mask_bs[size_t(2 * S + 3)] = mask_bs[size_t(2 * S + 4)] = 1;  // padded tail tokens
    for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) mask_sb[size_t(s * B + b)] = mask_bs[size_t(b * S + s)];
    HostTensor mask;
    mask.dtype = DType::boolean, mask.shape = {B, S}, mask.bytes = mask_bs;
    write_safetensors(path("w"), weights_to_tensors(w, DType::f32, "decoder.layers.0.mlp."));
    write_safetensors(
        path("x"), {{"input", HostTensor::from_double({x.data.begin(), x.data.end()}, {S, B, H}, DType::f32)},
                    {"padding_mask", mask},
                    {"grad_output", HostTensor::from_double({g.data.begin(), g.data.end()}, {S, B, H}, DType::f32)}});
    Result r = run("--weights " + path("w") + " --input " + path("x") + " --out " + path("r") + " --device cpu" +
                   " --moe-router-topk 3 --moe-router-score-function sigmoid --moe-router-enable-expert-bias"
                   " --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.1 --seed 9");
    ASSERT_EQ(r.status, 0) << r.output;
    const SafetensorsFile got = read_safetensors(path("r"));

    cpu::MoeLayer<float> layer(c);
    LayerInput<float> in;
    in.hidden = x, in.seq_length = S, in.micro_batch_size = B, in.padding_mask = mask_sb, in.jitter_seed = 9;
    const Matrix<float> out = layer.forward(w, in);
    MoeWeights<float> grads = zeros_like(w);
    const Matrix<float> gin = layer.backward(w, g, grads);
    auto same = [&](const std::string& name, const std::vector<float>& want) {
        const auto have = got.tensors.at(name).to_double();
        ASSERT_EQ(have.size(), want.size()) << name;
        for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(float(have[i]), want[i]) << name << "[" << i << "]";
    };
    same("output", out.data);
    same("grad_input", gin.data);
    same("probs", layer.probs().data);
    same("grad.router.weight", grads.router_weight.data);
    same("grad.experts.local_experts.5.linear_fc2.weight", grads.fc2[5].data);
    same("grad.shared_experts.gate_weight", grads.shared_gate.data);
    const auto& map = got.tensors.at("routing_map").bytes;
    EXPECT_TRUE(std::equal(map.begin(), map.end(), layer.routing_map().begin()));
    const RoutingSummary summary = layer.summary();
    EXPECT_EQ(float(got.tensors.at("loss.seq_aux_loss").to_double()[0]), float(summary.losses.seq_aux_loss));
    EXPECT_GT(summary.losses.seq_aux_loss, 0.0);
    std::vector<double> tpe(summary.tokens_per_expert.begin(), summary.tokens_per_expert.end());
    EXPECT_EQ(got.tensors.at("tokens_per_expert").to_double(), tpe);
    EXPECT_EQ(got.metadata.at("grad_output"), path("x"));
    EXPECT_EQ(got.metadata.at("device"), "cpu");
}

TEST_F(CmdLayer, DeviceDefaultsToCudaOnlyWithAGpu) {
    const std::string base = "--init random --seq-length 4 --hidden-size 16 --num-experts 4 --moe-ffn-hidden-size 8 ";
    const bool gpu = cuda_device_available();
    Result r = run(base + "--out " + path("r"));
    ASSERT_EQ(r.status, 0) << r.output;
    const std::string want = gpu ? "cuda" : "cpu";
    EXPECT_NE(r.output.find("moekit layer: --device " + want + " (default: " +
                            (gpu ? "a GPU is present)" : "no GPU found)")),
              std::string::npos)
        << r.output;
    const SafetensorsFile got = read_safetensors(path("r"));
    EXPECT_EQ(got.metadata.at("device"), want);
    EXPECT_EQ(got.metadata.count("missing"), 0u);  // every device writes probs and routing_map
    EXPECT_EQ(got.tensors.at("probs").shape, (std::vector<int64_t>{4, 4}));
    EXPECT_EQ(got.tensors.at("routing_map").shape, (std::vector<int64_t>{4, 4}));

    // fp64 is the CPU reference's alone: without --device it runs there, with --device cuda it is refused.
    r = run(base + "--dtype fp64 --out " + path("r64"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("moekit layer: --device cpu (default: --dtype fp64 runs on cpu only)"), std::string::npos)
        << r.output;
    r = run(base + "--dtype fp64 --device cuda --out " + path("r64"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("--dtype fp64 runs on --device cpu only"), std::string::npos) << r.output;
    r = run(base + "--device tpu --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("--device=tpu: must be cpu or cuda"), std::string::npos) << r.output;
    if (!gpu) {
        r = run(base + "--device cuda --out " + path("r"));
        EXPECT_EQ(r.status, 2);
        EXPECT_NE(r.output.find("--device cuda: "), std::string::npos) << r.output;  // no CUDA build / no GPU
    }
}

TEST_F(CmdLayer, BadFlagsAndFilesExitWithStatus2) {
    const std::string init = "--init random --seq-length 4 " + kShape + "--out " + path("r") + " ";
    Result r = run(init + "--moe-router-top-k 2");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("unknown flag --moe-router-top-k (did you mean --moe-router-topk?)"), std::string::npos)
        << r.output;
    r = run(init + "--moe-permute-fusion");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("--moe-permute-fusion: not supported yet by moekit"), std::string::npos) << r.output;
    r = run(init + "--moe-router-topk 5");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("--moe-router-topk=5 must not exceed --num-experts=4"), std::string::npos) << r.output;
    r = run("--init random --seq-length 4 " + kShape);
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("--out is required"), std::string::npos) << r.output;

    // A weight file with one tensor removed, and an input of the wrong hidden size.
    ASSERT_EQ(run(init + "--save-weights " + path("w")).status, 0);
    auto weights = read_safetensors(path("w")).tensors;
    weights.erase("experts.local_experts.3.linear_fc2.weight");
    write_safetensors(path("w_missing"), weights);
    r = run("--weights " + path("w_missing") + " --seq-length 4 --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find(path("w_missing") + ": missing tensor 'experts.local_experts.3.linear_fc2.weight' "
                                                "(expected [16, 8])"),
              std::string::npos)
        << r.output;
    r = run("--weights " + path("w") + " --num-experts 8 --seq-length 4 --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("tensor 'router.weight' has shape [4, 16], expected [8, 16]"), std::string::npos)
        << r.output;

    write_safetensors(path("x_bad"),
                      {{"input", HostTensor::from_double(std::vector<double>(24, 0.5), {4, 1, 6}, DType::f32)}});
    r = run("--weights " + path("w") + " --input " + path("x_bad") + " --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("tensor 'input' has shape [4, 1, 6], expected [S, B, 16] (--hidden-size=16)"),
              std::string::npos)
        << r.output;
    write_safetensors(path("x_empty"), {{"input", HostTensor::from_double({}, {0, 2, 16}, DType::f32)}});
    r = run("--weights " + path("w") + " --input " + path("x_empty") + " --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("tensor 'input' has shape [0, 2, 16]: S and B must be > 0"), std::string::npos) << r.output;
    write_safetensors(path("x_typo"),
                      {{"hidden", HostTensor::from_double(std::vector<double>(16, 0.5), {1, 1, 16}, DType::f32)}});
    r = run("--weights " + path("w") + " --input " + path("x_typo") + " --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("unexpected tensor 'hidden' (this file may hold input, padding_mask, grad_output)"),
              std::string::npos)
        << r.output;
    r = run("--weights " + path("nonexistent") + " --out " + path("r"));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.output.find("cannot open"), std::string::npos) << r.output;

    // --config with the shape, an explicit flag overriding it; the resolved config lands in the metadata.
    std::FILE* cfg = std::fopen(path("c.json").c_str(), "w");
    std::fputs(R"({"hidden_size": 16, "num-experts": 4, "moe_ffn_hidden_size": 8, "moe_router_topk": 3})", cfg);
    std::fclose(cfg);
    r = run("--init random --seq-length 2 --config " + path("c.json") +
            " --moe-router-topk 1 --moe-router-pre-softmax "
            "--out " +
            path("rc"));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto meta = read_safetensors(path("rc")).metadata;
    EXPECT_NE(meta.at("config").find("\"moe_router_topk\":1"), std::string::npos) << meta.at("config");
    EXPECT_NE(meta.at("config").find("\"num_moe_experts\":4"), std::string::npos) << meta.at("config");

    r = run("--help");
    EXPECT_EQ(r.status, 0);
    EXPECT_NE(r.output.find("--moe-router-topk int"), std::string::npos);
    EXPECT_NE(r.output.find("--save-weights str"), std::string::npos);
}

}  // namespace
}  // namespace moekit
