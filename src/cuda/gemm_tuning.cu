// The per-shape choice measured on the running device (gemm_tuning.h says when and why).
#include "cuda/gemm_tuning.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "core/gemm_tuning_math.h"
#include "cuda/cuda_check.h"
#include "cuda/event_timing.h"
#include "moekit/error.h"

namespace moekit::cuda {
namespace {

// A tuning is five rounds of every candidate, two launches a round, the rounds interleaving the candidates (each
// round starting one further along) and queued back to back with one host wait at the end: the GPU stays under load
// throughout, as in a training step. Before them the rule's launch runs back to back for kPreheatMs: under a power
// cap the clock falls over the first few hundred milliseconds of load, and rankings taken at the burst clock were
// not the step's (2026-12-07, H100, 700 W: every candidate timed 15 % under its steady time, and one kept at 2.74
// against the rule's 2.81 ms took 3.19 ms in the step's rounds).
constexpr int kRounds = 5, kLaunchesPerRound = 2;
constexpr double kPreheatMs = 250;
constexpr int kMaxPreheatLaunches = 512;  // small shapes (tests) heat nothing: bound their launches
constexpr double kMargin = 0.02;          // what a candidate must beat the rule by (core/gemm_tuning_math.h)

using Key = std::tuple<int, std::string, int64_t, int64_t, int64_t, int64_t>;  // device, op, G, max_rows, n, k

std::mutex g_mutex;
std::map<Key, GemmChoice> g_choices;
std::vector<GemmTuningRecord> g_records;

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

Key key_of(int device, const char* op, const GroupedGemmShape& s) {
    return Key{device, op, s.num_groups, s.max_rows, s.n, s.k};
}

// Per-launch milliseconds of each entry of `order` (kLaunchesPerRound launches of that candidate), all queued back to
// back on `stream` with an event between measurements and one host wait at the end; the events are freed on every path.
std::vector<double> time_back_to_back(const std::vector<size_t>& order, const std::vector<GemmChoice>& candidates,
                                      const std::function<void(const GemmChoice&)>& run, cudaStream_t stream) {
    struct Events {
        std::vector<cudaEvent_t> e;
        ~Events() {
            for (cudaEvent_t x : e) cudaEventDestroy(x);
        }
    } ev;
    for (size_t j = 0; j <= order.size(); ++j) {
        cudaEvent_t x = nullptr;
        MOEKIT_CUDA_CHECK(cudaEventCreate(&x));
        ev.e.push_back(x);
    }
    MOEKIT_CUDA_CHECK(cudaEventRecord(ev.e[0], stream));
    for (size_t j = 0; j < order.size(); ++j) {
        for (int l = 0; l < kLaunchesPerRound; ++l) run(candidates[order[j]]);
        MOEKIT_CUDA_CHECK(cudaEventRecord(ev.e[j + 1], stream));
    }
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(ev.e.back()));
    std::vector<double> ms(order.size());
    for (size_t j = 0; j < order.size(); ++j) {
        float t = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&t, ev.e[j], ev.e[j + 1]));
        ms[j] = double(t) / kLaunchesPerRound;
    }
    return ms;
}

}  // namespace

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

void keep(const char* op, const GroupedGemmShape& s, const GemmChoice& rule) {
    const Key key = key_of(current_device(), op, s);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_choices.emplace(key, rule);  // a choice another thread made meanwhile stands
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
    std::vector<std::vector<double>> times(n);
    const auto first = std::find(ran.begin(), ran.end(), true);
    if (first != ran.end()) {
        // Pre-heat on the rule (or the first candidate that ran): one timed launch says how many make kPreheatMs.
        const GemmChoice& heat = candidates[size_t(first - ran.begin())];
        const double one = time_ms([&] { run(heat); }, stream, 0, 1);
        const int preheat = int(std::min<double>(kMaxPreheatLaunches, std::ceil(kPreheatMs / std::max(one, 1e-3))));
        for (int i = 0; i < preheat; ++i) run(heat);
        std::vector<size_t> order;  // the measurements in queue order: rounds, each starting one further along
        for (int round = 0; round < kRounds; ++round)
            for (size_t j = 0; j < n; ++j)
                if (const size_t i = (j + size_t(round)) % n; ran[i]) order.push_back(i);
        const std::vector<double> ms = time_back_to_back(order, candidates, run, stream);
        for (size_t j = 0; j < order.size(); ++j) times[order[j]].push_back(ms[j]);
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
