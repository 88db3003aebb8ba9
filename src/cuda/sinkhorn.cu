// Sinkhorn routing matrix (see sinkhorn.cuh): one block of kThreads threads iterates
//   d0 = (1/T) / (C d1 + 1e-8),  d1 = (1/E) / (Cᵀ d0 + 1e-8)  until mean|d1_old - d1| <= 1e-4
// with C = exp(logits) (fp32), exactly the CPU twin's arithmetic: row sums run in the CPU's order
// (e ascending, no FMA contraction) and the convergence test is evaluated on the device, so every
// thread leaves the loop together without a host round trip. Column sums use a fixed two-level
// order (deterministic, not the CPU's order: fp32 rounding differences of ~1e-7 relative).
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/router.cuh"
#include "cuda/router_warp.cuh"
#include "cuda/sinkhorn.cuh"

namespace moekit::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / kWarp;
constexpr float kEps = 1e-8f;

// Sum of one double per thread, broadcast to every thread (fixed order: deterministic).
__device__ double block_sum(double v, double* red) {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    v = warp_sum(v);
    __syncthreads();  // red[] may still be read from the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double total = 0;
    for (int w = 0; w < kWarps; ++w) total += red[w];
    return total;
}

// Shared memory: d1 [E] fp32, partial [kThreads] fp32.
template <typename R>
__global__ void __launch_bounds__(kThreads)
    sinkhorn_kernel(int64_t T, int64_t E, const R* __restrict__ logits, const uint8_t* __restrict__ padding,
                    float* __restrict__ cost, float* __restrict__ d0) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ double red[kWarps];
    float* d1 = reinterpret_cast<float*>(smem_raw);
    float* partial = d1 + E;
    const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;

    double my_valid = 0;
    for (int64_t t = tid; t < T; t += kThreads) my_valid += padding[t] == 0;
    const double rows = block_sum(my_valid, red);
    for (int64_t i = tid; i < T * E; i += kThreads) cost[i] = expf(float(logits[i]));
    for (int64_t e = tid; e < E; e += kThreads) d1[e] = 1.0f;
    __syncthreads();

    // CPU: (T(1) / T(rows)) * T(1) / (s + eps), i.e. ((1/rows) * 1) / (s + eps).
    const float row_target = __fdiv_rn(1.0f, float(rows)), col_target = __fdiv_rn(1.0f, float(E));
    // Column pass layout: with E <= kThreads, thread (p, e) sums rows p, p + P, ... of column e.
    const int64_t P = E <= kThreads ? kThreads / E : 1;
    double error = 1e9;
    for (int it = 0; it < kSinkhornMaxIterations && error > kSinkhornTolerance; ++it) {
        for (int64_t t = tid; t < T; t += kThreads) {
            if (padding[t]) continue;
            const float* c = cost + t * E;
            float s = 0.0f;
            for (int64_t e = 0; e < E; ++e) s = __fadd_rn(s, __fmul_rn(d1[e], c[e]));
            d0[t] = __fdiv_rn(__fmul_rn(row_target, 1.0f), __fadd_rn(s, kEps));
        }
        __syncthreads();
        double my_err = 0;
        if (E <= kThreads) {
            if (tid < P * E) {
                const int64_t e = tid % E;
                float acc = 0.0f;
                for (int64_t t = tid / E; t < T; t += P)
                    if (!padding[t]) acc = __fadd_rn(acc, __fmul_rn(d0[t], cost[t * E + e]));
                partial[tid] = acc;
            }
            __syncthreads();  // d1 is no longer read in this iteration: update it in place
            for (int64_t e = warp; e < E; e += kWarps) {
                float s = 0.0f;
                for (int64_t p = lane; p < P; p += kWarp) s = __fadd_rn(s, partial[p * E + e]);
                s = warp_sum(s);
                if (lane == 0) {
                    const float d = __fdiv_rn(__fmul_rn(col_target, 1.0f), __fadd_rn(s, kEps));
                    my_err += fabs(double(__fsub_rn(d1[e], d)));
                    d1[e] = d;
                }
            }
        } else {
            __syncthreads();
            for (int64_t e = tid; e < E; e += kThreads) {
                float s = 0.0f;
                for (int64_t t = 0; t < T; ++t)
                    if (!padding[t]) s = __fadd_rn(s, __fmul_rn(d0[t], cost[t * E + e]));
                const float d = __fdiv_rn(__fmul_rn(col_target, 1.0f), __fadd_rn(s, kEps));
                my_err += fabs(double(__fsub_rn(d1[e], d)));
                d1[e] = d;
            }
        }
        error = block_sum(my_err, red) / double(E);  // same value in every thread: uniform exit
    }
    __syncthreads();
    for (int64_t i = tid; i < T * E; i += kThreads) {
        const int64_t t = i / E, e = i % E;
        cost[i] = padding[t] ? 0.0f : __fmul_rn(__fmul_rn(d1[e], cost[i]), d0[t]);
    }
}

}  // namespace

template <typename R>
void sinkhorn_forward(int64_t T, int64_t E, const R* logits, const uint8_t* padding_mask, float* out, float* d0,
                      cudaStream_t stream) {
    const size_t smem = size_t(E + kThreads) * sizeof(float);
    MOEKIT_REQUIRE(smem <= 200 * 1024, "--moe-router-load-balancing-type=sinkhorn on --device cuda: E=", E,
                   " experts exceed the Sinkhorn kernel's shared memory");
    if (smem > 48 * 1024)
        MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&sinkhorn_kernel<R>),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    sinkhorn_kernel<R><<<1, kThreads, smem, stream>>>(T, E, logits, padding_mask, out, d0);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template void sinkhorn_forward<float>(int64_t, int64_t, const float*, const uint8_t*, float*, float*, cudaStream_t);
template void sinkhorn_forward<double>(int64_t, int64_t, const double*, const uint8_t*, float*, float*, cudaStream_t);

}  // namespace moekit::cuda
