// ECHO planner on the GPU alone (src/cuda/echo_plan.cu): time per plan for E=256, S=2 per rank at
// EP = 8, 16, 32, 64 on Zipf 1.2 top-8 counts of 4096 tokens per rank (the issue-9 target: <= 50 us at
// EP=64), back-to-back launches and CUDA-graph replays, each plan first checked bit for bit against the
// CPU executor, then where the time goes: the profiled kernel's clock64 stamps per phase (cycles at the
// SM clock, shown in us at the device's rated clock), search rounds and listed experts.
// usage: bench_echo_plan [--iters N] [--algorithm waterfill|greedy|all] [--json FILE]
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/echo_plan.cuh"
#include "echo/planner.h"
#include "echo/trace.h"
#include "io/atomic_file.h"
#include "lib/bench_main.h"
#include "moekit/error.h"

namespace {

using namespace moekit;

struct Row {
    std::string algorithm;
    int64_t ep, num_experts, slots_per_rank, clones;
    double before, after, us_stream, us_graph;
    bool matches_cpu;
    std::vector<double> phase_us;  // [kEchoPlanPhases], mean over the profiled runs
    double profiled_us = 0;        // first stamp to last, mean
    int64_t rounds = 0, listed = 0;
};

// Mean cycles of each phase over `runs` launches of the profiled kernel (the caller checks the plan it leaves).
void profile_one(const EchoDims& d, EchoAlgorithm alg, const int64_t* dcounts, const cuda::EchoDevicePlan& view,
                 cudaStream_t stream, int runs, Row* row) {
    cuda::DeviceBuffer<int64_t> prof(cuda::kEchoPlanProfileSize);
    int khz = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    std::vector<double> cycles(cuda::kEchoPlanPhases, 0.0);
    double whole = 0;
    for (int i = 0; i < runs; ++i) {
        cuda::echo_plan_profiled(d, alg, dcounts, view, prof.get(), stream);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto p = prof.download();
        for (int k = 0; k < cuda::kEchoPlanPhases; ++k) cycles[k] += double(p[k + 1] - p[k]);
        whole += double(p[cuda::kEchoPlanPhases] - p[0]);
        row->rounds = p[cuda::kEchoPlanPhases + 1], row->listed = p[cuda::kEchoPlanPhases + 2];
    }
    const double us_per_cycle = 1000.0 / double(khz);
    row->phase_us.clear();
    for (double c : cycles) row->phase_us.push_back(c / runs * us_per_cycle);
    row->profiled_us = whole / runs * us_per_cycle;
}

Row bench_one(const EchoDims& d, EchoAlgorithm alg, const std::vector<int64_t>& counts, int iters) {
    cuda::DeviceBuffer<int64_t> dcounts(d.ep * d.num_experts), slot_tokens(d.num_slots()),
        clone_tokens(d.ep * d.num_slots()), home_tokens(d.ep * d.num_experts), before(d.ep), after(d.ep), summary(2);
    cuda::DeviceBuffer<int32_t> slot_expert(d.num_slots());
    dcounts.upload(counts);
    const cuda::EchoDevicePlan view{slot_expert.get(), slot_tokens.get(), clone_tokens.get(), home_tokens.get(),
                                    before.get(),      after.get(),       summary.get()};
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cuda::echo_plan(d, alg, dcounts.get(), view, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const echo::EchoPlan cpu = echo::plan(d, counts, alg);
    const auto s = summary.download();
    const bool same = slot_expert.download() == cpu.slot_expert && slot_tokens.download() == cpu.slot_tokens &&
                      clone_tokens.download() == cpu.clone_tokens && home_tokens.download() == cpu.home_tokens &&
                      after.download() == cpu.rank_load_after && s[0] == cpu.target && s[1] == cpu.num_clones;

    Row row{};
    profile_one(d, alg, dcounts.get(), view, stream, 100, &row);
    const auto s2 = summary.download();
    const bool same_profiled = slot_expert.download() == cpu.slot_expert && slot_tokens.download() == cpu.slot_tokens &&
                               clone_tokens.download() == cpu.clone_tokens &&
                               home_tokens.download() == cpu.home_tokens && after.download() == cpu.rank_load_after &&
                               s2[0] == cpu.target && s2[1] == cpu.num_clones;

    cudaEvent_t t0, t1;
    MOEKIT_CUDA_CHECK(cudaEventCreate(&t0));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&t1));
    for (int i = 0; i < 20; ++i) cuda::echo_plan(d, alg, dcounts.get(), view, stream);
    MOEKIT_CUDA_CHECK(cudaEventRecord(t0, stream));
    for (int i = 0; i < iters; ++i) cuda::echo_plan(d, alg, dcounts.get(), view, stream);
    MOEKIT_CUDA_CHECK(cudaEventRecord(t1, stream));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms_stream = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms_stream, t0, t1));

    // One plan per graph launch, as a captured training step would run it.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    cuda::echo_plan(d, alg, dcounts.get(), view, stream);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 20; ++i) MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEKIT_CUDA_CHECK(cudaEventRecord(t0, stream));
    for (int i = 0; i < iters; ++i) MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOEKIT_CUDA_CHECK(cudaEventRecord(t1, stream));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms_graph = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms_graph, t0, t1));
    MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    MOEKIT_CUDA_CHECK(cudaEventDestroy(t0));
    MOEKIT_CUDA_CHECK(cudaEventDestroy(t1));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
    row.algorithm = echo::algorithm_name(alg);
    row.ep = d.ep, row.num_experts = d.num_experts, row.slots_per_rank = d.slots_per_rank;
    row.clones = cpu.num_clones;
    row.before = cpu.max_over_mean_before(), row.after = cpu.max_over_mean_after();
    row.us_stream = 1000.0 * ms_stream / iters, row.us_graph = 1000.0 * ms_graph / iters;
    row.matches_cpu = same && same_profiled;
    return row;
}

}  // namespace

