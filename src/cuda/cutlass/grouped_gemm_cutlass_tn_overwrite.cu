// The CUTLASS grouped GEMM for the tn product when it overwrites its gradients: every tile configuration built
// without a source operand (grouped_gemm_cutlass.cuh's kSource), so no shared memory is held for C.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda::cutlass_detail {

void run_tn_overwrite(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                      const int32_t* d_offsets, WgradWrite write, CutlassConfig config, cudaStream_t stream) {
    run_config<Op::kTN, false>(s, A, B, C, d_offsets, write, config, stream);
}

}  // namespace moekit::cuda::cutlass_detail
