// ECHO balance under skew on one GPU (issue 9): for each EP (virtual ranks), Zipf top-k counts [EP, E] go to the
// device, the GPU planner (src/cuda/echo_plan.cu, checked bit for bit against the CPU executor) plans the spare
// slots, and a simulated EP step times every rank's expert MLP fwd+bwd (grouped GEMMs over its groups, SwiGLU x probs
// kernels included, one CUDA graph per rank, replays timed with events, median) rank by rank in one call, for
// no ECHO, ECHO, forced balance (mean load split evenly) and sampled forced balance (uniform routing). The verdict
// compares ECHO with the sampled run: that is what a run with --moe-router-force-load-balancing routes (Megatron
// draws random logits; every expert ~T*k/E tokens with sampling noise); the even split is printed as a bound.
// usage: bench_echo_balance [--ep 4,8] [--preset dsv3-e256] [--tokens-per-rank 4096] [--skew zipf:1.2]
//          [--moe-num-echo-experts S_TOTAL | --slots-per-rank 2] [--algorithm waterfill|greedy]
//          [--group-floor-rows R (plan for time: EchoDims::group_floor_rows)] [--iters 10]
//          [--warmup 2] [--seed 1234] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/activation.cuh"
#include "cuda/device_buffer.h"
#include "cuda/echo_plan.cuh"
#include "cuda/grouped_gemm.h"
#include "echo/planner.h"
#include "echo/trace.h"
#include "io/atomic_file.h"
#include "lib/bench_expert_mlp.h"
#include "lib/bench_flags.h"
#include "lib/bench_main.h"
#include "lib/bench_util.cuh"
#include "moekit/error.h"

namespace {

using namespace moekit;
using moekit::bench::parse_int_flag;
using moekit::bench::parse_int_list_flag;
using moekit::bench::parse_run_flag;
using moekit::bench::require_json_directory;
using cuda::bench::bf16;
using cuda::bench::DevBuf;

constexpr int64_t kTileRows = 128;  // the grouped GEMMs' row tile: a group's last tile is padded to it

struct Options {
    std::vector<int64_t> eps{4, 8};
    std::string preset = "dsv3-e256";
    int64_t tokens_per_rank = 4096;
    double zipf_s = 1.2;
    int64_t slots_total = -1;    // --moe-num-echo-experts (over all ranks); -1: slots_per_rank
    int64_t slots_per_rank = 2;  // --slots-per-rank
    EchoAlgorithm algorithm = EchoAlgorithm::waterfill;
    int64_t group_floor_rows = 0;  // --group-floor-rows
    int iters = 10, warmup = 2;
    uint64_t seed = 1234;
    std::string json_path;
};

Options parse(int argc, char** argv) {
    Options o;
    bool per_rank_given = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            MOEKIT_REQUIRE(i + 1 < argc, a, " needs a value");
            return argv[++i];
        };
        if (a == "--ep") {
            o.eps = parse_int_list_flag(a, value(), 1);
        } else if (a == "--preset") {
            o.preset = value();
            cuda::bench::find_preset(o.preset);  // UsageError naming the known presets
        } else if (a == "--tokens-per-rank") {
            o.tokens_per_rank = parse_int_flag(a, value(), 1);
        } else if (a == "--skew") {
            o.zipf_s = cuda::bench::parse_skew(value());
        } else if (a == "--moe-num-echo-experts") {
            o.slots_total = parse_int_flag(a, value(), 0);
        } else if (a == "--slots-per-rank") {
            o.slots_per_rank = parse_int_flag(a, value(), 0);
            per_rank_given = true;
        } else if (a == "--algorithm") {
            o.algorithm = echo::parse_algorithm(value(), "--algorithm");
        } else if (a == "--group-floor-rows") {
            o.group_floor_rows = parse_int_flag(a, value(), 0);
        } else if (!parse_run_flag(a, value, o.iters, o.warmup, o.seed, o.json_path)) {
            throw UsageError("unknown flag " + a +
                             " (flags: --ep 4,8, --preset NAME, --tokens-per-rank T, --skew zipf:S, "
                             "--moe-num-echo-experts S_TOTAL | --slots-per-rank S, --algorithm waterfill|greedy, "
                             "--group-floor-rows R, "
                             "--iters N, --warmup N, --seed N, --json FILE)");
        }
    }
    MOEKIT_REQUIRE(!(per_rank_given && o.slots_total >= 0),
                   "--moe-num-echo-experts and --slots-per-rank both given: give one");
    if (!o.json_path.empty()) require_json_directory(o.json_path);
    return o;
}

