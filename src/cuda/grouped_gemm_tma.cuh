// Warp-specialised, persistent Hopper grouped GEMM: one producer warp issues bulk tensor copies (TMA, 128-byte
// swizzle, completing on mbarriers) into a 4-stage ring; two consumer warpgroups run wgmma m64n256k16 on 128x256x64
// tiles; one CTA per SM walks the tiles; optionally 2-CTA clusters share (multicast) the A tile.
// Same scheduling and tile layout as grouped_gemm_mma.cuh; nt/nn results leave through shared memory as full-line
// stores, tn's fp32 gradients through shared memory as asynchronous bulk tensor stores / reduce-adds
// (MOEKIT_GEMM_EPILOGUE=direct: both from registers, as the mma kernel). TMA bounds come from static shapes, so a tile
// may read rows of the next group (or up to max_rows): harmless for nt/nn, where those rows only feed output rows
// that are never stored; for tn (reduction over the group's rows) the consumers zero those rows in shared memory.
// Included by grouped_gemm_kernels.cuh only.
#pragma once
#include <cuda.h>

namespace moekit::cuda::gemm_detail {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// Multicast variant: the box lands at the same shared-memory offset in every CTA of `mask` (cluster ranks), and
// completes bytes on the mbarrier at the same offset in each of them.
__device__ __forceinline__ void tma_2d_mc(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                          uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
// Arrive on the mbarrier at shared offset `bar` of cluster CTA `cta` (which may be this one). Default (.release.cta)
// semantics, as CUTLASS's ClusterBarrier: the consumers' smem reads are ordered by wgmma.wait_group already, and a
// .release.cluster arrive (a cluster-scope fence per k-step) measured 1.5x slower.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(cta)
        : "memory");
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// After the barriers' initialisation: every thread of the CTA, or of the cluster (whose peer multicasts into this
// CTA and arrives on its barriers), starts once they are initialised.
template <int kCluster>
__device__ __forceinline__ void sync_cta_or_cluster() {
    if constexpr (kCluster > 1)
        cluster_sync_all();
    else
        __syncthreads();
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// The producer's position in a ring of kStages stages: stage s of a round of parity ph. Past the first round
// (wrapped) a stage is refilled only once the consumers released its previous round (the empty barrier's phase of
// parity ph ^ 1). Kept incrementally: a division by the stage count a k-step cost the one issuing thread more than its
// copies (tma_wgrad_pingpong_kernel, docs/perf.md).
template <int kStages>
struct RingPosition {
    int s = 0;
    uint32_t ph = 0;
    bool wrapped = false;
    __device__ __forceinline__ void wait_free(uint32_t empty_bar) const {
        if (wrapped) mbar_wait(empty_bar, ph ^ 1);
    }
    __device__ __forceinline__ void advance() {
        if (++s == kStages) s = 0, ph ^= 1, wrapped = true;
    }
};
// Before a cluster's producer exits: the peer may still arrive on this CTA's empty barriers, so wait until the
// consumers of both CTAs released the last kStages stages. empty(s) = stage s's empty barrier.
template <int kStages, typename EmptyBar>
__device__ __forceinline__ void drain_ring(RingPosition<kStages> pos, EmptyBar empty) {
    for (int q = 0; q < kStages; ++q) {
        pos.wait_free(empty(pos.s));
        pos.advance();
    }
}
// A consumer warpgroup hands a stage back: one arrival on its empty barriers in every CTA of the cluster.
template <int kCluster>
__device__ __forceinline__ void release_stage(uint32_t empty_bar) {
    if constexpr (kCluster > 1) {
        for (int c = 0; c < kCluster; ++c) mbar_arrive_cluster(empty_bar, uint32_t(c));
    } else {
        mbar_arrive(empty_bar);
    }
}
__device__ __forceinline__ void st_shared_bf16x2(uint32_t addr, float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
// Epilogue staging (bf16 outputs): per consumer warpgroup 64 rows x 64 columns, rows padded to 144 bytes.
constexpr int kEpiRow = 144, kEpiBytes = 64 * kEpiRow;
// Epilogue staging (tn, fp32 gradients): per consumer warpgroup two buffers of 64 rows x 32 columns (8 KB, one TMA
// box with the 128-byte swizzle, 1024-byte aligned).
constexpr int kEpiF32Bytes = 64 * 32 * 4;
constexpr int kEpiRegion = 4 * kEpiF32Bytes > 2 * kEpiBytes ? 4 * kEpiF32Bytes : 2 * kEpiBytes;
// Dynamic shared memory of tma_kernel: 4 stages of A [128x64] + B [256x64] bf16, 1 KB for the 1024-byte alignment
// of the swizzled stages, 1 KB holding the mbarriers (keeps the epilogue region 1024-byte aligned), the epilogue
// staging region (bf16 buffers for nt/nn, fp32 buffers for tn).
constexpr int kTmaSmemBytes = 4 * (128 + 256) * kBK * 2 + 1024 + 1024 + kEpiRegion;
// The fused GLU forward with its epilogue on the producer warpgroup's three idle warps (tma_kernel kAsyncEpi): 3
// stages, and the whole 128 x 256 tile staged as bf16 (64 KB) so the consumers go on to the next tile at once.
constexpr int kAsyncStages = 3, kAsyncRow = 512, kAsyncEpiBytes = 128 * kAsyncRow;
constexpr int kTmaAsyncSmemBytes = kAsyncStages * (128 + 256) * kBK * 2 + 1024 + 1024 + kAsyncEpiBytes;
static_assert(kTmaAsyncSmemBytes <= 232448, "the async-epilogue kernel's shared memory must fit an H100 / H200 SM");
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Bulk tensor stores from shared memory (TMA, bulk-group completion): plain, or reduce-add into global (the add is
// done at L2: one writer per element, so the sum is the same fp32 add a load + add + store would do).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's committed bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// Columns 64c .. 64c+63 of a consumer warpgroup's 64 x 256 accumulators (thread row r and r + 8 of the wgmma
// layout), rounded to bf16, into its staging buffer (rows of kEpiRow bytes). c is a constant after unrolling.
__device__ __forceinline__ void stage_bf16_chunk(uint32_t buf, int r, int lane, const float (&d)[128], int c) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i = c * 8 + j;
        const uint32_t off = uint32_t(j * 8 + (lane & 3) * 2) * 2;
        st_shared_bf16x2(buf + r * kEpiRow + off, d[4 * i], d[4 * i + 1]);
        st_shared_bf16x2(buf + (r + 8) * kEpiRow + off, d[4 * i + 2], d[4 * i + 3]);
    }
}

// A warpgroup's staged 64-column chunk (stage_bf16_chunk) to global memory: each thread takes 4 x 16 bytes, 8
// threads a row, so rows leave as whole 128-byte segments; columns col0 + 8 ch at or past `limit` are not stored.
__device__ __forceinline__ void store_staged_chunk(uint32_t buf, const TileJob& job, int cw, int ctid,
                                                   __nv_bfloat16* dst, int64_t ld, int col0, int limit) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int item = q * 128 + (ctid & 127), rr = item >> 3, ch = item & 7;
        const int64_t gr = job.row0 + cw * 64 + rr;
        const uint4 v = ld_shared_v4(buf + rr * kEpiRow + ch * 16);
        if (gr < job.row_end && col0 + ch * 8 < limit) *reinterpret_cast<uint4*>(dst + gr * ld + col0 + ch * 8) = v;
    }
}

