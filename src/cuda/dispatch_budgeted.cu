// Budgeted (sync-free) dispatcher on the GPU, EP > 1 (issue 8; megatron-moe.md §1.3, §4.6): nothing reaches
// the host inside a step. Each rank writes its [E] counts into every peer's symmetric count matrix; after
// a device barrier every rank derives all receive offsets from the [EP, E] matrix with the shared scan
// (src/core/dispatch_math.h) and pushes its permutation-1 rows (and probs, and their source rows) straight
// into the receivers' fixed buffers of budget = ceil(T*k*f) rows, [local expert][source] order = the
// alltoall dispatcher's rows after sort_chunks, so the grouped GEMM reads them in place with device
// offsets. Combine and dispatch-backward return rows to their sources by source row; combine-backward
// pushes like dispatch. A barrier closes every phase (five per step). Nothing is written past a budget:
// an overflow sets a device flag that every rank computes alike; end_step() reads it between steps and
// the caller re-runs the step through the synchronous alltoall path (src/cuda/budget_step.h). Every
// device wait is bounded: past MOEKIT_DEVICE_WAIT_S (30 s) it records rank, peer and barrier and gives up.
// Transport: peer pointers of a DeviceComm symmetric buffer (other virtual ranks' memory on one GPU, or
// NCCL symmetric windows across GPUs). With ECHO spare slots (S > 0) the same protocol runs over L + S
// buckets per rank with the plan's tables, clone weights and gradients (dispatch_echo.cuh). Twin:
// src/cpu/dispatch_budgeted.cpp, src/cpu/dispatch_echo.cpp. Tests: tests/gpu/test_cuda_ep.cu, test_cuda_echo.cu.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "core/dispatch_math.h"
#include "cuda/combine.cuh"
#include "cuda/device_buffer.h"
#include "cuda/dispatch_echo.cuh"
#include "cuda/dispatcher.h"
#include "cuda/peer_copy.cuh"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kDispatchThreads = 256;
constexpr int kWarps = kDispatchThreads / 32;  // one row per warp at a time
constexpr int64_t kRegionAlign = 256;

// MOEKIT_BUDGETED_HOST_BARRIERS=1: every phase barrier is a stream sync + host barrier instead of a device
// spin. For compute-sanitizer, which runs one kernel at a time, so ranks' spinning barriers could never
// meet; the push/return kernels it checks run unchanged. Eager steps only (a host barrier can't be captured).
bool host_barriers() {
    const char* env = std::getenv("MOEKIT_BUDGETED_HOST_BARRIERS");
    return env && std::atoi(env) != 0;
}

int64_t wait_timeout_ns() {
    const char* env = std::getenv("MOEKIT_DEVICE_WAIT_S");
    const double s = env ? std::atof(env) : 0.0;
    return int64_t((s > 0 ? s : 30.0) * 1e9);
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Byte offsets of the regions of every rank's symmetric buffer (the same on all ranks).
struct Regions {
    int64_t counts = 0, flags = 0, recv_rows = 0, recv_probs = 0, recv_src = 0, grad_recv = 0, ret_rows = 0,
            ret_probs = 0, total = 0;
    EchoSlotRegions slots;  // ECHO: clone weights and their gradients (empty without)
};

using Tables = BudgetTables;

// Barrier over the EP ranks: bump the epoch, store it (release) into every peer's slot for this rank, wait
// (acquire) until every peer's slot here has reached it. Bounded: a timeout is recorded, never a hang.
__global__ void barrier_kernel(char* const* peers, int64_t flags_at, int rank, int ep, Tables t, int64_t timeout_ns) {
    __shared__ uint64_t e;
    if (threadIdx.x == 0) e = *t.epoch + 1, *t.epoch = e;
    __syncthreads();
    __threadfence_system();
    for (int q = threadIdx.x; q < ep; q += blockDim.x)
        store_release(reinterpret_cast<uint64_t*>(peers[q] + flags_at) + rank, e);
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(peers[rank] + flags_at);
    for (int q = threadIdx.x; q < ep; q += blockDim.x) {
        const uint64_t start = global_ns();
        while (load_acquire(mine + q) < e) {
            if (int64_t(global_ns() - start) > timeout_ns) {
                if (atomicCAS(t.status + 2, 0ull, 1ull) == 0ull)
                    t.status[3] = rank, t.status[4] = (unsigned long long)q, t.status[5] = e;
                break;
            }
        }
    }
}

__global__ void exchange_counts_kernel(const int32_t* counts, char* const* peers, int64_t counts_at, int rank, int ep,
                                       int64_t E) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < ep * E; i += int64_t(gridDim.x) * blockDim.x)
        reinterpret_cast<int32_t*>(peers[i / E] + counts_at)[rank * E + i % E] = counts[i % E];
}

