// fc2's dgrad with the gated activation's backward in CUTLASS's ping-pong epilogue (grouped_gemm_cutlass.h,
// glu_backward_visitor.cuh): D = d gate, written into grad_fc1's left half (rows 2n apart); the visitor stores d up
// and the d(prob) partials.
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda {

bool cutlass_grouped_gemm_nn_glu_backward(const GroupedGemmShape& shape, const __nv_bfloat16* A,
                                          const __nv_bfloat16* B, const int32_t* d_offsets,
                                          const GluBackwardEpilogue& epilogue, cudaStream_t stream,
                                          CutlassConfig config) {
    using namespace cutlass_detail;
    const int64_t rows_per_group = shape.num_groups > 0 ? shape.max_rows / shape.num_groups : 0;
    if (config == CutlassConfig::kAuto ? resolve_config(config, rows_per_group, false) != CutlassConfig::kPingpong
                                       : is_swapped_config(config))
        return false;
    static_assert(cute::size<1>(Pingpong::Tile{}) == kGluBackwardTileColumns, "a d(prob) partial per column tile");
    MOEKIT_CHECK(shape.n % 8 == 0 && shape.n < (int64_t(1) << 29), "fused dgrad + activation backward: n = ", shape.n);
    const GluBackwardArgs args{d_offsets,  epilogue.fc1_out,   epilogue.probs, epilogue.grad_fc1,
                               epilogue.dp_partials, int(shape.n), int(glu_backward_tiles(shape.n)),
                               int(epilogue.act)};
    run_grouped<Op::kNN, Pingpong, Stores::kPlain, GluBackwardVisitor>(shape, A, B, epilogue.grad_fc1, d_offsets,
                                                                       WgradWrite::overwrite, stream, Share::kAll,
                                                                       &args, 2 * shape.n);
    return true;
}

}  // namespace moekit::cuda
