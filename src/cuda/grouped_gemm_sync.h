// The synchronous baseline for the grouped GEMMs: the same three functions as grouped_gemm.h (same arguments, same
// results), implemented the way Megatron's SequentialMLP / TransformerEngine's multi-stream path do it: copy the
// offsets to the host, block on the stream (one host sync per call, counted), then one cuBLAS GEMM per group.
// A caller switches backends by function choice. Tests: tests/gpu/test_grouped_gemm.cu (equal to the grouped kernels).
#pragma once
#include <cstdint>

#include "cuda/grouped_gemm.h"

namespace moekit::cuda::sync_baseline {

void grouped_gemm_nt(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream);
void grouped_gemm_nn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream);
void grouped_gemm_tn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                     const int32_t* d_offsets, WgradWrite write, cudaStream_t stream);

// Host synchronisations made by the functions above since the process started (one per call with groups > 0).
int64_t host_sync_count();

}  // namespace moekit::cuda::sync_baseline
