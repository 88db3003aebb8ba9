// dense_gemm: one dense cuBLAS bf16 GEMM (fp32 accumulate) with the grouped GEMM functions' row-major conventions
// and all `rows` rows in one group: the floor the expert GEMMs are compared with. NT: C[rows,n] = A[rows,k]·B[n,k]ᵀ;
// NN: C = A·B[k,n]; TN: C[m,n] fp32 = A[rows,m]ᵀ·B[rows,n] (k is m there). Used by the training engine's speed
// report (train_engine.cu) and the benchmarks (bench/lib); exercised by test_cuda_train's report and `moekit bench`.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/grouped_gemm_kernels.cuh"

namespace moekit::cuda {

// The calling host thread's cuBLAS handle (handles are not thread-safe; virtual ranks are threads), created on
// first use and kept until the process exits. Shared by dense_gemm and the synchronous baseline.
cublasHandle_t thread_cublas_handle();

// The thread's cuBLAS handle, bound to `stream` for the call.
void dense_gemm(gemm_detail::Op op, int64_t rows, int64_t n, int64_t k, const __nv_bfloat16* A, const __nv_bfloat16* B,
                void* C, cudaStream_t stream);

}  // namespace moekit::cuda
