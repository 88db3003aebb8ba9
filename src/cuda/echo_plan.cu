// ECHO planner kernel (see echo_plan.cuh): one block of kEchoThreads. Every phase is one entry per thread
// or a warp-shuffle reduction; the only serial parts are the walks themselves: each search round tests
// kEchoSearchWays targets at once (one thread each, a flat one-piece-per-step walk over the precomputed
// list, src/core/echo_plan_math.h), the round's update is a block min/max, and thread 0 records the walk
// at the found target. A profiled instantiation stamps clock64() after each phase (bench_echo_plan).
#include "core/echo_plan_math.h"
#include "cuda/cuda_check.h"
#include "cuda/echo_plan.cuh"
#include "moekit/error.h"

namespace moekit::cuda {

namespace {

constexpr int kEchoThreads = 2 * kEchoSearchWays;  // the search uses the first kEchoSearchWays
constexpr int kEchoWarps = kEchoThreads / 32;
constexpr size_t kMaxSharedBytes = 48 * 1024;  // without an opt-in attribute (not set inside a capture)
static_assert(kEchoThreads >= kEchoSearchWays && kEchoThreads % 32 == 0, "one search candidate per thread");

// Dynamic shared memory: int64 total[E], key[E], home[E], list_base[E+1], list_cap[E+1], load[EP],
// recv_load[EP+2], slot_tokens[EP*S]; int32 list_expert[E+1], rank_order[EP], slot_expert[EP*S]. The slots are
// planned in shared memory (the split reads them many times) and copied out at the end.
size_t shared_bytes(const EchoDims& d) {
    const int64_t E = d.num_experts, EP = d.ep, slots = d.num_slots();
    return size_t(5 * E + 2 + 2 * EP + 2 + slots) * sizeof(int64_t) + size_t(E + 1 + EP + slots) * sizeof(int32_t);
}

// Lanes per expert in the per-expert loops that scan all sources or all experts: as many as the block
// has to spare (a power of two up to a warp), so E=256 in 512 threads uses two lanes per expert.
__device__ __forceinline__ int lanes_per_expert(int64_t E) {
    int g = 1;
    while (g < 32 && 2 * g * E <= kEchoThreads) g *= 2;
    return g;
}

__device__ __forceinline__ int64_t shfl_xor(int64_t v, int offset) {
    return int64_t(__shfl_xor_sync(0xffffffffu, (unsigned long long)v, offset));
}
__device__ __forceinline__ int64_t warp_sum(int64_t v) {
    for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
    return v;
}
__device__ __forceinline__ int64_t warp_max(int64_t v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, shfl_xor(v, o));
    return v;
}
__device__ __forceinline__ int64_t warp_min(int64_t v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, shfl_xor(v, o));
    return v;
}

