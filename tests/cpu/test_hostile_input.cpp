// Hostile and careless input (issue 11), one test per finding, each failing on the code before the fix:
// non-finite values in `moekit layer` files, sizes that overflow or exceed memory, output paths equal to
// input paths, folders and devices given as files, repeated and conflicting flags, safetensors headers
// whose byte size wraps or that hide bytes after a NUL, the capacity factor 1e19 and --deterministic-mode.
// All refusals exit with status 2 and name the flag, file or tensor. Runs the built tool (MOEKIT_BINARY).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/checked_math.h"
#include "core/flags.h"
#include "core/host_memory.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "moekit/error.h"
#include "run_tool.h"
#include "scratch_dir.h"

namespace moekit {
namespace {

using Result = testing_util::ToolResult;
Result layer(const std::string& args) { return testing_util::run_tool("layer --device cpu " + args); }

class HostileInput : public testing_util::ScratchDirTest {
protected:
    HostileInput() : ScratchDirTest("hostile") {}

    // Random weights (--init random, seed printed) saved to w.safetensors and an input x.safetensors [S, 1, H].
    void make_files(uint64_t seed) {
        std::printf("seed %llu\n", (unsigned long long)seed);
        const Result r = layer(str("--init random --seed ", seed, " ", kShape, "--seq-length 6 --save-weights ",
                                   path("w.safetensors"), " --out ", path("r0.safetensors")));
        ASSERT_EQ(r.status, 0) << r.output;
        const SafetensorsFile first = read_safetensors(path("r0.safetensors"));
        write_safetensors(path("x.safetensors"), {{"input", first.tensors.at("input")}});
    }
    // Rewrites one float value of a tensor in a file.
    void poison(const std::string& file, const std::string& tensor, int64_t index, double value) {
        SafetensorsFile f = read_safetensors(path(file));
        HostTensor& t = f.tensors.at(tensor);
        std::vector<double> v = t.to_double();
        v[size_t(index)] = value;
        t = HostTensor::from_double(v, t.shape, t.dtype);
        write_safetensors(path(file), f.tensors, f.metadata);
    }
    static std::vector<uint8_t> bytes_of(const std::string& p) {
        std::ifstream in(p, std::ios::binary);
        return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    }

    const std::string kShape = "--hidden-size 8 --num-experts 4 --moe-ffn-hidden-size 8 --moe-aux-loss-coeff 1e-2 ";
};

bool has(const Result& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

// ---- 1. non-finite values ----

TEST_F(HostileInput, NaNInRouterWeightIsRefusedNamingTensorAndIndex) {
    make_files(1201);
    poison("w.safetensors", "router.weight", 9, std::nan(""));  // [1, 1] of [4, 8]
    const Result r = layer("--weights " + path("w.safetensors") + " --input " + path("x.safetensors") + " --out " +
                           path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "tensor 'router.weight' holds a non-finite value")) << r.output;
    EXPECT_TRUE(has(r, "at index 9 [1, 1]")) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("r.safetensors")));
}

TEST_F(HostileInput, InfInInputIsRefusedNamingTensorAndIndex) {
    make_files(1202);
    poison("x.safetensors", "input", 13, -std::numeric_limits<double>::infinity());
    const Result r = layer("--weights " + path("w.safetensors") + " --input " + path("x.safetensors") + " --out " +
                           path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "x.safetensors: tensor 'input' holds a non-finite value (-inf) at index 13 [1, 0, 5]"))
        << r.output;
}

TEST_F(HostileInput, NaNInExpertWeightIsRefused) {
    make_files(1203);
    poison("w.safetensors", "experts.local_experts.2.linear_fc2.weight", 0, std::nan(""));
    const Result r = layer("--weights " + path("w.safetensors") + " --seq-length 4 --out " + path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "tensor 'experts.local_experts.2.linear_fc2.weight' holds a non-finite value")) << r.output;
}

TEST_F(HostileInput, HugeInitStdIsRefusedNotRunAsNaN) {
    const Result r = layer("--init random " + kShape + "--seq-length 4 --init-method-std 1e300 --out " +
                           path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "--init-method-std=1e+300 is too large for fp32")) << r.output;
}

