#!/usr/bin/env bash
# Device run for the grouped GEMMs (cuda-gemm): build, GPU tests, compute-sanitizer, benchmarks; results in $OUT
# (summary.txt, build.log, test.log, sanitizer.log, bench.txt, gemm.json, layer.json).
# usage (on the device machine, repo root, .third_party carried): scripts/device_gemm.sh
# Falls back to building the grouped-GEMM sources alone with nvcc when other files of src/cuda do not build.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
git log -1 --format='commit %h %ci' 2>/dev/null | tee -a "$OUT/summary.txt"

NV="nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Iinclude -Isrc"
SRC="src/cuda/grouped_gemm.cu src/cuda/grouped_gemm_sync.cu"
GTI=-I.third_party/googletest/googletest/include
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
TEST=$B/test_grouped_gemm BENCH=$B/bench_grouped_gemm TOOL=$B/moekit
if ! timeout 420 cmake --build $B --target test_grouped_gemm bench_grouped_gemm moekit >>"$OUT/build.log" 2>&1; then
    log "cmake build failed (see build.log); standalone nvcc build of the grouped-GEMM targets"
    grep -m5 "error" "$OUT/build.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
    cmake --build $B --target gtest_main >>"$OUT/build.log" 2>&1
    mkdir -p $B/alone
    GT=$(dirname "$(find $B -name 'libgtest.a' | head -1)")
    $NV $GTI tests/gpu/test_grouped_gemm.cu $SRC -o $B/alone/test_grouped_gemm -L"$GT" -lgtest_main -lgtest -lcublas \
        >>"$OUT/build.log" 2>&1 &
    $NV -I.third_party bench/bench_grouped_gemm.cu src/cuda/bench_expert_mlp.cu $SRC -o $B/alone/bench_grouped_gemm \
        -lcublas >>"$OUT/build.log" 2>&1 &
    wait
    TEST=$B/alone/test_grouped_gemm BENCH=$B/alone/bench_grouped_gemm TOOL=
fi
OBJ=$(find $B -name 'grouped_gemm.cu.o' | head -1)
[ -n "$OBJ" ] && log "HGMMA in grouped_gemm SASS: $(cuobjdump -sass "$OBJ" | grep -c HGMMA), UTMALDG: $(cuobjdump -sass "$OBJ" | grep -c UTMALDG)"

log "tests"
timeout 90 $TEST >"$OUT/test.log" 2>&1
TEST_RC=$?
grep -E '^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|rel_err|Expected' "$OUT/test.log" | head -60
if [ $TEST_RC -ne 0 ]; then log "tests failed or hung (rc $TEST_RC): stopping here"; cat "$OUT/summary.txt"; exit 1; fi
wait
log "memcheck (all kernels except the slow mid shape)"
timeout 200 compute-sanitizer --tool memcheck $TEST --gtest_filter='-*MidShape*' >"$OUT/sanitizer.log" 2>&1
grep -E "^\[ +(OK|FAILED) " "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"; tail -2 "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"
grep -m3 -A2 "=== [A-Z]" "$OUT/sanitizer.log" | grep -v "^--" | head -9 | tee -a "$OUT/summary.txt"
log "racecheck"
timeout 200 compute-sanitizer --tool racecheck $TEST --gtest_filter='*Tiny*:*OffTheTileGrid*:*AllRows*' 2>&1 | tail -3 \
    | tee -a "$OUT/summary.txt"
head -c 6000 "$OUT/sanitizer.log" >"$OUT/sanitizer_head.log" && mv "$OUT/sanitizer_head.log" "$OUT/sanitizer.log"

log "bench"
# GEMM_BENCH=0 skips the per-GEMM tables; LAYER_RUNS lists the `moekit bench` runs (';'-separated flag sets).
[ "${GEMM_BENCH:-1}" = 1 ] && timeout 300 $BENCH --preset all --iters 10 --mlp --json "$OUT/gemm.json" 2>&1 \
    | tee -a "$OUT/bench.txt"
if [ -n "$TOOL" ]; then
    IFS=';' read -ra RUNS <<<"${LAYER_RUNS:-mixtral;dsv3-ep8;dsv3-ep8 --skew zipf:1.2;dsv3-e256;qwen3-30b}"
    for a in "${RUNS[@]}"; do
        f=$(echo "$a" | tr -c 'a-z0-9\n' '_')
        timeout 150 $TOOL bench --preset $a --json "$B/layer_$f.json" 2>&1 | tee -a "$OUT/bench.txt"
    done
    python3 -c "import json,glob,sys; json.dump([json.load(open(f)) for f in sorted(glob.glob('$B/layer_*.json'))], open('$OUT/layer.json','w'), indent=1)"
fi
cat "$OUT/summary.txt"
