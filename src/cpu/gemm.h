// Dense row-major GEMM helpers for the CPU reference experts (fp32/fp64, accumulate in T).
// gemm_nn_acc: C[m, n] += A[m, k] . B[k, n];  gemm_tn_acc: C[k, n] += A[m, k]^T . B[m, n].
// Each output element sums its k (or m) terms in ascending order whatever the thread split,
// so results are deterministic. Inner loops are axpys over contiguous rows (i-k-j order), written
// in blocks of 8 so that gcc -O2 vectorises them. Used by src/cpu/experts.cpp.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu/parallel.h"

namespace moekit::cpu {

// c[0, n) = (((c + a0 b0) + a1 b1) + a2 b2) + a3 b3: four axpys fused, same rounding as in turn.
template <typename T>
inline void axpy4(int64_t n, T a0, const T* __restrict b0, T a1, const T* __restrict b1, T a2, const T* __restrict b2,
                  T a3, const T* __restrict b3, T* __restrict c) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int q = 0; q < 8; ++q) c[j + q] = (((c[j + q] + a0 * b0[j + q]) + a1 * b1[j + q]) + a2 * b2[j + q]) + a3 * b3[j + q];
    for (; j < n; ++j) c[j] = (((c[j] + a0 * b0[j]) + a1 * b1[j]) + a2 * b2[j]) + a3 * b3[j];
}

template <typename T>
inline void axpy1(int64_t n, T a, const T* __restrict b, T* __restrict c) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int q = 0; q < 8; ++q) c[j + q] += a * b[j + q];
    for (; j < n; ++j) c[j] += a * b[j];
}

// Rows [row_begin, row_end) of C += A . B.
template <typename T>
inline void gemm_nn_rows(int64_t row_begin, int64_t row_end, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
                         int64_t ldb, T* c, int64_t ldc) {
    for (int64_t i = row_begin; i < row_end; ++i) {
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
void gemm_nn_acc(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                 int64_t ldc) {
    const int64_t min_rows = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, n * k));
    parallel_for(m, min_rows, [&](int64_t begin, int64_t end) { gemm_nn_rows(begin, end, n, k, a, lda, b, ldb, c, ldc); });
}

// C[k, n] += A[m, k]^T . B[m, n], parallel over rows of C. The m terms of each element are added
// in ascending order; m is walked in blocks so the B block stays in cache across the rows of C.
template <typename T>
void gemm_tn_acc(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                 int64_t ldc) {
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
