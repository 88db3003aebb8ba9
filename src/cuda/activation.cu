// CUDA activation forward/backward (see activation.cuh): a warp per row where rows are narrow, else a block per
// row; vectors of up to 16 bytes, fp32 maths on the bf16 fc1 output, the scalar formulas of
// src/core/activation_math.h; d(prob) is a fixed-order warp or block reduction, so it is bitwise reproducible.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/activation.cuh"
#include "cuda/cuda_check.h"

namespace moekit::cuda {

namespace {

constexpr int kThreads = 256;
// Rows of at most this many activations take a warp each (row_threads).
constexpr int64_t kWarpRowMaxFfn = 1024;

// kPer columns per thread: 8, 4 or 2 (16-, 8-, 4-byte vectors, F % kPer == 0) or 1.
template <int kPer>
struct alignas(2 * kPer) Vec {
    __nv_bfloat16 v[kPer];
};

template <int kPer>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float* out) {
    const Vec<kPer> v = *reinterpret_cast<const Vec<kPer>*>(p);
    for (int i = 0; i < kPer; ++i) out[i] = __bfloat162float(v.v[i]);
}
template <int kPer>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float* in) {
    Vec<kPer> v;
    for (int i = 0; i < kPer; ++i) v.v[i] = __float2bfloat16(in[i]);
    *reinterpret_cast<Vec<kPer>*>(p) = v;
}

// A row is taken by kRowThreads consecutive threads of a block (a warp, or the whole block): narrow rows (F up to
// 1024, row_threads) give a warp each, so no thread idles on a row too short for the block and d(prob) is a
// warp shuffle instead of a block reduction with a barrier a step.
// The block case keeps 32-bit index maths (blockIdx, threadIdx, blockDim as they are): with 64-bit row-group
// maths its forward took 39 registers instead of 32, a quarter of the threads an SM, and the mixtral passes 15%
// longer (H200, 2026-11-27).
template <int kRowThreads>
struct RowGroup {
    static constexpr bool kBlock = kRowThreads == kThreads;
    __device__ static int64_t first() {
        if constexpr (kBlock) return blockIdx.x;
        else return int64_t(blockIdx.x) * (kThreads / kRowThreads) + threadIdx.x / kRowThreads;
    }
    __device__ static int64_t stride() {
        if constexpr (kBlock) return gridDim.x;
        else return int64_t(gridDim.x) * (kThreads / kRowThreads);
    }
    __device__ static unsigned lane() {
        if constexpr (kBlock) return threadIdx.x;
        else return threadIdx.x % kRowThreads;
    }
    __device__ static unsigned columns_step() {
        if constexpr (kBlock) return blockDim.x;
        else return kRowThreads;
    }
};

// One vector of kPer columns, forward: a = act(gate) [* up] * p, rounded through the router dtype R as Megatron.
template <typename R, int kPer>
__device__ __forceinline__ void forward_vector(const ActivationShape& s, const float* g, const float* u, R p,
                                               float* a) {
#pragma unroll
    for (int i = 0; i < kPer; ++i)
        a[i] = float(R(s.gated ? glu_forward(s.act, g[i], u[i]) : activation_forward(s.act, g[i])) * p);
}

// One vector backward: d gate (and d up) from the output gradient go, and the vector's act * go added to dp in
// column order.
template <int kPer>
__device__ __forceinline__ void backward_vector(const ActivationShape& s, const float* go, const float* g,
                                                const float* u, float p, float* dg, float* du, float& dp) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const float da = go[i] * p;
        if (s.gated) {
            float a;
            glu_backward_and_value(s.act, g[i], u[i], da, &dg[i], &du[i], &a);
            dp += a * go[i];
        } else {
            dg[i] = da * activation_grad(s.act, g[i]);
            dp += activation_forward(s.act, g[i]) * go[i];
        }
    }
}