// One block: thread q walks receiver q's chunks in buffer order (the shared scan).
__global__ void budget_plan_kernel(const int32_t* matrix, const int32_t* plan_offsets, int rank, int ep, int64_t E,
                                   int64_t L, int64_t budget, Tables t) {
    for (int q = threadIdx.x; q < ep; q += blockDim.x) {
        const int64_t total = for_each_recv_chunk(matrix, ep, E, L, q, [&](int64_t l, int64_t s, int64_t start, int64_t n) {
            if (s == rank) {
                t.send_src[q * L + l] = plan_offsets[q * L + l];
                t.send_dst[q * L + l] = int32_t(start);
                t.send_n[q * L + l] = int32_t(rows_within_budget(start, n, budget));
            }
            if (q == rank) t.chunk_start[l * ep + s] = int32_t(start < budget ? start : budget);
        });
        if (q == rank) {
            const int64_t held = total < budget ? total : budget;
            t.chunk_start[L * ep] = int32_t(held), *t.held = int32_t(held);
        }
        if (total > budget) atomicExch(t.status, 1ull);
        atomicMax(t.status + 1, (unsigned long long)total);
    }
    __syncthreads();
    for (int64_t l = threadIdx.x; l <= L; l += blockDim.x) t.expert_offsets[l] = t.chunk_start[l * ep];
}

// Sender side: chunk (q, b) = rows [send_src, +send_n) of this rank's permutation-1 order go to receiver q at
// send_dst (B buckets per receiver); row r is token row_token[r], read from the tokens (no permuted copy is
// written first). Receivers are walked from rank + 1, this rank last, so remote pushes start at once and no
// two ranks write to the same peer at a time; row j of the walk goes to warp j % warps, so every warp has
// rows whatever the chunk sizes (chunks are ~T*k/E rows, often fewer than the grid's warps).
template <typename R>
__global__ void push_kernel(const uint4* __restrict__ tokens, const int32_t* __restrict__ row_token,
                            const R* __restrict__ probs, Tables t, char* const* peers, int64_t rows_at,
                            int64_t probs_at, int64_t src_at, int rank, int ep, int64_t B, int64_t vecs) {
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(gridDim.x) * kWarps, w = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    int64_t walked = 0;  // rows of the chunks before this one
    for (int i = 1; i <= ep; ++i) {
        const int q = (rank + i) % ep;
        uint4* dst_rows = reinterpret_cast<uint4*>(peers[q] + rows_at);
        for (int64_t b = 0; b < B; ++b) {
            const int64_t c = q * B + b, n = t.send_n[c], src0 = t.send_src[c], dst0 = t.send_dst[c];
            for (int64_t j = ((w - walked) % warps + warps) % warps; j < n; j += warps) {
                const int64_t r = src0 + j;
                warp_copy_vectors(tokens + int64_t(row_token[r]) * vecs, dst_rows + (dst0 + j) * vecs, vecs, lane);
                if (lane == 0 && probs) reinterpret_cast<R*>(peers[q] + probs_at)[dst0 + j] = probs[r];
                if (lane == 0 && src_at >= 0) reinterpret_cast<int32_t*>(peers[q] + src_at)[dst0 + j] = int32_t(r);
            }
            walked += n;
        }
    }
}

