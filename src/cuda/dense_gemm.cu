// Dense cuBLAS GEMMs (dense_gemm.cuh). cuBLAS is column-major: a row-major C = A·Bᵀ is computed as Cᵀ = B·Aᵀ,
// hence the swapped operands.
#include "cuda/cuda_check.h"
#include "cuda/dense_gemm.cuh"

namespace moekit::cuda {

cublasHandle_t thread_cublas_handle() {
    thread_local cublasHandle_t h = [] {
        cublasHandle_t created = nullptr;
        MOEKIT_CUBLAS_CHECK(cublasCreate(&created));
        return created;
    }();
    return h;
}

void dense_gemm(gemm_detail::Op op, int64_t rows, int64_t n, int64_t k, const __nv_bfloat16* A, const __nv_bfloat16* B,
                void* C, cudaStream_t stream) {
    const float alpha = 1.f, beta = 0.f;
    cublasHandle_t h = thread_cublas_handle();
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

}  // namespace moekit::cuda
