// ECHO planner on the GPU (src/cuda/echo_plan.cu) against the CPU executor (src/echo/planner.cpp): every
// array of the plan equal bit for bit on seeded random count matrices (both algorithms, odd shapes,
// zeros, one expert takes all, the E=256/EP=64 Zipf case, the equivalence grid with ties and int64 totals,
// the profiled kernel too), the plan invariants on the device plan, and the planner captured in a CUDA
// graph and replayed on new counts. Skips without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu/echo_test_util.h"
#include "cuda/device_buffer.h"
#include "cuda/echo_plan.cuh"
#include "cuda/layer_runner.h"
#include "echo/planner.h"
#include "echo/trace.h"

namespace moekit {
namespace {

#define SKIP_WITHOUT_GPU()                   \
    if (::moekit::cuda::device_count() == 0) \
    GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or returned 0): GPU test skipped"

using test::CountKind;

// Device buffers of one plan, sized once (the planner itself allocates nothing).
struct DevicePlan {
    EchoDims d;
    cuda::DeviceBuffer<int64_t> counts, slot_tokens, clone_tokens, home_tokens, before, after, summary;
    cuda::DeviceBuffer<int32_t> slot_expert;
    explicit DevicePlan(const EchoDims& dims)
        : d(dims),
          counts(dims.ep * dims.num_experts),
          slot_tokens(dims.num_slots()),
          clone_tokens(dims.ep * dims.num_slots()),
          home_tokens(dims.ep * dims.num_experts),
          before(dims.ep),
          after(dims.ep),
          summary(2),
          slot_expert(dims.num_slots()) {}
    cuda::EchoDevicePlan view() {
        return {slot_expert.get(), slot_tokens.get(), clone_tokens.get(), home_tokens.get(),
                before.get(),      after.get(),       summary.get()};
    }
    echo::EchoPlan download(EchoAlgorithm alg) const {
        echo::EchoPlan p;
        p.dims = d;
        p.algorithm = alg;
        p.slot_expert = slot_expert.download();
        p.slot_tokens = slot_tokens.download();
        p.clone_tokens = clone_tokens.download();
        p.home_tokens = home_tokens.download();
        p.rank_load_before = before.download();
        p.rank_load_after = after.download();
        const auto s = summary.download();
        p.target = s[0], p.num_clones = s[1];
        return p;
    }
};

void expect_same_plan(const echo::EchoPlan& gpu, const echo::EchoPlan& cpu) {
    EXPECT_EQ(gpu.slot_expert, cpu.slot_expert);
    EXPECT_EQ(gpu.slot_tokens, cpu.slot_tokens);
    EXPECT_EQ(gpu.clone_tokens, cpu.clone_tokens);
    EXPECT_EQ(gpu.home_tokens, cpu.home_tokens);
    EXPECT_EQ(gpu.rank_load_before, cpu.rank_load_before);
    EXPECT_EQ(gpu.rank_load_after, cpu.rank_load_after);
    EXPECT_EQ(gpu.target, cpu.target);
    EXPECT_EQ(gpu.num_clones, cpu.num_clones);
    EXPECT_EQ(echo::plan_bytes(gpu), echo::plan_bytes(cpu));
}

const EchoDims kDims[] = {{1, 5, 2},   {2, 2, 4},        {3, 111, 1},     {7, 91, 2},
                          {5, 35, 0},  {8, 64, 2},       {16, 48, 3},     {13, 39, 1},
                          {64, 256, 2}, {32, 32, 5},     {8, 64, 2, 512}, {64, 256, 2, 512},
                          {7, 91, 2, 100}};  // the last three plan for time (group_floor_rows)

TEST(CudaEchoPlan, MatchesCpuBitwiseOnRandomCounts) {
    SKIP_WITHOUT_GPU();
    uint64_t seed = 19000;
    for (const EchoDims& d : kDims) {
        DevicePlan dev(d);
        for (CountKind kind :
             {CountKind::uniform, CountKind::zipf, CountKind::sparse, CountKind::zeros, CountKind::one_expert})
            for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
                ++seed;
                SCOPED_TRACE(echo::to_string(d) + " " + test::kind_name(kind) + " " + echo::algorithm_name(alg) +
                             " seed " + std::to_string(seed));
                const auto counts = test::random_counts(d, kind, seed);
                dev.counts.upload(counts);
                cuda::echo_plan(d, alg, dev.counts.get(), dev.view(), nullptr);
                MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
                const echo::EchoPlan gpu = dev.download(alg);
                test::expect_plan_invariants(d, counts, gpu);
                expect_same_plan(gpu, echo::plan(d, counts, alg));
            }
    }
}