template <typename R, int kPer, int kRowThreads>
__global__ void activation_forward_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                          const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                          __nv_bfloat16* __restrict__ out) {
    using G = RowGroup<kRowThreads>;
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = G::first(); r < n; r += G::stride()) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        const R p = probs ? probs[r] : R(1);
        for (int64_t f = G::lane() * kPer; f < F; f += G::columns_step() * kPer) {
            float g[kPer], u[kPer], a[kPer];
            load<kPer>(row + f, g);
            if (s.gated) load<kPer>(row + F + f, u);
            forward_vector<R, kPer>(s, g, u, p, a);
            store<kPer>(out + r * F + f, a);
        }
    }
}

// The sum of a row group's partials in a fixed order (reproducible), returned to all of them. A warp: butterfly
// shuffles (its 32 lanes take the same rows, so all are present); the block: a shared-memory tree.
template <int kRowThreads>
__device__ __forceinline__ float row_sum(float v, float* red) {
    if constexpr (kRowThreads == 32) {
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        return v;
    } else {
        red[threadIdx.x] = v;
        __syncthreads();
        for (int w = kThreads / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
            __syncthreads();
        }
        const float total = red[0];
        __syncthreads();
        return total;
    }
}

template <typename R, int kPer, int kRowThreads>
__global__ void activation_backward_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                           const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                           const __nv_bfloat16* __restrict__ grad_out,
                                           __nv_bfloat16* __restrict__ grad_fc1, R* __restrict__ grad_probs) {
    using G = RowGroup<kRowThreads>;
    __shared__ float red[kRowThreads == 32 ? 1 : kThreads];
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = G::first(); r < n; r += G::stride()) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        __nv_bfloat16* grow = grad_fc1 + r * in_cols;
        const float p = probs ? float(probs[r]) : 1.0f;
        float dp = 0.0f;
        for (int64_t f = G::lane() * kPer; f < F; f += G::columns_step() * kPer) {
            float go[kPer], g[kPer], u[kPer], dg[kPer], du[kPer];
            load<kPer>(grad_out + r * F + f, go);
            load<kPer>(row + f, g);
            if (s.gated) load<kPer>(row + F + f, u);
            backward_vector<kPer>(s, go, g, u, p, dg, du, dp);
            store<kPer>(grow + f, dg);
            if (s.gated) store<kPer>(grow + F + f, du);
        }
        if (grad_probs) {
            const float total = row_sum<kRowThreads>(dp, red);
            if (G::lane() == 0) grad_probs[r] = R(total);
        }
    }
}

// Forward of narrow rows (F <= kWarpRowMaxFfn, F % 8 == 0): a warp a row, and each lane loads all of its kU 16-byte
// vectors of gate and up before it uses the first, kept as raw bf16 (4 registers a vector): the looping kernel
// above has one vector a stream in flight per lane. qwen3-30b (F 768, three vectors a lane): forward stage 0.215 ->
// 0.167 ms (H200, 2026-11-27, moekit bench, two interleaved runs each). The backward built the same way (three
// streams, 94 registers at F 768, two blocks an SM) was slower, 0.321 -> 0.415 ms, and was not kept.
__device__ __forceinline__ void unpack8(const uint4& v, float* out) {
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(b[i]);
}

template <typename R, int kU>
__global__ void activation_forward_rows_kernel(ActivationShape s, const int32_t* __restrict__ num_rows,
                                               const __nv_bfloat16* __restrict__ fc1, const R* __restrict__ probs,
                                               __nv_bfloat16* __restrict__ out) {
    using G = RowGroup<32>;
    const int64_t n = num_rows ? min(int64_t(*num_rows), s.max_rows) : s.max_rows;
    const int64_t F = s.ffn, in_cols = s.gated ? 2 * F : F;
    for (int64_t r = G::first(); r < n; r += G::stride()) {
        const __nv_bfloat16* row = fc1 + r * in_cols;
        uint4 gv[kU], uv[kU];
#pragma unroll
        for (int j = 0; j < kU; ++j) {
            const int64_t f = (G::lane() + 32 * j) * 8;
            if (f < F) {
                gv[j] = __ldg(reinterpret_cast<const uint4*>(row + f));
                if (s.gated) uv[j] = __ldg(reinterpret_cast<const uint4*>(row + F + f));
            }
        }
        const R p = probs ? probs[r] : R(1);
#pragma unroll
        for (int j = 0; j < kU; ++j) {
            const int64_t f = (G::lane() + 32 * j) * 8;
            if (f >= F) continue;
            float g[8], u[8], a[8];
            unpack8(gv[j], g);
            if (s.gated) unpack8(uv[j], u);
            forward_vector<R, 8>(s, g, u, p, a);
            store<8>(out + r * F + f, a);
        }
    }
}

