// Device-initiated dispatch + combine against the transport's all-to-all of the same bytes (issues 12 and 13).
// Each rank routes its T tokens to k distinct experts drawn uniformly from E (the dsv3 shape by default: 4096
// tokens a rank, hidden 7168, top-8 of 256), builds the layer's routing plan, and times the budgeted (sync-free)
// dispatcher's forward dispatch (permute, count exchange, device barrier, plan, pushes into the peers' symmetric
// buffers, barrier) and combine (rows pushed back, barrier, the sum per token) with identity experts, for each
// --blocks value (the copy kernels' blocks, so the SMs they take); then one all_to_all_v of the dispatch bytes
// plus one of the combine bytes through the transport, and both in one call (NCCL under mpirun: grouped
// ncclSend/ncclRecv, which is what ncclAlltoAll does); the faster is the reference. GB/s = bytes this rank sent to
// other ranks / time. Every timed step is checked: no
// overflow, and every token's combined row equals k times its own row (bf16), so bytes that did not arrive fail.
// usage: mpirun -np N bench_dispatch [--tokens 4096] [--hidden 7168] [--experts 256] [--topk 8] [--factor 1.25]
//          [--blocks 16,24,32,64] [--iters 20] [--warmup 3] [--seed 1] [--json FILE]
//        bench_dispatch --virtual-ranks N ...   (N ranks on one GPU, the local-gpu transport)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/device_comm.h"
#include "core/rng.h"
#include "cuda/combine.cuh"
#include "cuda/device_buffer.h"
#include "cuda/dispatcher.h"
#include "io/atomic_file.h"
#include "lib/bench_flags.h"
#include "lib/bench_main.h"
#include "lib/bench_util.cuh"
#include "moekit/comm.h"
#include "moekit/error.h"

namespace {

using namespace moekit;
using cuda::DeviceBuffer;
using cuda::bench::bf16;
using cuda::bench::median;
using moekit::bench::parse_int_flag;
using moekit::bench::parse_int_list_flag;
using moekit::bench::parse_run_flag;
using moekit::bench::require_json_directory;

struct Options {
    int64_t tokens = 4096, hidden = 7168, experts = 256, topk = 8;
    double factor = 1.25;
    std::vector<int64_t> blocks{16, 24, 32, 64};
    int iters = 20, warmup = 3, virtual_ranks = 0;
    uint64_t seed = 1;
    std::string json_path;
};

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            MOEKIT_REQUIRE(i + 1 < argc, a, " needs a value");
            return argv[++i];
        };
        if (a == "--tokens") {
            o.tokens = parse_int_flag(a, value(), 1);
        } else if (a == "--hidden") {
            o.hidden = parse_int_flag(a, value(), 8);
        } else if (a == "--experts") {
            o.experts = parse_int_flag(a, value(), 1);
        } else if (a == "--topk") {
            o.topk = parse_int_flag(a, value(), 1);
        } else if (a == "--factor") {
            const std::string v = value();
            char* end = nullptr;
            o.factor = std::strtod(v.c_str(), &end);
            MOEKIT_REQUIRE(end && *end == '\0' && std::isfinite(o.factor) && o.factor > 0, "--factor=", v,
                           " must be a number > 0 (the receive budget, --moe-expert-rank-capacity-factor)");
        } else if (a == "--blocks") {
            o.blocks = parse_int_list_flag(a, value(), 1);
        } else if (a == "--virtual-ranks") {
            o.virtual_ranks = int(parse_int_flag(a, value(), 2));
        } else if (!parse_run_flag(a, value, o.iters, o.warmup, o.seed, o.json_path)) {
            throw UsageError("unknown flag " + a +
                             " (flags: --tokens T, --hidden H, --experts E, --topk K, --factor F, --blocks 16,24,32, "
                             "--iters N, --warmup N, --seed N, --virtual-ranks N, --json FILE)");
        }
    }
    MOEKIT_REQUIRE(o.hidden % 8 == 0, "--hidden=", o.hidden, " must be a multiple of 8 (rows move as 16-byte vectors)");
    MOEKIT_REQUIRE(o.topk <= o.experts, "--topk=", o.topk, " must be <= --experts=", o.experts);
    if (!o.json_path.empty()) require_json_directory(o.json_path);
    return o;
}

// This rank's routing: k distinct experts a token, uniform; probs uniform (combine does not weigh by them).
struct Routing {
    std::vector<uint8_t> map;     // [T, E]
    std::vector<float> probs;     // [T, E]
    std::vector<int64_t> counts;  // [E]
};

