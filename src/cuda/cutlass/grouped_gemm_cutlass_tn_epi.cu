// Experiment: the cooperative wgrad (tn) with other epilogue subtiles and stages (MOEKIT_WGRAD_EPI).
#include <cstdlib>

#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda::cutlass_detail {

int wgrad_epi_variant() {
    static const int v = [] {
        const char* env = std::getenv("MOEKIT_WGRAD_EPI");
        return env ? std::atoi(env) : 0;
    }();
    return v;
}

void run_tn_epi(int variant, const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                const int32_t* d_offsets, WgradWrite write, cudaStream_t stream, Share share) {
    switch (variant) {
        case 1:  // 128x32 subtiles, 4 buffers, 4 stores in flight (the builder: 2)
            return run_grouped<Op::kTN, CooperativeEpi<32, 4, 4>>(s, A, B, C, d_offsets, write, stream, share);
        case 2:  // 128x16 subtiles, 8 buffers, 8 in flight (same 64 KB)
            return run_grouped<Op::kTN, CooperativeEpi<16, 8, 8>>(s, A, B, C, d_offsets, write, stream, share);
        default:  // 128x16 subtiles, 4 buffers (32 KB): one more mainloop stage
            return run_grouped<Op::kTN, CooperativeEpi<16, 4, 4>>(s, A, B, C, d_offsets, write, stream, share);
    }
}

}  // namespace moekit::cuda::cutlass_detail