// fn(std::integral_constant<Activation, A>{}) for the runtime activation A: an epilogue instantiated per activation
// holds one formula. With the switch inside their unrolled loops the code of all four was laid out per element:
// the fused forward's kernel grew from 32 to 112 KB (the backward's to 320 KB) and took 2.08 ms against 1.33 +
// 0.17 unfused (qwen3-30b fc1, H200, 2026-11-27).
template <typename Fn>
__device__ __forceinline__ void with_activation(Activation act, Fn&& fn) {
    switch (act) {
        case Activation::gelu: fn(std::integral_constant<Activation, Activation::gelu>{}); break;
        case Activation::silu: fn(std::integral_constant<Activation, Activation::silu>{}); break;
        case Activation::relu: fn(std::integral_constant<Activation, Activation::relu>{}); break;
        case Activation::squared_relu: fn(std::integral_constant<Activation, Activation::squared_relu>{}); break;
    }
}

// nt epilogue with the gated activation's forward (Params::glu_out) stages a warpgroup's 64 rows x (64 gate | 64 up)
// columns at a time as bf16, rows of 256 bytes, the 16-byte chunk c of row r at c ^ (r & 7): conflict-free both for
// the lane quads' 4-byte writes (eight rows, eight chunk positions) and for 16-byte reads along a row.
constexpr int kGluRow = 256, kGluBytes = 64 * kGluRow;
static_assert(2 * kGluBytes <= kEpiRegion, "two warpgroups' gate / up staging must fit the epilogue region");
__device__ __forceinline__ uint32_t glu_slot(int r, int chunk) {
    return uint32_t(r * kGluRow + ((chunk ^ (r & 7)) << 4));
}

// Gate columns 64 piece .. +63 (accumulator blocks 8 piece ..) into chunks 0-7 and the same up columns (blocks
// 16 + 8 piece ..) into chunks 8-15, rounded to bf16 as the stored fc1 output is.
__device__ __forceinline__ void stage_glu_piece(uint32_t buf, int r, int lane, const float (&d)[128], int piece) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int i = 8 * piece + j + (j < 8 ? 0 : 8);
        const uint32_t off = uint32_t(lane & 3) * 4;
        st_shared_bf16x2(buf + glu_slot(r, j) + off, d[4 * i], d[4 * i + 1]);
        st_shared_bf16x2(buf + glu_slot(r + 8, j) + off, d[4 * i + 2], d[4 * i + 3]);
    }
}

// 8 bf16 gate and up columns of row gr (gate column col) stored where the plain nt writes them, and their activation
// times the row's probability: the float formula activation_forward applies to the stored output, so the same bits.
template <Activation kAct>
__device__ __forceinline__ void store_glu_vector(const Params& p, int64_t gr, int col, uint4 gv, uint4 uv,
                                                 float prob) {
    const int F = p.n >> 1;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.C) + gr * p.n + col;
    *reinterpret_cast<uint4*>(out) = gv;
    *reinterpret_cast<uint4*>(out + F) = uv;
    const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gv);
    const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uv);
    uint4 av;
    __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(&av);