// One rank's expert work in one configuration: rows of each group (home experts in order, then its spare slots).
struct RankWork {
    std::vector<int64_t> group_rows;
    int64_t slots = 0;  // the last `slots` groups are ECHO spare slots (their own GEMM launches, as in the layer)
    int64_t rows() const { return std::accumulate(group_rows.begin(), group_rows.end(), int64_t(0)); }
    int64_t padded_rows() const {  // rows the row tiles cover: what fc1/fc2/dgrad pay for
        int64_t p = 0;
        for (int64_t r : group_rows) p += (r + kTileRows - 1) / kTileRows * kTileRows;
        return p;
    }
};

struct Config {
    std::string key, label;
    std::vector<RankWork> ranks;
    std::vector<double> rank_ms;                     // median per rank, filled by the timing
    std::vector<std::vector<double>> rank_stage_ms;  // [rank][stage] medians (kStageNames), same replays
};

// One EP's input, plan and configurations (built before any buffer is sized, so the buffers fit all of them).
struct EpCase {
    EchoDims dims;
    std::vector<int64_t> counts;  // [EP, E] Zipf
    echo::EchoPlan device_plan;   // downloaded from the GPU planner
    bool matches_cpu = false;
    std::vector<Config> configs;  // no_echo, echo, forced_balance, forced_sampled
};

// Home expert totals of rank r from counts [EP, E] (no ECHO).
RankWork home_work(const EchoDims& d, const std::vector<int64_t>& counts, int64_t r) {
    RankWork w;
    const int64_t L = d.experts_per_rank();
    for (int64_t e = r * L; e < (r + 1) * L; ++e) w.group_rows.push_back(echo_expert_total(d, counts.data(), e));
    return w;
}

// The GPU planner on counts uploaded to the device; the plan (and per-rank loads) downloaded from the device.
echo::EchoPlan plan_on_device(const EchoDims& d, EchoAlgorithm alg, const std::vector<int64_t>& counts) {
    cuda::DeviceBuffer<int64_t> dcounts(d.ep * d.num_experts), slot_tokens(d.num_slots()),
        clone_tokens(d.ep * d.num_slots()), home_tokens(d.ep * d.num_experts), before(d.ep), after(d.ep), summary(2);
    cuda::DeviceBuffer<int32_t> slot_expert(d.num_slots());
    dcounts.upload(counts);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());  // the pageable copy's DMA, before a non-blocking stream reads it
    const cuda::EchoDevicePlan view{slot_expert.get(), slot_tokens.get(), clone_tokens.get(), home_tokens.get(),
                                    before.get(),      after.get(),       summary.get()};
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cuda::echo_plan(d, alg, dcounts.get(), view, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
    echo::EchoPlan p;
    p.dims = d, p.algorithm = alg;
    p.slot_expert = slot_expert.download(), p.slot_tokens = slot_tokens.download();
    p.clone_tokens = clone_tokens.download(), p.home_tokens = home_tokens.download();
    p.rank_load_before = before.download(), p.rank_load_after = after.download();
    const auto s = summary.download();
    p.target = s[0], p.num_clones = s[1];
    return p;
}

