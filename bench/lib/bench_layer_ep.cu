// `moekit bench --expert-model-parallel-size N --virtual-ranks N`: the CUDA layer at EP = N on ONE GPU, N
// virtual ranks (threads, own streams, the local-gpu DeviceComm), each with T/N of the preset's tokens and
// E/N experts; against the EP = 1 layer on all T tokens in the same call. Under `mpirun -np N` the same on N
// GPUs over NCCL (then each rank's EP = 1 reference is its own GPU's). Ranks share the GPU, so the
// whole-step time is the comparison that means something (the same total work, plus the exchanges);
// per-rank stage times show the load balance (the busiest rank's expert time is what ECHO evens out).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <mutex>

#include "comm/device_comm.h"
#include "cuda/budget_step.h"
#include "cuda/moe_layer.h"
#include "lib/bench_expert_mlp.h"
#include "lib/bench_util.cuh"
#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit::cuda::bench {
namespace {

// Router rows identical on every rank (one seed); each rank its own tokens and its local experts' weights.
void fill_layer(CudaMoeLayer& layer, int64_t T, const Preset& p, const Options& o, int rank) {
    const LayerBuffers& b = layer.buffers();
    const int64_t H = p.hidden, F = p.ffn, L = layer.shape().local_experts();
    const float w = 0.02f * std::sqrt(3.f);
    fill_uniform(b.hidden, size_t(T * H), 1.f, o.seed + 11 + 100 * uint64_t(rank));
    fill_uniform(b.grad_output, size_t(T * H), 1.f, o.seed + 12 + 100 * uint64_t(rank));
    fill_uniform(b.router_weight, size_t(p.experts * H), w, o.seed + 13);
    fill_uniform(b.fc1, size_t(L * 2 * F * H), w, o.seed + 14 + 100 * uint64_t(rank));
    fill_uniform(b.fc2, size_t(L * H * F), w, o.seed + 15 + 100 * uint64_t(rank));
    if (o.zipf_s > 0) apply_zipf_skew(b.hidden, T, b.router_weight, p.experts, H, o.zipf_s);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
}

double stage_sum(const StageTimesMs& t, std::initializer_list<LayerStage> stages) {
    double s = 0;
    for (LayerStage st : stages) s += t[size_t(st)];
    return s;
}

// Median ms of an all-to-all of `bytes` (this rank's, split evenly over the other ranks, 16-byte multiples).
double transport_all_to_all_ms(DeviceComm& dc, Communicator& world, int64_t bytes, cudaStream_t s, const Options& o) {
    const int n = world.size(), me = world.rank();
    const int64_t per_peer = n > 1 ? bytes / (n - 1) / 16 * 16 : 0;
    const std::vector<int64_t> all = world.all_gather(std::vector<int64_t>{per_peer});
    std::vector<int64_t> sb(static_cast<size_t>(n), per_peer), rb(static_cast<size_t>(n), 0);
    sb[size_t(me)] = 0;
    int64_t recv_total = 0;
    for (int p = 0; p < n; ++p)
        if (p != me) rb[size_t(p)] = all[size_t(p)], recv_total += all[size_t(p)];
    if (per_peer * (n - 1) == 0 && recv_total == 0) return 0.0;
    void *a = nullptr, *b = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&a, size_t(std::max<int64_t>(per_peer * (n - 1), 16))));
    MOEKIT_CUDA_CHECK(cudaMalloc(&b, size_t(std::max<int64_t>(recv_total, 16))));
    const double ms = time_ms_after([&] { world.barrier(); }, [&] { dc.all_to_all_v(a, sb.data(), b, rb.data(), s); },
                                    s, o.warmup, o.iters);
    world.barrier();
    cudaFree(a);
    cudaFree(b);
    return ms;
}

}  // namespace

