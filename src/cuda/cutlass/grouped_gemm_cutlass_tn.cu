// The CUTLASS grouped GEMM for the tn product (grouped_gemm_cutlass.h), its tile configurations.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda {

void cutlass_grouped_gemm_tn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                             const int32_t* d_offsets, WgradWrite write, cudaStream_t stream,
                             CutlassConfig config) {
    cutlass_detail::run<cutlass_detail::Op::kTN>(shape, A, B, C, d_offsets, write, config, stream);
}

}  // namespace moekit::cuda