Routing draw_routing(const Options& o, int rank) {
    const int64_t T = o.tokens, E = o.experts;
    Routing r{std::vector<uint8_t>(size_t(T * E), 0), std::vector<float>(size_t(T * E), 0.f),
              std::vector<int64_t>(size_t(E), 0)};
    Rng rng(o.seed, 1000 + uint64_t(rank));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < o.topk;) {
            const int64_t e = rng.below(E);
            if (r.map[size_t(t * E + e)]) continue;
            r.map[size_t(t * E + e)] = 1, r.probs[size_t(t * E + e)] = float(rng.uniform()), ++r.counts[size_t(e)], ++j;
        }
    return r;
}

// The layer's routing plan of `routing`, in device buffers owned here.
struct PlanBuffers {
    DeviceBuffer<uint8_t> map;
    DeviceBuffer<float> probs, row_prob;
    DeviceBuffer<int32_t> counts, offsets, rank, row_token, token_offsets, token_rows, token_counts, scratch;
    cuda::RoutingPlan<float> plan;

    PlanBuffers(const Routing& r, int64_t T, int64_t E, int64_t K)
        : map(T * E),
          probs(T * E),
          row_prob(T * K),
          counts(E),
          offsets(E + 1),
          rank(T * E),
          row_token(T * K),
          token_offsets(T + 1),
          token_rows(T * K),
          token_counts(T),
          scratch(cuda::routing_plan_scratch_elems(T, E)) {
        map.upload(r.map), probs.upload(r.probs);
        plan.num_tokens = T, plan.num_experts = E, plan.max_rows = T * K;
        plan.counts = counts.get(), plan.offsets = offsets.get(), plan.rank = rank.get(),
        plan.row_token = row_token.get();
        plan.row_prob = row_prob.get(), plan.token_offsets = token_offsets.get(), plan.token_rows = token_rows.get();
        plan.token_counts = token_counts.get(), plan.chunk_scratch = scratch.get();
        cuda::build_routing_plan<float>(map.get(), probs.get(), plan, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    }
};

// Per-peer bytes of the transport's all-to-all reference (packed in peer order, host arrays).
struct PeerBytes {
    std::vector<int64_t> send, recv;
    int64_t sent() const {
        int64_t n = 0;
        for (int64_t b : send) n += b;
        return n;
    }
};

// Median ms of the transport's all-to-all of the same bytes: one call a phase (dispatch, then combine), or
// both phases' bytes in one call; the benchmark compares with the faster of the two.
double transport_ms(cuda::DeviceComm& dc, Communicator& world, const std::vector<PeerBytes>& calls, const Options& o,
                    cudaStream_t s) {
    int64_t out = 16, in = 16;
    for (const PeerBytes& c : calls) {
        int64_t r = 0;
        for (int64_t b : c.recv) r += b;
        out = std::max(out, c.sent()), in = std::max(in, r);
    }
    DeviceBuffer<char> a(out), b(in);
    return cuda::time_ms_after([&] { world.barrier(); },
                               [&] {
                                   for (const PeerBytes& c : calls)
                                       dc.all_to_all_v(a.get(), c.send.data(), b.get(), c.recv.data(), s);
                               },
                               s, o.warmup, o.iters);
}

// bf16(k * x): what combine gives a token whose k rows are its own row (the fp32 sum of k equal bf16 values is
// exact for k < 2^16, then rounded once).
bool combined_rows_match(const std::vector<bf16>& hidden, const std::vector<bf16>& out, int64_t k) {
    for (size_t i = 0; i < hidden.size(); ++i)
        if (__bfloat162float(__float2bfloat16(float(k) * __bfloat162float(hidden[i]))) != __bfloat162float(out[i]))
            return false;
    return true;
}

nlohmann::json run_rank(Communicator& world, const Options& o) {
    const int n = world.size(), me = world.rank();
    const int64_t T = o.tokens, H = o.hidden, E = o.experts, K = o.topk;
    MOEKIT_REQUIRE(n >= 2 && E % n == 0, "bench_dispatch needs >= 2 ranks dividing --experts=", E, "; got ", n);
    std::unique_ptr<cuda::DeviceComm> dc = cuda::make_device_comm(world);  // NCCL: selects this rank's GPU
    const Routing routing = draw_routing(o, me);
    PlanBuffers pb(routing, T, E, K);
    DeviceBuffer<bf16> hidden(T * H), out(T * H);
    cuda::fill_uniform(hidden.get(), size_t(T * H), 1.f, o.seed + 77 * uint64_t(me + 1));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16> hidden_host = hidden.download();

    // Rows to and from each peer (the counts of every rank), and the bytes they make.
    const int64_t L = E / n;
    const std::vector<int64_t> all_counts = world.all_gather(routing.counts);
    std::vector<int64_t> rows_to(size_t(n), 0), rows_from(size_t(n), 0);
    for (int q = 0; q < n; ++q)
        for (int64_t e = 0; e < E; ++e) {
            if (q != me && e / L == q) rows_to[size_t(q)] += routing.counts[size_t(e)];
            if (q != me && e / L == me) rows_from[size_t(q)] += all_counts[size_t(q * E + e)];
        }
    // Dispatch: a row, its prob (fp32) and its source row (int32); combine: the row back.
    const int64_t dispatch_row_bytes = 2 * H + 4 + 4, combine_row_bytes = 2 * H;
    PeerBytes dispatch{std::vector<int64_t>(size_t(n), 0), std::vector<int64_t>(size_t(n), 0)}, combine = dispatch,
                                                                                                both = dispatch;
    for (int q = 0; q < n; ++q) {
        const size_t p = size_t(q);
        dispatch.send[p] = rows_to[p] * dispatch_row_bytes, dispatch.recv[p] = rows_from[p] * dispatch_row_bytes;
        combine.send[p] = rows_from[p] * combine_row_bytes, combine.recv[p] = rows_to[p] * combine_row_bytes;
        both.send[p] = dispatch.send[p] + combine.send[p], both.recv[p] = dispatch.recv[p] + combine.recv[p];
    }
    const int64_t sent = both.sent();
    cudaStream_t s;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2;
    MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&e2));
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t blocks : o.blocks) {
        cuda::RouterShape rs;
        rs.num_tokens = T, rs.seq_length = T, rs.num_experts = E, rs.hidden = H, rs.topk = K;
        cuda::DispatchShape ds{rs, T * K, n, me, o.factor};
        ds.dispatch_blocks = int(blocks);
        auto disp = cuda::make_cuda_dispatcher<float>("alltoall", ds, dc.get());
        world.barrier();
        std::vector<double> dispatch_ms, combine_ms;
        bool ok = true, overflow = false;
        // The first eager step runs the synchronous path (the dispatcher's warm-up), then the device path.
        for (int it = 0; it < 1 + o.warmup + o.iters; ++it) {
            MOEKIT_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, size_t(T * H) * sizeof(bf16), s));
            MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
            world.barrier();
            MOEKIT_CUDA_CHECK(cudaEventRecord(e0, s));
            const cuda::ExpertInput<float> in = disp->dispatch(pb.plan, pb.map.get(), pb.probs.get(), hidden.get(), s);
            MOEKIT_CUDA_CHECK(cudaEventRecord(e1, s));
            disp->combine(pb.plan, in.rows, nullptr, nullptr, out.get(), s);  // identity experts
            MOEKIT_CUDA_CHECK(cudaEventRecord(e2, s));
            MOEKIT_CUDA_CHECK(cudaEventSynchronize(e2));
            const cuda::BudgetStatus st = disp->end_step();
            overflow = overflow || st.overflow;
            float d = 0, c = 0;
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&d, e0, e1));
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&c, e1, e2));
            if (it > o.warmup) dispatch_ms.push_back(d), combine_ms.push_back(c);
            if (it == 0 || it == o.warmup + o.iters) ok = ok && combined_rows_match(hidden_host, out.download(), K);
        }
        const double d = median(dispatch_ms), c = median(combine_ms);
        rows.push_back({{"blocks", blocks},
                        {"dispatch_ms", d},
                        {"combine_ms", c},
                        {"gbps", sent / (d + c) / 1e6},
                        {"combined_rows_exact", ok},
                        {"overflow", overflow}});
    }
    const double a2a_two = transport_ms(*dc, world, {dispatch, combine}, o, s);
    const double a2a_one = transport_ms(*dc, world, {both}, o, s);
    const double a2a = std::min(a2a_two, a2a_one);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
    cudaDeviceProp prop{};
    MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dc->device()));
    return {{"rank", me},
            {"device", prop.name},
            {"sms", prop.multiProcessorCount},
            {"transport", dc->transport()},
            {"bytes_sent", sent},
            {"transport_ms", a2a},
            {"transport_two_calls_ms", a2a_two},
            {"transport_one_call_ms", a2a_one},
            {"transport_gbps", sent / a2a / 1e6},
            {"configs", rows}};
}