EpCase build_case(const Options& o, const cuda::bench::Preset& pr, int64_t ep) {
    EpCase c;
    const int64_t S = o.slots_total >= 0 ? o.slots_total / ep : o.slots_per_rank;  // divisibility checked in main
    c.dims = EchoDims{ep, pr.experts, S, o.group_floor_rows};
    echo::validate(c.dims);
    echo::ZipfRouting z;
    z.num_experts = pr.experts, z.topk = pr.topk, z.zipf_s = o.zipf_s, z.seed = o.seed;
    c.counts = echo::synthetic_zipf_trace(z, ep, o.tokens_per_rank, 1).steps[0].counts;

    c.device_plan = plan_on_device(c.dims, o.algorithm, c.counts);
    const echo::EchoPlan cpu = echo::plan(c.dims, c.counts, o.algorithm);
    const echo::EchoPlan& g = c.device_plan;
    c.matches_cpu = g.slot_expert == cpu.slot_expert && g.slot_tokens == cpu.slot_tokens &&
                    g.clone_tokens == cpu.clone_tokens && g.home_tokens == cpu.home_tokens &&
                    g.rank_load_before == cpu.rank_load_before && g.rank_load_after == cpu.rank_load_after &&
                    g.target == cpu.target && g.num_clones == cpu.num_clones;

    const EchoDims& d = c.dims;
    const int64_t L = d.experts_per_rank();
    Config off{"no_echo", "no ECHO", {}, {}}, on{"echo", "ECHO", {}, {}},
        forced{"forced_balance", "forced balance", {}, {}}, sampled{"forced_sampled", "forced (sampled)", {}, {}};
    // Sampled forced balance: what --moe-router-force-load-balancing routes in one step (uniform top-k).
    echo::ZipfRouting u = z;
    u.zipf_s = 0;
    const std::vector<int64_t> uniform = echo::synthetic_zipf_trace(u, ep, o.tokens_per_rank, 1).steps[0].counts;
    int64_t total = 0;
    for (int64_t x : c.counts) total += x;
    for (int64_t r = 0; r < ep; ++r) {
        // No ECHO: the home experts' full totals; ECHO off has no spare slots (L groups).
        off.ranks.push_back(home_work(d, c.counts, r));
        MOEKIT_CHECK(off.ranks[r].rows() == g.rank_load_before[r], "rank ", r, ": home totals ", off.ranks[r].rows(),
                     " != the device's rank_load_before ", g.rank_load_before[r]);
        // ECHO: home remainders over all sources, then the rank's S slots (their clones' shares; empty = 0 rows).
        RankWork w;
        for (int64_t e = r * L; e < (r + 1) * L; ++e) {
            int64_t rows = 0;
            for (int64_t s = 0; s < ep; ++s) rows += g.home_tokens[s * d.num_experts + e];
            w.group_rows.push_back(rows);
        }
        for (int64_t j = r * S; j < (r + 1) * S; ++j)
            w.group_rows.push_back(g.slot_expert[j] < 0 ? 0 : g.slot_tokens[j]);
        w.slots = S;
        MOEKIT_CHECK(w.rows() == g.rank_load_after[r], "rank ", r, ": ECHO groups hold ", w.rows(),
                     " rows != the device's rank_load_after ", g.rank_load_after[r]);
        on.ranks.push_back(w);
        // Forced balance: the mean load, split as evenly as possible over the L home experts.
        const int64_t rank_rows = total / ep + (r < total % ep ? 1 : 0);
        RankWork f;
        for (int64_t e = 0; e < L; ++e) f.group_rows.push_back(rank_rows / L + (e < rank_rows % L ? 1 : 0));
        forced.ranks.push_back(f);
        sampled.ranks.push_back(home_work(d, uniform, r));
    }
    c.configs = {off, on, forced, sampled};
    return c;
}

// Device operands shared by every rank and configuration (timing needs their shapes, not distinct values).
struct Buffers {
    int64_t H, F, rows, groups;
    DevBuf<bf16> x, w1, w2, h, act, y, dy, dact, dh, dx;
    DevBuf<float> dw1, dw2, prob;
    Buffers(int64_t H_, int64_t F_, int64_t rows_, int64_t groups_)
        : H(H_),
          F(F_),
          rows(rows_),
          groups(groups_),
          x(rows * H),
          w1(groups * 2 * F * H),
          w2(groups * H * F),
          h(rows * 2 * F),
          act(rows * F),
          y(rows * H),
          dy(rows * H),
          dact(rows * F),
          dh(rows * 2 * F),
          dx(rows * H),
          dw1(groups * 2 * F * H),
          dw2(groups * H * F),
          prob(rows) {}
    static double bytes(int64_t H, int64_t F, int64_t rows, int64_t groups) {
        return double(rows) * double(4 * H + 6 * F) * 2 + double(rows) * 4 +
               double(groups) * double(3 * F * H) * (2 + 4);
    }
    void fill(uint64_t seed) {
        using cuda::bench::fill_uniform;
        // Activations O(1), weights at init scale, probs in (0.05, 1): realistic magnitudes, never zeros.
        fill_uniform(x.ptr, rows * H, 1.f, seed + 1);
        fill_uniform(w1.ptr, groups * 2 * F * H, 0.02f, seed + 2);
        fill_uniform(w2.ptr, groups * H * F, 0.02f, seed + 3);
        fill_uniform(h.ptr, rows * 2 * F, 1.f, seed + 4);
        fill_uniform(act.ptr, rows * F, 1.f, seed + 5);
        fill_uniform(y.ptr, rows * H, 1.f, seed + 6);
        fill_uniform(dy.ptr, rows * H, 1.f, seed + 7);
        fill_uniform(dact.ptr, rows * F, 1.f, seed + 8);
        fill_uniform(dh.ptr, rows * 2 * F, 1.f, seed + 9);
        fill_uniform(dx.ptr, rows * H, 1.f, seed + 10);
        fill_uniform(prob.ptr, rows, 0.05f, 1.f, seed + 11);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    }
};

