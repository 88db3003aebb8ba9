#!/usr/bin/env bash
# A/B of benchmark runs in one call: builds TARGETS (default: moekit bench_grouped_gemm; no tests), then runs each
# variant "label|ENV=V ENV2=W|program arguments" of RUNS (separated by ';'; program = a binary of the build, e.g.
# "moekit bench --preset mixtral" or "bench_grouped_gemm --preset mixtral --skew zipf:1.2"), each bounded, with
# --json into $OUT/ab (returned as ab.tar.gz).
# usage (device, repo root; carry [".third_party/nlohmann", ".third_party/wheels"]):
#   RUNS="mixtral|MOEKIT_GEMM_KERNEL=tma|moekit bench --preset mixtral;..." bash scripts/device_bench_ab.sh
. "$(dirname "$0")/device_lib.sh"
B=build-ab
mkdir -p "$OUT/ab"
log "build moekit ($B)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DMOEKIT_TESTS=OFF \
  >"$OUT/build.log" 2>&1 &&
  timeout $((LIMIT - SECONDS - 60)) cmake --build $B --target ${TARGETS:-moekit bench_grouped_gemm} >>"$OUT/build.log" 2>&1 ||
  { log "build failed"; grep -E "error" "$OUT/build.log" | head -10 | tee -a "$OUT/summary.txt"; exit 1; }
IFS=';' read -ra items <<<"$RUNS"
for item in "${items[@]}"; do
  IFS='|' read -r label envs args <<<"$item"
  left 40 "$label" || break
  f="$OUT/ab/${label// /_}"
  env $envs timeout $((LIMIT - SECONDS - 10)) $B/$args --json "$f.json" >"$f.txt" 2>&1
  echo "## $label [$envs] $args: rc $?, t=${SECONDS}s" | tee -a "$OUT/summary.txt"
  grep -E "^  (stage|activation|fc1|fc2|router|permute|combine) |interleaved|phase by phase|^ *(fwd|dgrad|wgrad|gemm|shape)" \
    "$f.txt" | tee -a "$OUT/summary.txt"
done
tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"
log done