nlohmann::json bench_layer_ep(const Preset& p, const Options& o, int ep, const std::string& dispatcher,
                              double receive_factor, int64_t echo_slots) {
    MOEKIT_REQUIRE(ep >= 2 && p.tokens % ep == 0 && p.experts % ep == 0, "--expert-model-parallel-size=", ep,
                   " must be >= 2 and divide the preset's ", p.tokens, " tokens and ", p.experts, " experts");
    // Virtual ranks share one GPU: strong scaling (T/EP tokens each, the same total as EP = 1). Real ranks
    // (mpirun, a GPU each): weak scaling (T tokens per GPU, against EP = 1 on T tokens on that GPU).
    const bool real_ranks = comm::mpi_launched();
    const int64_t T = p.tokens, Tr = real_ranks ? T : T / ep;
    nlohmann::json out{{"preset", p.name}, {"ep", ep},          {"dispatcher", dispatcher}, {"T", T},
                       {"tokens_per_rank", Tr}, {"iters", o.iters}, {"H", p.hidden}, {"E", p.experts},
                       {"topk", p.topk},        {"F", p.ffn},          {"receive_factor", receive_factor},
                       {"zipf_s", o.zipf_s},    {"echo_slots_per_rank", echo_slots}};
    const bool sync_free = receive_factor > 0 || echo_slots > 0;  // the budgeted dispatcher
    cudaDeviceProp prop{};
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    out["device"] = prop.name;

    // EP = 1 on all T tokens, eager steps: the reference the EP step is compared with (on every real rank's
    // own GPU, inside the ranks below).
    const auto time_ep1 = [&] {
        auto layer = CudaMoeLayer::create(preset_config(p), T, 1);
        fill_layer(*layer, T, p, o, 0);
        cudaStream_t s;
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        const double ms = time_ms([&] { layer->forward(s, true), layer->backward(s); }, s, o.warmup, o.iters);
        MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
        return ms;
    };
    if (!real_ranks) {
        out["ep1_step_ms"] = time_ep1();
    }

    std::mutex mutex;
    std::vector<nlohmann::json> ranks(static_cast<size_t>(ep));
    std::vector<double> wall;
    // Virtual ranks on this GPU, or the MPI world (one GPU per process, NCCL) when started by mpirun.
    const auto on_ranks = [&](const std::function<void(Communicator&)>& fn) {
        if (comm::mpi_launched()) {
            Communicator& world = comm::mpi_world();
            MOEKIT_REQUIRE(world.size() == ep, "--expert-model-parallel-size=", ep, " under mpirun -np ", world.size(),
                           ": the EP benchmark takes one process per EP rank");
            return fn(world);
        }
        comm::run_virtual_ranks(ep, fn);
    };
    on_ranks([&](Communicator& world) {
        const int r = world.rank();
        MoeConfig c = preset_config(p);
        c.expert_model_parallel_size = ep;
        c.moe_token_dispatcher_type = dispatcher;
        if (receive_factor > 0) c.moe_expert_rank_capacity_factor = receive_factor;
        if (echo_slots > 0) c.moe_enable_echo = true, c.moe_num_echo_experts = echo_slots * ep;
        std::unique_ptr<DeviceComm> dc = make_device_comm(world);  // NCCL: selects this process's GPU
        double ep1_ms = 0;
        if (real_ranks) ep1_ms = time_ep1();
        auto layer = CudaMoeLayer::create(c, Tr, 1, true, dc.get());
        fill_layer(*layer, Tr, p, o, r);
        // No rank starts a step (whose device barriers spin) while another still allocates or synchronises.
        world.barrier();
        cudaStream_t s;
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        cudaEvent_t e0, e1;
        MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
        MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
        std::vector<double> mine, walls;
        // A step of the budgeted dispatcher is checked at its end and re-run through alltoall on an overflow
        // (budget_step.h): the time of an overflowing step includes its re-run, so it is a valid step.
        const auto step = [&] {
            layer->forward(s, true);
            layer->backward(s);
        };
        int64_t overflowed_steps = 0, peak_rows = 0;
        const auto checked_step = [&] {
            const BudgetStatus st = run_budgeted_cuda_step(*layer, s, step, /*log=*/false);
            overflowed_steps += st.overflow ? 1 : 0, peak_rows = std::max(peak_rows, st.peak_rows);
        };
        for (int it = 0; it < o.warmup + o.iters; ++it) {
            world.barrier();
            const auto t0 = std::chrono::steady_clock::now();
            MOEKIT_CUDA_CHECK(cudaEventRecord(e0, s));
            checked_step();
            MOEKIT_CUDA_CHECK(cudaEventRecord(e1, s));
            MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
            world.barrier();  // the step ends when the last rank's stream is done
            const double w = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
            float ms = 0;
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= o.warmup) mine.push_back(ms), walls.push_back(w);
        }
        // Stage timing (events only; the ranks still run together).
        layer->enable_stage_timing(true);
        std::vector<double> expert, dispatch, combine, router;
        for (int it = 0; it < o.iters; ++it) {
            world.barrier();
            checked_step();
            const StageTimesMs f = layer->forward_times_ms(), g = layer->backward_times_ms();
            const auto experts = {LayerStage::fc1, LayerStage::activation, LayerStage::fc2};
            expert.push_back(stage_sum(f, experts) + stage_sum(g, experts));
            dispatch.push_back(f[size_t(LayerStage::permute)] + g[size_t(LayerStage::permute)]);
            combine.push_back(f[size_t(LayerStage::combine)] + g[size_t(LayerStage::combine)]);
            router.push_back(f[size_t(LayerStage::router)] + g[size_t(LayerStage::router)]);
        }
        layer->enable_stage_timing(false);
        const BudgetStatus budget = layer->end_dispatch_step();
        // The budgeted step has no host sync: capture it (every rank its own graph) and time the replays. A
        // replay that overflowed is not a valid step (rows past the budget were not moved): then no graph time.
        std::vector<double> graph_walls;
        bool graph_overflowed = false;
        if (sync_free) {
            cudaGraph_t g = nullptr;
            cudaGraphExec_t ge = nullptr;
            MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            layer->forward(s, true);
            layer->backward(s);
            MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
            MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&ge, g, cudaGraphInstantiateFlagUseNodePriority));
            world.barrier();  // no rank replays (and spins) while another still instantiates (loads kernels)
            for (int it = 0; it < o.warmup + o.iters; ++it) {
                world.barrier();
                const auto t0 = std::chrono::steady_clock::now();
                MOEKIT_CUDA_CHECK(cudaGraphLaunch(ge, s));
                MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
                graph_overflowed = graph_overflowed || layer->end_dispatch_step().overflow;
                world.barrier();
                if (it >= o.warmup)
                    graph_walls.push_back(
                        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
            }
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
        }
        const BudgetStatus after = layer->end_dispatch_step();
        const EchoStepSummary echo = layer->echo_summary();
        const std::vector<int64_t> counts = layer->read_tokens_per_expert();
        const DispatchTraffic traffic = layer->traffic();
        const LayerMemory mem = layer->memory();
        // Reference for the bytes: the same payload through the transport's own all-to-all, split evenly over
        // the peers (NCCL: grouped send/recv, what ncclAlltoAll does; virtual ranks: peer device copies).
        const double a2a_ms = transport_all_to_all_ms(*dc, world, traffic.bytes_sent, s, o);
        nlohmann::json j{{"rank", r},
                         {"step_ms", median(mine)},
                         {"expert_ms", median(expert)},
                         {"dispatch_ms", median(dispatch)},
                         {"combine_ms", median(combine)},
                         {"router_ms", median(router)},
                         {"bytes_sent", traffic.bytes_sent},
                         {"host_syncs_per_step", traffic.host_syncs},
                         {"memory_bytes", mem.workspace_bytes},
                         {"transport_a2a_ms", a2a_ms},
                         {"ep1_step_ms", ep1_ms},
                         {"overflowed_steps", overflowed_steps},
                         {"overflow", overflowed_steps > 0 || budget.overflow || after.overflow || graph_overflowed},
                         {"budget_rows", budget.budget_rows},
                         {"peak_rows", std::max({peak_rows, budget.peak_rows, after.peak_rows})}};
        if (!graph_walls.empty() && !graph_overflowed) j["graph_whole_step_ms"] = median(graph_walls);
        if (echo_slots > 0)
            j["echo"] = {{"clones", echo.clones}, {"load_before", echo.load_before}, {"load_after", echo.load_after}};
        int64_t routed = 0;
        for (int64_t v : counts) routed += v;
        j["rows_routed"] = routed;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
        // Every rank's row on every rank (MPI ranks are separate processes).
        const std::string mine_json = j.dump();
        const auto all = world.all_gather_v(std::vector<char>(mine_json.begin(), mine_json.end()));
        std::lock_guard<std::mutex> lock(mutex);
        for (size_t q = 0; q < all.size(); ++q) ranks[q] = nlohmann::json::parse(std::string(all[q].begin(), all[q].end()));
        if (r == 0) wall = walls;
    });
    out["ranks"] = ranks;
    if (real_ranks) out["ep1_step_ms"] = ranks[0]["ep1_step_ms"];
    out["scaling"] = real_ranks ? "weak: T tokens per GPU" : "strong: T/EP tokens per virtual rank, one GPU";
    out["whole_step_ms"] = median(wall);
    out["whole_step_vs_ep1"] = out["whole_step_ms"].get<double>() / out["ep1_step_ms"].get<double>();
    if (ranks[0].contains("graph_whole_step_ms")) {
        out["graph_whole_step_ms"] = ranks[0]["graph_whole_step_ms"];
        out["graph_whole_step_vs_ep1"] = out["graph_whole_step_ms"].get<double>() / out["ep1_step_ms"].get<double>();
    }
    out["dispatch_blocks"] = sync_free ? kBudgetedDispatchBlocks : 0;
    if (ranks[0].contains("echo")) {
        const auto mom = [](const std::vector<int64_t>& v) {
            int64_t sum = 0, mx = 0;
            for (int64_t x : v) sum += x, mx = std::max(mx, x);
            return sum > 0 ? double(mx) * double(v.size()) / double(sum) : 1.0;
        };
        const nlohmann::json& e = ranks[0]["echo"];
        out["echo_clones"] = e["clones"];
        out["rank_load_max_over_mean_before"] = mom(e["load_before"].get<std::vector<int64_t>>());
        out["rank_load_max_over_mean_after"] = mom(e["load_after"].get<std::vector<int64_t>>());
    }
    int64_t bytes = 0;
    double max_expert = 0, sum_expert = 0;
    for (const auto& j : ranks) {
        bytes += j["bytes_sent"].get<int64_t>();
        max_expert = std::max(max_expert, j["expert_ms"].get<double>());
        sum_expert += j["expert_ms"].get<double>();
    }
    out["bytes_sent_total"] = bytes;
    out["expert_ms_max_over_mean"] = sum_expert > 0 ? max_expert / (sum_expert / ep) : 0.0;
    return out;
}

