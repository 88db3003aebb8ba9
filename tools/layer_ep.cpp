// run_layer_ranks (tools/layer_ep.h): `moekit layer` on N ranks, one micro-batch of the input per
// rank (split along B), the CPU pipeline (src/cpu/moe_pipeline.h) at EP = --expert-model-parallel-size,
// results gathered back into the original order. --device cuda runs each rank's micro-batch on the GPU
// layer (src/cuda/ep_rank_step.h): virtual ranks share the current GPU, MPI ranks use NCCL. Debug hook: MOEKIT_DEBUG_KILL_RANK=r makes rank r
// SIGKILL itself after the start-up check (tests/cpu/test_cmd_layer_ep.cpp: a killed rank ends the job).
#include "layer_ep.h"

#include <csignal>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/budget_step.h"
#include "cpu/moe_pipeline.h"
#include "moekit/error.h"
#if MOEKIT_WITH_CUDA
#include "cuda/ep_rank_step.h"
#endif

namespace moekit::tools {
namespace {

// The first line where two fingerprints differ (they are one "key=value" per line).
std::string first_difference(const std::string& a, const std::string& b) {
    size_t i = 0;
    while (true) {
        const size_t ea = a.find('\n', i), eb = b.find('\n', i);
        const std::string la = a.substr(i, ea == std::string::npos ? std::string::npos : ea - i);
        const std::string lb = b.substr(i, eb == std::string::npos ? std::string::npos : eb - i);
        if (la != lb || ea != eb) return la + " vs " + lb;
        if (ea == std::string::npos) return "(same text)";
        i = ea + 1;
    }
}

void check_same_everywhere(Communicator& world, const std::string& fingerprint) {
    const auto all = world.all_gather_v(std::vector<char>(fingerprint.begin(), fingerprint.end()));
    const std::string first(all[0].begin(), all[0].end());
    std::string report;
    for (size_t r = 1; r < all.size(); ++r) {
        const std::string mine(all[r].begin(), all[r].end());
        if (mine != first)
            report += str(report.empty() ? "" : "; ", "rank ", r, " has ", first_difference(mine, first), " on rank 0");
    }
    MOEKIT_REQUIRE(report.empty(), "the ranks were started with different configurations or files (", report,
                   "): every rank must get the same flags and read the same files");
}

template <typename T>
void all_reduce(Communicator& c, Matrix<T>& m) {
    c.all_reduce(m.data.data(), m.size());
}

// Rows of every rank's [S*Bl, cols] block -> [S*B, cols] in the original order (row s*B + r*Bl + b).
template <typename T>
Matrix<T> gather_batch(Communicator& world, const Matrix<T>& local, int64_t S, int64_t Bl) {
    const int N = world.size();
    const int64_t cols = local.cols;
    std::vector<T> all(static_cast<size_t>(local.size() * N));
    world.all_gather_bytes(local.data.data(), local.size() * int64_t(sizeof(T)), all.data());
    Matrix<T> out(S * Bl * N, cols);
    for (int r = 0; r < N; ++r)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t b = 0; b < Bl; ++b) {
                const T* src = all.data() + (size_t(r) * size_t(S * Bl) + size_t(s * Bl + b)) * size_t(cols);
                std::memcpy(out.row(s * Bl * N + r * Bl + b), src, size_t(cols) * sizeof(T));
            }
    return out;
}

// One rank's step, whatever the backend: its outputs, and grads already reduced over the groups.
template <typename T>
struct RankStep {
    Matrix<T> output, grad_input, probs;
    std::vector<uint8_t> routing_map;
    MoeWeights<T> grads;
    RoutingSummary summary;
    cpu::EpLayout layout;
};

template <typename T>
RankStep<T> cpu_rank_step(Communicator& world, const ProcessGroups& groups, const MoeConfig& config,
                          const MoeWeights<T>& weights, const LayerInput<T>& mine, const Matrix<T>& grad_mine,
                          LayerResults<T>& res) {
    cpu::MoePipeline<T> layer(config, groups);
    RankStep<T> r;
    // One step; with a receive budget, an overflow anywhere re-runs it through alltoall (budget_step.h).
    res.budget = cpu::run_budgeted_step<T>(layer, world, [&] {
        r.output = layer.forward(weights, mine);
        r.grads = zeros_like(weights);
        r.grad_input = layer.backward(weights, grad_mine, r.grads);
    });
    if (auto* b = dynamic_cast<cpu::BudgetStep*>(&layer.dispatcher()); b && b->has_budget()) {
        res.budgeted = true;
        res.overflow_events = b->overflow_events();
    }
    if (auto* echo = layer.echo_dispatcher(); echo && world.rank() == 0)  // --moe-enable-echo: what the plan did
        std::fprintf(stderr, "moekit layer: ECHO (EP group 0): %s; rank 0 sent %lld weight bytes, %lld grad bytes\n",
                     echo->stats().to_string().c_str(), (long long)layer.echo_experts()->traffic().weight_bytes,
                     (long long)layer.echo_experts()->traffic().grad_bytes);
    layer.reduce_gradients(r.grads);
    r.probs = layer.probs();
    r.routing_map = layer.routing_map();
    r.summary = layer.summary();
    r.layout = layer.layout();
    return r;
}

template <typename T>
RankStep<T> cuda_rank_step(const ProcessGroups& groups, const MoeConfig& config, const MoeWeights<T>& weights,
                           const LayerInput<T>& mine, const Matrix<T>& grad_mine) {
#if MOEKIT_WITH_CUDA
    if constexpr (std::is_same_v<T, float>) {
        cuda::EpRankStep s = cuda::run_ep_rank_step(config, groups, weights, mine, grad_mine);
        if (s.echo_clones > 0 && groups.world->rank() == 0) {  // what the device plan did (EP group 0)
            const auto max_over_mean = [](const std::vector<int64_t>& v) {
                int64_t sum = 0, mx = 0;
                for (int64_t x : v) sum += x, mx = std::max(mx, x);
                return sum > 0 ? double(mx) * double(v.size()) / double(sum) : 1.0;
            };
            std::fprintf(stderr, "moekit layer: ECHO on the GPU (EP group 0): %lld clones, rank load max/mean %.3f -> %.3f\n",
                         static_cast<long long>(s.echo_clones), max_over_mean(s.echo_load_before),
                         max_over_mean(s.echo_load_after));
        }
        if (s.overflow && groups.world->rank() == 0)
            std::fprintf(stderr, "moekit layer: the receive budget of %lld rows overflowed (peak %lld); the step was re-run\n",
                         static_cast<long long>(s.budget_rows), static_cast<long long>(s.peak_rows));
        RankStep<T> r{std::move(s.output), std::move(s.grad_input), std::move(s.probs), std::move(s.routing_map),
                      std::move(s.grads), std::move(s.summary), {}};
        r.layout = cpu::EpLayout{config.num_experts(), config.num_experts() / groups.ep_size(), groups.ep_size(),
                                 groups.ep_rank()};
        cpu::reduce_layer_gradients(groups, r.layout, r.grads);
        return r;
    }
#endif
    (void)groups, (void)config, (void)weights, (void)mine, (void)grad_mine;
    throw UsageError("--device cuda with several ranks needs a CUDA build and --dtype fp32");
}

}  // namespace

