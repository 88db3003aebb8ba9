#!/usr/bin/env bash
# Device run for the grouped GEMMs (cuda-gemm): build, GPU tests, compute-sanitizer, benchmarks; results in $OUT.
# usage (on the device machine, repo root, .third_party carried): scripts/device_gemm.sh [presets...]
# Falls back to building the grouped-GEMM sources alone with nvcc when other files of src/cuda do not build.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
PRESETS=${*:-"mixtral dsv3-ep8 dsv3-e256 qwen3-30b"}
B=build-dev
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
git log -1 --format='commit %h %ci' 2>/dev/null | tee -a "$OUT/summary.txt"

cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1
TEST=$B/test_grouped_gemm BENCH=$B/bench_grouped_gemm TOOL=$B/moekit
if ! timeout 420 cmake --build $B --target test_grouped_gemm bench_grouped_gemm >>"$OUT/build.log" 2>&1; then
    log "cmake build of my targets failed (see build.log); standalone nvcc build"
    cmake --build $B --target gtest_main >>"$OUT/build.log" 2>&1
    GT=$(dirname "$(find $B -name 'libgtest.a' | head -1)")
    NV="nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Iinclude -Isrc"
    SRC="src/cuda/grouped_gemm.cu src/cuda/grouped_gemm_sync.cu"
    mkdir -p $B/alone
    $NV -I.third_party/googletest/googletest/include tests/gpu/test_grouped_gemm.cu $SRC -o $B/alone/test_grouped_gemm \
        -L"$GT" -lgtest_main -lgtest -lcublas -lpthread >>"$OUT/build.log" 2>&1 &
    $NV -I.third_party bench/bench_grouped_gemm.cu src/cuda/bench_expert_mlp.cu $SRC -o $B/alone/bench_grouped_gemm \
        -lcublas >>"$OUT/build.log" 2>&1 &
    wait
    TEST=$B/alone/test_grouped_gemm BENCH=$B/alone/bench_grouped_gemm TOOL=
else
    timeout 300 cmake --build $B --target moekit >>"$OUT/build.log" 2>&1 || { log "moekit tool did not build"; TOOL=; }
fi
tail -5 "$OUT/build.log"
OBJ=$(find $B -name 'grouped_gemm.cu.o' | head -1)
[ -n "$OBJ" ] && log "HGMMA in grouped_gemm SASS: $(cuobjdump -sass "$OBJ" | grep -c HGMMA)"

log "tests"
timeout 240 $TEST 2>&1 | tee "$OUT/test.log" | grep -E '^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|error|rel_err|Expected' | head -60
log "memcheck"
timeout 300 compute-sanitizer --tool memcheck $TEST --gtest_filter='-*MidShape*' 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
log "racecheck"
timeout 300 compute-sanitizer --tool racecheck $TEST --gtest_filter='*Tiny*:*OffTheTileGrid*' 2>&1 | tail -4 | tee -a "$OUT/summary.txt"

log "bench"
for p in $PRESETS; do
    MOEKIT_GEMM_KERNEL=${MLP_KERNEL:-tma} timeout 200 $BENCH --preset "$p" --iters 10 --mlp --json "$OUT/bench_$p.json" 2>&1 | tee -a "$OUT/bench.txt"
done
[ -n "$TOOL" ] && MOEKIT_GEMM_KERNEL=${MLP_KERNEL:-tma} timeout 120 $TOOL bench --preset dsv3-ep8 --skew zipf:1.2 --iters 10 2>&1 | tee -a "$OUT/bench.txt"
cat "$OUT/summary.txt"