#pragma unroll
    for (int e = 0; e < 8; ++e)
        a[e] = __float2bfloat16(glu_forward(kAct, __bfloat162float(g[e]), __bfloat162float(u[e])) * prob);
    *reinterpret_cast<uint4*>(p.glu_out + gr * F + col) = av;
}

// nt epilogue with the gated activation's forward (Params::glu_out): the tile's accumulators are gate columns
// f0 .. f0+127 (0 .. 127) and the up columns F+f0 .. (128 .. 255). Per 64 columns: staged (stage_glu_piece), then
// each thread takes 8 columns of 4 rows (store_glu_vector). MOEKIT_GLU_FORWARD_EPILOGUE=inline only: the default
// runs it on warps of its own (store_tile_async).
template <Activation kAct>
__device__ __forceinline__ void glu_forward_epilogue(const Params& p, const TileJob& job, int cw, int ctid,
                                                     uint32_t buf, int r, int lane, const float (&d)[128]) {
    const int F = p.n >> 1, ch = ctid & 7;
    int64_t grow[4];
    float prob[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        grow[q] = job.row0 + cw * 64 + q * 16 + ((ctid & 127) >> 3);
        prob[q] = p.glu_probs && grow[q] < job.row_end ? __ldg(p.glu_probs + grow[q]) : 1.0f;
    }
#pragma unroll
    for (int piece = 0; piece < 2; ++piece) {
        if ((job.n0 >> 1) + piece * 64 >= F) continue;  // uniform over the warpgroup
        stage_glu_piece(buf, r, lane, d, piece);
        named_barrier(2 + cw, 128);
        const int col = (job.n0 >> 1) + piece * 64 + ch * 8;  // this thread's gate column
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (grow[q] >= job.row_end || col >= F) continue;
            const int rr = q * 16 + ((ctid & 127) >> 3);
            store_glu_vector<kAct>(p, grow[q], col, ld_shared_v4(buf + glu_slot(rr, ch)),
                                   ld_shared_v4(buf + glu_slot(rr, ch + 8)), prob[q]);
        }
        named_barrier(2 + cw, 128);
    }
}

// nn epilogue with the gated activation's backward (Params::glu_grad): the warpgroup's 64 x 256 accumulators are
// rounded to bf16 through its staging buffer 64 columns at a time (as the staged epilogue: the values the unfused
// path would store), then each thread takes 8 columns of 4 rows, with those rows' gate and up and probs, and
// writes d gate and d up (the formulas of src/cuda/activation.cu, so the results are the same bits); the 8 threads
// of a row then sum their act * dA into the row's d-prob partial of each 128 columns (kGluBackwardTileColumns).
// The gate / up loads of a chunk are issued before its accumulators are staged, so their latency hides behind the
// staging (issued after it, the epilogue cost mixtral's fc2 dgrad 1.8 ms more: H200, 2026-11-26).
template <Activation kAct>
__device__ __forceinline__ void glu_backward_epilogue(const Params& p, const TileJob& job, int cw, int ctid,
                                                      uint32_t buf, int r, int lane, const float (&d)[128]) {
    const int64_t in_cols = 2 * int64_t(p.n);
    float dp[4] = {0.f, 0.f, 0.f, 0.f}, prob[4];
    int64_t grow[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        grow[q] = job.row0 + cw * 64 + ((q * 128 + (ctid & 127)) >> 3);
        prob[q] = p.glu_probs && grow[q] < job.row_end ? __ldg(p.glu_probs + grow[q]) : 1.0f;
    }
    const int ch = ctid & 7;
    const int64_t dp_tiles = (p.n + kGluBackwardTileColumns - 1) / kGluBackwardTileColumns;
    // A row's partial per 128 columns (two chunks): the 8 threads of a row are 8 consecutive lanes (ch = lane & 7).
    auto flush = [&](int half) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float s = dp[q];
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            if (p.glu_dp && ch == 0 && grow[q] < job.row_end)
                p.glu_dp[grow[q] * dp_tiles + job.n0 / kGluBackwardTileColumns + half] = s;
            dp[q] = 0.f;
        }
    };
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        if (job.n0 + c * 64 >= p.n) {  // uniform over the warpgroup
            if ((c & 1) && job.n0 + (c >> 1) * kGluBackwardTileColumns < p.n) flush(c >> 1);
            continue;
        }
        const int gn = job.n0 + c * 64 + ch * 8;
        uint4 gv[4], uv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (grow[q] < job.row_end && gn < p.n) {
                const __nv_bfloat16* in = p.glu_in + grow[q] * in_cols + gn;
                gv[q] = __ldg(reinterpret_cast<const uint4*>(in));
                uv[q] = __ldg(reinterpret_cast<const uint4*>(in + p.n));
            }
        }
        stage_bf16_chunk(buf, r, lane, d, c);
        named_barrier(2 + cw, 128);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (grow[q] >= job.row_end || gn >= p.n) continue;
            const int rr = (q * 128 + (ctid & 127)) >> 3;
            const uint4 v = ld_shared_v4(buf + rr * kEpiRow + ch * 16);
            const __nv_bfloat16* go = reinterpret_cast<const __nv_bfloat16*>(&v);
            const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gv[q]);
            const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uv[q]);
            uint4 dgv, duv;
            __nv_bfloat16* dg = reinterpret_cast<__nv_bfloat16*>(&dgv);
            __nv_bfloat16* du = reinterpret_cast<__nv_bfloat16*>(&duv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float gof = __bfloat162float(go[e]), gf = __bfloat162float(g[e]), uf = __bfloat162float(u[e]);
                float dgf, duf, a;
                glu_backward_and_value(kAct, gf, uf, gof * prob[q], &dgf, &duf, &a);
                dp[q] += a * gof;
                dg[e] = __float2bfloat16(dgf);
                du[e] = __float2bfloat16(duf);
            }
            __nv_bfloat16* out = p.glu_grad + grow[q] * in_cols + gn;
            *reinterpret_cast<uint4*>(out) = dgv;
            *reinterpret_cast<uint4*>(out + p.n) = duv;
        }
        named_barrier(2 + cw, 128);
        if (c & 1) flush(c >> 1);
    }
}