int main(int argc, char** argv) {
    int iters = 1000;
    std::string json_path, which = "all";
    return moekit::cuda::bench::bench_main("bench_echo_plan", [&]() -> int {
        for (int i = 1; i < argc; ++i) {
            const std::string a = argv[i];
            auto value = [&]() -> std::string {
                MOEKIT_REQUIRE(i + 1 < argc, a, " needs a value");
                return argv[++i];
            };
            if (a == "--iters") {
                iters = std::stoi(value());
                MOEKIT_REQUIRE(iters > 0, "--iters=", iters, " must be > 0");
            } else if (a == "--algorithm") {
                which = value();
                if (which != "all") echo::parse_algorithm(which, "--algorithm");
            } else if (a == "--json") {
                json_path = value();
            } else {
                throw UsageError("unknown flag " + a +
                                 " (flags: --iters N, --algorithm waterfill|greedy|all, --json FILE)");
            }
        }
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
            std::fprintf(stderr, "bench_echo_plan: no CUDA device (cudaGetDeviceCount failed or returned 0)\n");
            return 1;
        }
        std::printf(
            "ECHO planner, one block on the GPU: Zipf 1.2, top-8, 4096 tokens per rank, E=256, S=2 per rank; "
            "%d plans per timing\n",
            iters);
        std::printf("%-10s %4s %4s %3s %16s %15s %7s %12s %12s %10s\n", "algorithm", "EP", "E", "S", "max/mean before",
                    "max/mean after", "clones", "us (stream)", "us (graph)", "= CPU plan");
        nlohmann::json rows = nlohmann::json::array();
        std::vector<Row> results;
        bool all_same = true;
        for (int64_t ep : {8, 16, 32, 64}) {
            echo::ZipfRouting z;
            z.num_experts = 256, z.topk = 8, z.zipf_s = 1.2, z.seed = 1234;
            const auto trace = echo::synthetic_zipf_trace(z, ep, 4096, 1);
            const EchoDims d{ep, 256, 2};
            for (EchoAlgorithm alg : {EchoAlgorithm::waterfill, EchoAlgorithm::greedy}) {
                if (which != "all" && which != echo::algorithm_name(alg)) continue;
                const Row r = bench_one(d, alg, trace.steps[0].counts, iters);
                all_same = all_same && r.matches_cpu;
                results.push_back(r);
                std::printf("%-10s %4lld %4lld %3lld %16.4f %15.4f %7lld %12.2f %12.2f %10s\n", r.algorithm.c_str(),
                            (long long)r.ep, (long long)r.num_experts, (long long)r.slots_per_rank, r.before, r.after,
                            (long long)r.clones, r.us_stream, r.us_graph, r.matches_cpu ? "yes" : "NO");
                std::fflush(stdout);
                rows.push_back({{"algorithm", r.algorithm},
                                {"expert_model_parallel_size", r.ep},
                                {"num_experts", r.num_experts},
                                {"slots_per_rank", r.slots_per_rank},
                                {"max_over_mean_before", r.before},
                                {"max_over_mean_after", r.after},
                                {"clones", r.clones},
                                {"us_per_plan_stream", r.us_stream},
                                {"us_per_plan_graph", r.us_graph},
                                {"matches_cpu", r.matches_cpu},
                                {"profile_phase_us", r.phase_us},
                                {"profile_us", r.profiled_us},
                                {"search_rounds", r.rounds},
                                {"listed_experts", r.listed}});
            }
        }
        // Where the time goes: one column per phase of the profiled kernel (us at the rated SM clock; the
        // stamps cover the kernel body, not the launch).
        std::printf("\nWhere the time goes (profiled kernel, mean of 100 plans, us at the rated SM clock):\n");
        std::printf("%-10s %4s", "algorithm", "EP");
        for (int k = 0; k < cuda::kEchoPlanPhases; ++k) std::printf(" %26s", cuda::echo_plan_phase_name(k));
        std::printf(" %10s %7s %7s\n", "body", "rounds", "listed");
        for (const Row& r : results) {
            std::printf("%-10s %4lld", r.algorithm.c_str(), (long long)r.ep);
            for (double us : r.phase_us) std::printf(" %26.2f", us);
            std::printf(" %10.2f %7lld %7lld\n", r.profiled_us, (long long)r.rounds, (long long)r.listed);
        }
        if (!json_path.empty()) io::write_file_atomically(json_path, rows.dump(1) + "\n");
        if (!all_same) {
            std::fprintf(stderr, "bench_echo_plan: a GPU plan differs from the CPU plan\n");
            return 1;
        }
        return 0;
    });
}