// The grid of the CPU equivalence test (tests/cpu/test_echo_plan_equivalence.cpp): EP 1/2/8/64, 1/3/4
// experts per rank, S 0/1/2/4, every count kind including ties, empty experts and totals past 2^31 (the
// walk's int64 path), both algorithms; the plain and the profiled kernel both equal the CPU plan.
TEST(CudaEchoPlan, MatchesCpuOnTheEquivalenceGrid) {
    SKIP_WITHOUT_GPU();
    uint64_t seed = 41000;
    cuda::DeviceBuffer<int64_t> profile(cuda::kEchoPlanProfileSize);
    for (int64_t ep : {1, 2, 8, 64})
        for (int64_t per_rank : {1, 3, 4})
            for (int64_t S : {0, 1, 2, 4}) {
                const EchoDims d{ep, ep * per_rank, S};
                DevicePlan dev(d);
                for (int kind = 0; kind < 9; ++kind)
                    for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
                        ++seed;
                        const bool extra = kind >= 5;
                        SCOPED_TRACE(echo::to_string(d) + " " +
                                     (extra ? test::extra_name(test::Extra(kind - 5))
                                            : test::kind_name(CountKind(kind))) +
                                     " " + echo::algorithm_name(alg) + " seed " + std::to_string(seed));
                        const auto counts = extra ? test::extra_counts(d, test::Extra(kind - 5), seed)
                                                  : test::random_counts(d, CountKind(kind), seed);
                        const echo::EchoPlan cpu = echo::plan(d, counts, alg);
                        dev.counts.upload(counts);
                        cuda::echo_plan(d, alg, dev.counts.get(), dev.view(), nullptr);
                        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
                        expect_same_plan(dev.download(alg), cpu);
                        cuda::echo_plan_profiled(d, alg, dev.counts.get(), dev.view(), profile.get(), nullptr);
                        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
                        expect_same_plan(dev.download(alg), cpu);
                        const auto p = profile.download();
                        for (int k = 0; k < cuda::kEchoPlanPhases; ++k) EXPECT_LE(p[k], p[k + 1]) << "phase " << k;
                        // The search runs (at least one round) exactly when waterfill's initial bracket is open.
                        const bool searches = alg == EchoAlgorithm::waterfill &&
                                              cpu.max_before() - echo_search_floor(d, cpu.total_tokens()) > 1;
                        EXPECT_EQ(p[cuda::kEchoPlanPhases + 1] > 0, searches)
                            << "search rounds " << p[cuda::kEchoPlanPhases + 1];
                        if (HasFailure()) return;
                    }
            }
}

// The benchmark's case: E=256, EP=64, S=2, Zipf 1.2 top-8 routing of 4096 tokens per rank.
TEST(CudaEchoPlan, MatchesCpuOnZipfE256Ep64) {
    SKIP_WITHOUT_GPU();
    echo::ZipfRouting z;
    z.num_experts = 256, z.topk = 8, z.zipf_s = 1.2, z.seed = 2026;
    const auto trace = echo::synthetic_zipf_trace(z, 64, 4096, 2);
    const EchoDims d{64, 256, 2};
    DevicePlan dev(d);
    for (const auto& step : trace.steps)
        for (EchoAlgorithm alg : {EchoAlgorithm::greedy, EchoAlgorithm::waterfill}) {
            SCOPED_TRACE(std::string(echo::algorithm_name(alg)) + " seed 2026");
            dev.counts.upload(step.counts);
            cuda::echo_plan(d, alg, dev.counts.get(), dev.view(), nullptr);
            MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
            const echo::EchoPlan gpu = dev.download(alg), cpu = echo::plan(d, step.counts, alg);
            expect_same_plan(gpu, cpu);
            EXPECT_GT(cpu.max_over_mean_before(), 2.0);
            if (alg == EchoAlgorithm::waterfill) EXPECT_LE(gpu.max_over_mean_after(), 1.05);
        }
}

// No host sync inside: the planner is captured once and replayed on counts uploaded between replays.
TEST(CudaEchoPlan, GraphCaptureAndReplay) {
    SKIP_WITHOUT_GPU();
    const EchoDims d{16, 48, 2};
    DevicePlan dev(d);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    cuda::echo_plan(d, EchoAlgorithm::waterfill, dev.counts.get(), dev.view(), stream);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (uint64_t seed : {31u, 32u, 33u}) {
        SCOPED_TRACE("seed " + std::to_string(seed));
        const auto counts = test::random_counts(d, CountKind::zipf, seed);
        dev.counts.upload(counts);
        MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        expect_same_plan(dev.download(EchoAlgorithm::waterfill), echo::plan(d, counts, EchoAlgorithm::waterfill));
    }
    MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moekit