// The async GLU forward epilogue (tma_kernel kAsyncEpi): the consumers stage the whole tile as bf16, rows of 512
// bytes, 16-byte chunk c of row r at c ^ (r & 7) (chunks 0-15 gate, 16-31 up; conflict-free as glu_slot), arrive
// on `staged` and go on with the next tile; three epilogue warps wait on it, store [gate | up] and the activation, and
// arrive on `freed`, which the consumers wait on before staging the next tile.
__device__ __forceinline__ uint32_t async_slot(int r, int chunk) {
    return uint32_t(r * kAsyncRow + ((chunk ^ (r & 7)) << 4));
}
__device__ __forceinline__ void stage_tile_async(uint32_t buf, int r, int lane, const float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const uint32_t off = uint32_t(lane & 3) * 4;
        st_shared_bf16x2(buf + async_slot(r, i) + off, d[4 * i], d[4 * i + 1]);
        st_shared_bf16x2(buf + async_slot(r + 8, i) + off, d[4 * i + 2], d[4 * i + 3]);
    }
}
// One epilogue thread (et of 96) of a staged tile: 8 gate columns of a row at a time, as glu_forward_epilogue.
template <Activation kAct>
__device__ __forceinline__ void store_tile_async(const Params& p, const TileJob& job, uint32_t buf, int et) {
    const int F = p.n >> 1, f0 = job.n0 >> 1;
    for (int item = et; item < 128 * 16; item += 96) {
        const int rr = item >> 4, ch = item & 15, col = f0 + ch * 8;
        const int64_t gr = job.row0 + rr;
        if (gr >= job.row_end || col >= F) continue;
        const float prob = p.glu_probs ? __ldg(p.glu_probs + gr) : 1.0f;
        store_glu_vector<kAct>(p, gr, col, ld_shared_v4(buf + async_slot(rr, ch)),
                               ld_shared_v4(buf + async_slot(rr, ch + 16)), prob);
    }
}

// tn epilogue (Params::staged_epilogue): the warpgroup's 64 x 256 fp32 accumulators leave 32 columns at a time
// through its two 8 KB buffers (laid out as the TMA box's 128-byte swizzle: a row's 16-byte piece q at q ^ (row & 7),
// which also keeps the st.shared conflict-free), each chunk one bulk tensor store, or with accumulation one bulk
// reduce-add (the fp32 main grad is read-modified-written at L2 instead of through the SM's registers). Nothing
// waits for a store to land: a buffer is reused once its previous store has read it out. Measured about even with
// the register stores (H200, docs/perf.md): this kernel's wgrad main loop waits on its TMA loads, not on its stores.
// `issued` counts this warpgroup's chunks, which rotate through its kBufs staging buffers. The warpgroup's 64 rows
// start at gradient row m0; N accumulators a thread hold N / 4 columns (m64n256: 128, m64n128: 64); `bar` is the
// warpgroup's named barrier.
template <int N, int kBufs = 2>
__device__ __forceinline__ void tn_store_epilogue(const Params& p, const TileJob& job, const CUtensorMap* map_c,
                                                  const CUtensorMap* map_c2, int m0, int bar, int ctid, uint32_t bufs,
                                                  int r, int lane, const float (&d)[N], int& issued) {
    const bool leader = (ctid & 127) == 0;
    const CUtensorMap* map = in_second(p, job.group) ? map_c2 : map_c;
    const int z = local_group(p, job.group);
    if (m0 >= p.k) return;  // uniform over the warpgroup: its rows lie past the gradient's
#pragma unroll
    for (int c = 0; c < N / 16; ++c) {
        if (job.n0 + c * 32 >= p.n) continue;  // uniform over the warpgroup
        const uint32_t buf = bufs + (issued % kBufs) * kEpiF32Bytes;
        if (issued >= kBufs) {  // the store kBufs chunks back used this buffer
            if (leader) bulk_wait_read<kBufs - 1>();
            named_barrier(bar, 128);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = c * 4 + j;  // the accumulators' 8-column block: columns 8j + 2(lane & 3) + {0, 1} here
            const uint32_t off = uint32_t(((j * 2 + ((lane & 3) >> 1)) ^ (r & 7)) << 4) + (lane & 1) * 8;
            st_shared_f32x2(buf + r * 128 + off, d[4 * i], d[4 * i + 1]);
            st_shared_f32x2(buf + (r + 8) * 128 + off, d[4 * i + 2], d[4 * i + 3]);
        }
        fence_proxy_async();  // generic-proxy writes, read by the async proxy
        named_barrier(bar, 128);
        if (leader) {
            if (p.accumulate)
                tma_reduce_add_3d(map, buf, job.n0 + c * 32, m0, z);
            else
                tma_store_3d(map, buf, job.n0 + c * 32, m0, z);
            bulk_commit();
        }
        ++issued;
    }
}

