// Synchronous grouped-GEMM baseline (grouped_gemm_sync.h): offsets D2H + cudaStreamSynchronize (counted), then one
// cuBLAS bf16 GEMM (fp32 compute) per non-empty group. Row-major operands are passed to column-major cuBLAS as
// their transposes: row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ.
#include <atomic>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/dense_gemm.cuh"
#include "cuda/grouped_gemm_sync.h"

namespace moekit::cuda::sync_baseline {
namespace {

std::atomic<int64_t> g_syncs{0};

// Offsets of the G groups on the host: the one blocking step that the sync-free path avoids.
std::vector<int32_t> host_offsets(const GroupedGemmShape& s, const int32_t* d_offsets, cudaStream_t stream) {
    thread_local int32_t* pinned = nullptr;
    thread_local int64_t pinned_len = 0;
    if (pinned_len < s.num_groups + 1) {
        if (pinned) MOEKIT_CUDA_CHECK(cudaFreeHost(pinned));
        MOEKIT_CUDA_CHECK(cudaMallocHost(&pinned, sizeof(int32_t) * (s.num_groups + 1)));
        pinned_len = s.num_groups + 1;
    }
    MOEKIT_CUDA_CHECK(
        cudaMemcpyAsync(pinned, d_offsets, sizeof(int32_t) * (s.num_groups + 1), cudaMemcpyDeviceToHost, stream));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    ++g_syncs;
    std::vector<int32_t> off(pinned, pinned + s.num_groups + 1);
    MOEKIT_CHECK(off[0] >= 0 && off[s.num_groups] <= s.max_rows, "sync baseline: offsets [", off[0], ", ",
                 off[s.num_groups], "] outside max_rows ", s.max_rows);
    return off;
}

void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
          const void* B, int64_t ldb, void* C, cudaDataType c_type, int64_t ldc, float beta, cudaStream_t stream) {
    const float alpha = 1.f;
    cublasHandle_t h = thread_cublas_handle();
    MOEKIT_CUBLAS_CHECK(cublasSetStream(h, stream));
    MOEKIT_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, int(m), int(n), int(k), &alpha, A, CUDA_R_16BF, int(lda), B,
                                     CUDA_R_16BF, int(ldb), &beta, C, c_type, int(ldc), CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
}

}  // namespace

int64_t host_sync_count() { return g_syncs.load(); }

namespace {
// nt and nn differ only in how B_g is read: Cᵀ[n, rows] = op(B_g) · A_gᵀ with B_g column-major [k, n]
// (row-major [n, k], op = T) or [n, k] (row-major [k, n], op = N).
void row_grouped_gemm(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                      const int32_t* d_offsets, cublasOperation_t op_b, int64_t ldb, cudaStream_t stream) {
    if (s.num_groups == 0 || s.max_rows == 0 || s.n == 0) return;
    auto off = host_offsets(s, d_offsets, stream);
    for (int64_t g = 0; g < s.num_groups; ++g) {
        int64_t rows = off[g + 1] - off[g];
        if (rows == 0) continue;
        if (s.k == 0) {
            MOEKIT_CUDA_CHECK(cudaMemsetAsync(C + int64_t(off[g]) * s.n, 0, sizeof(*C) * rows * s.n, stream));
            continue;
        }
        const __nv_bfloat16* Bg = group_block(B, s.second, s.second_from, g, s.n * s.k);
        gemm(op_b, CUBLAS_OP_N, s.n, rows, s.k, Bg, ldb, A + int64_t(off[g]) * s.k, s.k, C + int64_t(off[g]) * s.n,
             CUDA_R_16BF, s.n, 0.f, stream);
    }
}
}  // namespace

void grouped_gemm_nt(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream) {
    row_grouped_gemm(s, A, B, C, d_offsets, CUBLAS_OP_T, s.k, stream);
}

void grouped_gemm_nn(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream) {
    row_grouped_gemm(s, A, B, C, d_offsets, CUBLAS_OP_N, s.n, stream);
}

void grouped_gemm_tn(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                     const int32_t* d_offsets, WgradWrite write, cudaStream_t stream) {
    if (s.num_groups == 0 || s.n == 0 || s.k == 0) return;
    auto off = host_offsets(s, d_offsets, stream);
    const int64_t m = s.k;
    for (int64_t g = 0; g < s.num_groups; ++g) {
        int64_t rows = off[g + 1] - off[g];
        float* Cg = group_block(C, s.second, s.second_from, g, m * s.n);
        // The second base's blocks: fresh, and unwritten when empty (GroupedGemmShape::second_from).
        const bool second = in_second_base(s.second_from, g);
        const bool accumulate = write == WgradWrite::accumulate && !second;
        if (rows == 0) {
            if (write == WgradWrite::overwrite && !second)
                MOEKIT_CUDA_CHECK(cudaMemsetAsync(Cg, 0, sizeof(float) * m * s.n, stream));
            continue;
        }
        // C_gᵀ[n, m] = B_gᵀ[n, rows] · A_g[rows, m]  (A_g row-major [rows, m] = column-major [m, rows]: transpose)
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, s.n, m, rows, B + int64_t(off[g]) * s.n, s.n, A + int64_t(off[g]) * m, m, Cg,
             CUDA_R_32F, s.n, accumulate ? 1.f : 0.f, stream);
    }
}

}  // namespace moekit::cuda::sync_baseline