// One rank's expert MLP forward and backward in the layer's order (src/cuda/moe_layer.cu): fc1 nt, SwiGLU x probs,
// fc2 nt; fc2 dgrad nn, fc2 wgrad tn, SwiGLU backward, fc1 dgrad nn, fc1 wgrad tn (fresh fp32 grads). As in the
// layer, the S spare-slot groups (the last S of G) take their weights and gradients from a second base in the same
// launch (GroupedGemmShape::second_from), whose wgrad leaves an empty slot's gradient unwritten.
// MOEKIT_ECHO_SLOT_LAUNCH=1: the slots in launches of their own instead (measured: docs/perf.md).
constexpr int kStages = 8;
constexpr const char* kStageNames[kStages] = {"fc1_fwd",   "swiglu_fwd", "fc2_fwd",   "fc2_dgrad",
                                              "fc2_wgrad", "swiglu_bwd", "fc1_dgrad", "fc1_wgrad"};
// marks (kStages + 1 events, or null): recorded around every stage as event nodes of the graph being captured.
void expert_step(Buffers& b, int64_t G, int64_t S, int64_t max_rows, const int32_t* d_off, cudaStream_t s,
                 const cudaEvent_t* marks = nullptr) {
    using cuda::GroupedGemmShape;
    using cuda::WgradWrite;
    const int64_t H = b.H, F = b.F, L = G - S;
    const cuda::ActivationShape act{max_rows, F, true, Activation::silu};
    const int32_t* num_rows = d_off + G;  // offsets[G], read on the device
    // Slot weights and grads: the buffers' groups L.. through a second base, as the layer's clone buffers are.
    const bf16 *w1s = b.w1.ptr + L * 2 * F * H, *w2s = b.w2.ptr + L * H * F;
    float *g1s = b.dw1.ptr + L * 2 * F * H, *g2s = b.dw2.ptr + L * H * F;
    static const bool own_launch = [] {
        const char* env = std::getenv("MOEKIT_ECHO_SLOT_LAUNCH");
        return env && std::string(env) == "1";
    }();
    using Nt = decltype(&cuda::grouped_gemm_nt);
    // One GEMM over home + slot groups: one launch with a second base, or (own_launch) two launches.
    auto gemm = [&](Nt f, int64_t n, int64_t k, const bf16* A, const bf16* W, const bf16* Ws, bf16* C) {
        if (S == 0 || !own_launch) return f(GroupedGemmShape{G, max_rows, n, k, S ? L : 0, Ws}, A, W, C, d_off, s);
        f({L, max_rows, n, k}, A, W, C, d_off, s);
        f({S, max_rows, n, k}, A, Ws, C, d_off + L, s);
    };
    auto wgrad = [&](int64_t n, int64_t k, const bf16* A, const bf16* B, float* D, float* Ds) {
        if (S == 0 || !own_launch)
            return cuda::grouped_gemm_tn(GroupedGemmShape{G, max_rows, n, k, S ? L : 0, Ds}, A, B, D, d_off,
                                         WgradWrite::overwrite, s);
        cuda::grouped_gemm_tn({L, max_rows, n, k}, A, B, D, d_off, WgradWrite::overwrite, s);
        cuda::grouped_gemm_tn({S, max_rows, n, k}, A, B, Ds, d_off + L, WgradWrite::overwrite_nonempty, s);
    };
    int stage = 0;
    auto mark = [&] {
        if (marks) MOEKIT_CUDA_CHECK(cudaEventRecordWithFlags(marks[stage], s, cudaEventRecordExternal));
        ++stage;
    };
    mark(), gemm(cuda::grouped_gemm_nt, 2 * F, H, b.x.ptr, b.w1.ptr, w1s, b.h.ptr);
    mark(), cuda::activation_forward<float>(act, num_rows, b.h.ptr, b.prob.ptr, b.act.ptr, s);
    mark(), gemm(cuda::grouped_gemm_nt, H, F, b.act.ptr, b.w2.ptr, w2s, b.y.ptr);
    mark(), gemm(cuda::grouped_gemm_nn, F, H, b.dy.ptr, b.w2.ptr, w2s, b.dact.ptr);
    mark(), wgrad(F, H, b.dy.ptr, b.act.ptr, b.dw2.ptr, g2s);
    mark(), cuda::activation_backward<float>(act, num_rows, b.h.ptr, b.prob.ptr, b.dact.ptr, b.dh.ptr, nullptr, s);
    mark(), gemm(cuda::grouped_gemm_nn, H, 2 * F, b.dh.ptr, b.w1.ptr, w1s, b.dx.ptr);
    mark(), wgrad(H, 2 * F, b.dh.ptr, b.x.ptr, b.dw1.ptr, g1s);
    mark();
}