// Gathered A rows (Params::gather_row_token; the fused GLU forward on single CTAs): the consumer warpgroups load A
// themselves while their wgmmas run, each warpgroup its own 64 rows (its wgmmas read no others), kStages steps ahead:
// once a warpgroup retired a step it refills that step's slot with its rows for the step kStages later, with no wait
// on the other warpgroup. Thread t of a warpgroup copies, as 16-byte cp.async, chunk t & 7 of its rows t / 8 + 16 j
// (j < 4), from the row's token, into the TMA's 128-byte swizzle (chunk c of row r at c ^ (r & 7)); a warp's copy
// covers four whole 128-byte row pieces. The producer warp loads only B. A stage's full barrier counts 257 arrivals:
// the producer's expect_tx and each consumer thread's cp.async.mbarrier.arrive.noinc, which fires once that thread's
// copies landed. Rows past the tile's group read token 0 (their outputs are never stored); chunks past k are
// zero-filled. Off by default: qwen3-30b's fused fc1 took 1.84 ms gathered against 1.52 + 0.16 (TMA loads + the
// permute pass; ncu, H200); each token row is re-read for each of its experts, from DRAM more often than the permuted
// rows are. Slower still: the producer warp's 32 lanes issuing every cp.async (4.4 ms), one-row TMA boxes (10 ms).
__device__ __forceinline__ int gather_row(int ctid, int j) { return (ctid >> 7) * 64 + ((ctid & 127) >> 3) + 16 * j; }
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
struct GatherCursor {  // the next step a consumer thread gathers: k-step kt of the i-th job
    int i = -1, kt = 0, nk = 0, rows = 0;
    int64_t row0 = 0;
    int tok[4] = {0, 0, 0, 0};  // the tokens of this thread's rows (gather_row) of the job's tile
};
__device__ __forceinline__ void gather_a_chunks(const Params& p, uint32_t stage, const GatherCursor& g, int ctid) {
    const int c = ctid & 7, col = g.kt * kBK + 8 * c;
    const bool in_k = col < p.k;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int r = gather_row(ctid, j);
        cp_async16(stage + swizzled_chunk(r, c), p.gather_tokens + int64_t(g.tok[j]) * p.k + (in_k ? col : 0), in_k);
    }
}
// This thread's chunks of a consumed stage whose rows belong to the tile's group, out to the permuted copy
// (Params::gather_copy) that the wgrad reads: the CTAs of the first column tile write it.
__device__ __forceinline__ void copy_out_a_chunks(const Params& p, uint32_t stage, const TileJob& job, int kt,
                                                  int ctid) {
    const int c = ctid & 7, col = kt * kBK + 8 * c;
    if (col >= p.k) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int r = gather_row(ctid, j);
        if (job.row0 + r >= job.row_end) break;
        const uint4 v = ld_shared_v4(stage + swizzled_chunk(r, c));
        // Evict-first: the copy is read only by the wgrad, much later; L2 is better kept for the token rows.
        __stcs(reinterpret_cast<uint4*>(p.gather_copy + (job.row0 + r) * p.k + col), v);
    }
}

