// Checked CUDA / cuBLAS calls: one macro body, each instance throws moekit::Error with the
// expression, file:line, device, numeric code and message. Included by .cu and CUDA-aware .cpp only.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "moekit/error.h"

namespace moekit::cuda::detail {
inline int current_device() {
    int d = -1;
    cudaGetDevice(&d);
    return d;
}
}  // namespace moekit::cuda::detail

#define MOEKIT_CHECK_GEN(expr, ok, code_type, name_fn)                                                       \
    do {                                                                                                     \
        code_type moekit_status_ = (expr);                                                                   \
        if (moekit_status_ != (ok))                                                                          \
            throw ::moekit::Error(::moekit::str(__FILE__, ":", __LINE__, ": ", #expr, " failed on device ",   \
                                                ::moekit::cuda::detail::current_device(), ": code ",         \
                                                int(moekit_status_), " (", name_fn(moekit_status_), ")"));   \
    } while (0)

#define MOEKIT_CUDA_CHECK(expr) MOEKIT_CHECK_GEN(expr, cudaSuccess, cudaError_t, cudaGetErrorString)
#define MOEKIT_CUBLAS_CHECK(expr) MOEKIT_CHECK_GEN(expr, CUBLAS_STATUS_SUCCESS, cublasStatus_t, cublasGetStatusString)
// After every <<<...>>>: the launch itself must have succeeded.
#define MOEKIT_CUDA_LAUNCH_CHECK() MOEKIT_CUDA_CHECK(cudaGetLastError())
