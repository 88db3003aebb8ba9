#!/usr/bin/env bash
# Issues 10 and 9's measurements in one bounded device call: build everything; the GPU suite once; the whole layer
# on the four presets and under zipf 1.2 (moekit bench, per-shape GEMM choice, interleaved timing); the ECHO
# simulated EP step (bench_echo_balance, issue 9) planning for tokens and for time; compute-sanitizer on the wgrad
# split.
# usage: MOEKIT_COMMIT=<sha> scripts/device_issue10.sh; results in $OUT. Follow with BUILD=0 scripts/device_suite.sh
# on the still-warm machine for the repeated suite and the sanitizers.
. "$(dirname "$0")/device_lib.sh"
log "build (all targets)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 330 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
log "ctest -L gpu, run 1"
(cd $B && timeout 200 ctest -L gpu -j 4 --output-on-failure --timeout 150 2>&1) >"$OUT/ctest_gpu_1.log"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Total Test time" "$OUT/ctest_gpu_1.log" | tee -a "$OUT/summary.txt"
for p in mixtral dsv3-ep8 qwen3-30b dsv3-e256 "dsv3-ep8 --skew zipf:1.2" "mixtral --skew zipf:1.2" \
  "qwen3-30b --skew zipf:1.2"; do
  left 40 "moekit bench $p" || break
  log "moekit bench --preset $p"
  timeout 80 $B/moekit bench --preset $p --iters 10 --json "$OUT/bench/layer_$(echo $p | tr -cd 'a-z0-9.-').json" 2>&1 \
    | grep -E "^moekit|^  (fc1|fc2|activation|router|permute|combine) |interleaved|TFLOP|x floor|roofline|memory" | tee -a "$OUT/summary.txt"
done
# ECHO's simulated EP step (issue 9), planning for tokens and for time (--group-floor-rows), twice each, interleaved.
for v in "tokens|" "time|--group-floor-rows 512" "tokens-2|" "time-2|--group-floor-rows 512"; do
  IFS='|' read -r label args <<<"$v"
  left 50 "bench_echo_balance $label" || break
  log "bench_echo_balance ($label: $args; simulated EP step, rank by rank, zipf 1.2, waterfill)"
  timeout 100 $B/bench_echo_balance --ep 4,8 --skew zipf:1.2 --algorithm waterfill --iters 20 $args \
    --json "$OUT/bench/echo_balance_$label.json" >"$OUT/bench/echo_balance_$label.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^EP=|^  (GPU plan|configuration|ECHO|forced|no ECHO|busiest|acceptance)" "$OUT/bench/echo_balance_$label.txt" \
    | cut -c1-220 | tee -a "$OUT/summary.txt"
done
left 60 "sanitizers" && {
  log "compute-sanitizer on the wgrad split (grouped GEMMs)"
  sanitize racecheck 50 $B/test_grouped_gemm '*WgradGroupsSplit*:*EmptyFirst*'
  sanitize memcheck 40 $B/test_grouped_gemm '*WgradGroupsSplit*:*EmptyFirst*:*GraphReplay*'
}
tar -czf "$OUT/bench.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
log "done"