// Whether the all-vectors-first forward takes narrow rows (MOEKIT_ACT_ROWS_FIRST=0: the looping one, for A/B), and
// with how many vectors a lane (0: not for this F).
int rows_first_vectors(int64_t ffn, int row_threads) {
    static const bool on = [] {
        const char* env = std::getenv("MOEKIT_ACT_ROWS_FIRST");
        return !(env && std::strcmp(env, "0") == 0);
    }();
    if (!on || row_threads != 32 || ffn % 8 != 0 || ffn > kWarpRowMaxFfn) return 0;
    return int(ceil_div(ffn, 32 * 8));
}

// Threads a row (MOEKIT_ACT_ROW_THREADS=32|256 forces one): a warp up to F = 1024, else the block. H200,
// moekit bench, 2026-11-27, warp vs block fwd / bwd ms: qwen3-30b (F 768) 0.23 / 0.37 vs 0.25 / 0.53; F 2048
// (dsv3-ep8, dsv3-e256) 0.16 / 0.26 vs 0.15 / 0.26.
int row_threads(int64_t ffn) {
    static const int forced = [] {
        const char* env = std::getenv("MOEKIT_ACT_ROW_THREADS");
        const int v = env ? std::atoi(env) : 0;
        return v == 32 || v == kThreads ? v : 0;
    }();
    if (forced) return forced;
    return ffn <= kWarpRowMaxFfn ? 32 : kThreads;
}

int grid_for_rows(int64_t max_rows, int row_threads) {
    return int(std::min<int64_t>(std::max<int64_t>(ceil_div(max_rows, kThreads / row_threads), 1), 16384));
}

}  // namespace

