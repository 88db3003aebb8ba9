// safetensors reader/writer (src/io/safetensors.cpp) and the Megatron-named weight mapping
// (src/io/weights_io.cpp): round trips of every dtype and the metadata; each kind of malformed file
// gives a UsageError naming the file and the problem; missing / misshapen / non-float weights.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "io/safetensors.h"
#include "moekit/error.h"
#include "moekit/weights.h"

namespace moekit {
namespace {

// Deterministic non-trivial bytes for a tensor (BOOL gets 0/1).
HostTensor make_tensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
    HostTensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.bytes.resize(size_t(t.numel()) * dtype_size(dtype));
    uint32_t x = seed * 2654435761u + 1;
    for (auto& b : t.bytes) {
        x = x * 1664525u + 1013904223u;
        b = dtype == DType::boolean ? uint8_t((x >> 13) & 1) : uint8_t(x >> 24);
    }
    return t;
}

std::string message_of(const std::vector<uint8_t>& bytes) {
    try {
        parse_safetensors(bytes, "f.safetensors");
    } catch (const UsageError& e) {
        return e.what();
    }
    return "(no error)";
}

// A file from a raw header string and a data buffer of `data_bytes` zero bytes.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
    std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
    for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
    std::memcpy(out.data() + 8, header.data(), header.size());
    return out;
}

TEST(Safetensors, RoundTripEveryDtypeAndMetadata) {
    std::map<std::string, HostTensor> tensors;
    uint32_t seed = 1;
    for (DType d : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8, DType::boolean})
        tensors[std::string("t_") + dtype_name(d)] = make_tensor(d, {3, 5}, seed++);
    tensors["scalar"] = make_tensor(DType::f32, {}, 99);
    tensors["empty"] = make_tensor(DType::f32, {0, 4}, 100);
    tensors["rank3"] = make_tensor(DType::bf16, {2, 3, 4}, 101);
    const std::map<std::string, std::string> metadata = {{"config", "{\"a\": 1}"}, {"format", "pt"}};

    const auto path = (std::filesystem::temp_directory_path() / "moekit_test_roundtrip.safetensors").string();
    write_safetensors(path, tensors, metadata);
    const SafetensorsFile back = read_safetensors(path);
    std::filesystem::remove(path);
    EXPECT_EQ(back.metadata, metadata);
    ASSERT_EQ(back.tensors.size(), tensors.size());
    for (const auto& [name, t] : tensors) {
        const HostTensor& b = back.tensors.at(name);
        EXPECT_EQ(b.dtype, t.dtype) << name;
        EXPECT_EQ(b.shape, t.shape) << name;
        EXPECT_EQ(b.bytes, t.bytes) << name;  // bit for bit
    }
    EXPECT_EQ(back.tensors.at("scalar").numel(), 1);
    EXPECT_NE(back.tensors.at("t_F32").bytes, std::vector<uint8_t>(60, 0));  // non-trivial data
}

TEST(Safetensors, HeaderLayoutFollowsTheSpec) {
    const auto bytes =
        serialize_safetensors({{"b", make_tensor(DType::f32, {2}, 1)}, {"a", make_tensor(DType::u8, {3}, 2)}});
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[size_t(i)];
    EXPECT_EQ(n % 8, 0u);  // data 8-byte aligned
    const std::string header(bytes.begin() + 8, bytes.begin() + 8 + long(n));
    EXPECT_NE(header.find("\"a\":{\"data_offsets\":[0,3],\"dtype\":\"U8\",\"shape\":[3]}"), std::string::npos)
        << header;
    EXPECT_NE(header.find("\"b\":{\"data_offsets\":[3,11],\"dtype\":\"F32\",\"shape\":[2]}"), std::string::npos)
        << header;
    EXPECT_EQ(bytes.size(), 8 + n + 11);
}

