// ECHO planner kernel (see echo_plan.cuh): one block. Per-expert and per-rank statistics and the walk
// orders are computed one entry per thread; the waterfill search tests kEchoSearchWays targets per round,
// one per thread, each a scalar-state walk over the spilling experts; thread 0 records the plan; the
// source split and the loads after are again one entry per thread.
#include "core/echo_plan_math.h"
#include "cuda/cuda_check.h"
#include "cuda/echo_plan.cuh"
#include "moekit/error.h"

namespace moekit::cuda {

namespace {

constexpr int kEchoThreads = kEchoSearchWays;  // one search candidate per thread
constexpr size_t kMaxSharedBytes = 48 * 1024;  // without an opt-in attribute (not set inside a capture)

// Dynamic shared memory: int64 total[E], load[EP], ahead[E], key[E], slot_tokens[EP*S]; int32 expert_order[E],
// rank_order[EP], slot_expert[EP*S]; uint8 feasible[kEchoSearchWays]. The slots are planned in shared memory
// (the split reads them hundreds of times per thread) and copied out at the end.
size_t shared_bytes(const EchoDims& d) {
    return size_t(3 * d.num_experts + d.ep + d.num_slots()) * sizeof(int64_t) +
           size_t(d.num_experts + d.ep + d.num_slots()) * sizeof(int32_t) + kEchoSearchWays;
}

__global__ void __launch_bounds__(kEchoThreads)
    echo_plan_kernel(EchoDims d, EchoAlgorithm algorithm, const int64_t* __restrict__ counts, EchoDevicePlan out) {
    extern __shared__ int64_t smem[];
    const int64_t E = d.num_experts, EP = d.ep, slots = d.num_slots();
    int64_t* total = smem;
    int64_t* load = total + E;
    int64_t* ahead = load + EP;
    int64_t* key = ahead + E;
    int64_t* slot_tokens = key + E;
    int32_t* expert_order = reinterpret_cast<int32_t*>(slot_tokens + slots);
    int32_t* rank_order = expert_order + E;
    int32_t* slot_expert = rank_order + EP;
    uint8_t* feasible = reinterpret_cast<uint8_t*>(slot_expert + slots);
    __shared__ int64_t mean_floor, lo, hi;
    __shared__ bool stop;
    const int tid = threadIdx.x, nt = blockDim.x;

    // Statistics.
    for (int64_t e = tid; e < E; e += nt) total[e] = echo_expert_total(d, counts, e);
    __syncthreads();
    for (int64_t r = tid; r < EP; r += nt) load[r] = echo_rank_load(d, total, r);
    for (int64_t e = tid; e < E; e += nt) ahead[e] = echo_ahead_sum(d, total, e);
    for (int64_t j = tid; j < slots; j += nt) slot_expert[j] = -1, slot_tokens[j] = 0;
    __syncthreads();
    if (tid == 0) {
        int64_t sum = 0, mx = 0;
        for (int64_t r = 0; r < EP; ++r) sum += load[r], mx = load[r] > mx ? load[r] : mx;
        mean_floor = sum / EP, lo = echo_search_floor(d, sum), hi = mx, stop = false;
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += nt) key[e] = echo_walk_key(d, algorithm, total, load, ahead, e, mean_floor);
    for (int64_t r = tid; r < EP; r += nt) {
        rank_order[echo_asc_position(load, EP, r)] = int32_t(r);
        out.rank_load_before[r] = load[r];
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += nt) expert_order[echo_desc_position(key, E, e)] = int32_t(e);
    __syncthreads();

    // Targets and the recorded walk.
    if (algorithm == EchoAlgorithm::greedy) {
        if (tid == 0) {
            hi = mean_floor;
            echo_walk(d, false, mean_floor, total, load, ahead, expert_order, rank_order, slot_expert, slot_tokens);
        }
    } else {
        while (true) {
            const int64_t l = lo, h = hi;  // the same for every thread: read after a barrier
            if (h - l <= 1 || stop) break;
            for (int64_t i = tid; i < kEchoSearchWays; i += nt) {
                const int64_t cand = echo_search_candidate(l, h, i, kEchoSearchWays);
                feasible[i] = cand >= 0 &&
                              echo_walk(d, true, cand, total, load, ahead, expert_order, rank_order, nullptr, nullptr);
            }
            __syncthreads();
            if (tid == 0) {
                int64_t nl = l, nh = h;
                stop = !echo_search_update(&nl, &nh, feasible, kEchoSearchWays);
                lo = nl, hi = nh;
            }
            __syncthreads();
        }
        if (tid == 0) echo_walk(d, true, hi, total, load, ahead, expert_order, rank_order, slot_expert, slot_tokens);
    }
    __syncthreads();

    // Source split, loads after, summary; the slots go out to global memory.
    for (int64_t e = tid; e < E; e += nt) {
        const int64_t h = echo_home_tokens(d, total, slot_expert, slot_tokens, e);
        echo_fill_interval(d, counts, e, 0, h, out.home_tokens + e, E);
    }
    for (int64_t j = tid; j < slots; j += nt) {
        const int64_t e = slot_expert[j];
        if (e < 0) {
            for (int64_t s = 0; s < EP; ++s) out.clone_tokens[s * slots + j] = 0;
        } else {
            const int64_t b = echo_slot_begin(d, total, slot_expert, slot_tokens, j);
            echo_fill_interval(d, counts, e, b, b + slot_tokens[j], out.clone_tokens + j, slots);
        }
        out.slot_expert[j] = slot_expert[j], out.slot_tokens[j] = slot_tokens[j];
    }
    for (int64_t r = tid; r < EP; r += nt)
        out.rank_load_after[r] = echo_rank_load_after(d, total, slot_expert, slot_tokens, r);
    if (tid == 0) {
        int64_t clones = 0;
        for (int64_t j = 0; j < slots; ++j) clones += slot_expert[j] >= 0;
        out.summary[0] = hi, out.summary[1] = clones;
    }
}

void launch_echo_plan_kernel(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts,
                             const EchoDevicePlan& plan, cudaStream_t stream) {
    const size_t bytes = shared_bytes(d);
    MOEKIT_REQUIRE(bytes <= kMaxSharedBytes, "ECHO planner on the GPU: EP=", d.ep, " E=", d.num_experts, " needs ",
                   bytes, " bytes of shared memory, more than the ", kMaxSharedBytes, " a single block gets");
    echo_plan_kernel<<<1, kEchoThreads, bytes, stream>>>(d, algorithm, counts, plan);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

}  // namespace

void echo_plan(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts, const EchoDevicePlan& plan,
               cudaStream_t stream) {
    MOEKIT_REQUIRE(d.ep >= 1 && d.num_experts > 0 && d.num_experts % d.ep == 0 && d.slots_per_rank >= 0,
                   "ECHO planner on the GPU: EP=", d.ep, " E=", d.num_experts, " S=", d.slots_per_rank,
                   " (needs EP >= 1, E > 0 divisible by EP, S >= 0)");
    MOEKIT_REQUIRE(algorithm == EchoAlgorithm::greedy || algorithm == EchoAlgorithm::waterfill,
                   "ECHO planner on the GPU: unknown algorithm ", int(algorithm));
    MOEKIT_CHECK(counts && plan.home_tokens && plan.rank_load_before && plan.rank_load_after && plan.summary &&
                     (d.slots_per_rank == 0 || (plan.slot_expert && plan.slot_tokens && plan.clone_tokens)),
                 "ECHO planner on the GPU: a device pointer of the plan is null");
    launch_echo_plan_kernel(d, algorithm, counts, plan, stream);
}

}  // namespace moekit::cuda