struct Graph {
    cudaGraphExec_t exec = nullptr;
    cuda::DeviceBuffer<int32_t> offsets;
    cudaEvent_t marks[kStages + 1] = {};  // stage boundaries, event nodes of the graph
    Graph() {
        for (cudaEvent_t& e : marks) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
    }
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
        if (exec) cudaGraphExecDestroy(exec);
        for (cudaEvent_t e : marks) cudaEventDestroy(e);
    }
};

// Each rank's step of each configuration: run once eagerly (first-use set-up stays out of the capture, and a bad
// launch fails here), then captured in one graph; replays interleaved (iteration, configuration, rank) so clock
// drift hits every configuration alike; median per rank.
void time_case(EpCase& c, Buffers& b, const Options& o, cudaStream_t s) {
    std::vector<std::vector<std::unique_ptr<Graph>>> graphs(c.configs.size());
    for (size_t ci = 0; ci < c.configs.size(); ++ci) {
        for (const RankWork& w : c.configs[ci].ranks) {
            auto g = std::make_unique<Graph>();
            const int64_t G = int64_t(w.group_rows.size());
            std::vector<int32_t> off(G + 1, 0);
            for (int64_t i = 0; i < G; ++i) off[i + 1] = int32_t(off[i] + w.group_rows[i]);
            g->offsets.resize(G + 1);
            g->offsets.upload(off);
            // A pageable cudaMemcpy may return before its DMA lands, and s does not wait for the legacy stream.
            MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
            // max_rows = the rank's own rows (>= 1: a zero-row tensor map is refused): launch geometry from the
            // real load, every buffer holds b.rows >= this many rows.
            const int64_t max_rows = std::max<int64_t>(w.rows(), 1);
            MOEKIT_CHECK(max_rows <= b.rows && G <= b.groups, "buffers too small");
            expert_step(b, G, w.slots, max_rows, g->offsets.get(), s);
            MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
            cudaGraph_t graph = nullptr;
            MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            expert_step(b, G, w.slots, max_rows, g->offsets.get(), s, g->marks);
            MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
            const cudaError_t inst = cudaGraphInstantiate(&g->exec, graph, 0);
            cudaGraphDestroy(graph);
            MOEKIT_CUDA_CHECK(inst);
            graphs[ci].push_back(std::move(g));
        }
    }
    cudaEvent_t t0, t1;
    MOEKIT_CUDA_CHECK(cudaEventCreate(&t0));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&t1));
    std::vector<std::vector<std::vector<float>>> ms(c.configs.size(),
                                                    std::vector<std::vector<float>>(size_t(c.dims.ep)));
    // [config][rank][stage] -> replays: where a rank's time goes (the graph's own event nodes)
    std::vector<std::vector<std::vector<std::vector<float>>>> stage_ms(
        c.configs.size(),
        std::vector<std::vector<std::vector<float>>>(size_t(c.dims.ep), std::vector<std::vector<float>>(kStages)));
    for (int it = 0; it < o.warmup + o.iters; ++it)
        for (size_t ci = 0; ci < c.configs.size(); ++ci)
            for (int64_t r = 0; r < c.dims.ep; ++r) {
                MOEKIT_CUDA_CHECK(cudaEventRecord(t0, s));
                MOEKIT_CUDA_CHECK(cudaGraphLaunch(graphs[ci][r]->exec, s));
                MOEKIT_CUDA_CHECK(cudaEventRecord(t1, s));
                MOEKIT_CUDA_CHECK(cudaEventSynchronize(t1));
                float t = 0;
                MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&t, t0, t1));
                if (it < o.warmup) continue;
                ms[ci][r].push_back(t);
                for (int st = 0; st < kStages; ++st) {
                    float m = 0;
                    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&m, graphs[ci][r]->marks[st], graphs[ci][r]->marks[st + 1]));
                    stage_ms[ci][r][size_t(st)].push_back(m);
                }
            }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    for (size_t ci = 0; ci < c.configs.size(); ++ci) {
        c.configs[ci].rank_ms.clear();
        c.configs[ci].rank_stage_ms.clear();
        for (size_t r = 0; r < ms[ci].size(); ++r) {
            c.configs[ci].rank_ms.push_back(cuda::bench::median(ms[ci][r]));
            std::vector<double> st;
            for (const auto& v : stage_ms[ci][r]) st.push_back(cuda::bench::median(v));
            c.configs[ci].rank_stage_ms.push_back(st);
        }
    }
}