TEST(Safetensors, MalformedFilesGivePreciseErrors) {
    EXPECT_EQ(message_of({1, 2, 3}),
              "f.safetensors: too short for a safetensors file (3 bytes; it starts with an 8-byte header length)");
    EXPECT_EQ(message_of(raw_file("{}", 0)), "(no error)");
    auto truncated = serialize_safetensors({{"x", make_tensor(DType::f32, {4}, 1)}});
    truncated.resize(truncated.size() - 4);
    EXPECT_EQ(message_of(truncated),
              "f.safetensors: tensor 'x': data_offsets [0, 16] run past the data buffer (12 bytes)");
    auto long_header = raw_file("{}", 0);
    long_header[0] = 200;
    EXPECT_EQ(message_of(long_header),
              "f.safetensors: header length 200 exceeds the file (10 bytes): truncated or not a safetensors file");
    EXPECT_NE(message_of(raw_file("{\"x\": ", 0)).find("f.safetensors: the 6-byte header is not valid JSON"),
              std::string::npos);
    EXPECT_EQ(message_of(raw_file("[1, 2]", 0)), "f.safetensors: the header is not a JSON object");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                                      "x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                  16)),
              "f.safetensors: tensor name 'x' appears twice in the header");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8)),
              "f.safetensors: tensor 'x': unknown dtype 'F33'");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})", 2)),
              "f.safetensors: tensor 'x': dtype I8 is not supported by moekit (F64 F32 BF16 F16 I64 I32 U8 BOOL)");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
              "f.safetensors: tensor 'x': data_offsets [0, 8] hold 8 bytes but shape [3] x F32 needs 12");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)),
              "f.safetensors: tensor 'x': data_offsets [0, 8] run past the data buffer (4 bytes)");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)),
              "f.safetensors: tensor 'x': data_offsets [8, 0] end before they begin");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)),
              "f.safetensors: tensor 'x': shape [-2] must hold non-negative integers");
    EXPECT_EQ(message_of(raw_file(R"({"x":{"dtype":"F32","shape":[2]}})", 8)),
              "f.safetensors: tensor 'x': missing \"data_offsets\"");
    EXPECT_EQ(message_of(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                                      "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  12)),
              "f.safetensors: tensors 'a' and 'b' overlap in the data buffer (at byte 4)");
    EXPECT_EQ(message_of(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)),
              "f.safetensors: bytes [0, 4) of the data buffer belong to no tensor (holes are invalid)");
    EXPECT_EQ(message_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8)),
              "f.safetensors: bytes [4, 8) at the end of the data buffer belong to no tensor");
    EXPECT_EQ(message_of(raw_file(R"({"__metadata__":{"k":1}})", 0)),
              "f.safetensors: __metadata__ value of 'k' is not a string: 1");
    auto bad_bool = raw_file(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", 2);
    bad_bool.back() = 7;
    EXPECT_EQ(message_of(bad_bool), "f.safetensors: tensor 'm': BOOL value 7 is neither 0 nor 1");
    try {
        read_safetensors("/nonexistent/w.safetensors");
        ADD_FAILURE() << "read a missing file";
    } catch (const UsageError& e) {
        EXPECT_EQ(std::string(e.what()).rfind("/nonexistent/w.safetensors: cannot open", 0), 0u) << e.what();
    }
}

// Random corruption (byte flips anywhere, truncation) must give a clean UsageError or a valid file,
// never a crash or another exception type. Seed fixed; 3000 mutations take a few ms.
TEST(Safetensors, CorruptedFilesFailCleanly) {
    const auto good = serialize_safetensors({{"a", make_tensor(DType::f32, {3, 2}, 1)},
                                             {"b", make_tensor(DType::boolean, {5}, 2)},
                                             {"c", make_tensor(DType::bf16, {2, 2}, 3)}},
                                            {{"k", "v"}});
    uint32_t x = 12345;
    auto next = [&] { return x = x * 1664525u + 1013904223u; };
    int rejected = 0;
    for (int trial = 0; trial < 3000; ++trial) {
        auto bytes = good;
        if (trial % 3 == 0) {
            bytes.resize(next() % bytes.size());
        } else {
            for (int flips = 1 + int(next() % 3); flips > 0; --flips) {
                const size_t at = trial % 3 == 1 ? next() % std::min<size_t>(bytes.size(), 120) : next() % bytes.size();
                bytes[at] = uint8_t(next() >> 24);
            }
        }
        try {
            parse_safetensors(bytes, "fuzz");
        } catch (const UsageError&) {
            ++rejected;
        } catch (const std::exception& e) {
            FAIL() << "trial " << trial << " (seed 12345): " << e.what();
        }
    }
    EXPECT_GT(rejected, 1000);  // the mutations do reach the checks
}