// Receiver side: held row i (chunk l*EP + s) goes back to source s, at its source row.
template <typename R>
__global__ void return_kernel(const uint4* __restrict__ rows, const R* __restrict__ probs,
                              const int32_t* __restrict__ src_rows, Tables t, char* const* peers, int64_t rows_at,
                              int64_t probs_at, int ep, int64_t B, int64_t vecs) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t held = *t.held, chunks = B * ep;
    for (int64_t i = int64_t(blockIdx.x) * kWarps + warp; i < held; i += int64_t(gridDim.x) * kWarps) {
        int64_t lo = 0, hi = chunks - 1;  // the last chunk starting at or before i (empty chunks skipped)
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (t.chunk_start[mid] <= i) lo = mid; else hi = mid - 1;
        }
        const int s = int(lo % ep);
        const int64_t to = src_rows[i];
        warp_copy_vectors(rows + i * vecs, reinterpret_cast<uint4*>(peers[s] + rows_at) + to * vecs, vecs, lane);
        if (lane == 0 && probs) reinterpret_cast<R*>(peers[s] + probs_at)[to] = probs[i];
    }
}

template <typename R>
class BudgetedDispatcher final : public CudaDispatcher<R> {
public:
    BudgetedDispatcher(const DispatchShape& s, DeviceComm& ep)
        : s_(s), ep_(ep), timeout_ns_(wait_timeout_ns()), host_barriers_(host_barriers()) {
        const int64_t T = s.router.num_tokens, H = s.router.hidden, E = s.router.num_experts, L = s.local_experts();
        const int64_t S = s.echo_slots, B = L + S, K = s.router.topk;
        const int EP = s.ep_size;
        MOEKIT_REQUIRE(H % 8 == 0, "--moe-expert-rank-capacity-factor or --moe-enable-echo on --device cuda needs "
                       "--hidden-size divisible by 8 (rows and expert weights move as 16-byte vectors); got ", H);
        // Without a factor (ECHO alone) the budget is the dropless bound: every source's tokens, each with at
        // most min(k, L + S) rows here.
        budget_ = s.receive_factor > 0 ? budget_rows(T, K, s.receive_factor)
                                       : align_up(EP * T * std::min(K, B), kBudgetRowAlign);
        const int64_t M = s.plan_max_rows;
        int64_t at = 0;
        const auto region = [&](int64_t bytes) {
            const int64_t here = at;
            at = align_up(at + bytes, kRegionAlign);
            return here;
        };
        r_.counts = region(EP * E * 4), r_.flags = region(EP * 8), r_.recv_rows = region(budget_ * H * 2);
        r_.recv_probs = region(budget_ * int64_t(sizeof(R))), r_.recv_src = region(budget_ * 4);
        r_.grad_recv = region(budget_ * H * 2), r_.ret_rows = region(M * H * 2);
        r_.ret_probs = region(M * int64_t(sizeof(R)));
        if (S > 0) {
            EchoSlotRegions& sr = r_.slots;
            sr.fc1_elems = s.fc1_rows * H, sr.fc2_elems = H * s.ffn;
            MOEKIT_CHECK(sr.fc1_elems > 0 && sr.fc2_elems > 0, "ECHO on --device cuda: expert shapes F1=", s.fc1_rows,
                         " F=", s.ffn, " H=", H);  // H % 8 == 0 makes both whole 16-byte vectors
            sr.fc1 = region(S * sr.fc1_elems * 2), sr.fc2 = region(S * sr.fc2_elems * 2);
            sr.grad_fc1 = region(S * sr.fc1_elems * 4), sr.grad_fc2 = region(S * sr.fc2_elems * 4);
        }
        r_.total = at;
        sym_ = ep.alloc_symmetric(r_.total);
        std::vector<char*> peers;
        for (void* p : sym_->peers()) peers.push_back(static_cast<char*>(p));
        peers_.resize(EP);
        upload(peers_.get(), peers);
        send_src_.resize(EP * B), send_dst_.resize(EP * B), send_n_.resize(EP * B), chunk_start_.resize(B * EP + 1);
        offsets_.resize(B + 1);
        held_.resize(1), status_.resize(6), epoch_.resize(1);
        if (S > 0) {
            EchoDeviceState& st = echo_;
            st.dims = EchoDims{EP, E, S, s.echo_group_floor_rows}, st.algorithm = s.echo_algorithm;
            echo_counts_.resize(EP * E), slot_expert_.resize(EP * S), slot_tokens_.resize(EP * S);
            clone_tokens_.resize(EP * EP * S), home_tokens_.resize(EP * E), load_before_.resize(EP);
            load_after_.resize(EP), plan_summary_.resize(2), recv_offsets_.resize(EP * (B * EP + 1));
            st.counts = echo_counts_.get(), st.recv_offsets = recv_offsets_.get();
            st.plan = EchoDevicePlan{slot_expert_.get(), slot_tokens_.get(), clone_tokens_.get(), home_tokens_.get(),
                                     load_before_.get(), load_after_.get(), plan_summary_.get()};
        }
        fallback_ = make_alltoall_cuda_dispatcher<R>(s, ep);
        preload_kernels();
    }

