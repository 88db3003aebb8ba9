// The CUTLASS grouped GEMM for the nn product in its SwapAB configuration (grouped_gemm_cutlass.cuh).
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda::cutlass_detail {

void run_swapped_nn(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                    const int32_t* d_offsets, cudaStream_t stream, bool pingpong) {
    run_swapped<Op::kNN>(s, A, B, C, d_offsets, stream, pingpong);
}

}  // namespace moekit::cuda::cutlass_detail
