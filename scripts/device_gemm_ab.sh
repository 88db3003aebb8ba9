#!/usr/bin/env bash
# Grouped-GEMM backends side by side in one bounded device call (issue 10): build; the grouped-GEMM tests (every
# backend incl. CUTLASS, graph replays with new device counts); per-GEMM A/B (bench_grouped_gemm: own TMA kernel,
# CUTLASS cooperative / ping-pong, mma.sync, sync cuBLAS, dense floor); the whole layer with each backend
# (moekit bench: the default per-shape choice, and MOEKIT_GEMM_KERNEL=tma|cutlass forced); the layer's GPU tests
# with CUTLASS forced; compute-sanitizer.
# usage: MOEKIT_COMMIT=<sha> [PRESETS="mixtral dsv3-ep8 ..."] scripts/device_gemm_ab.sh; results in $OUT.
. "$(dirname "$0")/device_lib.sh"
PRESETS=${PRESETS:-"mixtral dsv3-ep8 qwen3-30b dsv3-e256"}
build_targets 330 moekit test_grouped_gemm bench_grouped_gemm test_cuda_layer test_cuda_graph
grep -E "CUTLASS" "$OUT/build.log" | tee -a "$OUT/summary.txt"
gtest_run 120 test_grouped_gemm  # every backend
left 100 "bench_grouped_gemm" && {
  log "bench_grouped_gemm (per GEMM, 10 iterations)"
  for p in $PRESETS; do
    left 40 "bench_grouped_gemm $p" || break
    timeout 60 $B/bench_grouped_gemm --preset $p --iters 10 --json "$OUT/bench/gemm_$p.json" 2>&1 | tee -a "$OUT/summary.txt"
  done
}
for p in $PRESETS "dsv3-ep8 --skew zipf:1.2"; do
  for k in ${KERNELS:-auto tma}; do
    left 40 "moekit bench $p $k" || break
    log "moekit bench --preset $p (MOEKIT_GEMM_KERNEL=$k)"
    env $([ $k != auto ] && echo MOEKIT_GEMM_KERNEL=$k) timeout 80 $B/moekit bench --preset $p --iters 10 \
      --json "$OUT/bench/layer_${p// /_}_$k.json" 2>&1 | grep -vE "^  (shared_expert|router|permute|combine|activation) " | tee -a "$OUT/summary.txt" | tail -8
  done
done
left 80 "layer tests with CUTLASS" && {
  log "test_cuda_layer + test_cuda_graph with MOEKIT_GEMM_KERNEL=cutlass"
  for t in test_cuda_layer test_cuda_graph; do
    MOEKIT_GEMM_KERNEL=cutlass timeout 70 $B/$t >"$OUT/$t.log" 2>&1
    echo "$t exit $?" | tee -a "$OUT/summary.txt"
    grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/$t.log" | head -8 | cut -c1-200 | tee -a "$OUT/summary.txt"
  done
}
left 60 "memcheck" && {
  log "compute-sanitizer memcheck on the CUTLASS grouped GEMMs"
  sanitize memcheck 90 $B/test_grouped_gemm '*EmptyFirst*:*AllRows*:*SizesOff*:*GraphReplay*'
}
log "done"