    std::string name() const override {
        const std::string me = s_.echo_slots > 0 ? "budgeted+echo" : "budgeted";
        return synchronous_ ? me + " (re-run: alltoall)" : me;
    }
    int64_t num_local_experts() const override { return s_.local_experts(); }
    // The expert stage is sized for the synchronous re-run too (an overflow must not lose a token).
    int64_t expert_max_rows() const override { return std::max(budget_, fallback_->expert_max_rows()); }
    size_t allocated_bytes() const override {
        size_t n = size_t(r_.total) + fallback_->allocated_bytes();
        auto add = [&](const auto&... b) { ((n += b.bytes()), ...); };
        add(peers_, send_src_, send_dst_, send_n_, chunk_start_, offsets_, held_, status_, epoch_);
        add(echo_counts_, slot_expert_, slot_tokens_, clone_tokens_, home_tokens_, load_before_, load_after_,
            plan_summary_, recv_offsets_);
        return n;
    }
    size_t saved_bytes() const override {
        return size_t(budget_ * s_.router.hidden * 2 + budget_ * int64_t(sizeof(R) + 4)) + chunk_start_.bytes() +
               offsets_.bytes() + (echo() ? size_t(s_.echo_slots * (r_.slots.fc1_elems + r_.slots.fc2_elems) * 2) : 0);
    }
    bf16* expert_rows_buffer() override { return sym_local<bf16>(r_.recv_rows); }
    int64_t budget() const { return budget_; }

