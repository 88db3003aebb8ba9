// run_budgeted_cuda_step: one step (forward + backward, eager or a graph replay) of a CUDA layer whose
// dispatcher may be the budgeted one, with megatron-moe.md §4.6's recovery: after the step the device
// verdict is read (every rank computes the same one from the shared count matrix, so no collective is
// needed); on overflow the event is logged with the factor that would have sufficed, the router trackers
// are restored, and the step is re-run through the synchronous alltoall path, so the results equal the
// dropless run. `step` must redo everything it accumulates. The CPU twin: src/cpu/budget_step.h.
// Used by src/cuda/ep_rank_step.cu; tests: tests/gpu/test_cuda_ep.cu.
#pragma once
#include <cstdio>
#include <functional>

#include "core/dispatch_math.h"
#include "cuda/cuda_check.h"
#include "cuda/moe_layer.h"

namespace moekit::cuda {

// The budgeted dispatcher's first eager step is a synchronous warm-up that loads every kernel before any
// device barrier spins (src/cuda/dispatch_budgeted.cu says why). This runs it, collectively, and undoes
// what it counted, so the next step is the first real one. A no-op for the other dispatchers.
inline void warm_up_budgeted(CudaMoeLayer& layer, cudaStream_t stream, const std::function<void()>& step) {
    if (!layer.shape().sync_free_dispatch()) return;
    layer.save_router_trackers(stream);
    step();
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    (void)layer.end_dispatch_step();
    layer.restore_router_trackers(stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

inline BudgetStatus run_budgeted_cuda_step(CudaMoeLayer& layer, cudaStream_t stream, const std::function<void()>& step,
                                           bool log = true) {
    layer.save_router_trackers(stream);
    step();
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const BudgetStatus status = layer.end_dispatch_step();
    if (!status.overflow) return status;
    const RouterShape& r = layer.shape().router;
    if (log)
        std::fprintf(stderr,
                     "moekit: EP rank %d: the receive budget of %lld rows overflowed (a rank was due %lld rows); the "
                     "step was re-run through the synchronous alltoall dispatcher; "
                     "--moe-expert-rank-capacity-factor %.2f would have held it\n",
                     layer.shape().ep_rank, static_cast<long long>(status.budget_rows),
                     static_cast<long long>(status.peak_rows), sufficient_factor(status.peak_rows, r.num_tokens, r.topk));
    layer.restore_router_trackers(stream);
    layer.set_synchronous_dispatch(true);
    try {
        step();
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    } catch (...) {
        layer.set_synchronous_dispatch(false);
        throw;
    }
    layer.set_synchronous_dispatch(false);
    return status;
}

}  // namespace moekit::cuda
