#!/usr/bin/env bash
# Device run for the grouped GEMMs: build, grouped-GEMM tests, compute-sanitizer, the GPU ctest label, and an A/B
# benchmark of TMA-kernel variants (MOEKIT_GEMM_CLUSTER=1|2, MOEKIT_GEMM_EPILOGUE=direct|staged): bench_grouped_gemm and
# `moekit bench` on the acceptance presets. Results in $OUT (summary.txt, build.log, test.log, sanitizer.log,
# ctest.log, bench.txt, gemm_c<N>.json). usage (device machine, repo root, .third_party carried):
#   scripts/device_gemm.sh
# defaults: PRESETS="mixtral dsv3-ep8" VARIANTS="1:direct 1:staged 2:staged" SANITIZE=1 CTEST=1
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
PRESETS=${PRESETS:-mixtral dsv3-ep8}
VARIANTS=${VARIANTS:-1:direct 1:staged 2:staged}
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
git log -1 --format='commit %h %ci' 2>/dev/null | tee -a "$OUT/summary.txt"

log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
if ! timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1; then
    log "build failed"; grep -E "error" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"; exit 1
fi
TEST=$B/test_grouped_gemm

log "grouped-GEMM tests"
timeout 120 $TEST >"$OUT/test.log" 2>&1
TEST_RC=$?
grep -E '^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|rel_err|Expected|Which is' "$OUT/test.log" | head -60 \
    | tee -a "$OUT/summary.txt"
if [ $TEST_RC -ne 0 ]; then log "tests failed or hung (rc $TEST_RC): stopping here"; exit 1; fi
MOEKIT_GEMM_EPILOGUE=direct timeout 120 $TEST >"$OUT/test_direct.log" 2>&1
echo "tests with MOEKIT_GEMM_EPILOGUE=direct: rc $? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/test_direct.log")" \
    | tee -a "$OUT/summary.txt"

log "bench A/B (variants, cluster:epilogue: $VARIANTS)"
for v in $VARIANTS; do
    for p in $PRESETS; do
        echo "### $v bench_grouped_gemm --preset $p" | tee -a "$OUT/bench.txt"
        MOEKIT_GEMM_CLUSTER=${v%%:*} MOEKIT_GEMM_EPILOGUE=${v##*:} timeout 120 $B/bench_grouped_gemm --preset $p \
            --iters 10 --mlp --json "$OUT/gemm_${v/:/_}_$p.json" 2>&1 | tee -a "$OUT/bench.txt" >/dev/null
    done
done
for p in $PRESETS; do
    for v in $VARIANTS; do
        echo "### $v moekit bench --preset $p" | tee -a "$OUT/bench.txt"
        MOEKIT_GEMM_CLUSTER=${v%%:*} MOEKIT_GEMM_EPILOGUE=${v##*:} timeout 100 $B/moekit bench --preset $p 2>&1 \
            | tee -a "$OUT/bench.txt" | tail -3
    done
done

if [ "${SANITIZE:-1}" = 1 ]; then
    log "compute-sanitizer on test_grouped_gemm (small cases)"
    S="timeout 200 compute-sanitizer --error-exitcode 9"
    {
        $S --tool memcheck $TEST --gtest_filter='-*MidShape*'
        $S --tool racecheck $TEST --gtest_filter='*Tiny*:*OffTheTileGrid*:*AllRows*'
    } >"$OUT/sanitizer.log" 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"
    grep -m3 -A4 "^========= [A-Z]" "$OUT/sanitizer.log" | head -15 | tee -a "$OUT/summary.txt"
    head -c 20000 "$OUT/sanitizer.log" >"$OUT/s.log" && mv "$OUT/s.log" "$OUT/sanitizer.log"
fi
if [ "${CTEST:-1}" = 1 ]; then
    log "ctest -L gpu"
    (cd $B && timeout 200 ctest -L gpu -j 2 --output-on-failure --timeout 150 2>&1) >"$OUT/ctest.log"
    grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\(Not Run\)" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
fi
log "done"