// Every thread gets the block's min (kMin) or max of v: one value per warp into scratch[kEchoWarps], one
// barrier. Callers alternate two scratch arrays, so no second barrier is needed before the next use.
template <bool kMin>
__device__ __forceinline__ int64_t block_min_or_max(int64_t v, int64_t* scratch) {
    v = kMin ? warp_min(v) : warp_max(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    int64_t r = scratch[0];
#pragma unroll
    for (int w = 1; w < kEchoWarps; ++w) r = kMin ? min(r, scratch[w]) : max(r, scratch[w]);
    return r;
}

template <bool kProfile>
__global__ void __launch_bounds__(kEchoThreads)
    echo_plan_kernel(EchoDims d, EchoAlgorithm algorithm, const int64_t* __restrict__ counts, EchoDevicePlan out,
                     int64_t* __restrict__ profile) {
    extern __shared__ int64_t smem[];
    const int64_t E = d.num_experts, EP = d.ep, slots = d.num_slots();
    int64_t* total = smem;
    int64_t* key = total + E;
    int64_t* home = key + E;  // first each expert's walk base, then its tokens that stay home
    int64_t* list_base = home + E;
    int64_t* list_cap = list_base + E + 1;
    int64_t* load = list_cap + E + 1;
    int64_t* recv_load = load + EP;
    int64_t* slot_tokens = recv_load + EP + 2;
    int32_t* list_expert = reinterpret_cast<int32_t*>(slot_tokens + slots);
    int32_t* rank_order = list_expert + E + 1;
    int32_t* slot_expert = rank_order + EP;
    __shared__ int64_t red_a[kEchoWarps], red_b[kEchoWarps];
    __shared__ unsigned long long s_sum, s_listed, s_clones;
    __shared__ long long s_max;
    const int tid = threadIdx.x, nt = kEchoThreads;
    __shared__ int64_t stamp[kEchoPlanPhases + 1];  // thread 0's clock64() stamps (profiled instantiation)
    if (kProfile && tid == 0) stamp[0] = clock64();
    if (tid == 0) s_sum = 0, s_listed = 0, s_clones = 0, s_max = 0;
    const int g = lanes_per_expert(E), part = tid % g;

    // Phase 1, statistics: expert totals (g lanes per expert split the sources; integer sums, any order),
    // rank loads with their block sum and max.
    for (int64_t e0 = 0; e0 < E; e0 += nt / g) {  // uniform trip count: every lane reaches the shuffles
        const int64_t e = e0 + tid / g;
        int64_t sum = 0;
        if (e < E) {  // independent loads in flight: EP=64 over 2 lanes waits two memory latencies
#pragma unroll 16
            for (int64_t s = part; s < EP; s += g) sum += counts[s * E + e];
        }
        for (int o = 1; o < g; o <<= 1) sum += shfl_xor(sum, o);
        if (e < E && part == 0) total[e] = sum;
    }
    for (int64_t j = tid; j < slots; j += nt) slot_expert[j] = -1, slot_tokens[j] = 0;
    __syncthreads();
    {
        int64_t sum = 0, mx = 0;
        for (int64_t r = tid; r < EP; r += nt) {
            load[r] = echo_rank_cost(d, total, r);  // what the walk balances
            out.rank_load_before[r] = d.group_floor_rows > 0 ? echo_rank_load(d, total, r) : load[r];
            sum += load[r], mx = max(mx, load[r]);
        }
        sum = warp_sum(sum), mx = warp_max(mx);
        if ((tid & 31) == 0 && mx > 0) atomicAdd(&s_sum, (unsigned long long)sum), atomicMax(&s_max, (long long)mx);
    }
    __syncthreads();
    if (kProfile && tid == 0) stamp[1] = clock64();

    // Phase 2, the walk list and the receivers: keys, then positions (g lanes per expert), scattered.
    const int64_t all = int64_t(s_sum), max_before = s_max, mean_floor = all / EP;
    {
        int64_t listed = 0;
        for (int64_t e = tid; e < E; e += nt) {
            home[e] = echo_walk_base(d, total, load, e);
            key[e] = echo_list_key(algorithm, home[e], total[e], mean_floor);
            listed += key[e] >= 0;
        }
        listed = warp_sum(listed);
        if ((tid & 31) == 0 && listed > 0) atomicAdd(&s_listed, (unsigned long long)listed);
    }
    for (int64_t r = tid; r < EP; r += nt) {
        const int64_t pos = echo_asc_position(load, EP, r);
        rank_order[pos] = int32_t(r), recv_load[pos] = load[r];
    }
    if (tid == 0) recv_load[EP] = recv_load[EP + 1] = all;  // sentinels: no room at any target
    __syncthreads();
    for (int64_t e0 = 0; e0 < E; e0 += nt / g) {
        const int64_t e = e0 + tid / g;
        const bool listed = e < E && key[e] >= 0;
        int64_t pos = listed ? echo_desc_position_part(key, part, E, g, e) : 0;
        for (int o = 1; o < g; o <<= 1) pos += shfl_xor(pos, o);
        if (listed && part == 0) list_base[pos] = home[e], list_cap[pos] = total[e], list_expert[pos] = int32_t(e);
    }
    const int64_t n_listed = int64_t(s_listed);
    if (tid == 0) list_base[n_listed] = -1, list_cap[n_listed] = 0, list_expert[n_listed] = -1;  // sentinel
    __syncthreads();
    if (kProfile && tid == 0) stamp[2] = clock64();

    // Phase 3, the target: greedy's is floor(mean); waterfill searches kEchoSearchWays candidates a round.
    for (int64_t e = tid; e < E; e += nt) home[e] = total[e];  // minus the clones' tokens in phase 5
    int64_t target = mean_floor, rounds = 0;
    if (algorithm == EchoAlgorithm::waterfill) {
        int64_t lo = echo_search_floor(d, all), hi = max_before;  // the same in every thread
        while (hi - lo > 1) {
            int64_t cand = -1;
            bool feasible = false;
            if (tid < kEchoSearchWays) {
                cand = echo_search_candidate(lo, hi, tid, kEchoSearchWays);
                feasible = cand >= 0 && echo_walk<true, false>(d, all, cand, list_base, list_cap, list_expert,
                                                               recv_load, rank_order, nullptr, nullptr);
            }
            const int64_t new_hi = block_min_or_max<true>(echo_search_hi_term(cand, feasible, hi), red_a);
            const int64_t new_lo = block_min_or_max<false>(echo_search_lo_term(cand, feasible, new_hi, lo), red_b);
            const bool changed = new_lo != lo || new_hi != hi;
            lo = new_lo, hi = new_hi, ++rounds;
            if (!changed) break;  // cannot happen for a gap > 1 (echo_search_update)
        }
        target = hi;
    }
    if (kProfile && tid == 0) stamp[3] = clock64();

    // Phase 4, thread 0 records the walk at the target.
    if (tid == 0) {
        if (algorithm == EchoAlgorithm::greedy)
            echo_walk<false, true>(d, all, target, list_base, list_cap, list_expert, recv_load, rank_order,
                                   slot_expert, slot_tokens);
        else
            echo_walk<true, true>(d, all, target, list_base, list_cap, list_expert, recv_load, rank_order,
                                  slot_expert, slot_tokens);
    }
    __syncthreads();
    if (kProfile && tid == 0) stamp[4] = clock64();

    // Phase 5: home remainders (integer sums, any order), source split, loads after, summary.
    {
        int64_t clones = 0;
        for (int64_t j = tid; j < slots; j += nt) {
            const int32_t e = slot_expert[j];
            if (e < 0) continue;
            ++clones;
            atomicAdd(reinterpret_cast<unsigned long long*>(home + e), (unsigned long long)(-slot_tokens[j]));
        }
        clones = warp_sum(clones);
        if ((tid & 31) == 0 && clones > 0) atomicAdd(&s_clones, (unsigned long long)clones);
    }
    __syncthreads();
    for (int64_t item = tid; item < E + slots; item += nt) {
        if (item < E) {
            echo_fill_interval(d, counts, item, 0, home[item], out.home_tokens + item, E);
            continue;
        }
        const int64_t j = item - E;
        const int32_t e = slot_expert[j];
        if (e < 0) {
            for (int64_t s = 0; s < EP; ++s) out.clone_tokens[s * slots + j] = 0;
        } else {
            const int64_t b = echo_slot_begin(home, slot_expert, slot_tokens, j);
            echo_fill_interval(d, counts, e, b, b + slot_tokens[j], out.clone_tokens + j, slots);
        }
        out.slot_expert[j] = e, out.slot_tokens[j] = slot_tokens[j];
    }
    for (int64_t r = tid; r < EP; r += nt) out.rank_load_after[r] = echo_rank_load_after(d, home, slot_tokens, r);
    if (tid == 0) out.summary[0] = target, out.summary[1] = int64_t(s_clones);
    if (kProfile) {
        __syncthreads();
        if (tid == 0) {
            stamp[5] = clock64();
            for (int i = 0; i <= kEchoPlanPhases; ++i) profile[i] = stamp[i];
            profile[kEchoPlanPhases + 1] = rounds, profile[kEchoPlanPhases + 2] = n_listed;
        }
    }
}

void launch_echo_plan_kernel(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts,
                             const EchoDevicePlan& plan, int64_t* profile, cudaStream_t stream) {
    const size_t bytes = shared_bytes(d);
    MOEKIT_REQUIRE(bytes <= kMaxSharedBytes, "ECHO planner on the GPU: EP=", d.ep, " E=", d.num_experts, " S=",
                   d.slots_per_rank, " needs ", bytes, " bytes of shared memory, more than the ", kMaxSharedBytes,
                   " a single block gets");
    if (profile)
        echo_plan_kernel<true><<<1, kEchoThreads, bytes, stream>>>(d, algorithm, counts, plan, profile);
    else
        echo_plan_kernel<false><<<1, kEchoThreads, bytes, stream>>>(d, algorithm, counts, plan, nullptr);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void check_args(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts, const EchoDevicePlan& plan) {
    MOEKIT_REQUIRE(d.ep >= 1 && d.num_experts > 0 && d.num_experts % d.ep == 0 && d.slots_per_rank >= 0,
                   "ECHO planner on the GPU: EP=", d.ep, " E=", d.num_experts, " S=", d.slots_per_rank,
                   " (needs EP >= 1, E > 0 divisible by EP, S >= 0)");
    MOEKIT_REQUIRE(algorithm == EchoAlgorithm::greedy || algorithm == EchoAlgorithm::waterfill,
                   "ECHO planner on the GPU: unknown algorithm ", int(algorithm));
    MOEKIT_CHECK(counts && plan.home_tokens && plan.rank_load_before && plan.rank_load_after && plan.summary &&
                     (d.slots_per_rank == 0 || (plan.slot_expert && plan.slot_tokens && plan.clone_tokens)),
                 "ECHO planner on the GPU: a device pointer of the plan is null");
}

}  // namespace

void echo_plan(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts, const EchoDevicePlan& plan,
               cudaStream_t stream) {
    check_args(d, algorithm, counts, plan);
    launch_echo_plan_kernel(d, algorithm, counts, plan, nullptr, stream);
}

void echo_plan_profiled(const EchoDims& d, EchoAlgorithm algorithm, const int64_t* counts,
                        const EchoDevicePlan& plan, int64_t* profile, cudaStream_t stream) {
    check_args(d, algorithm, counts, plan);
    MOEKIT_CHECK(profile, "ECHO planner on the GPU: the profile array is null");
    launch_echo_plan_kernel(d, algorithm, counts, plan, profile, stream);
}

void echo_plan_preload() {
    cudaFuncAttributes a{};
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, echo_plan_kernel<false>));
}

}  // namespace moekit::cuda
