// Expert GEMM backend selection (see expert_gemm.h). The synchronous baseline is linked in when
// its header exists (src/cuda/grouped_gemm_sync.h, namespace moekit::cuda::sync_baseline).
#include "cuda/expert_gemm.h"
#include "moekit/error.h"
#if __has_include("cuda/grouped_gemm_sync.h")
#include "cuda/grouped_gemm_sync.h"
#define MOEKIT_HAVE_SYNC_BASELINE 1
#endif

namespace moekit::cuda {

ExpertGemm expert_gemm(ExpertGemmKind kind) {
    switch (kind) {
        case ExpertGemmKind::grouped:
            return ExpertGemm{&grouped_gemm_nt, &grouped_gemm_nn, &grouped_gemm_tn, &grouped_gemm_nn_glu_backward,
                              &grouped_gemm_nt_glu_forward, &fc1_gather_enabled, "grouped",
                              /*concurrent_wgrad=*/true};
        case ExpertGemmKind::sync_baseline:
#ifdef MOEKIT_HAVE_SYNC_BASELINE
            return ExpertGemm{&sync_baseline::grouped_gemm_nt, &sync_baseline::grouped_gemm_nn,
                              &sync_baseline::grouped_gemm_tn, nullptr, nullptr, nullptr, "sync_baseline",
                              /*concurrent_wgrad=*/false};  // one cuBLAS handle and workspace
#else
            throw UsageError("expert GEMM backend sync_baseline: not built in this moekit (supported: grouped)");
#endif
    }
    throw UsageError("unknown expert GEMM backend (supported: grouped, sync_baseline)");
}

}  // namespace moekit::cuda
