#!/usr/bin/env bash
# A/B of `moekit bench` runs in one call: builds the moekit target only (no tests), then runs each variant
# "label|ENV=V ENV2=W|moekit bench arguments" of RUNS (separated by ';'), each bounded, text and JSON in $OUT/ab.
# usage (device, repo root; carry [".third_party/nlohmann", ".third_party/wheels"]):
#   RUNS="mixtral|MOEKIT_ACT_BWD_UNROLL=2|--preset mixtral;..." bash scripts/device_bench_ab.sh
. "$(dirname "$0")/device_lib.sh"
B=build-ab
mkdir -p "$OUT/ab"
log "build moekit ($B)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DMOEKIT_TESTS=OFF \
  >"$OUT/build.log" 2>&1 && timeout $((LIMIT - SECONDS - 60)) cmake --build $B --target moekit >>"$OUT/build.log" 2>&1 ||
  { log "build failed"; grep -E "error" "$OUT/build.log" | head -10 | tee -a "$OUT/summary.txt"; exit 1; }
IFS=';' read -ra items <<<"$RUNS"
for item in "${items[@]}"; do
  IFS='|' read -r label envs args <<<"$item"
  left 40 "$label" || break
  f="$OUT/ab/${label// /_}"
  env $envs timeout $((LIMIT - SECONDS - 10)) $B/moekit bench $args --json "$f.json" >"$f.txt" 2>&1
  echo "## $label [$envs] moekit bench $args: rc $?, t=${SECONDS}s" | tee -a "$OUT/summary.txt"
  grep -E "^  (stage|activation|fc1|fc2|router|permute|combine) |interleaved|phase by phase" "$f.txt" | tee -a "$OUT/summary.txt"
done
tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"
log done
