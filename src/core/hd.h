// MOEKIT_HD marks maths shared by the CPU reference and the CUDA kernels: __host__ __device__
// under nvcc, nothing elsewhere. One ceil_div and one align_up for the whole project.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MOEKIT_HD __host__ __device__ __forceinline__
#else
#define MOEKIT_HD inline
#endif

namespace moekit {

MOEKIT_HD constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOEKIT_HD constexpr int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace moekit