// ---- weights_to_tensors / weights_from_tensors ----

MoeConfig small_config() {
    MoeConfig c;
    c.hidden_size = 4;
    c.num_moe_experts = 3;
    c.moe_ffn_hidden_size = 5;
    c.gated_linear_unit = true;
    c.moe_shared_expert_intermediate_size = 6;
    c.moe_shared_expert_gate = true;
    c.moe_router_score_function = "sigmoid";
    c.moe_router_enable_expert_bias = true;
    return c;
}

template <typename T>
Matrix<T> filled(int64_t r, int64_t c, double base) {
    Matrix<T> m(r, c);
    for (int64_t i = 0; i < m.size(); ++i) m.data[size_t(i)] = T(base + 0.01 * double(i) - 0.003 * double(i % 7));
    return m;
}

MoeWeights<double> small_weights(const MoeConfig& c) {
    const int64_t E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), S = c.shared_ffn();
    MoeWeights<double> w;
    w.router_weight = filled<double>(E, H, 0.1);
    w.expert_bias = {0.25, -0.5, 0.125};
    for (int64_t e = 0; e < E; ++e) {
        w.fc1.push_back(filled<double>(2 * F, H, 0.3 + double(e)));
        w.fc2.push_back(filled<double>(H, F, -0.2 - double(e)));
    }
    w.shared_fc1 = filled<double>(2 * S, H, 0.7);
    w.shared_fc2 = filled<double>(H, S, 0.9);
    w.shared_gate = filled<double>(1, H, -0.4);
    return w;
}

std::string load_error(const MoeConfig& c, const std::map<std::string, HostTensor>& t) {
    try {
        weights_from_tensors<float>(c, t);
    } catch (const UsageError& e) {
        return e.what();
    }
    return "(no error)";
}

TEST(WeightsIo, MegatronNamesAndRoundTrip) {
    const MoeConfig c = small_config();
    const MoeWeights<double> w = small_weights(c);
    const auto tensors = weights_to_tensors(w, DType::f64);
    std::vector<std::string> names;
    for (const auto& [name, t] : tensors) names.push_back(name);
    EXPECT_EQ(names, (std::vector<std::string>{
                         "experts.local_experts.0.linear_fc1.weight", "experts.local_experts.0.linear_fc2.weight",
                         "experts.local_experts.1.linear_fc1.weight", "experts.local_experts.1.linear_fc2.weight",
                         "experts.local_experts.2.linear_fc1.weight", "experts.local_experts.2.linear_fc2.weight",
                         "router.expert_bias", "router.weight", "shared_experts.gate_weight",
                         "shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"}));
    EXPECT_EQ(tensors.at("router.expert_bias").dtype, DType::f32);  // an fp32 buffer upstream
    EXPECT_EQ(tensors.at("experts.local_experts.1.linear_fc1.weight").shape, (std::vector<int64_t>{10, 4}));
    EXPECT_EQ(tensors.at("experts.local_experts.1.linear_fc2.weight").shape, (std::vector<int64_t>{4, 5}));

    const MoeWeights<double> back = weights_from_tensors<double>(c, tensors);
    EXPECT_EQ(back.router_weight.data, w.router_weight.data);  // F64 -> double is exact
    EXPECT_EQ(back.expert_bias, w.expert_bias);
    for (size_t e = 0; e < 3; ++e) {
        EXPECT_EQ(back.fc1[e].data, w.fc1[e].data);
        EXPECT_EQ(back.fc2[e].data, w.fc2[e].data);
    }
    EXPECT_EQ(back.shared_fc1.data, w.shared_fc1.data);
    EXPECT_EQ(back.shared_fc2.data, w.shared_fc2.data);
    EXPECT_EQ(back.shared_gate.data, w.shared_gate.data);

    // Through a file with a Megatron module prefix, which is detected.
    const auto bytes = serialize_safetensors(weights_to_tensors(w, DType::bf16, "decoder.layers.3.mlp."));
    const auto file = parse_safetensors(bytes, "w.safetensors");
    const MoeWeights<float> bf = weights_from_tensors<float>(c, file.tensors);
    EXPECT_NEAR(bf.fc2[2](3, 4), w.fc2[2](3, 4), 1e-2 * std::abs(w.fc2[2](3, 4)));  // bf16 keeps 8 bits
}

