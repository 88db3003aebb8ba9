#!/usr/bin/env bash
# A short GPU re-check of the EP fixes: build the GPU EP tests only, then run the budgeted-dispatcher tests,
# the layer shape-change test and the EP training engine's single-rank test each in a fresh process (as ctest
# does: kernels not yet loaded). usage: scripts/device_ep_focus.sh; results in $OUT/summary.txt.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
log "build (test targets)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 150 cmake --build $B --target test_cuda_ep test_cuda_layer test_cuda_train_ep >>"$OUT/build.log" 2>&1 \
  || { grep -E "error" "$OUT/build.log" | head -5 | tee -a "$OUT/summary.txt"; exit 1; }
log "fresh-process runs"
export MOEKIT_DEVICE_WAIT_S=5
run() { timeout 40 "$@" 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure|exception|first at" | head -4 | cut -c1-220 | tee -a "$OUT/summary.txt"; }
run $B/test_cuda_ep --gtest_filter='*softmax_post_swiglu_ep8_budgeted*'
run $B/test_cuda_ep --gtest_filter='CudaEpBudgeted.ReceiveBuffer*'
run $B/test_cuda_ep --gtest_filter='CudaEpBudgeted.WholeStep*'
run $B/test_cuda_layer --gtest_filter='CudaLayer.ShapeChange*'
run $B/test_cuda_train_ep --gtest_filter='CudaTrainEpEngine.OneRank*'
run $B/test_cuda_ep --gtest_filter='CudaEpBudgeted.Overflow*'
log "done"