    DispatchTraffic traffic() const override {
        if (sync()) return fallback_->traffic();
        // Rows that left this rank and came back (a host read of the count matrix or plan: between steps only).
        const int64_t E = s_.router.num_experts, L = s_.local_experts(), EP = s_.ep_size, me = s_.ep_rank;
        const int64_t S = s_.echo_slots;
        int64_t out = 0, in = 0, weight_bytes = 0;
        if (!echo()) {
            const std::vector<int32_t> m = download(sym_local<const int32_t>(r_.counts), EP * E);
            for (int64_t e = 0; e < E; ++e)
                if (e / L != me) out += m[size_t(me * E + e)];
            for (int64_t src = 0; src < EP; ++src)
                for (int64_t l = 0; l < L; ++l)
                    if (src != me) in += m[size_t(src * E + me * L + l)];
        } else {
            const std::vector<int64_t> home = home_tokens_.download(), clone = clone_tokens_.download();
            const std::vector<int32_t> slot = slot_expert_.download();
            const int64_t J = EP * S, expert_bytes = (r_.slots.fc1_elems + r_.slots.fc2_elems) * 2;
            for (int64_t src = 0; src < EP; ++src)
                for (int64_t e = 0; e < E; ++e) {
                    const int64_t n = home[size_t(src * E + e)], dst = e / L;
                    if (src == me && dst != me) out += n;
                    if (src != me && dst == me) in += n;
                }
            for (int64_t src = 0; src < EP; ++src)
                for (int64_t j = 0; j < J; ++j) {
                    const int64_t n = clone[size_t(src * J + j)], dst = j / S;
                    if (src == me && dst != me) out += n;
                    if (src != me && dst == me) in += n;
                }
            // Weights I push to other ranks' slots, and my slots' fp32 gradients (twice the bf16 bytes) that
            // their home ranks read.
            for (int64_t j = 0; j < J; ++j) {
                if (slot[size_t(j)] < 0) continue;
                const int64_t home_rank = slot[size_t(j)] / L, slot_rank = j / S;
                if (home_rank == me && slot_rank != me) weight_bytes += expert_bytes;
                if (slot_rank == me && home_rank != me) weight_bytes += 2 * expert_bytes;
            }
        }
        const int64_t row = s_.router.hidden * 2, prob = int64_t(sizeof(R));
        // forward: rows + prob + source row out, rows back; backward: grad rows out, grad rows + prob back.
        return {out * (2 * row + prob + 4) + in * (2 * row + prob) + weight_bytes, 0};
    }

    EchoStepSummary echo_summary() const override {
        EchoStepSummary sum;
        if (!echo()) return sum;
        sum.clones = plan_summary_.download()[1];
        sum.load_before = load_before_.download(), sum.load_after = load_after_.download();
        return sum;
    }
    void force_random_echo_plans(uint64_t seed) override {
        MOEKIT_CHECK(echo(), "forced random ECHO plans need --moe-enable-echo");
        echo_.forced = true, echo_.forced_seed = seed;
    }
    void set_expert_params(const ExpertParams& p) override {
        if (!echo()) return;
        const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
        MOEKIT_CHECK(p.fc1 && p.fc2 && p.grad_fc1 && p.grad_fc2 && aligned(p.fc1) && aligned(p.fc2) &&
                         aligned(p.grad_fc1) && aligned(p.grad_fc2),
                     "ECHO: expert weights and grads must be set and 16-byte aligned (copied as vectors)");
        params_ = p;
    }

    ExpertInput<R> dispatch(const RoutingPlan<R>& plan, const uint8_t* map, const R* probs, const bf16* hidden,
                            cudaStream_t stream) override {
        // Warm-up: the first eager step runs the synchronous path, so every kernel of the layer (cuBLAS's too) is
        // loaded on every rank before any device barrier spins. With lazy module loading (CUDA's default) a
        // kernel's first launch may wait for the kernels running on the device, a peer's spinning barrier
        // among them: a deadlock (CUDA C++ Programming Guide, Lazy Loading). A captured step needs no warm-up
        // (instantiation loads its kernels); callers meet on the host between instantiation and replay.
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
        warm_up_step_ = !warmed_ && capturing == cudaStreamCaptureStatusNone;
        warmed_ = true;
        if (sync()) return fallback_->dispatch(plan, map, probs, hidden, stream);
        const int64_t E = s_.router.num_experts, L = s_.local_experts(), S = s_.echo_slots;
        exchange_counts_kernel<<<1, 256, 0, stream>>>(plan.counts, peers_.get(), r_.counts, s_.ep_rank, s_.ep_size, E);
        MOEKIT_CUDA_LAUNCH_CHECK();
        barrier(stream);
        if (echo()) {
            MOEKIT_CHECK(params_.fc1, "ECHO: set_expert_params before dispatch");
            echo_plan_and_tables(echo_, sym_local<const int32_t>(r_.counts), plan.offsets, s_.ep_rank, budget_, tables(),
                                 stream);
        } else {
            budget_plan_kernel<<<1, 64, 0, stream>>>(sym_local<const int32_t>(r_.counts), plan.offsets, s_.ep_rank,
                                                     s_.ep_size, E, L, budget_, tables());
            MOEKIT_CUDA_LAUNCH_CHECK();
        }
        push(hidden, plan.row_token, plan.row_prob, r_.recv_rows, r_.recv_probs, r_.recv_src, stream);
        if (echo())  // clone weights travel in the same phase as the rows
            echo_push_clone_weights(echo_, params_, peers_.get(), r_.slots, s_.ep_rank, s_.dispatch_blocks, stream);
        barrier(stream);
        ExpertInput<R> in{L, budget_, sym_local<bf16>(r_.recv_rows), sym_local<R>(r_.recv_probs), offsets_.get()};
        if (echo()) {
            in.num_slots = S;
            in.slot_fc1 = sym_local<bf16>(r_.slots.fc1), in.slot_fc2 = sym_local<bf16>(r_.slots.fc2);
            in.slot_grad_fc1 = sym_local<float>(r_.slots.grad_fc1), in.slot_grad_fc2 = sym_local<float>(r_.slots.grad_fc2);
        }
        return in;
    }

