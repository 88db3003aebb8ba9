#!/usr/bin/env bash
# The wgrad (tn) GEMMs in one bounded device call (issues 9, 10): build; the grouped-GEMM tests (every backend);
# ECHO's simulated EP step (bench_echo_balance) for each configuration of ECHO_RUNS ("label|ENV=V ...|args;...");
# per-GEMM tables (bench_grouped_gemm: the own TMA kernel's tn column against CUTLASS's configurations) on PRESETS,
# for each own-kernel wgrad variant of TN_VARIANTS; moekit bench for LAYER_RUNS; compute-sanitizer racecheck +
# memcheck on the tn cases.
# usage: MOEKIT_COMMIT=<sha> [PRESETS=...] [HOT=512] scripts/device_wgrad.sh (a list set empty skips its part); results in $OUT.
# A PRESETS entry P@zipf:S runs bench_grouped_gemm --preset P --skew zipf:S; ECHO_ARGS go to bench_echo_balance.
. "$(dirname "$0")/device_lib.sh"
PRESETS=${PRESETS-"dsv3-ep8 mixtral qwen3-30b dsv3-e256"}
HOT=${HOT:-512}
TN_VARIANTS=${TN_VARIANTS-"staged|;direct|MOEKIT_GEMM_EPILOGUE=direct"}
ECHO_RUNS=${ECHO_RUNS-"default|;interleave|MOEKIT_WGRAD_HOT_ROWS=$HOT;own-in-order|MOEKIT_WGRAD_HOT_ROWS=1000000000"}
build_targets 330 test_grouped_gemm bench_grouped_gemm bench_echo_balance ${EXTRA_TARGETS:-}
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: benchmarks only; EXTRA_TESTS: more gtest binaries (in EXTRA_TARGETS)
  for t in test_grouped_gemm ${EXTRA_TESTS:-}; do gtest_run 120 $t; done
fi
IFS=';' read -ra echo_runs <<<"$ECHO_RUNS"
for v in "${echo_runs[@]}"; do
  IFS='|' read -r label envs args <<<"$v"
  left 60 "bench_echo_balance $label" || break
  log "bench_echo_balance ($label: $envs $args)"
  env $envs timeout 100 $B/bench_echo_balance --ep 4,8 --skew zipf:1.2 ${ECHO_ARGS:-} $args \
    --json "$OUT/bench/echo_$label.json" \
    >"$OUT/bench/echo_$label.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^EP=|^  (configuration|ECHO|forced|no ECHO|busiest|acceptance)" "$OUT/bench/echo_$label.txt" | cut -c1-220 \
    | tee -a "$OUT/summary.txt"
done
IFS=';' read -ra tn_variants <<<"$TN_VARIANTS"
for entry in $PRESETS; do
  p=${entry%@*} skew=()
  [ "$entry" != "$p" ] && skew=(--skew "${entry#*@}")
  for v in "${tn_variants[@]}"; do
    IFS='|' read -r label envs <<<"$v"
    left 80 "bench_grouped_gemm $entry $label" || break
    log "bench_grouped_gemm --preset $p ${skew[*]} ($label: $envs)"
    env $envs timeout 60 $B/bench_grouped_gemm --preset $p "${skew[@]}" --iters 10 \
      --json "$OUT/bench/gemm_${entry//[:@]/_}_$label.json" 2>&1 \
      | grep -E "^  (gemm|fc)" | grep -E "gemm|tn" | tee -a "$OUT/summary.txt"
  done
done
# LAYER_RUNS="label|ENV=V|preset args;...": moekit bench (needs EXTRA_TARGETS=moekit), stage table and totals.
IFS=';' read -ra layer_runs <<<"${LAYER_RUNS:-}"
for v in "${layer_runs[@]}"; do
  IFS='|' read -r label envs args <<<"$v"
  left 60 "moekit bench $label" || break
  log "moekit bench $args ($label: $envs)"
  env $envs timeout 80 $B/moekit bench $args --iters 10 --json "$OUT/bench/layer_${label}.json" 2>&1 \
    | grep -E "^moekit|^  (fc1|fc2) |interleaved|roofline" | tee -a "$OUT/summary.txt"
done
[ "${TESTS:-1}" = 1 ] && left 200 "sanitizers" && {
  log "compute-sanitizer on the tn cases"
  sanitize racecheck 120 $B/test_grouped_gemm '*EmptyFirst*:*WgradGradientOff*:*WgradGroupsSplit*:*WgradEmpty*:*SecondOperand*'
  sanitize memcheck 90 $B/test_grouped_gemm \
    '*EmptyFirst*:*SizesOff*:*WgradHotCold*:*WgradGradientOff*:*WgradGroupsSplit*:*WgradEmpty*:*SecondOperand*:*GraphReplay*'
}
tar -czf "$OUT/bench.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
log "done"