std::string table(const nlohmann::json& r) {
    char line[320];
    std::string out;
    const nlohmann::json& r0 = r["ranks"][0];
    std::snprintf(line, sizeof line,
                  "bench_dispatch: EP=%d on %s (%s), T=%lld tokens a rank, H=%lld, top-%lld of %lld experts, receive "
                  "factor %.2f\n",
                  int(r["ranks"].size()), r0["device"].get<std::string>().c_str(),
                  r0["transport"].get<std::string>().c_str(), static_cast<long long>(r["tokens"].get<int64_t>()),
                  static_cast<long long>(r["hidden"].get<int64_t>()), static_cast<long long>(r["topk"].get<int64_t>()),
                  static_cast<long long>(r["experts"].get<int64_t>()), r["factor"].get<double>());
    out += line;
    // a2a: the transport's all-to-all of the same bytes, two calls (dispatch, combine) / one call; GB/s of the faster.
    std::snprintf(line, sizeof line, "  %-5s %6s %9s %12s %11s %10s %15s %9s %8s %6s %6s\n", "rank", "blocks",
                  "sent MiB", "dispatch ms", "combine ms", "GB/s sent", "a2a ms (2 / 1)", "a2a GB/s", "vs a2a", "exact",
                  "ovfl");
    out += line;
    for (const auto& j : r["ranks"])
        for (const auto& c : j["configs"]) {
            std::snprintf(
                line, sizeof line, "  %-5d %6lld %9.1f %12.3f %11.3f %10.1f %7.3f / %5.3f %9.1f %8.2f %6s %6s\n",
                j["rank"].get<int>(), static_cast<long long>(c["blocks"].get<int64_t>()),
                double(j["bytes_sent"].get<int64_t>()) / (1 << 20), c["dispatch_ms"].get<double>(),
                c["combine_ms"].get<double>(), c["gbps"].get<double>(), j["transport_two_calls_ms"].get<double>(),
                j["transport_one_call_ms"].get<double>(), j["transport_gbps"].get<double>(),
                c["gbps"].get<double>() / j["transport_gbps"].get<double>(),
                c["combined_rows_exact"].get<bool>() ? "yes" : "NO", c["overflow"].get<bool>() ? "YES" : "no");
            out += line;
        }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    return cuda::bench::bench_main("bench_dispatch", [&] {
        const Options o = parse(argc, argv);
        std::mutex mutex;
        nlohmann::json result{{"tokens", o.tokens}, {"hidden", o.hidden}, {"experts", o.experts},
                              {"topk", o.topk},     {"factor", o.factor}, {"iters", o.iters}};
        std::vector<nlohmann::json> ranks;  // filled where rank 0 runs (the process, or its virtual rank's thread)
        const auto body = [&](Communicator& world) {
            const nlohmann::json mine = run_rank(world, o);
            const std::string text = mine.dump();
            const auto all = world.all_gather_v(std::vector<char>(text.begin(), text.end()));
            if (world.rank() != 0) return;
            std::lock_guard<std::mutex> lock(mutex);
            for (const auto& a : all) ranks.push_back(nlohmann::json::parse(std::string(a.begin(), a.end())));
        };
        if (comm::mpi_launched()) {
            MOEKIT_REQUIRE(o.virtual_ranks == 0, "--virtual-ranks and mpirun exclude each other");
            body(comm::mpi_world());
        } else {
            MOEKIT_REQUIRE(o.virtual_ranks >= 2, "start under mpirun -np N, or give --virtual-ranks N (one GPU)");
            comm::run_virtual_ranks(o.virtual_ranks, body);
        }
        if (ranks.empty()) return 0;  // another MPI rank: rank 0 reports
        result["ranks"] = ranks;
        std::fputs(table(result).c_str(), stdout);
        bool ok = true;
        for (const auto& j : ranks)
            for (const auto& c : j["configs"])
                ok = ok && c["combined_rows_exact"].get<bool>() && !c["overflow"].get<bool>();
        if (!o.json_path.empty()) io::write_file_atomically(o.json_path, result.dump(2));
        if (!ok)
            std::fprintf(stderr, "bench_dispatch: a combined row differs from k x its token (or a step overflowed)\n");
        return ok ? 0 : 1;
    });
}