std::string format_layer_ep_table(const nlohmann::json& r) {
    std::string out = str("moekit bench --preset ", r["preset"].get<std::string>(), " --expert-model-parallel-size ",
                          r["ep"].get<int>(), " --virtual-ranks ", r["ep"].get<int>(), " --moe-token-dispatcher-type ",
                          r["dispatcher"].get<std::string>(), "  (T ", r["T"].get<int64_t>(), " = ",
                          r["tokens_per_rank"].get<int64_t>(), " per rank) on ", r["device"].get<std::string>(),
                          " (all ranks share it)\n");
    char line[256];
    // GB/s: the bytes this rank sent over its dispatch + combine time (both directions), and over the
    // transport's all-to-all of the same bytes.
    std::snprintf(line, sizeof line, "  %-5s %10s %10s %10s %10s %10s %12s %8s %10s %8s %6s %9s\n", "rank", "step ms",
                  "router", "dispatch", "experts", "combine", "sent MiB", "GB/s", "a2a ms", "a2a GB/s", "syncs",
                  "mem MiB");
    out += line;
    for (const auto& j : r["ranks"]) {
        const double sent = double(j["bytes_sent"].get<int64_t>()), moved_ms = j["dispatch_ms"].get<double>() +
                                                                                   j["combine_ms"].get<double>();
        const double a2a_ms = j["transport_a2a_ms"].get<double>();
        std::snprintf(line, sizeof line,
                      "  %-5d %10.3f %10.3f %10.3f %10.3f %10.3f %12.2f %8.1f %10.3f %8.1f %6lld %9.0f\n",
                      j["rank"].get<int>(), j["step_ms"].get<double>(), j["router_ms"].get<double>(),
                      j["dispatch_ms"].get<double>(), j["expert_ms"].get<double>(), j["combine_ms"].get<double>(),
                      sent / (1 << 20), moved_ms > 0 ? sent / moved_ms / 1e6 : 0.0, a2a_ms,
                      a2a_ms > 0 ? sent / a2a_ms / 1e6 : 0.0,
                      static_cast<long long>(j["host_syncs_per_step"].get<int64_t>()),
                      double(j["memory_bytes"].get<int64_t>()) / (1 << 20));
        out += line;
    }
    std::snprintf(line, sizeof line,
                  "  whole EP step %.3f ms vs EP=1 on all tokens %.3f ms (x%.2f); %.1f MiB sent per step; expert "
                  "time max/mean over ranks %.3f\n",
                  r["whole_step_ms"].get<double>(), r["ep1_step_ms"].get<double>(),
                  r["whole_step_vs_ep1"].get<double>(), double(r["bytes_sent_total"].get<int64_t>()) / (1 << 20),
                  r["expert_ms_max_over_mean"].get<double>());
    out += line;
    if (r.contains("echo_clones")) {
        std::snprintf(line, sizeof line, "  ECHO (%lld spare slots per rank, zipf %.2f): %lld clones, rank load max/mean %.3f -> %.3f\n",
                      static_cast<long long>(r["echo_slots_per_rank"].get<int64_t>()), r["zipf_s"].get<double>(),
                      static_cast<long long>(r["echo_clones"].get<int64_t>()),
                      r["rank_load_max_over_mean_before"].get<double>(), r["rank_load_max_over_mean_after"].get<double>());
        out += line;
    }
    const nlohmann::json& r0 = r["ranks"][0];
    if (r0["overflow"].get<bool>()) {
        std::snprintf(line, sizeof line,
                      "  overflow: %lld eager steps exceeded the budget of %lld rows (peak %lld) and were re-run through "
                      "alltoall (their time includes the re-run)%s\n",
                      static_cast<long long>(r0["overflowed_steps"].get<int64_t>()),
                      static_cast<long long>(r0["budget_rows"].get<int64_t>()),
                      static_cast<long long>(r0["peak_rows"].get<int64_t>()),
                      r.contains("graph_whole_step_ms") ? "" : "; graph replays overflowed: no graph time");
        out += line;
    }
    if (r.contains("graph_whole_step_ms")) {
        std::snprintf(line, sizeof line,
                      "  budgeted (factor %.2f, %d dispatch blocks): whole step in one graph per rank %.3f ms (x%.2f "
                      "EP=1), no overflow\n",
                      r["receive_factor"].get<double>(), r["dispatch_blocks"].get<int>(),
                      r["graph_whole_step_ms"].get<double>(), r["graph_whole_step_vs_ep1"].get<double>());
        out += line;
    }
    return out;
}

}  // namespace moekit::cuda::bench
