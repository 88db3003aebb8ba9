// ECHO device steps of the budgeted dispatcher (see dispatch_echo.cuh): counts -> plan -> send tables in
// two small kernels, clone weights pushed into peers' slots, clone gradients added at home.
#include "cuda/dispatch_echo.cuh"

#include "core/dispatch_math.h"
#include "core/echo_dispatch_math.h"
#include "core/echo_random_plan_math.h"
#include "cuda/cuda_check.h"
#include "cuda/peer_copy.cuh"

namespace moekit::cuda {
namespace {

constexpr int kTableThreads = 64;
constexpr int kCopyThreads = 256;

__global__ void widen_counts_kernel(const int32_t* counts32, int64_t n, int64_t* counts64) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        counts64[i] = counts32[i];
}

// One thread: the forced random plan (the CPU's draw), then its loads and clone count as the planner reports them.
__global__ void random_plan_kernel(EchoDims d, const int64_t* counts, uint64_t seed, EchoDevicePlan p) {
    const int64_t EP = d.ep, E = d.num_experts, slots = d.num_slots(), S = d.slots_per_rank;
    echo_random_plan_draw(d, counts, seed, p.slot_expert, p.slot_tokens, p.home_tokens, p.clone_tokens);
    int64_t clones = 0, max_after = 0;
    for (int64_t r = 0; r < EP; ++r) p.rank_load_before[r] = 0, p.rank_load_after[r] = 0;
    for (int64_t s = 0; s < EP; ++s)
        for (int64_t e = 0; e < E; ++e) {
            p.rank_load_before[d.home_rank(e)] += counts[s * E + e];
            p.rank_load_after[d.home_rank(e)] += p.home_tokens[s * E + e];
        }
    for (int64_t j = 0; j < slots; ++j) p.rank_load_after[j / S] += p.slot_tokens[j], clones += p.slot_expert[j] >= 0;
    for (int64_t r = 0; r < EP; ++r) max_after = p.rank_load_after[r] > max_after ? p.rank_load_after[r] : max_after;
    p.summary[0] = max_after, p.summary[1] = clones;
}

// One block; thread q walks receiver q's buffer layout (echo_recv_chunk_offsets) and fills this rank's
// chunk (q, b) of it; the receiver's own layout (q == rank) gives the held rows and the GEMM offsets.
__global__ void echo_tables_kernel(EchoDeviceState st, const int32_t* plan_offsets, int rank, int64_t budget,
                                   BudgetTables t) {
    const EchoDims d = st.dims;
    const int64_t E = d.num_experts, L = d.experts_per_rank(), S = d.slots_per_rank, B = L + S, EP = d.ep;
    const int32_t* slot_expert = st.plan.slot_expert;
    const int64_t* home = st.plan.home_tokens;
    const int64_t* clone = st.plan.clone_tokens;
    const int64_t* home_row = home + rank * E;
    const int64_t* clone_row = clone + rank * d.num_slots();
    for (int64_t q = threadIdx.x; q < EP; q += blockDim.x) {
        int64_t* off = st.recv_offsets + q * (B * EP + 1);
        const int64_t total = echo_recv_chunk_offsets(d, slot_expert, home, clone, q, off);
        for (int64_t b = 0; b < B; ++b) {
            const int64_t c = q * B + b, e = echo_bucket_expert(d, slot_expert, q, b);
            const int64_t n = echo_chunk_rows(d, slot_expert, home, clone, q, b, rank);
            const int64_t begin = b < L || e < 0 ? 0 : echo_segment_begin(d, slot_expert, home_row, clone_row, q * S + b - L);
            const int64_t dst = off[b * EP + rank];
            t.send_src[c] = e < 0 ? 0 : int32_t(plan_offsets[e] + begin);
            t.send_dst[c] = int32_t(dst);
            t.send_n[c] = int32_t(rows_within_budget(dst, n, budget));
        }
        if (q == rank) {
            for (int64_t i = 0; i <= B * EP; ++i) t.chunk_start[i] = int32_t(off[i] < budget ? off[i] : budget);
            *t.held = int32_t(total < budget ? total : budget);
        }
        if (total > budget) atomicExch(t.status, 1ull);
        atomicMax(t.status + 1, (unsigned long long)total);
    }
    __syncthreads();
    for (int64_t b = threadIdx.x; b <= B; b += blockDim.x) t.expert_offsets[b] = t.chunk_start[b * EP];
}

// Grid-stride over (slot j, 16-byte vector v) of the clones homed here: weights into slot j % S of rank j / S.
__global__ void push_weights_kernel(EchoDims d, const int32_t* slot_expert, const uint4* fc1, const uint4* fc2,
                                    char* const* peers, EchoSlotRegions r, int rank) {
    const int64_t L = d.experts_per_rank(), S = d.slots_per_rank, v1 = r.fc1_elems / 8, v2 = r.fc2_elems / 8;
    for (int64_t j = 0; j < d.num_slots(); ++j) {
        const int64_t e = slot_expert[j];
        if (e < 0 || d.home_rank(e) != rank) continue;
        const int64_t l = e - int64_t(rank) * L, q = j / S, s = j % S;
        uint4* dst1 = reinterpret_cast<uint4*>(peers[q] + r.fc1) + s * v1;
        uint4* dst2 = reinterpret_cast<uint4*>(peers[q] + r.fc2) + s * v2;
        grid_copy_vectors(fc1 + l * v1, dst1, v1);
        grid_copy_vectors(fc2 + l * v2, dst2, v2);
    }
}

// For each home expert l with clones: grad[l] += clone grads, slots in ascending order, 4 floats at a time. A clone
// given no tokens adds nothing and is skipped: its slot's gradient block was not written (overwrite_nonempty).
__global__ void add_clone_grads_kernel(EchoDims d, const int32_t* slot_expert, const int64_t* slot_tokens,
                                       float4* gfc1, float4* gfc2, char* const* peers, EchoSlotRegions r, int rank) {
    const int64_t L = d.experts_per_rank(), S = d.slots_per_rank, v1 = r.fc1_elems / 4, v2 = r.fc2_elems / 4;
    for (int64_t l = 0; l < L; ++l) {
        const int64_t e = int64_t(rank) * L + l;
        bool cloned = false;
        for (int64_t j = 0; j < d.num_slots() && !cloned; ++j)
            cloned = slot_expert[j] == e && echo_clone_adds(slot_expert, slot_tokens, j);
        if (!cloned) continue;
        // kPeerCopyUnroll vectors a thread, their peer loads issued together (remote loads are latency-bound);
        // each element still adds its clones in ascending slot order.
        const int64_t n = v1 + v2, stride = int64_t(gridDim.x) * blockDim.x;
        for (int64_t base = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; base < n; base += stride * kPeerCopyUnroll) {
            float4 acc[kPeerCopyUnroll] = {};
#pragma unroll
            for (int u = 0; u < kPeerCopyUnroll; ++u) {
                const int64_t i = base + stride * u;
                if (i < n) acc[u] = i < v1 ? gfc1[l * v1 + i] : gfc2[l * v2 + (i - v1)];
            }
            for (int64_t j = 0; j < d.num_slots(); ++j) {
                if (slot_expert[j] != e || !echo_clone_adds(slot_expert, slot_tokens, j)) continue;
                const float4* c1 = reinterpret_cast<const float4*>(peers[j / S] + r.grad_fc1) + (j % S) * v1;
                const float4* c2 = reinterpret_cast<const float4*>(peers[j / S] + r.grad_fc2) + (j % S) * v2;
                float4 c[kPeerCopyUnroll] = {};
#pragma unroll
                for (int u = 0; u < kPeerCopyUnroll; ++u) {
                    const int64_t i = base + stride * u;
                    if (i < n) c[u] = i < v1 ? c1[i] : c2[i - v1];
                }
#pragma unroll
                for (int u = 0; u < kPeerCopyUnroll; ++u)
                    acc[u].x += c[u].x, acc[u].y += c[u].y, acc[u].z += c[u].z, acc[u].w += c[u].w;
            }
#pragma unroll
            for (int u = 0; u < kPeerCopyUnroll; ++u) {
                const int64_t i = base + stride * u;
                if (i < n) (i < v1 ? gfc1[l * v1 + i] : gfc2[l * v2 + (i - v1)]) = acc[u];
            }
        }
    }
}

}  // namespace