template <typename R>
void activation_forward(const ActivationShape& s, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                        const R* probs, __nv_bfloat16* out, cudaStream_t stream) {
    const int per = s.ffn % 8 == 0 ? 8 : 1;
    const int rt = row_threads(s.ffn), grid = grid_for_rows(s.max_rows, rt);
    auto launch = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, out); };
    if (const int u = rows_first_vectors(s.ffn, rt)) {
        if (u == 1) launch(activation_forward_rows_kernel<R, 1>);
        else if (u == 2) launch(activation_forward_rows_kernel<R, 2>);
        else if (u == 3) launch(activation_forward_rows_kernel<R, 3>);
        else launch(activation_forward_rows_kernel<R, 4>);
        MOEKIT_CUDA_LAUNCH_CHECK();
        return;
    }
    if (per == 8)
        rt == 32 ? launch(activation_forward_kernel<R, 8, 32>) : launch(activation_forward_kernel<R, 8, kThreads>);
    else
        rt == 32 ? launch(activation_forward_kernel<R, 1, 32>) : launch(activation_forward_kernel<R, 1, kThreads>);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void activation_backward(const ActivationShape& s, const int32_t* num_rows, const __nv_bfloat16* fc1_out,
                         const R* probs, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_fc1, R* grad_probs,
                         cudaStream_t stream) {
    // Width of the backward's vectors (MOEKIT_ACT_BWD_VEC=1|2|4|8 forces one). H100, interleaved moekit bench:
    // mixtral 1.465 / 1.338 / 1.349 / 2.221 ms, dsv3-ep8 0.490 / 0.425 / 0.436 / 0.704 ms for 1 / 2 / 4 / 8 (scalar
    // loads move half a cache line per warp; 8-wide costs five 8-float arrays of registers per thread). Two or four
    // 2-wide vectors in flight per thread (all loads of a round before the first use) measured slower again: mixtral
    // 1.26 -> 1.68 / 1.63 ms, dsv3-ep8 0.41 -> 0.56 (H100, 2026-11-23, scripts/device_bench_ab.sh). Those ran the
    // GLU backward with three sigmoids an element; with one (glu_backward_and_value) the pass went mixtral 1.40 ->
    // 0.89 ms, dsv3-ep8 0.46 -> 0.30, qwen3-30b 0.75 -> 0.54 (H200, 2026-11-26).
    // With one sigmoid an element the pass leans on memory more: 4-wide (H200, 2026-11-26: mixtral F 14336 0.74 /
    // 0.89 / 0.78 ms for 4 / 2 / 8). The block's 2-wide fallback for F < 1024 went with the warp a row (row_threads):
    // such rows now take a warp, 4-wide, every lane busy (qwen3-30b F 768 0.53 ms block 2-wide -> 0.36 warp 4-wide).
    // A warp's row 8-wide (three 16-byte vectors a lane at F 768): qwen3-30b 0.324 / 0.318 ms 4-wide, 0.287 / 0.286
    // 8-wide, 0.371 / 0.370 2-wide (H200, 2026-11-27, moekit bench, two interleaved runs each).
    static const int forced = [] {
        const char* env = std::getenv("MOEKIT_ACT_BWD_VEC");
        const int v = env ? std::atoi(env) : 0;
        return v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
    }();
    const int rt = row_threads(s.ffn), grid = grid_for_rows(s.max_rows, rt);
    const int vec = forced ? forced : rt == 32 ? 8 : 4;
    const int width = s.ffn % vec == 0 ? vec : 1;
    auto launch = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(s, num_rows, fc1_out, probs, grad_out, grad_fc1, grad_probs);
    };
    auto launch_width = [&](auto row_threads_tag) {
        constexpr int kRt = decltype(row_threads_tag)::value;
        if (width == 8) launch(activation_backward_kernel<R, 8, kRt>);
        else if (width == 4) launch(activation_backward_kernel<R, 4, kRt>);
        else if (width == 2) launch(activation_backward_kernel<R, 2, kRt>);
        else launch(activation_backward_kernel<R, 1, kRt>);
    };
    if (rt == 32) launch_width(std::integral_constant<int, 32>{});
    else launch_width(std::integral_constant<int, kThreads>{});
    MOEKIT_CUDA_LAUNCH_CHECK();
}

namespace {
// One thread a row: the tiles' partials in tile order (fixed, so reproducible).
__global__ void probs_from_partials_kernel(int64_t max_rows, const int32_t* __restrict__ num_rows,
                                           const float* __restrict__ partials, int64_t tiles,
                                           float* __restrict__ grad_probs) {
    const int64_t n = num_rows ? min(int64_t(*num_rows), max_rows) : max_rows;
    for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n; r += int64_t(gridDim.x) * blockDim.x) {
        float s = 0.0f;
        for (int64_t t = 0; t < tiles; ++t) s += partials[r * tiles + t];
        grad_probs[r] = s;
    }
}
}  // namespace

void activation_backward_probs_from_partials(int64_t max_rows, const int32_t* num_rows, const float* partials,
                                             int64_t tiles, float* grad_probs, cudaStream_t stream) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>((max_rows + kThreads - 1) / kThreads, 1), 4096));
    probs_from_partials_kernel<<<grid, kThreads, 0, stream>>>(max_rows, num_rows, partials, tiles, grad_probs);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

#define MOEKIT_INSTANTIATE_ACTIVATION(R)                                                                       \
    template void activation_forward<R>(const ActivationShape&, const int32_t*, const __nv_bfloat16*, const R*, \
                                        __nv_bfloat16*, cudaStream_t);                                         \
    template void activation_backward<R>(const ActivationShape&, const int32_t*, const __nv_bfloat16*, const R*, \
                                         const __nv_bfloat16*, __nv_bfloat16*, R*, cudaStream_t);
MOEKIT_INSTANTIATE_ACTIVATION(float)
MOEKIT_INSTANTIATE_ACTIVATION(double)

}  // namespace moekit::cuda
