// Dense row-major GEMM helpers for the CPU reference experts (fp32/fp64, accumulate in T).
// gemm_nn_acc: C[m, n] += A[m, k] . B[k, n];  gemm_tn_acc: C[k, n] += A[m, k]^T . B[m, n].
// Each output element sums its k (or m) terms in ascending order whatever the thread split,
// so results are deterministic. Inner loops are axpys over contiguous rows (i-k-j order), written
// with GCC/Clang vector types so that -O2 vectorises them. Used by src/cpu/experts.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/parallel.h"

namespace moekit::cpu {

// GCC/Clang vector extension: 16 bytes of T (one SSE2/NEON register, always available).
// Element-wise maths, so the rounding is exactly that of the scalar loop.
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
    typedef float type __attribute__((vector_size(16)));
};
template <>
struct VecOf<double> {
    typedef double type __attribute__((vector_size(16)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int64_t kLanes = int64_t(16 / sizeof(T));

template <typename T>
inline Vec<T> load(const T* p) {
    Vec<T> v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}
template <typename T>
inline void store(T* p, Vec<T> v) {
    std::memcpy(p, &v, sizeof(v));
}

// c[0, n) = (((c + a0 b0) + a1 b1) + a2 b2) + a3 b3: four axpys fused, same rounding as in turn.
template <typename T>
inline void axpy4(int64_t n, T a0, const T* b0, T a1, const T* b1, T a2, const T* b2, T a3, const T* b3, T* c) {
    int64_t j = 0;
    for (; j + kLanes<T> <= n; j += kLanes<T>)
        store(c + j, (((load(c + j) + a0 * load(b0 + j)) + a1 * load(b1 + j)) + a2 * load(b2 + j)) + a3 * load(b3 + j));
    for (; j < n; ++j) c[j] = (((c[j] + a0 * b0[j]) + a1 * b1[j]) + a2 * b2[j]) + a3 * b3[j];
}

template <typename T>
inline void axpy1(int64_t n, T a, const T* b, T* c) {
    int64_t j = 0;
    for (; j + kLanes<T> <= n; j += kLanes<T>) store(c + j, load(c + j) + a * load(b + j));
    for (; j < n; ++j) c[j] += a * b[j];
}

// Four rows of C at once: c_r += a_r[0] b0 + a_r[1] b1 + a_r[2] b2 + a_r[3] b3 for r < 4, so each
// loaded B element serves four rows (B is read from cache a quarter as often). Same per-element
// order as four axpy4 calls.
template <typename T>
inline void axpy4x4(int64_t n, const T* a0, const T* a1, const T* a2, const T* a3, const T* b0, const T* b1,
                    const T* b2, const T* b3, T* c0, T* c1, T* c2, T* c3) {
    int64_t j = 0;
    for (; j + kLanes<T> <= n; j += kLanes<T>) {
        const Vec<T> v0 = load(b0 + j), v1 = load(b1 + j), v2 = load(b2 + j), v3 = load(b3 + j);
        store(c0 + j, (((load(c0 + j) + a0[0] * v0) + a0[1] * v1) + a0[2] * v2) + a0[3] * v3);
        store(c1 + j, (((load(c1 + j) + a1[0] * v0) + a1[1] * v1) + a1[2] * v2) + a1[3] * v3);
        store(c2 + j, (((load(c2 + j) + a2[0] * v0) + a2[1] * v1) + a2[2] * v2) + a2[3] * v3);
        store(c3 + j, (((load(c3 + j) + a3[0] * v0) + a3[1] * v1) + a3[2] * v2) + a3[3] * v3);
    }
    for (; j < n; ++j) {
        const T v0 = b0[j], v1 = b1[j], v2 = b2[j], v3 = b3[j];
        c0[j] = (((c0[j] + a0[0] * v0) + a0[1] * v1) + a0[2] * v2) + a0[3] * v3;
        c1[j] = (((c1[j] + a1[0] * v0) + a1[1] * v1) + a1[2] * v2) + a1[3] * v3;
        c2[j] = (((c2[j] + a2[0] * v0) + a2[1] * v1) + a2[2] * v2) + a2[3] * v3;
        c3[j] = (((c3[j] + a3[0] * v0) + a3[1] * v1) + a3[2] * v2) + a3[3] * v3;
    }
}

// Rows [row_begin, row_end) of C += A . B.
template <typename T>
inline void gemm_nn_rows(int64_t row_begin, int64_t row_end, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
                         int64_t ldb, T* c, int64_t ldc) {
    int64_t i = row_begin;
    for (; i + 4 <= row_end; i += 4) {
        const T* ai = a + i * lda;
        T* ci = c + i * ldc;
        int64_t p = 0;
        for (; p + 4 <= k; p += 4)
            axpy4x4(n, ai + p, ai + lda + p, ai + 2 * lda + p, ai + 3 * lda + p, b + p * ldb, b + (p + 1) * ldb,
                    b + (p + 2) * ldb, b + (p + 3) * ldb, ci, ci + ldc, ci + 2 * ldc, ci + 3 * ldc);
        for (; p < k; ++p)
            for (int r = 0; r < 4; ++r) axpy1(n, ai[r * lda + p], b + p * ldb, ci + r * ldc);
    }
    for (; i < row_end; ++i) {
        const T* ai = a + i * lda;
        T* ci = c + i * ldc;
        int64_t p = 0;
        for (; p + 4 <= k; p += 4)
            axpy4(n, ai[p], b + p * ldb, ai[p + 1], b + (p + 1) * ldb, ai[p + 2], b + (p + 2) * ldb, ai[p + 3],
                  b + (p + 3) * ldb, ci);
        for (; p < k; ++p) axpy1(n, ai[p], b + p * ldb, ci);
    }
}

// C[m, n] += A[m, k] . B[k, n], parallel over rows of C.
template <typename T>
void gemm_nn_acc(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
    const int64_t min_rows = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, n * k));
    parallel_for(m, min_rows,
                 [&](int64_t begin, int64_t end) { gemm_nn_rows(begin, end, n, k, a, lda, b, ldb, c, ldc); });
}

// C[k, n] += A[m, k]^T . B[m, n], parallel over rows of C. The m terms of each element are added
// in ascending order; m is walked in blocks so the B block stays in cache across the rows of C.
template <typename T>
void gemm_tn_acc(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
    constexpr int64_t kBlock = 64;
    const int64_t min_rows = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, n * m));
    parallel_for(k, min_rows, [&](int64_t begin, int64_t end) {
        for (int64_t i0 = 0; i0 < m; i0 += kBlock) {
            const int64_t i1 = std::min(m, i0 + kBlock);
            for (int64_t p = begin; p < end; ++p) {
                T* cp = c + p * ldc;
                int64_t i = i0;
                for (; i + 4 <= i1; i += 4)
                    axpy4(n, a[i * lda + p], b + i * ldb, a[(i + 1) * lda + p], b + (i + 1) * ldb, a[(i + 2) * lda + p],
                          b + (i + 2) * ldb, a[(i + 3) * lda + p], b + (i + 3) * ldb, cp);
                for (; i < i1; ++i) axpy1(n, a[i * lda + p], b + i * ldb, cp);
            }
        }
    });
}

// out[cols, rows] = in[rows, cols]^T.
template <typename T>
void transpose(int64_t rows, int64_t cols, const T* in, T* out) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
}

}  // namespace moekit::cpu