// 3e38 is finite in fp32 but overflows inside the layer: the results are refused, nothing is written.
TEST_F(HostileInput, InputThatOverflowsInsideTheLayerIsRefused) {
    make_files(1204);
    SafetensorsFile x = read_safetensors(path("x.safetensors"));
    HostTensor& t = x.tensors.at("input");
    t = HostTensor::from_double(std::vector<double>(size_t(t.numel()), 3e38), t.shape, t.dtype);
    write_safetensors(path("x.safetensors"), x.tensors);
    const Result r = layer("--weights " + path("w.safetensors") + " --input " + path("x.safetensors") +
                           " --moe-z-loss-coeff 1e-3 --out " + path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "is not finite")) << r.output;
    EXPECT_TRUE(has(r, "nothing was written")) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("r.safetensors")));
}

// An F64 value beyond fp32's range would become Inf when converted for an fp32 run.
TEST_F(HostileInput, F64ValueBeyondFp32IsRefused) {
    make_files(1205);
    SafetensorsFile x = read_safetensors(path("x.safetensors"));
    HostTensor& t = x.tensors.at("input");
    std::vector<double> v = t.to_double();
    v[2] = 1e300;
    t = HostTensor::from_double(v, t.shape, DType::f64);
    write_safetensors(path("x.safetensors"), x.tensors);
    const Result r = layer("--weights " + path("w.safetensors") + " --input " + path("x.safetensors") + " --out " +
                           path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "beyond the range of the compute dtype fp32")) << r.output;
}

// ---- 2. sizes ----

TEST_F(HostileInput, OverflowingSizesAreRefusedBeforeAnyAllocation) {
    const std::string big = "4611686018427387904";  // 2^62
    const struct {
        std::string flags, expect;
    } cases[] = {
        {"--hidden-size 8 --num-experts 4 --moe-ffn-hidden-size " + big + " --seq-length 4",
         "--moe-ffn-hidden-size=" + big},
        {"--hidden-size 8 --num-experts 4 --moe-shared-expert-intermediate-size " + big + " --seq-length 4",
         "--moe-shared-expert-intermediate-size=" + big},
        {"--hidden-size 8 --num-experts " + big + " --seq-length 4", "--num-experts=" + big},
        {"--hidden-size 8 --num-experts 4 --seq-length 4294967296 --micro-batch-size 4294967296",
         "--seq-length=4294967296 x --micro-batch-size=4294967296"},
        {"--hidden-size " + big + " --num-experts 4 --seq-length 4", "--hidden-size=" + big},
        // No overflow, but terabytes: the bound names the memory it would need.
        {"--hidden-size 8 --num-experts 268435456 --moe-ffn-hidden-size 64 --seq-length 4", "GiB"},
    };
    for (const auto& c : cases) {
        SCOPED_TRACE(c.flags);
        const auto start = std::chrono::steady_clock::now();
        const Result r = layer("--init random " + c.flags + " --out " + path("r.safetensors"));
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_EQ(r.status, 2) << r.output;
        EXPECT_TRUE(has(r, c.expect)) << r.output;
        EXPECT_LT(seconds, 10.0) << "refused only after working";
        EXPECT_FALSE(std::filesystem::exists(path("r.safetensors")));
    }
}

TEST_F(HostileInput, HostMemoryBoundNamesBothSizes) {
    MoeConfig c;
    c.hidden_size = 8;
    c.num_moe_experts = 4;
    EXPECT_NO_THROW(require_fits_in_host_memory(c, 16));
    c.num_moe_experts = int64_t(1) << 34;  // ~ 6 TiB of weights: more than this host
    try {
        require_fits_in_host_memory(c, 16);
        FAIL() << "no error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("but this host has"), std::string::npos) << e.what();
    }
}

