// time_ms: the median milliseconds of fn() on one stream over `iters` runs after `warmup` runs, each run timed
// with a pair of CUDA events (time_ms_after: a host step before each run); graph_time_ms: the same for fn
// captured in a CUDA graph. Header-only because they take any callable. Used by the training engine's speed
// report (train_engine.cu, `moekit train --device cuda`, tests/gpu/test_cuda_train.cu) and the benchmarks
// (bench/lib/bench_util.cuh; time_ms_after with a barrier of ranks: bench_layer_ep.cu, bench_dispatch.cu), and the
// grouped GEMMs' measured per-shape choice (gemm_tuning.cu).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/cuda_check.h"

namespace moekit::cuda {

// before() runs on the host ahead of every run, outside its events (benchmarks across ranks: a barrier, so a run's
// time is the collective's and not the wait for a late rank).
template <typename Before, typename Fn>
double time_ms_after(Before&& before, Fn&& fn, cudaStream_t stream, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) before(), fn();
    cudaEvent_t a, b;
    MOEKIT_CUDA_CHECK(cudaEventCreate(&a));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
        before();
        MOEKIT_CUDA_CHECK(cudaEventRecord(a, stream));
        fn();
        MOEKIT_CUDA_CHECK(cudaEventRecord(b, stream));
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t.empty() ? 0.0 : t[t.size() / 2];
}

template <typename Fn>
double time_ms(Fn&& fn, cudaStream_t stream, int warmup, int iters) {
    return time_ms_after([] {}, fn, stream, warmup, iters);
}

// fn's launches captured once in a CUDA graph (global capture mode: a host sync inside fails it), then the median
// of `iters` timed replays: GPU time without the host's launch costs between fn's kernels. fn runs once eagerly
// first, so first-use set-up (attributes, workspaces) stays out of the capture.
template <typename Fn>
double graph_time_ms(Fn&& fn, cudaStream_t stream, int warmup, int iters) {
    fn();
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    fn();
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    cudaGraphDestroy(graph);
    MOEKIT_CUDA_CHECK(inst);
    const double ms = time_ms([&] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, stream, warmup, iters);
    cudaGraphExecDestroy(exec);
    return ms;
}

}  // namespace moekit::cuda