    void combine(const RoutingPlan<R>& plan, const bf16* expert_out, const bf16* shared_out, const float* shared_gate,
                 bf16* out, cudaStream_t stream) override {
        if (sync()) return fallback_->combine(plan, expert_out, shared_out, shared_gate, out, stream);
        give_back(expert_out, nullptr, stream);
        combine_forward<R>(plan, s_.router.hidden, sym_local<bf16>(r_.ret_rows), shared_out, shared_gate, out, stream);
    }

    const bf16* combine_backward(const RoutingPlan<R>& plan, const bf16* grad_out, bf16* scratch,
                                 cudaStream_t stream) override {
        if (sync()) return fallback_->combine_backward(plan, grad_out, scratch, stream);
        push(grad_out, plan.row_token, nullptr, r_.grad_recv, -1, -1, stream);  // combine's backward gather, pushed
        barrier(stream);
        return sym_local<bf16>(r_.grad_recv);
    }

    void dispatch_backward(const RoutingPlan<R>& plan, const uint8_t* map, const bf16* grad_rows,
                           const R* grad_row_probs, float* grad_input, bool accumulate, R* grad_probs,
                           cudaStream_t stream) override {
        if (sync())
            return fallback_->dispatch_backward(plan, map, grad_rows, grad_row_probs, grad_input, accumulate, grad_probs,
                                                stream);
        give_back(grad_rows, grad_row_probs, stream);
        // The barrier closing give_back follows every rank's weight-gradient GEMMs: the clone grads are final.
        if (echo()) echo_add_clone_grads(echo_, params_, peers_.get(), r_.slots, s_.ep_rank, s_.dispatch_blocks, stream);
        permute_rows_backward<R>(plan, s_.router.hidden, sym_local<bf16>(r_.ret_rows), grad_input, accumulate, stream);
        scatter_row_probs_grad<R>(plan, map, sym_local<R>(r_.ret_probs), grad_probs, stream);
    }

