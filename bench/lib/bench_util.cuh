// Helpers of the expert-GEMM / expert-MLP benchmarks (bench_expert_mlp.cu): device buffers, random fills,
// dense cuBLAS GEMMs for the floor, event timing (median over iterations). The activation is the layer's own
// (src/cuda/activation.cuh), so the MLP benchmark measures the kernels the layer runs.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "cuda/cuda_check.h"
#include "cuda/grouped_gemm_kernels.cuh"

namespace moekit::cuda::bench {

using bf16 = __nv_bfloat16;

// Internal linkage: this header is included by more than one benchmark .cu of the same library.
namespace {

template <typename T>
struct DevBuf {
    T* ptr = nullptr;
    explicit DevBuf(size_t n) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, sizeof(T) * (n ? n : 1))); }
    ~DevBuf() { cudaFree(ptr); }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
};

// Uniform in [-scale, scale), never all zeros (zeros time faster than real data).
__global__ void fill_uniform_kernel(bf16* p, size_t n, float scale, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16(float((2 * uniform01(seed, 0, i) - 1) * scale));
}
__global__ void fill_uniform_f32_kernel(float* p, size_t n, float lo, float hi, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = float(lo + (hi - lo) * uniform01(seed, 1, i));
}
void fill_uniform(bf16* p, size_t n, float scale, uint64_t seed) {
    fill_uniform_kernel<<<1024, 256>>>(p, n, scale, seed);
    MOEKIT_CUDA_LAUNCH_CHECK();
}
void fill_uniform(float* p, size_t n, float lo, float hi, uint64_t seed) {
    fill_uniform_f32_kernel<<<1024, 256>>>(p, n, lo, hi, seed);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

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

// Dense cuBLAS GEMMs with the grouped functions' row-major conventions and one group of `rows` rows:
// NT: C[rows,n] = A[rows,k]·B[n,k]ᵀ; NN: C = A·B[k,n]; TN: C[m,n] fp32 = A[rows,m]ᵀ·B[rows,n].
cublasHandle_t dense_handle() {
    static cublasHandle_t h = [] {
        cublasHandle_t c = nullptr;
        MOEKIT_CUBLAS_CHECK(cublasCreate(&c));
        return c;
    }();
    return h;
}
void dense_gemm(gemm_detail::Op op, int64_t rows, int64_t n, int64_t k, const bf16* A, const bf16* B, void* C,
                cudaStream_t stream) {
    const float alpha = 1.f, beta = 0.f;
    cublasHandle_t h = dense_handle();
    MOEKIT_CUBLAS_CHECK(cublasSetStream(h, stream));
    using gemm_detail::Op;
    if (op == Op::kNT)
        MOEKIT_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(rows), int(k), &alpha, B, CUDA_R_16BF,
                                         int(k), A, CUDA_R_16BF, int(k), &beta, C, CUDA_R_16BF, int(n),
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else if (op == Op::kNN)
        MOEKIT_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(rows), int(k), &alpha, B, CUDA_R_16BF,
                                         int(n), A, CUDA_R_16BF, int(k), &beta, C, CUDA_R_16BF, int(n),
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else  // k is m here
        MOEKIT_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, int(n), int(k), int(rows), &alpha, B, CUDA_R_16BF,
                                         int(n), A, CUDA_R_16BF, int(k), &beta, C, CUDA_R_32F, int(n),
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Median milliseconds of fn() on `stream` over iters runs after warmup runs, timed with events.
template <typename Fn>
double time_ms(Fn&& fn, cudaStream_t stream, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) fn();
    cudaEvent_t a, b;
    MOEKIT_CUDA_CHECK(cudaEventCreate(&a));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
        MOEKIT_CUDA_CHECK(cudaEventRecord(a, stream));
        fn();
        MOEKIT_CUDA_CHECK(cudaEventRecord(b, stream));
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t.empty() ? 0.0 : t[t.size() / 2];
}

}  // namespace
}  // namespace moekit::cuda::bench
