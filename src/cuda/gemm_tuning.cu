// The per-shape choice measured on the running device (gemm_tuning.h says when and why).
#include "cuda/gemm_tuning.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "core/gemm_tuning_math.h"
#include "cuda/cuda_check.h"
#include "moekit/error.h"

namespace moekit::cuda {
namespace {

// A tuning is three rounds of every candidate, two launches a round: the rounds interleave the candidates (each
// round starting one further along) so that a clock drift under the power cap spreads over all of them.
constexpr int kRounds = 3, kLaunchesPerRound = 2;
constexpr double kMargin = 0.02;  // what a candidate must beat the rule by (core/gemm_tuning_math.h)

using Key = std::tuple<int, std::string, int64_t, int64_t, int64_t, int64_t>;  // device, op, G, max_rows, n, k

std::mutex g_mutex;
std::map<Key, GemmChoice> g_choices;
std::vector<GemmTuningRecord> g_records;
std::atomic<int> g_tuning{-1};

int current_device() {
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    return dev;
}

// This thread's capture mode relaxed while it tunes: a graph another thread captures in global mode would otherwise
// forbid the waits on this thread's own (not captured) stream, and the failed call would invalidate that capture.
struct RelaxedCaptureMode {
    cudaStreamCaptureMode was = cudaStreamCaptureModeRelaxed;
    RelaxedCaptureMode() { MOEKIT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&was)); }
    ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&was); }
    RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
    RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
};

struct Events {  // a timing pair, destroyed however the tuning ends
    cudaEvent_t a = nullptr, b = nullptr;
    Events() {
        MOEKIT_CUDA_CHECK(cudaEventCreate(&a));
        MOEKIT_CUDA_CHECK(cudaEventCreate(&b));
    }
    ~Events() {
        cudaEventDestroy(a);
        cudaEventDestroy(b);
    }
    Events(const Events&) = delete;
    Events& operator=(const Events&) = delete;
};

Key key_of(int device, const char* op, const GroupedGemmShape& s) {
    return Key{device, op, s.num_groups, s.max_rows, s.n, s.k};
}

}  // namespace

void set_gemm_tuning(int on) { g_tuning = on; }
int gemm_tuning() { return g_tuning.load(); }

bool gemm_tuning_enabled() {
    const int v = g_tuning.load();
    if (v >= 0) return v > 0;
    static const bool env = [] {
        const char* e = std::getenv("MOEKIT_GEMM_TUNE");
        if (!e) return false;
        MOEKIT_REQUIRE(std::strcmp(e, "0") == 0 || std::strcmp(e, "1") == 0, "MOEKIT_GEMM_TUNE=", e,
                       ": expected 1 (measure each shape's configuration) or 0 (the per-shape rule)");
        return e[0] == '1';
    }();
    return env;
}

std::vector<GemmTuningRecord> gemm_tuning_records() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_records;
}

void clear_gemm_tuning() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_choices.clear();
    g_records.clear();
}

namespace gemm_tuning_detail {

bool lookup(const char* op, const GroupedGemmShape& s, GemmChoice* out) {
    const Key key = key_of(current_device(), op, s);
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = g_choices.find(key);
    if (it == g_choices.end()) return false;
    *out = it->second;
    return true;
}

GemmChoice tune(const char* op, const GroupedGemmShape& s, const std::vector<GemmChoice>& candidates,
                const std::function<void(const GemmChoice&)>& run, cudaStream_t stream) {
    MOEKIT_CHECK(!candidates.empty(), "GEMM tuning of ", s.to_string(), ": no candidates");
    const size_t n = candidates.size();
    const RelaxedCaptureMode relaxed;
    std::vector<bool> ran(n, true);
    // One warm launch each: first-use set-up (shared-memory attributes, argument workspaces) stays out of the timing.
    for (size_t i = 0; i < n; ++i) {
        try {
            run(candidates[i]);
        } catch (const Error&) {
            ran[i] = false;  // e.g. CUTLASS's can_implement refused the shape: checked before anything launched
        }
    }
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const Events ev;
    cudaEvent_t a = ev.a, b = ev.b;
    std::vector<std::vector<double>> times(n);
    for (int round = 0; round < kRounds; ++round)
        for (size_t j = 0; j < n; ++j) {
            const size_t i = (j + size_t(round)) % n;
            if (!ran[i]) continue;
            MOEKIT_CUDA_CHECK(cudaEventRecord(a, stream));
            for (int l = 0; l < kLaunchesPerRound; ++l) run(candidates[i]);
            MOEKIT_CUDA_CHECK(cudaEventRecord(b, stream));
            MOEKIT_CUDA_CHECK(cudaEventSynchronize(b));
            float ms = 0;
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
            times[i].push_back(double(ms) / kLaunchesPerRound);
        }

    GemmTuningRecord r;
    r.op = op;
    r.shape = s;
    r.shape.second = nullptr;
    r.device = current_device();
    for (size_t i = 0; i < n; ++i) {
        r.names.push_back(candidates[i].name);
        r.ms.push_back(ran[i] ? tuning_median(times[i]) : std::nan(""));
    }
    r.kept = pick_tuned(r.ms, 0, kMargin);
    if (r.kept < 0) return candidates[0];  // nothing ran: the caller's launch of the rule reports why
    const GemmChoice kept = candidates[size_t(r.kept)];
    std::lock_guard<std::mutex> lock(g_mutex);
    g_choices[key_of(r.device, op, s)] = kept;
    g_records.push_back(std::move(r));
    return kept;
}

}  // namespace gemm_tuning_detail
}  // namespace moekit::cuda