    BudgetStatus end_step() override {
        std::vector<unsigned long long> st = status_.download();
        zero_fill(status_.get(), status_.bytes());
        MOEKIT_CHECK(st[2] == 0, "budgeted dispatcher: EP rank ", st[3], " waited more than ", timeout_ns_ / 1e9,
                     " s at barrier ", st[5], " for EP rank ", st[4],
                     " (a rank that died, hangs or runs another step; MOEKIT_DEVICE_WAIT_S sets the bound)");
        BudgetStatus b;
        b.budgeted = true, b.overflow = st[0] != 0, b.budget_rows = budget_, b.peak_rows = int64_t(st[1]);
        return b;
    }
    void set_synchronous(bool on) override { synchronous_ = on; }

private:
    bool sync() const { return synchronous_ || warm_up_step_; }
    bool echo() const { return s_.echo_slots > 0; }
    int64_t buckets() const { return s_.local_experts() + s_.echo_slots; }
    // The dispatcher's own kernels, loaded now (outside any step) for the same reason as the warm-up.
    void preload_kernels() const {
        cudaFuncAttributes a{};
        MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, barrier_kernel));
        MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, exchange_counts_kernel));
        MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, budget_plan_kernel));
        MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, push_kernel<R>));
        MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, return_kernel<R>));
        if (echo()) echo_preload_kernels();
    }
    template <typename T>
    T* sym_local(int64_t at) const {
        return reinterpret_cast<T*>(static_cast<char*>(sym_->local()) + at);
    }
    Tables tables() {
        return {send_src_.get(), send_dst_.get(), send_n_.get(), chunk_start_.get(), offsets_.get(), held_.get(),
                status_.get(), epoch_.get()};
    }
    void barrier(cudaStream_t stream) {
        if (host_barriers_) {
            MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
            ep_.host().barrier();
            return;
        }
        barrier_kernel<<<1, 64, 0, stream>>>(peers_.get(), r_.flags, s_.ep_rank, s_.ep_size, tables(), timeout_ns_);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
    // Token rows (row r of the walk = tokens[row_token[r]]) and their probs into the receivers' buffers.
    void push(const bf16* tokens, const int32_t* row_token, const R* probs, int64_t rows_at, int64_t probs_at,
              int64_t src_at, cudaStream_t stream) {
        push_kernel<R><<<s_.dispatch_blocks, kDispatchThreads, 0, stream>>>(
            reinterpret_cast<const uint4*>(tokens), row_token, probs, tables(), peers_.get(), rows_at, probs_at, src_at,
            s_.ep_rank, s_.ep_size, buckets(), s_.router.hidden / 8);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
    // Held rows (and probs) back to their sources' return buffers, then the phase's barrier.
    void give_back(const bf16* rows, const R* probs, cudaStream_t stream) {
        return_kernel<R><<<s_.dispatch_blocks, kDispatchThreads, 0, stream>>>(
            reinterpret_cast<const uint4*>(rows), probs, sym_local<const int32_t>(r_.recv_src), tables(), peers_.get(),
            r_.ret_rows, r_.ret_probs, s_.ep_size, buckets(), s_.router.hidden / 8);
        MOEKIT_CUDA_LAUNCH_CHECK();
        barrier(stream);
    }

    DispatchShape s_;
    DeviceComm& ep_;
    int64_t timeout_ns_ = 0, budget_ = 0;
    bool host_barriers_ = false;
    Regions r_;
    std::unique_ptr<SymmetricBuffer> sym_;
    DeviceBuffer<char*> peers_;
    DeviceBuffer<int32_t> send_src_, send_dst_, send_n_, chunk_start_, offsets_, held_;
    DeviceBuffer<unsigned long long> status_;
    DeviceBuffer<uint64_t> epoch_;
    // ECHO (S > 0): the plan's device arrays (identical on every rank) and this step's expert parameters.
    EchoDeviceState echo_;
    DeviceBuffer<int64_t> echo_counts_, slot_tokens_, clone_tokens_, home_tokens_, load_before_, load_after_;
    DeviceBuffer<int64_t> plan_summary_, recv_offsets_;
    DeviceBuffer<int32_t> slot_expert_;
    ExpertParams params_;
    std::unique_ptr<CudaDispatcher<R>> fallback_;
    bool synchronous_ = false;
    bool warmed_ = false, warm_up_step_ = false;
};

}  // namespace

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_budgeted_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep) {
    return std::make_unique<BudgetedDispatcher<R>>(shape, ep);
}
template std::unique_ptr<CudaDispatcher<float>> make_budgeted_cuda_dispatcher<float>(const DispatchShape&, DeviceComm&);
template std::unique_ptr<CudaDispatcher<double>> make_budgeted_cuda_dispatcher<double>(const DispatchShape&,
                                                                                       DeviceComm&);

}  // namespace moekit::cuda
