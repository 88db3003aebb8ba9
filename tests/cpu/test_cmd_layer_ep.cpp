// `moekit layer` under expert parallelism, end to end (tools/cmd_layer.cpp, tools/layer_ep.cpp): with
// --virtual-ranks N the results equal N separate single-rank runs on the micro-batches (columns of B)
// with grads summed; mpirun -np N equals --virtual-ranks N bit for bit; bad layouts exit 2 and say
// why; ranks started with different flags are refused; a rank that fails, or is killed with SIGKILL,
// ends the job within 60 s with an error naming it. The MPI cases skip in builds without MPI.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>

#include "core/rng.h"
#include "io/safetensors.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include <nlohmann/json.hpp>
#include "run_tool.h"
#include "scratch_dir.h"

namespace moekit {
namespace {

using testing_util::moekit_binary;
using testing_util::run_shell;
using testing_util::run_tool;
using testing_util::ToolResult;


std::string mpirun(int np) { return testing_util::mpirun_prefix(np); }

class CmdLayerEp : public testing_util::ScratchDirTest {
protected:
    CmdLayerEp() : ScratchDirTest("cmd_layer_ep") {}
};

const std::string kLayer =
    "layer --device cpu --hidden-size 12 --num-experts 4 --moe-ffn-hidden-size 8 --swiglu --moe-router-topk 2 "
    "--moe-aux-loss-coeff 0.05 --moe-z-loss-coeff 0.01 --moe-shared-expert-intermediate-size 6 "
    "--moe-shared-expert-gate ";

// input [S, B, H], padding_mask [B, S], grad_output [S, B, H] (fp64, seeded), and its micro-batches.
void write_inputs(const std::string& file, int64_t S, int64_t B, int64_t H, uint64_t seed) {
    std::vector<double> x(size_t(S * B * H)), g(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = normal01(seed, 1, i), g[i] = normal01(seed, 2, i);
    HostTensor mask;
    mask.dtype = DType::boolean;
    mask.shape = {B, S};
    for (int64_t i = 0; i < B * S; ++i) mask.bytes.push_back(uniform01(seed, 3, uint64_t(i)) < 0.2);
    write_safetensors(file, {{"input", HostTensor::from_double(x, {S, B, H}, DType::f64)},
                             {"grad_output", HostTensor::from_double(g, {S, B, H}, DType::f64)},
                             {"padding_mask", mask}});
}

// Columns [b0, b0 + nb) of every [S, B, ...] tensor (and rows [b0, b0 + nb) of the [B, S] mask).
HostTensor columns(const HostTensor& t, int64_t b0, int64_t nb, bool mask_layout = false) {
    HostTensor out = t;
    const size_t es = dtype_size(t.dtype);
    if (mask_layout) {
        const int64_t S = t.shape[1];
        out.shape[0] = nb;
        out.bytes.assign(t.bytes.begin() + long(b0 * S * es), t.bytes.begin() + long((b0 + nb) * S * es));
        return out;
    }
    const int64_t S = t.shape[0], B = t.shape[1];
    int64_t inner = 1;
    for (size_t d = 2; d < t.shape.size(); ++d) inner *= t.shape[d];
    out.shape[1] = nb;
    out.bytes.clear();
    for (int64_t s = 0; s < S; ++s)
        out.bytes.insert(out.bytes.end(), t.bytes.begin() + long(((s * B + b0) * inner) * es),
                         t.bytes.begin() + long(((s * B + b0 + nb) * inner) * es));
    return out;
}

// The rows of token columns [b0, b0 + nb) of a [S*B, cols] result.
std::vector<double> token_columns(const HostTensor& t, int64_t S, int64_t B, int64_t b0, int64_t nb) {
    const std::vector<double> v = t.to_double();
    const int64_t cols = int64_t(v.size()) / (S * B);
    std::vector<double> out;
    for (int64_t s = 0; s < S; ++s)
        out.insert(out.end(), v.begin() + (s * B + b0) * cols, v.begin() + (s * B + b0 + nb) * cols);
    return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    double scale = 1, worst = 0;
    for (double v : b) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    EXPECT_LE(worst, tol * scale) << what << ": largest |diff| " << worst;
}

TEST_F(CmdLayerEp, VirtualRanksEqualSeparateRunsOnMicroBatches) {
    const int64_t S = 6, B = 4, H = 12, N = 2;
    ToolResult r = run_tool(kLayer + "--dtype fp64 --init random --seq-length 2 --save-weights " + path("w") +
                            " --out " + path("init"));
    ASSERT_EQ(r.status, 0) << r.output;
    write_inputs(path("x"), S, B, H, 42);
    const SafetensorsFile x = read_safetensors(path("x"));
    std::vector<SafetensorsFile> single;
    for (int64_t rank = 0; rank < N; ++rank) {
        const std::string xr = path("x" + std::to_string(rank));
        write_safetensors(xr, {{"input", columns(x.tensors.at("input"), rank * B / N, B / N)},
                               {"grad_output", columns(x.tensors.at("grad_output"), rank * B / N, B / N)},
                               {"padding_mask", columns(x.tensors.at("padding_mask"), rank * B / N, B / N, true)}});
        r = run_tool(kLayer + "--dtype fp64 --weights " + path("w") + " --input " + xr + " --out " +
                     path("single" + std::to_string(rank)));
        ASSERT_EQ(r.status, 0) << r.output;
        single.push_back(read_safetensors(path("single" + std::to_string(rank))));
    }
    for (const std::string dispatcher : {"alltoall", "allgather"}) {
        SCOPED_TRACE(dispatcher);
        r = run_tool(kLayer + "--dtype fp64 --weights " + path("w") + " --input " + path("x") +
                     " --expert-model-parallel-size 2 --virtual-ranks 2 --moe-token-dispatcher-type " + dispatcher +
                     " --out " + path("ep"));
        ASSERT_EQ(r.status, 0) << r.output;
        const SafetensorsFile ep = read_safetensors(path("ep"));
        // alltoall sums a token's expert rows on its own rank in expert order (exact); allgather's
        // reduce-scatter adds per-rank partial sums (reduction order only).
        const double tol = dispatcher == std::string("alltoall") ? 0.0 : 1e-12;
        for (int64_t rank = 0; rank < N; ++rank) {
            const SafetensorsFile& one = single[size_t(rank)];
            for (const char* name : {"output", "grad_input"})
                expect_close(token_columns(ep.tensors.at(name), S, B, rank * B / N, B / N), one.tensors.at(name).to_double(),
                             tol, name);
            for (const char* name : {"probs", "routing_map"})
                expect_close(token_columns(ep.tensors.at(name), S, B, rank * B / N, B / N), one.tensors.at(name).to_double(),
                             0.0, name);
            for (const char* name : {"loss.aux_loss", "loss.z_loss"}) {
                ASSERT_EQ(ep.tensors.at(name).shape, std::vector<int64_t>({N})) << name;
                EXPECT_EQ(ep.tensors.at(name).to_double()[size_t(rank)], one.tensors.at(name).to_double()[0]) << name;
            }
        }
        size_t grads = 0;
        for (const auto& [name, t] : ep.tensors) {
            if (name.rfind("grad.", 0) != 0) continue;
            std::vector<double> sum = single[0].tensors.at(name).to_double();
            const std::vector<double> second = single[1].tensors.at(name).to_double();
            for (size_t i = 0; i < sum.size(); ++i) sum[i] += second[i];
            double norm = 0;
            for (double v : sum) norm += std::abs(v);
            EXPECT_GT(norm, 0) << name << " is zero in the reference: the check would prove nothing";
            expect_close(t.to_double(), sum, 1e-12, name);
            ++grads;
        }
        EXPECT_EQ(grads, 1u + 3u + 2u * 4u) << "router, shared fc1/fc2/gate and 4 experts' fc1/fc2";
    }
}

TEST_F(CmdLayerEp, RefusesBadLayouts) {
    const std::string base = kLayer + "--init random --seq-length 3 --micro-batch-size 4 --out " + path("r");
    ToolResult r = run_tool(base + " --virtual-ranks 3");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("B=4 sequences, not divisible by the 3 ranks"), std::string::npos) << r.output;
    r = run_tool(base + " --expert-model-parallel-size 2");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--expert-model-parallel-size=2 needs that many ranks"), std::string::npos) << r.output;
    r = run_tool(kLayer + "--init random --seq-length 3 --micro-batch-size 3 --out " + path("r") +
                 " --expert-model-parallel-size 3 --virtual-ranks 3");
    EXPECT_EQ(r.status, 2) << r.output;  // E = 4 not divisible by EP = 3
    EXPECT_NE(r.output.find("divisible by --expert-model-parallel-size=3"), std::string::npos) << r.output;
    r = run_tool(base + " --expert-model-parallel-size 4 --virtual-ranks 2");
    EXPECT_EQ(r.status, 2) << r.output;  // EP must divide the ranks
    r = run_tool(base + " --virtual-ranks -1");
    EXPECT_EQ(r.status, 2) << r.output;
    // --device cuda on several ranks runs where a GPU is (tests/gpu/test_cuda_ep.cu); without one: exit 2, saying so.
    if (!cuda_device_available()) {
        r = run_tool(kLayer.substr(0, kLayer.find("--device")) + "--device cuda --init random --seq-length 3 "
                     "--micro-batch-size 2 --hidden-size 16 --num-experts 4 --virtual-ranks 2 "
                     "--expert-model-parallel-size 2 --out " + path("r"));
        EXPECT_EQ(r.status, 2) << r.output;
        EXPECT_TRUE(r.output.find("no CUDA device") != std::string::npos ||
                    r.output.find("built without CUDA") != std::string::npos)
            << r.output;
    }
}

TEST_F(CmdLayerEp, MpiRanksEqualVirtualRanksBitwise) {
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI";
    const std::string base = kLayer + "--init random --seq-length 5 --micro-batch-size 4 --moe-expert-capacity-factor 1.0 ";
    for (const auto& [np, flags] : std::vector<std::pair<int, std::string>>{
             {2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"},
             {4, "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"}}) {
        SCOPED_TRACE(flags);
        ToolResult r = run_shell(mpirun(np) + moekit_binary() + " " + base + flags + " --out " + path("m"));
        ASSERT_EQ(r.status, 0) << r.output;
        r = run_tool(base + flags + " --virtual-ranks " + std::to_string(np) + " --out " + path("v"));
        ASSERT_EQ(r.status, 0) << r.output;
        const SafetensorsFile m = read_safetensors(path("m")), v = read_safetensors(path("v"));
        EXPECT_EQ(m.tensors.size(), v.tensors.size());
        for (const auto& [name, t] : v.tensors) {
            ASSERT_TRUE(m.tensors.count(name)) << name;
            EXPECT_TRUE(m.tensors.at(name).bytes == t.bytes && m.tensors.at(name).shape == t.shape) << name;
        }
    }
}

// --moe-expert-rank-capacity-factor: a tiny factor overflows (T*k = 64 rows per rank, budget 16), the
// step is re-run and the file equals the alltoall run bit for bit, with the event in the metadata; a
// generous one never overflows; the MoE Echo spelling and flex select the same path; mpirun -np 2 gives
// the same bits and metadata as --virtual-ranks 2.
TEST_F(CmdLayerEp, ReceiveBudgetOverflowIsReRunAndReported) {
    const std::string base = kLayer + "--init random --seq-length 16 --micro-batch-size 4 --expert-model-parallel-size 2 ";
    ToolResult r = run_tool(base + "--virtual-ranks 2 --moe-token-dispatcher-type alltoall --out " + path("ref"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(r.output.find("receive budget"), std::string::npos) << r.output;
    const SafetensorsFile ref = read_safetensors(path("ref"));
    EXPECT_EQ(ref.metadata.count("ep_receive_budget"), 0u);
    struct Run {
        std::string flags;
        bool overflow;
    };
    std::vector<std::pair<std::string, Run>> runs = {
        {"tiny", {"--virtual-ranks 2 --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 0.05", true}},
        {"echo", {"--virtual-ranks 2 --moe-token-dispatcher-type flex --moe-received-token-capacity 0.05", true}},
        {"generous", {"--virtual-ranks 2 --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 2", false}}};
    if (MOEKIT_HAVE_MPI)
        runs.push_back({"mpi", {"--moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 0.05", true}});
    for (const auto& [name, run] : runs) {
        SCOPED_TRACE(name);
        r = name == "mpi" ? run_shell(mpirun(2) + moekit_binary() + " " + base + run.flags + " --out " + path(name))
                          : run_tool(base + run.flags + " --out " + path(name));
        ASSERT_EQ(r.status, 0) << r.output;
        const SafetensorsFile f = read_safetensors(path(name));
        for (const auto& [tname, t] : ref.tensors) {
            ASSERT_TRUE(f.tensors.count(tname)) << tname;
            EXPECT_TRUE(f.tensors.at(tname).bytes == t.bytes) << tname << " differs from the alltoall run";
        }
        ASSERT_EQ(f.metadata.count("ep_receive_budget"), 1u);
        const nlohmann::json b = nlohmann::json::parse(f.metadata.at("ep_receive_budget"));
        EXPECT_EQ(b.at("overflow_events"), run.overflow ? 1 : 0) << b.dump();
        EXPECT_EQ(b.at("rerun"), run.overflow ? "alltoall" : "none") << b.dump();
        EXPECT_EQ(b.at("budget_rows"), run.overflow ? 16 : 128) << b.dump();  // ceil(T*k*f) aligned, T*k = 32 tokens * 2
        const double sufficient = b.at("sufficient_factor");
        EXPECT_GT(b.at("peak_rows").get<int64_t>(), run.overflow ? 16 : 0) << b.dump();
        EXPECT_LE(b.at("peak_rows").get<int64_t>(), 128) << b.dump();
        if (run.overflow) {
            EXPECT_FALSE(b.at("overflowed_ranks").empty()) << b.dump();
            EXPECT_NE(r.output.find("EP receive budget overflow"), std::string::npos) << r.output;
            EXPECT_NE(r.output.find(str("a factor of ", sufficient, " would have sufficed")), std::string::npos) << r.output;
        }
    }
    // The factor the log suggested runs without an overflow.
    const nlohmann::json tiny = nlohmann::json::parse(read_safetensors(path("tiny")).metadata.at("ep_receive_budget"));
    r = run_tool(base + "--virtual-ranks 2 --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor " +
                 str(tiny.at("sufficient_factor").get<double>()) + " --out " + path("suggested"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(nlohmann::json::parse(read_safetensors(path("suggested")).metadata.at("ep_receive_budget")).at("overflow_events"), 0);
    // Refused combinations exit 2 naming the flags.
    r = run_tool(base + "--virtual-ranks 2 --moe-expert-rank-capacity-factor 0.05 --out " + path("bad"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--moe-expert-rank-capacity-factor requires --moe-token-dispatcher-type=alltoall or flex"),
              std::string::npos) << r.output;
}

TEST_F(CmdLayerEp, RanksWithDifferentFlagsAreRefused) {
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI";
    // Rank 1 asks for top-3 where rank 0 has kLayer's top-2 (each command line names the flag once).
    std::string top3 = kLayer;
    top3.replace(top3.find("--moe-router-topk 2"), 19, "--moe-router-topk 3");
    const std::string rest = "--init random --seq-length 3 --micro-batch-size 2 --expert-model-parallel-size 2 ";
    const ToolResult r = run_shell(mpirun(1) + moekit_binary() + " " + kLayer + rest + "--out " + path("r") +
                                   " : -np 1 " + moekit_binary() + " " + top3 + rest + "--out " + path("r"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("rank 1 has moe_router_topk=3 vs moe_router_topk=2 on rank 0"), std::string::npos)
        << r.output;
}

TEST_F(CmdLayerEp, ARankThatFailsEndsTheJobNamingIt) {
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI";
    // Rank 1 cannot read its weights file and fails while rank 0 waits in the start-up collective.
    const std::string base = kLayer + "--seq-length 3 --micro-batch-size 2 --expert-model-parallel-size 2 --out " + path("r");
    const auto t0 = std::chrono::steady_clock::now();
    const ToolResult r = run_shell("timeout 120 " + mpirun(1) + moekit_binary() + " " + base + " --init random : -np 1 " +
                                   moekit_binary() + " " + base + " --weights " + path("missing.safetensors"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
    EXPECT_NE(r.output.find("moekit layer: error on rank 1 of 2: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("missing.safetensors"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("r")));
}

TEST_F(CmdLayerEp, KilledRankEndsTheJobNamingIt) {
    if (!MOEKIT_HAVE_MPI) GTEST_SKIP() << "built without MPI";
    const auto t0 = std::chrono::steady_clock::now();
    const ToolResult r = run_shell("MOEKIT_DEBUG_KILL_RANK=1 timeout 120 " + mpirun(2) + "-x MOEKIT_DEBUG_KILL_RANK " +
                                   moekit_binary() + " " + kLayer +
                                   "--init random --seq-length 3 --micro-batch-size 2 --expert-model-parallel-size 2 "
                                   "--out " + path("r"));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.status, 124) << "timed out: the job hung after a rank died\n" << r.output;
    EXPECT_LT(seconds, 60.0) << r.output;
    EXPECT_NE(r.output.find("process rank 1"), std::string::npos) << r.output;  // mpirun's report
    EXPECT_NE(r.output.find("signal 9"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("r"))) << "no results file from a failed job";
}

}  // namespace
}  // namespace moekit