uint64_t digest_bytes(const void* data, size_t bytes, uint64_t seed) {
    uint64_t h = seed;
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

template <typename T>
LayerResults<T> run_layer_ranks(Communicator& world, const MoeConfig& config, const MoeWeights<T>& weights,
                                const LayerInput<T>& input, const Matrix<T>& grad_output,
                                const std::string& fingerprint, const std::string& device) {
    const int N = world.size(), rank = world.rank();
    check_same_everywhere(world, fingerprint);
    const int64_t S = input.seq_length, B = input.micro_batch_size, H = input.hidden.cols, E = config.num_experts();
    MOEKIT_REQUIRE(B % N == 0, "the input has B=", B, " sequences, not divisible by the ", N,
                   " ranks: the batch is split along B into one micro-batch per rank");
    const int64_t Bl = B / N;
    if (const char* kill = std::getenv("MOEKIT_DEBUG_KILL_RANK"); kill && std::atoi(kill) == rank) {
        std::fprintf(stderr, "moekit layer: rank %d: MOEKIT_DEBUG_KILL_RANK, sending SIGKILL to myself\n", rank);
        std::fflush(stderr);
        std::raise(SIGKILL);
    }

    // Micro-batch `rank`: columns [rank*Bl, rank*Bl + Bl) of [S, B].
    LayerInput<T> mine = input;
    mine.hidden = Matrix<T>(S * Bl, H);
    mine.micro_batch_size = Bl;
    Matrix<T> grad_mine(S * Bl, H);
    if (!input.padding_mask.empty()) mine.padding_mask.assign(size_t(S * Bl), 0);
    for (int64_t s = 0; s < S; ++s)
        for (int64_t b = 0; b < Bl; ++b) {
            const int64_t g = s * B + rank * Bl + b, l = s * Bl + b;
            std::memcpy(mine.hidden.row(l), input.hidden.row(g), size_t(H) * sizeof(T));
            std::memcpy(grad_mine.row(l), grad_output.row(g), size_t(H) * sizeof(T));
            if (!input.padding_mask.empty()) mine.padding_mask[size_t(l)] = input.padding_mask[size_t(g)];
        }
    MoeConfig rank_config = config;
    rank_config.micro_batch_size = Bl;

    const auto groups = make_process_groups(world, int(config.expert_model_parallel_size));
    LayerResults<T> res;
    RankStep<T> step = device == "cuda" ? cuda_rank_step(*groups, rank_config, weights, mine, grad_mine)
                                        : cpu_rank_step(world, *groups, rank_config, weights, mine, grad_mine, res);
    res.grads = std::move(step.grads);

    res.output = gather_batch(world, step.output, S, Bl);
    res.grad_input = gather_batch(world, step.grad_input, S, Bl);
    res.probs = gather_batch(world, step.probs, S, Bl);
    Matrix<uint8_t> map(S * Bl, E);
    map.data = step.routing_map;
    res.routing_map = gather_batch(world, map, S, Bl).data;
    res.tokens_per_expert = step.summary.tokens_per_expert;
    world.all_reduce(res.tokens_per_expert.data(), E);
    const std::vector<LossValues> losses = world.all_gather(std::vector<LossValues>{step.summary.losses});
    res.rank_losses = losses;

    // Expert grads live on their owners: EP rank j's block is taken from world rank j (EP group 0;
    // the other EP groups hold the same values after the expert-data-parallel reduction).
    const cpu::EpLayout& ep = step.layout;
    std::vector<T> local;
    for (int64_t e = ep.first_local_expert(); e < ep.first_local_expert() + ep.num_local_experts; ++e) {
        const auto& f1 = res.grads.fc1[size_t(e)].data;
        const auto& f2 = res.grads.fc2[size_t(e)].data;
        local.insert(local.end(), f1.begin(), f1.end());
        local.insert(local.end(), f2.begin(), f2.end());
    }
    const std::vector<T> all = world.all_gather(local);
    for (int owner = 0; owner < ep.ep_size; ++owner) {
        size_t at = size_t(owner) * local.size();
        for (int64_t l = 0; l < ep.num_local_experts; ++l) {
            const size_t e = size_t(owner * ep.num_local_experts + l);
            auto& f1 = res.grads.fc1[e].data;
            auto& f2 = res.grads.fc2[e].data;
            std::copy(all.begin() + long(at), all.begin() + long(at + f1.size()), f1.begin());
            at += f1.size();
            std::copy(all.begin() + long(at), all.begin() + long(at + f2.size()), f2.begin());
            at += f2.size();
        }
    }
    return res;
}

template LayerResults<float> run_layer_ranks<float>(Communicator&, const MoeConfig&, const MoeWeights<float>&,
                                                    const LayerInput<float>&, const Matrix<float>&, const std::string&,
                                                    const std::string&);
template LayerResults<double> run_layer_ranks<double>(Communicator&, const MoeConfig&, const MoeWeights<double>&,
                                                      const LayerInput<double>&, const Matrix<double>&,
                                                      const std::string&, const std::string&);

}  // namespace moekit::tools