void echo_plan_and_tables(const EchoDeviceState& st, const int32_t* counts32, const int32_t* plan_offsets, int rank,
                          int64_t budget, const BudgetTables& t, cudaStream_t stream) {
    const int64_t n = st.dims.ep * st.dims.num_experts;
    widen_counts_kernel<<<int((n + 255) / 256), 256, 0, stream>>>(counts32, n, st.counts);
    MOEKIT_CUDA_LAUNCH_CHECK();
    if (st.forced) {
        random_plan_kernel<<<1, 1, 0, stream>>>(st.dims, st.counts, st.forced_seed, st.plan);
        MOEKIT_CUDA_LAUNCH_CHECK();
    } else {
        echo_plan(st.dims, st.algorithm, st.counts, st.plan, stream);
    }
    echo_tables_kernel<<<1, kTableThreads, 0, stream>>>(st, plan_offsets, rank, budget, t);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void echo_push_clone_weights(const EchoDeviceState& st, const ExpertParams& w, char* const* peers,
                             const EchoSlotRegions& r, int rank, int blocks, cudaStream_t stream) {
    push_weights_kernel<<<blocks, kCopyThreads, 0, stream>>>(st.dims, st.plan.slot_expert,
                                                             reinterpret_cast<const uint4*>(w.fc1),
                                                             reinterpret_cast<const uint4*>(w.fc2), peers, r, rank);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void echo_add_clone_grads(const EchoDeviceState& st, const ExpertParams& w, char* const* peers,
                          const EchoSlotRegions& r, int rank, int blocks, cudaStream_t stream) {
    add_clone_grads_kernel<<<blocks, kCopyThreads, 0, stream>>>(st.dims, st.plan.slot_expert, st.plan.slot_tokens,
                                                                reinterpret_cast<float4*>(w.grad_fc1),
                                                                reinterpret_cast<float4*>(w.grad_fc2), peers, r, rank);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void echo_preload_kernels() {
    cudaFuncAttributes a{};
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, widen_counts_kernel));
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, random_plan_kernel));
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, echo_tables_kernel));
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, push_weights_kernel));
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&a, add_clone_grads_kernel));
    echo_plan_preload();
}

}  // namespace moekit::cuda
