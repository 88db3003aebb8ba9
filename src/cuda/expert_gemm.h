// The expert GEMM backend a CudaMoeLayer calls through: the sync-free grouped GEMM
// (src/cuda/grouped_gemm.h) or the synchronous per-expert cuBLAS baseline (same signatures,
// src/cuda/grouped_gemm_sync.h). Function pointers keep the layer independent of which one.
#pragma once
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {

struct ExpertGemm {
    using Nt = void (*)(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                        const int32_t*, cudaStream_t);
    using Tn = void (*)(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, float*, const int32_t*,
                        WgradWrite, cudaStream_t);
    using NnGlu = bool (*)(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, const int32_t*,
                           const GluBackwardEpilogue&, cudaStream_t);
    using NtGlu = bool (*)(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                           const int32_t*, const GluForwardEpilogue&, cudaStream_t, const RowGather*);
    Nt nt = nullptr;  // C = A · B[g]ᵀ   (forward)
    Nt nn = nullptr;  // C = A · B[g]    (dgrad)
    Tn tn = nullptr;  // C[g] = A_gᵀ B_g (wgrad, fp32)
    NnGlu nn_glu_backward = nullptr;  // fc2 dgrad + the gated activation's backward, where the backend fuses it
    NtGlu nt_glu_forward = nullptr;   // fc1 forward + the gated activation (and the gathered rows), where fused
    bool (*gathers)(const GroupedGemmShape&) = nullptr;  // whether nt_glu_forward would gather this shape's rows
    const char* name = "";
    // Whether a wgrad may run on a second stream while the other calls run on the first (no handle or workspace
    // shared between streams): the layer's wgrad overlap (moe_layer.h set_wgrad_overlap) needs it.
    bool concurrent_wgrad = false;
};

enum class ExpertGemmKind { grouped, sync_baseline };

// Throws UsageError when the kind is not built in.
ExpertGemm expert_gemm(ExpertGemmKind kind);

}  // namespace moekit::cuda