template <typename T>
double max_over_mean(const std::vector<T>& v) {
    double sum = 0, mx = 0;
    for (T x : v) sum += double(x), mx = std::max(mx, double(x));
    return sum > 0 ? mx * double(v.size()) / sum : 1.0;
}

nlohmann::json config_json(const Config& cfg) {
    std::vector<int64_t> rows, padded;
    nlohmann::json groups = nlohmann::json::array();
    for (const RankWork& w : cfg.ranks) {
        rows.push_back(w.rows()), padded.push_back(w.padded_rows());
        groups.push_back(w.group_rows);
    }
    const auto busiest = std::max_element(cfg.rank_ms.begin(), cfg.rank_ms.end());
    nlohmann::json stages = nlohmann::json::object();
    const auto& busiest_stages = cfg.rank_stage_ms[size_t(busiest - cfg.rank_ms.begin())];
    for (int st = 0; st < kStages; ++st) stages[kStageNames[st]] = busiest_stages[size_t(st)];
    const double mean = std::accumulate(cfg.rank_ms.begin(), cfg.rank_ms.end(), 0.0) / double(cfg.rank_ms.size());
    return {{"label", cfg.label},
            {"groups_per_rank", cfg.ranks.empty() ? 0 : cfg.ranks[0].group_rows.size()},
            {"rank_rows", rows},
            {"rank_padded_rows", padded},
            {"rows_max_over_mean", max_over_mean(rows)},
            {"group_rows", groups},
            {"rank_ms", cfg.rank_ms},
            {"busiest_ms", *busiest},
            {"busiest_rank", busiest - cfg.rank_ms.begin()},
            {"busiest_stage_ms", stages},
            {"mean_ms", mean},
            {"ms_max_over_mean", max_over_mean(cfg.rank_ms)}};
}

}  // namespace