TEST(CheckedMath, ReportsOverflowInsteadOfWrapping) {
    EXPECT_EQ(checked_mul(int64_t(1) << 32, int64_t(1) << 30), int64_t(1) << 62);
    EXPECT_FALSE(checked_mul(int64_t(1) << 32, int64_t(1) << 32));
    EXPECT_FALSE(checked_mul(-1, 4));
    EXPECT_FALSE(checked_product({int64_t(1) << 40, 1 << 20, 1 << 10}));
    EXPECT_EQ(checked_product({3, 5, 7}), 105);
    EXPECT_FALSE(checked_sum({INT64_MAX, 1}));
    EXPECT_FALSE(checked_product({std::nullopt, 1}));
}

TEST_F(HostileInput, DevZeroAsWeightsIsRefusedQuickly) {
    const auto start = std::chrono::steady_clock::now();
    const Result r = layer("--weights /dev/zero --seq-length 4 --out " + path("r.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_TRUE(has(r, "/dev/zero: is not a regular file")) << r.output;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

TEST_F(HostileInput, CapacityFactor1e19KeepsEveryToken) {
    const Result r = layer("--init random " + kShape + "--seq-length 8 --moe-expert-capacity-factor 1e19 --out " +
                           path("r.safetensors"));
    ASSERT_EQ(r.status, 0) << r.output;
    const SafetensorsFile f = read_safetensors(path("r.safetensors"));
    double routed = 0;
    for (double v : f.tensors.at("tokens_per_expert").to_double()) routed += v;
    EXPECT_EQ(routed, 8 * 2) << "every token kept (k = 2)";
}

// ---- 3. files ----

TEST_F(HostileInput, OutputPathEqualToAnInputIsRefusedAndTheInputKept) {
    make_files(1206);
    const auto weights_before = bytes_of(path("w.safetensors"));
    const auto input_before = bytes_of(path("x.safetensors"));
    const std::string w = " --weights " + path("w.safetensors"), x = " --input " + path("x.safetensors");
    const struct {
        std::string args, expect;
    } cases[] = {
        {w + x + " --out " + path("w.safetensors"), "--out and --weights name the same file"},
        // Another spelling of the same file: compared by canonical path.
        {w + x + " --out " + (dir / "." / "w.safetensors").string(), "--out and --weights name the same file"},
        {w + x + " --out " + path("x.safetensors"), "--out and --input name the same file"},
        {w + x + " --out " + path("r.safetensors") + " --save-weights " + path("r.safetensors"),
         "--out and --save-weights name the same file"},
        {w + x + " --out " + path("r.safetensors") + " --save-weights " + path("w.safetensors"),
         "--save-weights and --weights name the same file"},
        {w + x + " --out " + path("r.safetensors") + " --grad-output " + path("r.safetensors"),
         "--out and --grad-output name the same file"},
    };
    std::filesystem::create_hard_link(path("w.safetensors"), path("w_link.safetensors"));
    for (const auto& c : cases) {
        SCOPED_TRACE(c.args);
        const Result r = layer(c.args);
        EXPECT_EQ(r.status, 2) << r.output;
        EXPECT_TRUE(has(r, c.expect)) << r.output;
    }
    const Result link = layer(w + x + " --out " + path("w_link.safetensors"));
    EXPECT_EQ(link.status, 2) << "a hard link to the weights: " << link.output;
    EXPECT_TRUE(bytes_of(path("w.safetensors")) == weights_before) << "weights overwritten";
    EXPECT_TRUE(bytes_of(path("x.safetensors")) == input_before) << "input overwritten";
}

TEST_F(HostileInput, DirectoryGivenAsAFileExitsWith2) {
    make_files(1207);
    std::filesystem::create_directories(path("folder"));
    const Result as_weights = layer("--weights " + path("folder") + " --seq-length 4 --out " + path("r.safetensors"));
    EXPECT_EQ(as_weights.status, 2) << as_weights.output;
    EXPECT_TRUE(has(as_weights, "is a directory")) << as_weights.output;
    const Result as_input = layer("--weights " + path("w.safetensors") + " --input " + path("folder") + " --out " +
                                  path("r.safetensors"));
    EXPECT_EQ(as_input.status, 2) << as_input.output;
    const Result as_out = layer("--weights " + path("w.safetensors") + " --seq-length 4 --out " + path("folder"));
    EXPECT_EQ(as_out.status, 2) << as_out.output;
    EXPECT_TRUE(has(as_out, "--out " + path("folder") + ": is a directory")) << as_out.output;
    const Result no_folder =
        layer("--weights " + path("w.safetensors") + " --seq-length 4 --out " + path("missing/r.safetensors"));
    EXPECT_EQ(no_folder.status, 2) << no_folder.output;
    EXPECT_TRUE(has(no_folder, "does not exist")) << no_folder.output;
}

// write_safetensors goes through a temp file + rename: after a write the folder holds the file and nothing
// else, and a write that cannot happen leaves the earlier file as it was.
TEST_F(HostileInput, SafetensorsAreWrittenAtomically) {
    const HostTensor t = HostTensor::from_double({1, 2, 3}, {3}, DType::f32);
    write_safetensors(path("a.safetensors"), {{"t", t}});
    write_safetensors(path("a.safetensors"), {{"t", t}, {"u", t}});
    size_t files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
    EXPECT_EQ(files, 1u) << "a temporary file was left behind";
    EXPECT_EQ(read_safetensors(path("a.safetensors")).tensors.size(), 2u);
    std::filesystem::create_directories(path("taken"));
    EXPECT_THROW(write_safetensors(path("taken"), {{"t", t}}), UsageError);
    EXPECT_TRUE(std::filesystem::is_directory(path("taken")));
}

// ---- 4. safetensors headers ----

std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
    std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
    for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
    std::memcpy(out.data() + 8, header.data(), header.size());
    return out;
}

std::string parse_error(const std::vector<uint8_t>& bytes) {
    try {
        parse_safetensors(bytes, "f.safetensors");
    } catch (const UsageError& e) {
        return e.what();
    } catch (const std::exception& e) {
        return std::string("not a UsageError: ") + e.what();
    }
    return "(no error)";
}

TEST(SafetensorsHostile, ByteSizeThatWrapsIsAUsageError) {
    // 2^61 x 8 bytes = 2^64 = 0 mod 2^64: the old check accepted offsets [0, 0] and failed later (exit 1).
    const std::string e = parse_error(raw_file(R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0));
    EXPECT_NE(e.find("tensor 't': shape [2305843009213693952] x F64 is too large"), std::string::npos) << e;
    const std::string e2 =
        parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
    EXPECT_NE(e2.find("is too large"), std::string::npos) << e2;
}

TEST(SafetensorsHostile, HeaderWithBytesAfterANulIsRefused) {
    std::string header = R"({"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
    header += std::string(1, '\0') + "hidden";
    const std::string e = parse_error(raw_file(header, 2));
    EXPECT_NE(e.find("f.safetensors: the header holds a NUL byte at offset 53"), std::string::npos) << e;
}

// Found by fuzz_safetensors: a file the reader accepted and the writer refused (an internal error, exit 1).
TEST(SafetensorsHostile, EmptyTensorNameIsRefused) {
    const std::string e = parse_error(raw_file(R"({"":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2));
    EXPECT_EQ(e, "f.safetensors: a tensor has an empty name");
}

TEST(SafetensorsHostile, DeviceAndFolderAreRefusedByKind) {
    auto read_error = [](const std::string& p) {
        try {
            read_safetensors(p);
        } catch (const UsageError& e) {
            return std::string(e.what());
        }
        return std::string("(no error)");
    };
    EXPECT_EQ(read_error("/dev/zero"), "/dev/zero: is not a regular file (a device or a pipe); give a safetensors file");
    const std::string d = std::filesystem::temp_directory_path().string();
    EXPECT_EQ(read_error(d), d + ": is a directory, not a safetensors file");
}

// The header is checked before the body is read: a header that claims more data than the file holds is
// refused without allocating the claim.
TEST(SafetensorsHostile, HeaderClaimingMoreThanTheFileIsRefusedFromAPath) {
    const auto p = (std::filesystem::temp_directory_path() / "moekit_test_hostile_claim.safetensors").string();
    const auto bytes = raw_file(R"({"t":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,4000000000000]}})", 4);
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    try {
        read_safetensors(p);
        FAIL() << "no error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("run past the data buffer (4 bytes)"), std::string::npos) << e.what();
    }
    std::filesystem::remove(p);
}

// ---- 5. flags ----

std::string flag_error(const std::vector<std::string>& args) {
    std::vector<std::string> all = {"--hidden-size", "8", "--num-experts", "4"};
    all.insert(all.end(), args.begin(), args.end());
    try {
        parse_moe_config(all);
    } catch (const UsageError& e) {
        return e.what();
    }
    return "(no error)";
}

TEST(FlagsHostile, RepeatedFlagIsRefusedNamingIt) {
    EXPECT_EQ(flag_error({"--moe-router-topk", "2", "--moe-router-topk", "4"}),
              "--moe-router-topk is given twice on the command line: give it once (the last one would silently win)");
    EXPECT_EQ(flag_error({"--moe-router-pre-softmax", "--no-moe-router-pre-softmax"}),
              "--moe-router-pre-softmax is given twice on the command line (as --moe-router-pre-softmax and "
              "--no-moe-router-pre-softmax): give it once (the last one would silently win)");
    EXPECT_NE(flag_error({"--seed=1", "--seed", "2"}).find("--seed is given twice"), std::string::npos);
}

TEST(FlagsHostile, SwigluWithAnotherActivationIsRefusedNamingBoth) {
    EXPECT_EQ(flag_error({"--swiglu", "--activation-func", "relu"}),
              "--swiglu conflicts with --activation-func=relu (--swiglu means --activation-func=silu): give one of "
              "them");
    EXPECT_EQ(flag_error({"--activation-func", "relu", "--swiglu"}),
              "--swiglu conflicts with --activation-func=relu (--swiglu means --activation-func=silu): give one of "
              "them");
    EXPECT_NE(flag_error({"--geglu", "--no-gated-linear-unit"}).find("--geglu conflicts with --gated-linear-unit=false"),
              std::string::npos);
    // Agreeing spellings stay accepted.
    EXPECT_EQ(flag_error({"--swiglu", "--activation-func", "silu", "--gated-linear-unit"}), "(no error)");
}

TEST(FlagsHostile, ConfigFileWithARepeatedKeyIsRefused) {
    const auto p = (std::filesystem::temp_directory_path() / "moekit_test_hostile_config.json").string();
    std::ofstream(p) << R"({"moe_router_topk": 2, "moe_router_topk": 4})";
    EXPECT_NE(flag_error({"--config", p}).find("key 'moe_router_topk' appears twice"), std::string::npos);
    std::ofstream(p) << R"({"moe_router_topk": 2, "moe-router-topk": 4})";
    EXPECT_NE(flag_error({"--config", p}).find("both set --moe-router-topk"), std::string::npos);
    std::filesystem::remove(p);
}

// --deterministic-mode: every moekit path is deterministic (fixed-order reductions, no float atomics), so the
// flag is accepted and two runs give the same bytes.
TEST_F(HostileInput, DeterministicModeRerunIsBitwiseEqual) {
    for (int i = 0; i < 2; ++i) {
        const Result r = layer(str("--init random --seed 1208 ", kShape, "--seq-length 64 --micro-batch-size 2 ",
                                   "--moe-z-loss-coeff 1e-3 --moe-expert-capacity-factor 1.2 --deterministic-mode --out ",
                                   path(str("r", i, ".safetensors"))));
        ASSERT_EQ(r.status, 0) << r.output;
    }
    const SafetensorsFile a = read_safetensors(path("r0.safetensors")), b = read_safetensors(path("r1.safetensors"));
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (const auto& [name, t] : a.tensors) EXPECT_TRUE(t.bytes == b.tensors.at(name).bytes) << name;
}

}  // namespace
}  // namespace moekit