TEST(WeightsIo, ErrorsNameTensorAndExpectation) {
    const MoeConfig c = small_config();
    const auto good = weights_to_tensors(small_weights(c), DType::f32);
    EXPECT_EQ(load_error(c, good), "(no error)");

    auto t = good;
    t.erase("router.weight");
    EXPECT_EQ(load_error(c, t), "missing tensor 'router.weight' (expected [3, 4])");
    t = good;
    t.erase("experts.local_experts.2.linear_fc2.weight");
    EXPECT_EQ(load_error(c, t), "missing tensor 'experts.local_experts.2.linear_fc2.weight' (expected [4, 5])");
    t = good;
    t["router.weight"] = make_tensor(DType::f32, {4, 3}, 1);
    EXPECT_EQ(load_error(c, t), "tensor 'router.weight' has shape [4, 3], expected [3, 4]");
    t = good;
    t["router.weight"] = make_tensor(DType::i64, {3, 4}, 1);
    EXPECT_EQ(load_error(c, t), "tensor 'router.weight' has dtype I64, not a floating type (F32, F64, BF16, F16)");

    MoeConfig plain = c;
    plain.gated_linear_unit = false;
    EXPECT_EQ(load_error(plain, good),
              "tensor 'experts.local_experts.0.linear_fc1.weight' has shape [10, 4], expected "
              "[5, 4]; the file looks gated: pass --swiglu or --geglu");
    MoeConfig fewer = c;
    fewer.num_moe_experts = 2;
    fewer.moe_router_enable_expert_bias = false;
    t = good;
    t.erase("router.expert_bias");
    t["router.weight"] = make_tensor(DType::f32, {2, 4}, 1);
    EXPECT_EQ(load_error(fewer, t),
              "unexpected tensor 'experts.local_experts.2.linear_fc1.weight' [10, 4]: only 2 "
              "experts are configured (--num-experts)");
    MoeConfig no_bias = c;
    no_bias.moe_router_enable_expert_bias = false;
    EXPECT_EQ(load_error(no_bias, good),
              "unexpected tensor 'router.expert_bias' [3]: expert bias is off: pass --moe-router-enable-expert-bias");

    auto two_layers = weights_to_tensors(small_weights(c), DType::f32, "decoder.layers.0.mlp.");
    for (auto& [name, tensor] : weights_to_tensors(small_weights(c), DType::f32, "decoder.layers.1.mlp."))
        two_layers[name] = tensor;
    EXPECT_EQ(load_error(c, two_layers),
              "several MoE layers in one file (prefixes decoder.layers.0.mlp., "
              "decoder.layers.1.mlp.): choose one with --weights-prefix");
    EXPECT_EQ(weights_from_tensors<float>(c, two_layers, "decoder.layers.1.mlp.").fc1.size(), 3u);
}

}  // namespace
}  // namespace moekit
