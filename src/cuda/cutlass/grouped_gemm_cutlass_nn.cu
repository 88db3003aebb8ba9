// The CUTLASS grouped GEMM for the nn product (grouped_gemm_cutlass.h), its tile configurations.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda {

void cutlass_grouped_gemm_nn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                             __nv_bfloat16* C, const int32_t* d_offsets, cudaStream_t stream,
                             CutlassConfig config) {
    cutlass_detail::run<cutlass_detail::Op::kNN>(shape, A, B, C, d_offsets, WgradWrite::overwrite, config, stream);
}

}  // namespace moekit::cuda
