#!/usr/bin/env bash
# CUTLASS scheduling sweep in one bounded device call (issue 10): per-GEMM times of every grouped backend and
# CUTLASS tile configuration (bench_grouped_gemm) under each group-scheduler raster order / swizzle, then the whole
# layer with per-stage times eager vs inside the graph (moekit bench) for each GEMM kernel.
# usage: MOEKIT_COMMIT=<sha> [PRESETS=...] [SCHEDULES="m:1 n:1 m:4"] [KERNELS="cutlass tma"] scripts/device_gemm_sweep.sh
. "$(dirname "$0")/device_lib.sh"
PRESETS=${PRESETS:-"mixtral dsv3-ep8 dsv3-e256 qwen3-30b"}
SCHEDULES=${SCHEDULES:-"m:1 n:1 m:4"}
KERNELS=${KERNELS:-"cutlass tma"}
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 330 cmake --build $B --target moekit test_grouped_gemm bench_grouped_gemm >>"$OUT/build.log" 2>&1 \
  || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
timeout 100 $B/test_grouped_gemm >"$OUT/test_grouped_gemm.log" 2>&1
echo "test_grouped_gemm exit $?" | tee -a "$OUT/summary.txt"
grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/test_grouped_gemm.log" | head -10 | tee -a "$OUT/summary.txt"
for p in $PRESETS; do
  left 30 "moekit bench $p" || break
  for k in $KERNELS; do
    log "moekit bench --preset $p (MOEKIT_GEMM_KERNEL=$k)"
    MOEKIT_GEMM_KERNEL=$k timeout 60 $B/moekit bench --preset $p --iters 10 --json "$OUT/bench/layer_${p}_$k.json" 2>&1 \
      | grep -vE "^  (shared_expert|router|permute|combine) " | tee -a "$OUT/summary.txt" | tail -3
  done
done
for sch in $SCHEDULES; do
  for p in $PRESETS; do
    left 25 "gemm sweep $sch $p" || break
    log "bench_grouped_gemm --preset $p (raster ${sch%%:*}, swizzle ${sch##*:})"
    MOEKIT_CUTLASS_RASTER=${sch%%:*} MOEKIT_CUTLASS_SWIZZLE=${sch##*:} timeout 60 $B/bench_grouped_gemm --preset $p \
      --iters 10 --json "$OUT/bench/gemm_${p}_${sch/:/_}.json" 2>&1 | tail -7 | tee -a "$OUT/summary.txt"
  done
done
log "done"
