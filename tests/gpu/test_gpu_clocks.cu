// ClockSampler (bench/lib/gpu_clocks.h), the benchmarks' SM-clock readings: on a GPU machine NVML must open, samples
// must land only in the measurement that is open, and a busy kernel's SM clock must read as a clock.
#include <chrono>
#include <thread>

#include "gpu/cuda_layer_test_util.h"
#include "lib/gpu_clocks.h"

namespace moekit::test {
namespace {

using moekit::bench::ClockSampler;

// Keeps every SM busy for about `cycles` clock cycles (a dependent chain the compiler cannot fold).
__global__ void spin_kernel(long long cycles, float* sink) {
    const long long start = clock64();
    float x = float(threadIdx.x);
    while (clock64() - start < cycles) x = x * 0.999f + 1.0f;
    if (x == -1.0f) *sink = x;  // never true: keeps the loop
}

TEST(GpuClocks, SamplesOnlyTheOpenMeasurement) {
    SKIP_WITHOUT_GPU();
    ClockSampler clocks(0, 3, 200);
    // A machine with a GPU has its driver's NVML: not finding it would silently drop every clock reading.
    ASSERT_TRUE(clocks.available()) << clocks.why_unavailable();
    float* sink = nullptr;
    ASSERT_EQ(cudaMalloc(&sink, sizeof(float)), cudaSuccess);
    // Busy for at least 300 ms of wall time: a kernel's cycles are no measure of it where other processes share
    // the GPU (the suite runs four test binaries at once), and at one sample each 200 us plus NVML's own latency
    // 300 ms leave room for well over 10 samples.
    clocks.begin(1);
    const auto start = std::chrono::steady_clock::now();
    do {
        spin_kernel<<<1024, 256>>>(20'000'000LL, sink);  // ~10-20 ms at 1-2 GHz
        ASSERT_EQ(cudaGetLastError(), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    } while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(300));
    clocks.end();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // nothing open: these samples count nowhere
    clocks.begin(7);  // out of range: ignored
    clocks.end();
    EXPECT_EQ(cudaFree(sink), cudaSuccess);

    EXPECT_EQ(clocks.stats(0).samples, 0);
    EXPECT_EQ(clocks.stats(2).samples, 0);
    EXPECT_EQ(clocks.stats(7).samples, 0);
    const auto s = clocks.stats(1);
    EXPECT_EQ(s.failed_queries, 0);
    EXPECT_GE(s.samples, 10) << "NVML refused " << s.failed_queries << " clock queries";
    EXPECT_GT(s.sm_mhz, 200.0);  // a busy SM's clock, not idle's or a unit mix-up
    EXPECT_LT(s.sm_mhz, 4000.0);
    EXPECT_GE(s.power_capped, 0.0);
    EXPECT_LE(s.power_capped, 1.0);

    const nlohmann::json j = moekit::bench::clock_json(clocks, {"idle", "busy", "never"}, 3);
    ASSERT_EQ(j.size(), 1u);
    ASSERT_TRUE(j.contains("busy"));
    EXPECT_EQ(j["busy"]["samples"].get<int>(), s.samples);
    const std::string line = moekit::bench::format_clocks(j);
    EXPECT_NE(line.find("busy"), std::string::npos) << line;
    EXPECT_NE(line.find("MHz"), std::string::npos) << line;
    EXPECT_EQ(moekit::bench::format_clocks(nlohmann::json::object()), "");
}

}  // namespace
}  // namespace moekit::test
