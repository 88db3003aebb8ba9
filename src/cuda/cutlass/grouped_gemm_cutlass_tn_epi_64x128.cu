// One wgrad epilogue variant of the CUTLASS ping-pong configuration (PingpongEpi64x128, grouped_gemm_cutlass.cuh), in a
// translation unit of its own so that the variants compile in parallel.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda::cutlass_detail {

void run_tn_epi_64x128(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                    const int32_t* d_offsets, bool accumulate, cudaStream_t stream) {
    run_grouped<Op::kTN, PingpongEpi64x128>(s, A, B, C, d_offsets, accumulate, stream);
}

}  // namespace moekit::cuda::cutlass_detail
