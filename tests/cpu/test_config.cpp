// MoeConfig validation (megatron-moe.md §5.7) and the flag parser (src/core/flags.cpp, moe_flags.cpp):
// every rule gives an error naming the flag and the value; all violations are reported at once;
// unknown / unsupported flags, bad values, --config JSON with command-line overrides, and --help.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/flags.h"
#include "moekit/config.h"
#include "moekit/error.h"

namespace moekit {
namespace {

// A valid small layer: H=16, E=8, k=2, softmax, aux_loss.
MoeConfig valid_config() {
    MoeConfig c;
    c.hidden_size = 16;
    c.num_moe_experts = 8;
    c.moe_ffn_hidden_size = 32;
    return c;
}

// The validation errors as one string, to search in.
std::string errors_of(const MoeConfig& c) {
    std::string all;
    for (const auto& e : c.validation_errors()) all += e + "\n";
    return all;
}

#define EXPECT_ERROR(config, text) EXPECT_NE(errors_of(config).find(text), std::string::npos) << errors_of(config)

TEST(Config, ValidDefaultsPass) {
    EXPECT_EQ(errors_of(valid_config()), "");
    EXPECT_NO_THROW(valid_config().validate());
    MoeConfig c = valid_config();
    c.moe_ffn_hidden_size.reset();
    EXPECT_EQ(c.expert_ffn(), 64);  // 4H
    c.ffn_hidden_size = 48;
    EXPECT_EQ(c.expert_ffn(), 48);
    c.gated_linear_unit = true;
    EXPECT_EQ(c.fc1_rows(), 96);
}

TEST(Config, DefaultConfigNeedsShape) {
    MoeConfig c;  // Megatron defaults: no experts, no hidden size
    EXPECT_ERROR(c, "--hidden-size=0 must be > 0");
    EXPECT_ERROR(c, "--num-experts is required");
    EXPECT_THROW(c.validate(), UsageError);
}

TEST(Config, ShapeRules) {
    MoeConfig c = valid_config();
    c.num_moe_experts = 0;
    EXPECT_ERROR(c, "--num-experts=0 must be > 0");
    c = valid_config();
    c.num_moe_experts = 6;
    c.expert_model_parallel_size = 4;
    EXPECT_ERROR(c, "--num-experts=6 must be divisible by --expert-model-parallel-size=4");
    c = valid_config();
    c.num_moe_experts.reset();
    c.expert_model_parallel_size = 2;
    EXPECT_ERROR(c, "--expert-model-parallel-size=2 requires it");
    c = valid_config();
    c.moe_ffn_hidden_size = 0;
    EXPECT_ERROR(c, "--moe-ffn-hidden-size=0 must be > 0");
    c = valid_config();
    c.ffn_hidden_size = -3;
    EXPECT_ERROR(c, "--ffn-hidden-size=-3 must be > 0");
    c = valid_config();
    c.micro_batch_size = 0;
    EXPECT_ERROR(c, "--micro-batch-size=0 must be >= 1");
    c = valid_config();
    c.num_layers = 0;
    EXPECT_ERROR(c, "--num-layers=0 must be >= 1");
    c = valid_config();
    c.seq_length = -1;
    EXPECT_ERROR(c, "--seq-length=-1 must be >= 0");
    c = valid_config();
    c.expert_model_parallel_size = 0;
    EXPECT_ERROR(c, "--expert-model-parallel-size=0 must be >= 1");
}

TEST(Config, TopkRules) {
    MoeConfig c = valid_config();
    c.moe_router_topk = 10;
    EXPECT_ERROR(c, "--moe-router-topk=10 must not exceed --num-experts=8");
    c.moe_router_topk = 0;
    EXPECT_ERROR(c, "--moe-router-topk=0 must be >= 1");
    c = valid_config();
    c.moe_router_topk = 1;
    EXPECT_ERROR(c, "--moe-router-topk=1 with --moe-router-score-function=softmax requires --moe-router-pre-softmax");
    c.moe_router_pre_softmax = true;
    EXPECT_EQ(errors_of(c), "");
    c.moe_router_pre_softmax = false;
    c.moe_router_score_function = "sigmoid";  // k=1 is fine with sigmoid
    EXPECT_EQ(errors_of(c), "");
    c.moe_router_score_function = "softmax";
    c.moe_router_load_balancing_type = {"sinkhorn"};  // ... and with sinkhorn
    EXPECT_EQ(errors_of(c), "");
}

TEST(Config, RouterRules) {
    MoeConfig c = valid_config();
    c.moe_router_score_function = "tanh";
    EXPECT_ERROR(c, "--moe-router-score-function=tanh must be one of softmax, sigmoid, sqrtsoftplus");
    c = valid_config();
    c.moe_router_enable_expert_bias = true;
    EXPECT_ERROR(c, "--moe-router-enable-expert-bias requires --moe-router-score-function=sigmoid or sqrtsoftplus");
    c.moe_router_score_function = "sqrtsoftplus";
    EXPECT_EQ(errors_of(c), "");
    c = valid_config();
    c.moe_router_dtype = "bf16";
    EXPECT_ERROR(c, "--moe-router-dtype=bf16 must be fp32 or fp64");
    c = valid_config();
    c.moe_router_topk_scaling_factor = 0.0;
    EXPECT_ERROR(c, "--moe-router-topk-scaling-factor=0 must be a finite number > 0");
    c = valid_config();
    c.moe_input_jitter_eps = 1.5;
    EXPECT_ERROR(c, "--moe-input-jitter-eps=1.5 must be in (0, 1)");
    c = valid_config();
    c.moe_input_jitter_eps = 0.0;
    EXPECT_ERROR(c, "--moe-input-jitter-eps=0 must be in (0, 1)");
    c = valid_config();
    c.moe_loss_backward_scale = std::numeric_limits<double>::infinity();
    EXPECT_ERROR(c, "--moe-loss-backward-scale=inf must be finite");
    c = valid_config();
    c.moe_z_loss_coeff = -0.1;
    EXPECT_ERROR(c, "--moe-z-loss-coeff=-0.1 must be a finite number >= 0");
    c = valid_config();
    c.moe_router_bias_update_rate = -1;
    EXPECT_ERROR(c, "--moe-router-bias-update-rate=-1 must be a finite number >= 0");
}

TEST(Config, GroupLimitedRules) {
    MoeConfig c = valid_config();
    c.moe_router_group_topk = 2;
    EXPECT_ERROR(c, "--moe-router-group-topk=2 requires --moe-router-num-groups");
    c = valid_config();
    c.moe_router_num_groups = 4;
    EXPECT_ERROR(c, "--moe-router-num-groups=4 requires --moe-router-group-topk");
    c = valid_config();
    c.moe_router_num_groups = 3, c.moe_router_group_topk = 1;
    EXPECT_ERROR(c, "--num-experts=8 must be divisible by --moe-router-num-groups=3");
    c = valid_config();
    c.moe_router_num_groups = 2, c.moe_router_group_topk = 4, c.moe_router_topk = 4;
    EXPECT_ERROR(c, "--moe-router-group-topk=4 must not exceed --moe-router-num-groups=2");
    c = valid_config();
    c.moe_router_num_groups = 4, c.moe_router_group_topk = 4, c.moe_router_topk = 2;
    EXPECT_ERROR(c, "--moe-router-topk=2 must be >= --moe-router-group-topk=4");
    c = valid_config();  // 8 experts in 4 groups of 2; k=6 over group_topk=2 groups: 3 per group > 2
    c.moe_router_num_groups = 4, c.moe_router_group_topk = 2, c.moe_router_topk = 6;
    EXPECT_ERROR(c, "exceeds the 2 experts per group");
    c = valid_config();  // DeepSeek-V3-like: fine
    c.moe_router_num_groups = 4, c.moe_router_group_topk = 2, c.moe_router_topk = 4;
    EXPECT_EQ(errors_of(c), "");
}

TEST(Config, LoadBalancingRules) {
    MoeConfig c = valid_config();
    c.moe_router_load_balancing_type = {"aux_loss", "seq_aux_loss"};
    EXPECT_ERROR(c,
                 "--moe-aux-loss-coeff=0 has 1 value(s) but --moe-router-load-balancing-type=aux_loss "
                 "seq_aux_loss has 2");
    c.moe_aux_loss_coeff = {0.01, 0.001};
    EXPECT_EQ(errors_of(c), "");
    EXPECT_DOUBLE_EQ(c.aux_loss_coeff("seq_aux_loss"), 0.001);
    EXPECT_DOUBLE_EQ(c.aux_loss_coeff("global_aux_loss"), 0.0);
    c.moe_router_load_balancing_type = {"aux_loss", "bogus"};
    EXPECT_ERROR(c, "--moe-router-load-balancing-type=bogus is not a known type");
    c.moe_router_load_balancing_type = {"aux_loss", "aux_loss"};
    EXPECT_ERROR(c, "lists 'aux_loss' twice");
    c.moe_router_load_balancing_type = {"aux_loss", "sinkhorn"};
    EXPECT_ERROR(c, "'sinkhorn' cannot be combined with other types");
    c = valid_config();
    c.moe_router_load_balancing_type = {"sinkhorn"};
    c.moe_aux_loss_coeff = {0.01};
    EXPECT_ERROR(c, "--moe-aux-loss-coeff=0.01 must be 0 with --moe-router-load-balancing-type=sinkhorn");
    c = valid_config();
    c.moe_router_load_balancing_type = {"quantile_balancing"};
    EXPECT_ERROR(c, "quantile_balancing: not supported yet by moekit");
    c = valid_config();
    c.moe_aux_loss_coeff = {-1};
    EXPECT_ERROR(c, "--moe-aux-loss-coeff=-1 must be a finite number >= 0");
}

TEST(Config, CapacityRules) {
    MoeConfig c = valid_config();
    c.moe_pad_expert_input_to_capacity = true;
    EXPECT_ERROR(c, "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor");
    c.moe_expert_capacity_factor = 1.5;
    EXPECT_EQ(errors_of(c), "");
    c.moe_router_load_balancing_type = {"sinkhorn"};
    EXPECT_ERROR(c, "--moe-expert-capacity-factor=1.5 requires --moe-router-load-balancing-type in");
    c = valid_config();
    c.moe_expert_capacity_factor = -1.0;  // Megatron: negative means None, not an error
    EXPECT_EQ(errors_of(c), "");
    c.normalize();
    EXPECT_FALSE(c.moe_expert_capacity_factor.has_value());
    c.moe_expert_capacity_factor = 0.0;
    EXPECT_ERROR(c, "--moe-expert-capacity-factor=0 must be > 0");
    c = valid_config();
    c.moe_token_drop_policy = "random";
    EXPECT_ERROR(c, "--moe-token-drop-policy=random must be probs or position");
    c = valid_config();
    c.moe_token_dispatcher_type = "flex";
    EXPECT_ERROR(c, "--moe-token-dispatcher-type=flex: not supported yet by moekit");
    c.moe_token_dispatcher_type = "ring";
    EXPECT_ERROR(c, "--moe-token-dispatcher-type=ring must be one of allgather, alltoall, flex");
    c = valid_config();
    c.moe_token_dropping = true;
    EXPECT_ERROR(c, "--moe-token-dropping: not supported");
}

TEST(Config, ExpertAndSharedRules) {
    MoeConfig c = valid_config();
    c.activation_func = "tanh";
    EXPECT_ERROR(c, "--activation-func=tanh must be one of gelu, silu, relu, squared_relu");
    c = valid_config();
    c.add_bias_linear = true;
    EXPECT_ERROR(c, "--add-bias-linear: not supported yet by moekit");
    c = valid_config();
    c.moe_shared_expert_intermediate_size = 0;
    EXPECT_ERROR(c, "--moe-shared-expert-intermediate-size=0 must be > 0");
    c = valid_config();
    c.moe_shared_expert_gate = true;
    EXPECT_ERROR(c, "--moe-shared-expert-gate requires --moe-shared-expert-intermediate-size");
    c = valid_config();
    c.moe_shared_expert_intermediate_size = 32;
    c.moe_shared_expert_overlap = true;
    EXPECT_ERROR(c, "--moe-shared-expert-overlap requires --moe-token-dispatcher-type=alltoall");
    EXPECT_ERROR(c, "--moe-shared-expert-overlap: not supported yet by moekit");
    c = valid_config();
    c.init_method_std = 0;
    EXPECT_ERROR(c, "--init-method-std=0 must be a finite number > 0");
}

TEST(Config, AllViolationsReportedAtOnce) {
    MoeConfig c = valid_config();
    c.moe_router_topk = 10;
    c.moe_router_score_function = "tanh";
    c.moe_token_drop_policy = "random";
    EXPECT_EQ(c.validation_errors().size(), 3u) << errors_of(c);
    try {
        c.validate();
        FAIL() << "validate() accepted an invalid config";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("3 configuration errors"), std::string::npos) << m;
        EXPECT_NE(m.find("--moe-router-topk=10 must not exceed --num-experts=8"), std::string::npos) << m;
        EXPECT_NE(m.find("--moe-router-score-function=tanh"), std::string::npos) << m;
        EXPECT_NE(m.find("--moe-token-drop-policy=random"), std::string::npos) << m;
    }
}

// ---- flag parser ----

std::string usage_error(const std::vector<std::string>& args) {
    try {
        parse_moe_config(args);
    } catch (const UsageError& e) {
        return e.what();
    }
    return "(no error)";
}

const std::vector<std::string> kShape = {"--hidden-size", "16", "--num-experts", "8", "--moe-ffn-hidden-size", "32"};

std::vector<std::string> with_shape(std::vector<std::string> args) {
    args.insert(args.begin(), kShape.begin(), kShape.end());
    return args;
}

TEST(Flags, ParsesEveryKindOfValue) {
    MoeConfig c = parse_moe_config(
        with_shape({"--moe-router-topk=4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                    "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2,1e-3",
                    "--moe-expert-capacity-factor", "-1", "--moe-z-loss-coeff=0.001", "--swiglu", "--seed", "7",
                    "--moe-router-dtype", "fp64"}));
    EXPECT_EQ(c.hidden_size, 16);
    EXPECT_EQ(c.num_moe_experts, 8);
    EXPECT_EQ(c.moe_router_topk, 4);
    EXPECT_EQ(c.moe_router_score_function, "sigmoid");
    EXPECT_TRUE(c.moe_router_enable_expert_bias);
    EXPECT_EQ(c.moe_router_load_balancing_type, (std::vector<std::string>{"aux_loss", "seq_aux_loss"}));
    EXPECT_EQ(c.moe_aux_loss_coeff, (std::vector<double>{1e-2, 1e-3}));
    EXPECT_FALSE(c.moe_expert_capacity_factor.has_value());  // negative -> None
    EXPECT_EQ(c.moe_z_loss_coeff, 0.001);
    EXPECT_TRUE(c.gated_linear_unit);
    EXPECT_EQ(c.activation_func, "silu");
    EXPECT_EQ(c.seed, 7u);
    EXPECT_EQ(c.moe_router_dtype, "fp64");
}

TEST(Flags, BooleanForms) {
    EXPECT_TRUE(parse_moe_config(with_shape({"--moe-router-pre-softmax"})).moe_router_pre_softmax);
    EXPECT_TRUE(parse_moe_config(with_shape({"--moe-router-pre-softmax=true"})).moe_router_pre_softmax);
    EXPECT_FALSE(parse_moe_config(with_shape({"--no-moe-router-pre-softmax"})).moe_router_pre_softmax);
    EXPECT_FALSE(parse_moe_config(with_shape({"--moe-router-pre-softmax=0"})).moe_router_pre_softmax);
    EXPECT_EQ(usage_error(with_shape({"--moe-router-pre-softmax=maybe"})),
              "--moe-router-pre-softmax=maybe: expected a boolean (true or false)");
    MoeConfig g = parse_moe_config(with_shape({"--geglu", "--disable-bias-linear"}));
    EXPECT_TRUE(g.gated_linear_unit);
    EXPECT_EQ(g.activation_func, "gelu");
    EXPECT_FALSE(g.add_bias_linear);
    EXPECT_EQ(parse_moe_config(with_shape({"--squared-relu"})).activation_func, "squared_relu");
    EXPECT_EQ(usage_error(with_shape({"--swiglu", "--squared-relu"})),
              "--squared-relu cannot be combined with --swiglu");
}

TEST(Flags, BadValuesNameFlagAndType) {
    EXPECT_EQ(usage_error(with_shape({"--moe-router-topk", "two"})), "--moe-router-topk=two: expected an integer");
    EXPECT_EQ(usage_error(with_shape({"--moe-aux-loss-coeff", "0.1x"})),
              "--moe-aux-loss-coeff=0.1x: expected a number");
    EXPECT_EQ(usage_error(with_shape({"--moe-router-topk"})), "--moe-router-topk: expects a value (int)");
    EXPECT_EQ(usage_error(with_shape({"--moe-expert-capacity-factor", "--swiglu"})),
              "--moe-expert-capacity-factor: expects a value (float|None)");
    EXPECT_EQ(usage_error(with_shape({"--seed", "-1"})), "--seed=-1: expected a non-negative integer");
    EXPECT_EQ(usage_error(with_shape({"stray"})), "unexpected argument 'stray' (flags start with --)");
    EXPECT_EQ(usage_error(with_shape({"--swiglu=maybe"})), "--swiglu=maybe: expected a boolean (true or false)");
}

TEST(Flags, UnknownFlagSuggestsNearest) {
    EXPECT_EQ(usage_error(with_shape({"--moe-router-top-k", "2"})),
              "unknown flag --moe-router-top-k (did you mean --moe-router-topk?)");
    EXPECT_EQ(usage_error(with_shape({"--num-expert", "2"})),
              "unknown flag --num-expert (did you mean --num-experts?)");
    EXPECT_EQ(usage_error(with_shape({"--completely-unrelated-thing"})), "unknown flag --completely-unrelated-thing");
}

TEST(Flags, UnsupportedMegatronFlagsAreRefused) {
    for (const char* flag : {"--moe-permute-fusion", "--moe-router-padding-for-fp8", "--moe-shared-expert-overlap",
                             "--moe-token-dropping", "--add-bias-linear", "--expert-tensor-parallel-size",
                             "--moe-router-fusion", "--moe-latent-size", "--moe-flex-dispatcher-backend"}) {
        const std::string e = usage_error(with_shape({flag}));
        EXPECT_EQ(e.rfind(std::string(flag) + ": not supported yet by moekit", 0), 0u) << flag << ": " << e;
        EXPECT_EQ(usage_error(with_shape({std::string(flag) + "=1"})).rfind(flag, 0), 0u) << flag;
    }
}

TEST(Flags, ValidationRunsAfterParsing) {
    EXPECT_EQ(usage_error(with_shape({"--moe-router-topk", "10"})),
              "--moe-router-topk=10 must not exceed --num-experts=8");
}

class TempDir : public ::testing::Test {
   protected:
    std::filesystem::path dir;
    void SetUp() override {
        dir = std::filesystem::temp_directory_path() /
              ("moekit_test_config_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
        std::filesystem::create_directories(dir);
    }
    void TearDown() override { std::filesystem::remove_all(dir); }
    std::string write(const std::string& name, const std::string& text) {
        std::ofstream(dir / name) << text;
        return (dir / name).string();
    }
};

using ConfigFile = TempDir;

TEST_F(ConfigFile, JsonWithCommandLineOverride) {
    const std::string path = write("c.json", R"({"hidden-size": 16, "num_moe_experts": 8, "moe-ffn-hidden-size": 32,
        "moe_router_topk": 4, "moe-router-load-balancing-type": ["aux_loss", "z"], "moe_aux_loss_coeff": [0.1, 0.2],
        "moe_expert_capacity_factor": null, "swiglu": true, "moe_permute_fusion": false})");
    // The list is fixed by the command line; the explicit --moe-router-topk wins whatever the order.
    MoeConfig c = parse_moe_config(
        {"--moe-router-topk", "3", "--config", path, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"});
    EXPECT_EQ(c.hidden_size, 16);
    EXPECT_EQ(c.num_moe_experts, 8);
    EXPECT_EQ(c.moe_router_topk, 3);
    EXPECT_EQ(c.moe_aux_loss_coeff, (std::vector<double>{0.1, 0.2}));
    EXPECT_TRUE(c.gated_linear_unit);
}

TEST_F(ConfigFile, BadFilesNameFileAndKey) {
    EXPECT_EQ(usage_error({"--config", write("a.json", R"({"moe_router_topk": "two"})")}),
              (dir / "a.json").string() + ": --moe-router-topk=two: expected an integer");
    EXPECT_EQ(usage_error({"--config", write("b.json", R"({"moe_router_topkk": 2})")}),
              (dir / "b.json").string() + ": unknown key 'moe_router_topkk' (did you mean 'moe_router_topk'?)");
    EXPECT_NE(usage_error({"--config", write("c.json", "{not json")}).find("not valid JSON"), std::string::npos);
    EXPECT_EQ(usage_error({"--config", write("d.json", R"({"moe_permute_fusion": true})")}),
              (dir / "d.json").string() + ": --moe-permute-fusion: not supported yet by moekit");
    EXPECT_EQ(usage_error({"--config", write("e.json", R"({"moe_router_topk": [1, 2]})")}),
              (dir / "e.json").string() + ": moe_router_topk: expected a single int, got [1,2]");
    EXPECT_EQ(usage_error({"--config", (dir / "missing.json").string()}),
              "--config " + (dir / "missing.json").string() + ": cannot open the file");
}

TEST_F(ConfigFile, ToJsonRoundTripsEveryField) {
    MoeConfig c = parse_moe_config(
        with_shape({"--moe-router-score-function", "sigmoid", "--moe-router-topk", "3",
                    "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor", "1.25",
                    "--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate", "--moe-router-dtype",
                    "fp32", "--moe-z-loss-coeff", "1e-3", "--seed", "18446744073709551615", "--geglu"}));
    const nlohmann::json j = to_json(c);
    EXPECT_EQ(j.at("num_moe_experts"), 8);
    EXPECT_EQ(j.at("moe_expert_capacity_factor"), 1.25);
    EXPECT_TRUE(j.at("moe_input_jitter_eps").is_null());
    EXPECT_EQ(j.at("moe_router_load_balancing_type"), nlohmann::json({"aux_loss"}));
    EXPECT_EQ(j.size(), 44u);  // every MoeConfig field (38 + the 5 ECHO fields + force load balancing)
    MoeConfig back = parse_moe_config({"--config", write("r.json", j.dump())});
    EXPECT_EQ(to_json(back), j);
}

TEST(Flags, PrintConfigListsEveryField) {
    MoeConfig c = valid_config();
    std::FILE* f = std::tmpfile();
    ASSERT_NE(f, nullptr);
    print_config(c, f);
    std::rewind(f);
    std::string text;
    for (int ch; (ch = std::fgetc(f)) != EOF;) text += char(ch);
    std::fclose(f);
    const nlohmann::json j = to_json(c);
    for (const auto& [key, value] : j.items()) EXPECT_NE(text.find(key), std::string::npos) << key;
    EXPECT_NE(text.find("num_moe_experts"), std::string::npos);
}

TEST(Flags, HelpListsEveryFlagWithDefault) {
    MoeConfig c;
    FlagParser p("moekit test [flags]");
    add_moe_flags(p, c);
    std::string out_path;
    p.add("--out", &out_path, "output file");
    const std::string h = p.help();
    for (const auto& f : p.flags()) EXPECT_NE(h.find(f.name), std::string::npos) << f.name;
    EXPECT_NE(h.find("[default: 2]"), std::string::npos);  // --moe-router-topk
    EXPECT_NE(h.find("[default: aux_loss]"), std::string::npos);
    EXPECT_NE(h.find("[default: None]"), std::string::npos);
    EXPECT_NE(h.find("[default: 0.001]"), std::string::npos);  // bias update rate
    EXPECT_FALSE(p.parse({"--out", "x", "--help"}));           // --help prints and says "stop"
    EXPECT_TRUE(p.parse({"--out", "x"}));
    EXPECT_EQ(out_path, "x");
    EXPECT_TRUE(p.was_set("--out"));
    EXPECT_FALSE(p.was_set("--moe-router-topk"));
}

TEST(Config, ExpertRankCapacityFactorRules) {
    MoeConfig c = valid_config();
    c.moe_token_dispatcher_type = "alltoall";
    c.moe_expert_rank_capacity_factor = 1.5;
    EXPECT_EQ(errors_of(c), "");
    c.moe_token_dispatcher_type = "flex";  // flex is the budgeted dispatcher
    EXPECT_EQ(errors_of(c), "");
    for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
        c.moe_expert_rank_capacity_factor = bad;
        EXPECT_ERROR(c, "--moe-expert-rank-capacity-factor=");
        EXPECT_ERROR(c, "must be > 0 and finite");
    }
    c = valid_config();
    c.moe_expert_rank_capacity_factor = 2.0;  // default dispatcher: allgather
    EXPECT_ERROR(c, "--moe-expert-rank-capacity-factor requires --moe-token-dispatcher-type=alltoall or flex (got allgather");
    c.moe_token_dispatcher_type = "alltoall";
    c.moe_expert_capacity_factor = 1.0;
    c.moe_pad_expert_input_to_capacity = true;
    EXPECT_ERROR(c, "--moe-expert-rank-capacity-factor cannot be combined with --moe-pad-expert-input-to-capacity");
    c.moe_pad_expert_input_to_capacity = false;  // dropping without padding is fine with a budget
    EXPECT_EQ(errors_of(c), "");
}

TEST(Flags, ExpertRankCapacityFactorAndItsEchoAlias) {
    MoeConfig c = parse_moe_config(with_shape({"--moe-token-dispatcher-type", "flex", "--moe-expert-rank-capacity-factor", "1.25"}));
    EXPECT_EQ(c.moe_expert_rank_capacity_factor, 1.25);
    c = parse_moe_config(with_shape({"--moe-token-dispatcher-type", "alltoall", "--moe-received-token-capacity", "2"}));
    EXPECT_EQ(c.moe_expert_rank_capacity_factor, 2.0);
    EXPECT_EQ(to_json(c).at("moe_expert_rank_capacity_factor"), 2.0);
    EXPECT_EQ(usage_error(with_shape({"--moe-token-dispatcher-type", "alltoall", "--moe-received-token-capacity", "2",
                                      "--moe-expert-rank-capacity-factor", "2"})),
              "--moe-expert-rank-capacity-factor and --moe-received-token-capacity are the same setting: give one");
    EXPECT_NE(usage_error(with_shape({"--moe-expert-rank-capacity-factor", "0.5"})).find("(got allgather"),
              std::string::npos);
    EXPECT_NE(usage_error(with_shape({"--moe-token-dispatcher-type", "alltoall", "--moe-expert-rank-capacity-factor", "0"}))
                  .find("--moe-expert-rank-capacity-factor=0 must be > 0 and finite"),
              std::string::npos);
    EXPECT_NE(usage_error(with_shape({"--moe-token-dispatcher-type", "flex"})).find("--moe-token-dispatcher-type=flex"),
              std::string::npos);
}

}  // namespace
}  // namespace moekit