// Tensor maps (host-encoded, 128B swizzle, boxes of 64 elements along the contiguous dimension):
//   NT: a = {k, max_rows} box {64,128} (kCluster 2: {64,64}, one half per CTA); b = {k, n, G} box {64,256,1}
//   NN: a as NT;                                   b = {n, k, G} box {64,64,1}  (4 boxes per stage)
//   TN: a = {m, max_rows} box {64,64} (x2);        b = {n, max_rows} box {64,64} (x4)
//   c (tn's staged epilogue only; a copy of a otherwise): fp32 {n, m, G} box {32,64,1}
//   map_2 (groups >= p.second_from, GroupedGemmShape::second_from; a copy of a where unused): as b (nt / nn) or c (tn)
//   over the second base's G - second_from groups
// kCluster 2: the two CTAs of a cluster own n-neighbour tiles of the same row tile (TN: of the same group and
// m-slab), so their A tile is the same: each CTA loads one half of it and multicasts it to both, which cuts the
// L2 -> SM traffic per k-step from 48 KB to 40 KB. A stage is then free only when the consumers of BOTH CTAs
// released it (empty barriers count 2 warpgroups x 2 CTAs; consumers arrive on both CTAs' barriers).
// kAsyncEpi (nt with Params::glu_out only): 3 stages, and the epilogue on the producer warpgroup's warps 1-3
// (stage_tile_async / store_tile_async), so it overlaps the consumers' next main loop.
template <Op kOp, int kCluster, bool kAsyncEpi = false>
__global__ void __launch_bounds__(384, 1)
    tma_kernel(Params p, const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(!kAsyncEpi || kOp == Op::kNT, "the async epilogue is the fused GLU forward's");
    constexpr int BM = 128, BN = 256, kStages = kAsyncEpi ? kAsyncStages : 4;
    constexpr uint32_t kStageA = BM * kBK * 2, kStageB = BN * kBK * 2, kStageBytes = kStageA + kStageB;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t bars = base + kStages * kStageBytes;  // full[kStages], empty[kStages], staged, free
    const uint32_t epi = bars + 1024;  // epilogue staging (kEpiRegion or kAsyncEpiBytes bytes, 1024-aligned)
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (kStages + s); };
    const uint32_t staged = bars + 8 * (2 * kStages), freed = staged + 8;  // kAsyncEpi's hand-over
    auto sA = [&](int s) { return base + s * kStageBytes; };
    auto sB = [&](int s) { return base + s * kStageBytes + kStageA; };
    const int tid = threadIdx.x, wg = tid / 128;
    const int rank = kCluster > 1 ? int(cluster_ctarank()) : 0;
    // The fused GLU forward on single CTAs may gather its A rows from the unpermuted tokens (gather_a_chunks).
    const bool gathering = kAsyncEpi && kCluster == 1 && p.gather_row_token != nullptr;
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), gathering ? 257 : 1);  // gathered A: + each consumer thread's cp.async arrival
            mbar_init(empty(s), 2 * kCluster);  // one arrival per consumer warpgroup of each CTA of the cluster
        }
        if constexpr (kAsyncEpi) {
            mbar_init(staged, 256);  // every consumer thread, once a tile
            mbar_init(freed, 96);    // every epilogue thread, once a tile
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    sync_cta_or_cluster<kCluster>();
    // Persistent: the CTA (cluster) walks tiles (pairs) blockIdx.x / kCluster, + gridDim.x / kCluster, ...
    // Producer and consumers walk the same sequence and count k-steps globally (it), so the ring's stages and phases
    // carry over from one tile to the next and the producer fills the next tile's first stages while the consumers
    // run the epilogue of the current one. Both CTAs of a cluster see the same jobs except n0, hence the same k-steps.
    const int first = blockIdx.x / kCluster, stride = gridDim.x / kCluster;
    // The i-th job of this CTA (pair): tile pid = first + i * stride, or (tn with p.tn_hot_rows) the hot/cold
    // interleave. Returns false past the last one; job.active is false for a tile with nothing to do.
    auto job_at = [&](int i, TileJob& job) {
        if constexpr (kOp == Op::kTN) {
            if (p.tn_hot_rows > 0) {
                job = tn_interleaved_job<BM, BN, kCluster>(p, first, stride, i, rank);
                return job.active;
            }
        }
        const int pid = first + i * stride;
        if (pid >= p.total_tiles) return false;
        job = find_job_warp<kOp, BM, BN, kCluster>(p, pid, rank);
        return true;
    };

    if (wg == 0) {                 // producer warpgroup: warp 0 finds the jobs, its lane 0 issues every copy
#ifndef MOEKIT_GEMM_NO_SETMAXNREG  // (sanitizer builds: instrumented code may not fit in 40 registers)
        if constexpr (kAsyncEpi)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");  // warps 1-3 run the epilogue
        else
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
#endif
        if constexpr (kAsyncEpi) {
            if (tid >= 32) {  // the epilogue warps: every tile the consumers staged, in the consumers' order
                TileJob job;
                int t = 0;
                for (int i = 0; job_at(i, job); ++i) {
                    if (!job.active) continue;
                    mbar_wait(staged, t & 1);
                    with_activation(Activation(p.glu_act),
                                    [&](auto a) { store_tile_async<decltype(a)::value>(p, job, epi, tid - 32); });
                    mbar_arrive(freed);
                    ++t;
                }
                return;
            }
        } else {
            if (tid >= 32) return;
        }
        RingPosition<kStages> ring;
        TileJob job;
        for (int i = 0; job_at(i, job); ++i) {
            if (!job.active) continue;
            const int nk = num_ktiles<kOp>(p, job);
            // Boxes entirely past n (or m, or max_rows) would only feed outputs that are never stored: skip them,
            // and expect only the bytes of the boxes issued (the same A boxes in both CTAs of a cluster).
            const int a_boxes = kOp == Op::kTN    ? min(BM / 64, (p.k - job.m0 + 63) / 64)
                                : kCluster > 1 ? (job.row0 + 64 < p.max_rows ? 2 : 1)
                                               : 1;
            const int b_boxes =
                kOp == Op::kNT ? (job.n0 < p.n ? 1 : 0) : max(0, min(BN / 64, (p.n - job.n0 + 63) / 64));
            const uint32_t a_bytes = gathering                          ? 0u  // the consumers gather A
                                     : kOp == Op::kTN || kCluster > 1 ? uint32_t(a_boxes) * kBlockBytes
                                                                      : kStageA;
            const uint32_t bytes = a_bytes + uint32_t(b_boxes) * (kOp == Op::kNT ? kStageB : kBlockBytes);
            for (int kt = 0; kt < nk && tid == 0; ++kt) {
                const int s = ring.s;
                ring.wait_free(empty(s));
                mbar_expect_tx(full(s), bytes);
                const int k0 = kt * kBK;
                if constexpr (kOp == Op::kTN) {
                    const int r0 = int(job.row0) + k0;
                    if constexpr (kCluster > 1) {
                        if (rank < a_boxes)
                            tma_2d_mc(sA(s) + rank * kBlockBytes, &map_a, job.m0 + 64 * rank, r0, full(s), 3);
                    } else {
                        for (int j = 0; j < a_boxes; ++j)
                            tma_2d(sA(s) + j * kBlockBytes, &map_a, job.m0 + 64 * j, r0, full(s));
                    }
                    for (int j = 0; j < b_boxes; ++j)
                        tma_2d(sB(s) + j * kBlockBytes, &map_b, job.n0 + 64 * j, r0, full(s));
                } else {
                    if constexpr (kCluster > 1) {
                        if (rank < a_boxes)
                            tma_2d_mc(sA(s) + rank * kBlockBytes, &map_a, k0, int(job.row0) + 64 * rank, full(s), 3);
                    } else if (!gathering) {
                        tma_2d(sA(s), &map_a, k0, int(job.row0), full(s));
                    }
                    // B[g] of the first base or (groups >= p.second_from) of the second (map_2).
                    const CUtensorMap* mb = in_second(p, job.group) ? &map_2 : &map_b;
                    const int z = local_group(p, job.group);
                    if constexpr (kOp == Op::kNT) {
                        if (b_boxes > 0 && p.glu_out) {  // gate rows f0 .., up rows F + f0 .. (boxes of 128)
                            tma_3d(sB(s), mb, k0, job.n0 >> 1, z, full(s));
                            tma_3d(sB(s) + kStageB / 2, mb, k0, (p.n >> 1) + (job.n0 >> 1), z, full(s));
                        } else if (b_boxes > 0) {
                            tma_3d(sB(s), mb, k0, job.n0, z, full(s));
                        }
                    } else {
                        for (int j = 0; j < b_boxes; ++j)
                            tma_3d(sB(s) + j * kBlockBytes, mb, job.n0 + 64 * j, k0, z, full(s));
                    }
                }
                ring.advance();
            }
            __syncwarp();  // lanes 1-31 skipped the copies: meet lane 0 before the next job search
        }
        if constexpr (kCluster > 1) {
            if (tid == 0) drain_ring(ring, empty);
            __syncwarp();
        }
        return;
    }

#ifndef MOEKIT_GEMM_NO_SETMAXNREG
    if constexpr (kAsyncEpi)
        // 128 x 56 + 256 x 224 = the launch's 384 x 168: inc waits for registers the other warps freed, so a split
        // over the launch's hangs (seen: 144 / 184 for a dgrad epilogue, docs/perf.md).
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    else
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
#endif
    const int cw = wg - 1;  // consumer warpgroup 0/1: output rows 64*cw ..
    const int ctid = tid - 128;
    const int w = (ctid >> 5) & 3, lane = ctid & 31;
    constexpr int kTransA = kOp == Op::kTN ? 1 : 0;
    constexpr int kTransB = kOp == Op::kNT ? 0 : 1;
    auto release = [&](int s) { release_stage<kCluster>(empty(s)); };
    int it = 0, tn_chunks = 0, staged_tiles = 0;
    // Gathered A: the next step to gather (g_it, global), kStages ahead of the consumed one; every thread gathers
    // one step after each step its warpgroup retired, into the slot that step freed.
    GatherCursor g;
    int g_it = 0;
    auto gather_next = [&] {
        TileJob gj;
        while (g.kt >= g.nk) {  // into the next tile with steps
            if (!job_at(++g.i, gj)) return;
            if (!gj.active) continue;
            g.kt = 0, g.nk = num_ktiles<kOp>(p, gj), g.row0 = gj.row0;
            g.rows = int(min(int64_t(BM), gj.row_end - gj.row0));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = gather_row(ctid, j);
                g.tok[j] = r < g.rows ? p.gather_row_token[g.row0 + r] : 0;
            }
        }
        const int gs = g_it % kStages;  // this warpgroup retired the step that last used the slot
        gather_a_chunks(p, sA(gs), g, ctid);
        cp_async_arrive_noinc(full(gs));
        ++g.kt, ++g_it;
    };
    if (gathering)
        for (int q = 0; q < kStages; ++q) gather_next();
    float d[128];
    TileJob job;
    for (int i = 0; job_at(i, job); ++i) {
        if (!job.active) continue;
        const int nk = num_ktiles<kOp>(p, job);
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.f;
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(full(s), (it / kStages) & 1);
            if (gathering) {
                fence_proxy_async();  // A came through cp.async (generic proxy); wgmma reads through the async proxy
                if (p.gather_copy && job.n0 == 0) copy_out_a_chunks(p, sA(s), job, kt, ctid);
            }
            if constexpr (kOp == Op::kTN) {
                // Reduction rows at or past the group's end (the next group's, or past max_rows) must count as zero.
                const int valid = int(job.row_end - (job.row0 + int64_t(kt) * kBK));
                if (valid < kBK) {
                    const int bad_rows = kBK - valid, blocks = (BM + BN) / 64;
                    for (int c = ctid; c < bad_rows * blocks * 8; c += 256) {
                        int blk = c / (bad_rows * 8), rest = c % (bad_rows * 8);
                        int r = valid + rest / 8, ch = rest % 8;
                        const uint32_t dst = sA(s) + blk * kBlockBytes + r * 128 + ch * 16;
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
                    }
                    fence_proxy_async();
                    named_barrier(1, 256);
                }
            }
            const uint32_t a_s = sA(s), b_s = sB(s);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk) {
                uint64_t da = kTransA ? make_desc(a_s + cw * kBlockBytes + kk * 2048, kBlockBytes, 1024)
                                      : make_desc(a_s + cw * 64 * 128 + kk * 32, 16, 1024);
                uint64_t db =
                    kTransB ? make_desc(b_s + kk * 2048, kBlockBytes, 1024) : make_desc(b_s + kk * 32, 16, 1024);
                wgmma_m64n256k16<kTransA, kTransB>(d, da, db, 1);
            }
            wgmma_commit();
            wgmma_wait<1>();  // step it-1 retired by this warpgroup: hand its stage back to the producer(s)
            if (kt > 0 && (ctid & 127) == 0) release((it - 1) % kStages);
            if (kt > 0 && gathering) gather_next();
        }
        wgmma_wait<0>();
        if (nk > 0 && (ctid & 127) == 0) release((it - 1) % kStages);
        if (nk > 0 && gathering) gather_next();
        const int row = cw * 64 + w * 16 + (lane >> 2);
        if constexpr (kAsyncEpi) {  // hand the tile to the epilogue warps once they are done with the last one
            if (staged_tiles > 0) mbar_wait(freed, (staged_tiles - 1) & 1);
            stage_tile_async(epi, row, lane, d);
            mbar_arrive(staged);
            ++staged_tiles;
            continue;
        }
        if constexpr (kOp == Op::kNT) {
            if (p.glu_out) {  // [gate | up] and the gated activation (Params::glu_out)
                with_activation(Activation(p.glu_act), [&](auto a) {
                    glu_forward_epilogue<decltype(a)::value>(p, job, cw, ctid, epi + cw * kGluBytes, row - cw * 64,
                                                             lane, d);
                });
                continue;
            }
        }
        if constexpr (kOp == Op::kNN) {
            if (p.glu_grad) {  // the gated activation's backward instead of storing dA (Params::glu_grad)
                with_activation(Activation(p.glu_act), [&](auto a) {
                    glu_backward_epilogue<decltype(a)::value>(p, job, cw, ctid, epi + cw * kEpiBytes, row - cw * 64,
                                                              lane, d);
                });
                continue;
            }
        }
        if constexpr (kOp == Op::kTN) {
            if (p.staged_epilogue) {
                // An empty group adds nothing to an accumulated gradient, and an overwrite_nonempty one is not
                // written: its tile is left as it is.
                if (!((p.keep_empty || in_second(p, job.group)) && nk == 0))
                    tn_store_epilogue(p, job, &map_c, &map_2, job.m0 + 64 * cw, 2 + cw, ctid,
                                      epi + cw * 2 * kEpiF32Bytes, row - cw * 64, lane, d, tn_chunks);
                continue;
            }
        }
        if constexpr (kOp != Op::kTN) {
            if (p.staged_epilogue) {
                // bf16 results through shared memory, 64 columns at a time: the accumulator layout gives 16-byte row
                // pieces per lane quad (half a 32-byte sector per store); re-read as whole 128-byte row segments
                // they leave the SM as full-line 16-byte-per-lane stores. Rows padded to 144 B: conflict-free both
                // ways. Each warpgroup owns its 64 rows and its own staging buffer (named barrier 2 + cw).
                const uint32_t buf = epi + cw * kEpiBytes;
                const int r = row - cw * 64;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int col0 = job.n0 + c * 64;
                    if (col0 >= p.n) continue;  // uniform over the warpgroup
                    stage_bf16_chunk(buf, r, lane, d, c);
                    named_barrier(2 + cw, 128);
                    store_staged_chunk(buf, job, cw, ctid, static_cast<__nv_bfloat16*>(p.C), p.n, col0, p.n);
                    named_barrier(2 + cw, 128);
                }
                continue;
            }
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            int col = i * 8 + (lane & 3) * 2;
            store_pair<kOp>(p, job, row, col, d[4 * i], d[4 * i + 1]);
            store_pair<kOp>(p, job, row + 8, col, d[4 * i + 2], d[4 * i + 3]);
        }
    }
    if constexpr (kOp == Op::kTN) {
        // The last bulk stores must have read their shared-memory source before the CTA (and its memory) ends.
        if (tn_chunks > 0 && (ctid & 127) == 0) bulk_wait_all();
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
