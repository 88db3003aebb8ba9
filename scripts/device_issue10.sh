#!/usr/bin/env bash
# Issue 10's measurements in one bounded device call: build everything; the GPU suite once; the whole layer on the
# four presets and under zipf 1.2 (moekit bench, per-shape GEMM choice, interleaved timing); the SwiGLU-backward
# vector-width A/B; the ECHO simulated EP step (bench_echo_balance, issue 9) on the current GEMMs.
# usage: MOEKIT_COMMIT=<sha> scripts/device_issue10.sh; results in $OUT. Follow with BUILD=0 scripts/device_suite.sh
# on the still-warm machine for the repeated suite and the sanitizers.
. "$(dirname "$0")/device_lib.sh"
log "build (all targets)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 330 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
log "ctest -L gpu, run 1"
(cd $B && timeout 200 ctest -L gpu -j 4 --output-on-failure --timeout 150 2>&1) >"$OUT/ctest_gpu_1.log"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Total Test time" "$OUT/ctest_gpu_1.log" | tee -a "$OUT/summary.txt"
for p in mixtral dsv3-ep8 qwen3-30b dsv3-e256 "dsv3-ep8 --skew zipf:1.2" "mixtral --skew zipf:1.2"; do
  left 40 "moekit bench $p" || break
  log "moekit bench --preset $p"
  timeout 80 $B/moekit bench --preset $p --iters 10 --json "$OUT/bench/layer_$(echo $p | tr -cd 'a-z0-9.-').json" 2>&1 \
    | grep -E "^moekit|^  (fc1|fc2|activation|router|permute|combine) |interleaved|TFLOP|x floor|roofline|memory" | tee -a "$OUT/summary.txt"
done
for v in 2 4 8; do
  for p in mixtral dsv3-ep8; do
    left 30 "act bwd vec $v $p" || break
    log "moekit bench --preset $p with MOEKIT_ACT_BWD_VEC=$v"
    MOEKIT_ACT_BWD_VEC=$v timeout 60 $B/moekit bench --preset $p --iters 10 2>&1 | grep -E "^  activation|interleaved" | tee -a "$OUT/summary.txt"
  done
done
left 70 "bench_echo_balance" && {
  log "bench_echo_balance (simulated EP step, rank by rank, zipf 1.2, waterfill)"
  timeout 100 $B/bench_echo_balance --ep 4,8 --skew zipf:1.2 --algorithm waterfill --json "$OUT/bench/echo_balance.json" \
    >"$OUT/bench/echo_balance.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  tail -32 "$OUT/bench/echo_balance.txt" | cut -c1-220 | tee -a "$OUT/summary.txt"
}
log "done"