int main(int argc, char** argv) {
    return moekit::cuda::bench::bench_main("bench_echo_balance", [&]() -> int {
        const Options o = parse(argc, argv);
        const cuda::bench::Preset& pr = cuda::bench::find_preset(o.preset);
        for (int64_t ep : o.eps) {  // flag errors before the GPU check, so they exit 2 everywhere
            MOEKIT_REQUIRE(pr.experts % ep == 0, "--ep ", ep, ": the preset's E=", pr.experts,
                           " must be divisible by every EP");
            MOEKIT_REQUIRE(o.slots_total < 0 || o.slots_total % ep == 0, "--moe-num-echo-experts=", o.slots_total,
                           " must be divisible by every EP of --ep (", ep, " is not a divisor)");
        }
        if (cuda::bench::gpu_count() == 0) {
            std::printf("bench_echo_balance: no GPU (nothing measured)\n");
            return 0;
        }
        const int64_t H = pr.hidden, F = pr.ffn, k = pr.topk;
        cudaDeviceProp prop{};
        MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        const char* kernel_name = cuda::grouped_gemm_kernel_name(cuda::grouped_gemm_kernel());
        std::printf(
            "ECHO balance, simulated EP step on %s: preset %s (H %lld, F %lld, E %lld, top-%lld; SwiGLU), %lld tokens "
            "per rank (flag; the preset's T=%lld is not used), skew zipf:%g, planner %s, seed %llu\n"
            "per rank: expert MLP fwd+bwd = 6 grouped GEMMs (%s) + SwiGLU x probs fwd/bwd, one CUDA graph per rank, "
            "median of %d replays (after %d), ranks one at a time\n",
            prop.name, pr.name.c_str(), (long long)H, (long long)F, (long long)pr.experts, (long long)k,
            (long long)o.tokens_per_rank, (long long)pr.tokens, o.zipf_s, echo::algorithm_name(o.algorithm),
            (unsigned long long)o.seed, kernel_name, o.iters, o.warmup);
        std::fflush(stdout);

        // Plans and per-rank work for every EP first: the shared buffers are sized from the real counts.
        std::vector<EpCase> cases;
        int64_t max_rows = 1, max_groups = 1;
        for (int64_t ep : o.eps) {
            cases.push_back(build_case(o, pr, ep));
            for (const Config& cfg : cases.back().configs)
                for (const RankWork& w : cfg.ranks)
                    max_rows = std::max(max_rows, w.rows()),
                    max_groups = std::max(max_groups, int64_t(w.group_rows.size()));
        }
        MOEKIT_REQUIRE(max_rows < (int64_t(1) << 30), "a rank's rows (", max_rows,
                       ") reach 2^30: lower --tokens-per-rank");
        size_t free_bytes = 0, total_bytes = 0;
        MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
        const double need = Buffers::bytes(H, F, max_rows, max_groups);
        MOEKIT_REQUIRE(need + double(1 << 30) <= double(free_bytes), "the busiest rank (", max_rows, " rows, ",
                       max_groups, " groups) needs ", need / (1 << 30), " GiB of device memory, ",
                       double(free_bytes) / (1 << 30), " GiB free: lower --tokens-per-rank or pick a smaller --preset");
        Buffers buf(H, F, max_rows, max_groups);
        buf.fill(o.seed);
        std::printf("buffers: %lld rows (the busiest rank of any configuration) x %lld groups, %.1f GiB\n",
                    (long long)max_rows, (long long)max_groups, need / (1 << 30));

        cudaStream_t stream;
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const double expert_bytes = double(3 * F * H) * 2;  // fc1 [2F, H] + fc2 [H, F], bf16
        bool all_match = true;
        nlohmann::json runs = nlohmann::json::array();
        for (EpCase& c : cases) {
            time_case(c, buf, o, stream);
            const echo::EchoPlan& p = c.device_plan;
            const EchoDims& d = c.dims;
            all_match = all_match && c.matches_cpu;
            nlohmann::json cfgs = nlohmann::json::object();
            for (const Config& cfg : c.configs) cfgs[cfg.key] = config_json(cfg);
            const double forced = cfgs["forced_balance"]["busiest_ms"].get<double>();
            const double sampled = cfgs["forced_sampled"]["busiest_ms"].get<double>();
            const double echo_ms = cfgs["echo"]["busiest_ms"].get<double>();
            const double off_ms = cfgs["no_echo"]["busiest_ms"].get<double>();
            const double before = max_over_mean(p.rank_load_before), after = max_over_mean(p.rank_load_after);
            nlohmann::json run{{"expert_model_parallel_size", d.ep},
                               {"experts_per_rank", d.experts_per_rank()},
                               {"slots_per_rank", d.slots_per_rank},
                               {"moe_num_echo_experts", d.num_slots()},
                               {"plan",
                                {{"source", "GPU planner (cuda::echo_plan) on the device counts, downloaded"},
                                 {"matches_cpu", c.matches_cpu},
                                 {"rank_load_before", p.rank_load_before},
                                 {"rank_load_after", p.rank_load_after},
                                 {"max_over_mean_before", before},
                                 {"max_over_mean_after", after},
                                 {"target", p.target},
                                 {"clones", p.num_clones},
                                 {"slot_expert", p.slot_expert},
                                 {"slot_tokens", p.slot_tokens}}},
                               {"weight_bytes",
                                {{"expert_bf16", expert_bytes},
                                 {"forward_clone_weights", double(p.num_clones) * expert_bytes},
                                 {"backward_clone_grads_fp32", double(p.num_clones) * expert_bytes * 2}}},
                               {"configs", cfgs},
                               {"ratios",
                                {{"echo_over_forced", echo_ms / forced},
                                 {"no_echo_over_forced", off_ms / forced},
                                 {"echo_over_forced_sampled", echo_ms / sampled},
                                 {"forced_sampled_over_forced", sampled / forced}}},
                               {"acceptance",
                                {{"loads_max_over_mean_after_le_1_05", after <= 1.05},
                                 {"echo_busiest_le_1_05_forced_sampled", echo_ms <= 1.05 * sampled}}}};

            std::printf(
                "\nEP=%lld: E=%lld, %lld home experts + %lld spare slots per rank, %lld x top-%lld = %lld rows "
                "per rank on average\n",
                (long long)d.ep, (long long)d.num_experts, (long long)d.experts_per_rank(), (long long)d.slots_per_rank,
                (long long)o.tokens_per_rank, (long long)k, (long long)(o.tokens_per_rank * k));
            std::printf(
                "  GPU plan (%s): per-rank loads max/mean %.4f before, %.4f after; %lld clones; = CPU plan: %s\n",
                echo::algorithm_name(o.algorithm), before, after, (long long)p.num_clones,
                c.matches_cpu ? "yes" : "NO");
            std::printf(
                "  ECHO weight traffic per layer and step: %lld clones x %.1f MiB = %.1f MiB bf16 weights "
                "forward, %.1f MiB fp32 grads backward\n",
                (long long)p.num_clones, expert_bytes / (1 << 20), p.num_clones * expert_bytes / (1 << 20),
                2 * p.num_clones * expert_bytes / (1 << 20));
            std::printf("  %-18s %6s %14s %12s %8s %12s %9s %12s %11s\n", "configuration", "groups", "rows max/mean",
                        "padded rows", "busiest", "busiest ms", "mean ms", "ms max/mean", "/ forced");
            for (const Config& cfg : c.configs) {
                const nlohmann::json& j = cfgs[cfg.key];
                const int64_t br = j["busiest_rank"].get<int64_t>();
                std::printf("  %-18s %6lld %14.4f %12lld %8lld %12.3f %9.3f %12.4f %10.4fx\n", cfg.label.c_str(),
                            (long long)j["groups_per_rank"].get<int64_t>(), j["rows_max_over_mean"].get<double>(),
                            (long long)cfg.ranks[br].padded_rows(), (long long)br, j["busiest_ms"].get<double>(),
                            j["mean_ms"].get<double>(), j["ms_max_over_mean"].get<double>(),
                            j["busiest_ms"].get<double>() / forced);
            }
            std::printf("  busiest rank by stage (ms):");
            for (int st = 0; st < kStages; ++st) std::printf(" %10s", kStageNames[st]);
            std::printf("\n");
            for (const Config& cfg : c.configs) {
                std::printf("  %-18s         ", cfg.label.c_str());
                for (int st = 0; st < kStages; ++st)
                    std::printf(" %10.3f", cfgs[cfg.key]["busiest_stage_ms"][kStageNames[st]].get<double>());
                std::printf("\n");
            }
            std::printf(
                "  acceptance: loads max/mean after %.4f <= 1.05: %s; busiest ECHO / busiest forced-balance run "
                "(sampled) %.4f <= 1.05: %s (no ECHO: %.4f; ECHO / the even split's bound: %.4f)\n",
                after, after <= 1.05 ? "yes" : "NO", echo_ms / sampled, echo_ms <= 1.05 * sampled ? "yes" : "NO",
                off_ms / sampled, echo_ms / forced);
            std::fflush(stdout);
            runs.push_back(run);
        }
        MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
        if (!o.json_path.empty()) {
            const nlohmann::json out{
                {"benchmark", "bench_echo_balance"},
                {"device", prop.name},
                {"preset", pr.name},
                {"H", H},
                {"F", F},
                {"E", pr.experts},
                {"topk", k},
                {"tokens_per_rank", o.tokens_per_rank},
                {"zipf_s", o.zipf_s},
                {"algorithm", echo::algorithm_name(o.algorithm)},
                {"seed", o.seed},
                {"iters", o.iters},
                {"warmup", o.warmup},
                {"gemm_kernel", kernel_name},
                {"method",
                 "per rank: fc1 nt, SwiGLU x probs, fc2 nt, fc2 dgrad nn, fc2 wgrad tn, SwiGLU bwd, fc1 dgrad nn, fc1 "
                 "wgrad tn (fp32 grads, fresh) over the rank's groups, one CUDA graph per rank and configuration, "
                 "max_rows = the rank's rows; replays interleaved over configurations and ranks, median per rank. "
                 "no_echo: L home experts with their totals; echo: L home remainders + S slots from the device plan, "
                 "the slots in the home groups' GEMM launches through a second base as in the layer (an empty "
                 "slot's wgrad not written); "
                 "forced_balance: total/EP rows split evenly over L experts; forced_sampled: uniform top-k routing"},
                {"runs", runs}};
            io::write_file_atomically(o.json_path, out.dump(1) + "\n");
            std::printf("\nwrote %s\n", o.json_path.c_str());
        }
        if (!all_match) {
            std::fprintf(stderr, "bench_echo_balance: a GPU plan differs from the CPU executor's plan\n");
            return 1;
        }
        return 0;
    });
}
