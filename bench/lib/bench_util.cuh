// Helpers of the expert-GEMM / expert-MLP / layer benchmarks (bench/lib, bench/bench_echo_balance.cu): device
// buffers and the zipf skew here; random fills, dense cuBLAS GEMMs for the floor and event timing (median over
// iterations) are the engine's (src/cuda/random_fill.h, dense_gemm.cuh, event_timing.h: the training engine's
// speed report uses them too). The activation is the layer's own (src/cuda/activation.cuh), so the MLP benchmark
// measures the kernels the layer runs.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/cuda_check.h"
#include "lib/balanced_order.h"
#include "cuda/dense_gemm.cuh"
#include "cuda/event_timing.h"
#include "cuda/random_fill.h"

namespace moekit::cuda::bench {

using bf16 = __nv_bfloat16;
using cuda::dense_gemm;
using cuda::fill_uniform;
using cuda::time_ms;
using cuda::time_ms_after;
using moekit::bench::balanced_order;

// Internal linkage: this header is included by more than one benchmark .cu of the same library.
namespace {

// The median of timed samples (the upper one of an even count; 0 for none).
template <typename T>
double median(std::vector<T> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : double(v[v.size() / 2]);
}

template <typename T>
struct DevBuf {
    T* ptr = nullptr;
    explicit DevBuf(size_t n) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, sizeof(T) * (n ? n : 1))); }
    ~DevBuf() { cudaFree(ptr); }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
};

__global__ void set_column_kernel(bf16* p, int64_t rows, int64_t cols, int64_t col, float value) {
    for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x)
        p[r * cols + col] = __float2bfloat16(value);
}

// --skew zipf:S: feature 0 of every token is 1 and router row e gets -S*log(e+1) there (scaled to the
// logit noise of init-scale weights): a per-expert logit bias that makes expert e's popularity fall like
// a zipf law. hidden [T, H], router_weight [E, H].
void apply_zipf_skew(bf16* hidden, int64_t T, bf16* router_weight, int64_t E, int64_t H, double s) {
    set_column_kernel<<<256, 256>>>(hidden, T, H, 0, 1.f);
    MOEKIT_CUDA_LAUNCH_CHECK();
    const float noise = std::sqrt(float(H) / 3.f) * 0.02f;
    std::vector<bf16> bias(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) bias[size_t(e)] = __float2bfloat16(float(-s * std::log(double(e + 1)) * noise));
    MOEKIT_CUDA_CHECK(cudaMemcpy2D(router_weight, H * sizeof(bf16), bias.data(), sizeof(bf16), sizeof(bf16), size_t(E),
                                   cudaMemcpyHostToDevice));
}

}  // namespace
}  // namespace moekit::cuda::bench
