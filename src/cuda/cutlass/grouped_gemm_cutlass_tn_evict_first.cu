// The CUTLASS wgrad (tn) kernels whose epilogue stores the fp32 gradient evict-first in L2
// (tma_store_evict_first.cuh): their own translation unit, compiled beside grouped_gemm_cutlass_tn.cu.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda::cutlass_detail {

void run_tn_evict_first(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                        const int32_t* d_offsets, WgradWrite write, CutlassConfig config, cudaStream_t stream) {
    run_tn<Stores::kEvictFirst>(s, A, B, C, d_offsets, write, config, stream);
}

}  // namespace moekit::cuda::cutlass_detail
