#!/usr/bin/env bash
# The whole check on a GPU machine in one call: build everything, the full ctest suite (cpu + gpu labels),
# compute-sanitizer memcheck and racecheck on the GPU test binaries (small cases, default TMA GEMM),
# `moekit bench` on the acceptance presets, and `moekit train` on cuda and on cpu (same seed).
# usage (device machine, repo root, .third_party carried): scripts/device_check.sh; results under $OUT:
# summary.txt, ctest.log, sanitizer.log, bench.txt, train_cuda.json, train_cpu.json, train_cuda.png.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
git log -1 --format='commit %h %ci' 2>/dev/null | tee -a "$OUT/summary.txt"

log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
if ! timeout 330 cmake --build $B >>"$OUT/build.log" 2>&1; then
    log "build failed"; grep -E "error" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"; exit 1
fi
log "ctest (all labels)"
(cd $B && timeout 240 ctest -j 4 --output-on-failure --timeout 200 2>&1) >"$OUT/ctest.log"
grep -E "tests passed|tests failed|Label Time|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)|\(Not Run\)" "$OUT/ctest.log" \
    | tee -a "$OUT/summary.txt"

log "compute-sanitizer (small cases)"
S="timeout 150 compute-sanitizer --error-exitcode 9"
{
    $S --tool memcheck $B/test_grouped_gemm --gtest_filter='*Tiny*:*OffTheTileGrid*:*AllRows*:*ManyGroups*'
    $S --tool memcheck $B/test_cuda_stages
    $S --tool memcheck $B/test_cuda_layer --gtest_filter='*softmax_post*:*shared_gate*:*capacity_pad*:*padding_mask*'
    $S --tool memcheck $B/test_cuda_graph --gtest_filter='-*Sinkhorn*'
    $S --tool memcheck $B/test_cuda_router_non_finite
    $S --tool racecheck $B/test_grouped_gemm --gtest_filter='*Tiny*:*OffTheTileGrid*'
    $S --tool racecheck $B/test_cuda_stages --gtest_filter='-*Sinkhorn*'
} >"$OUT/sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"

log "moekit train, cuda and cpu (same seed and flags)"
for dev in cuda cpu; do
    timeout 150 $B/moekit train --device $dev --out-dir $B/train_$dev >"$B/train_$dev.log" 2>&1
    tail -6 "$B/train_$dev.log" | tee -a "$OUT/summary.txt"
    cp $B/train_$dev/report.json "$OUT/train_$dev.json" 2>/dev/null
done
cp $B/train_cuda/train.png "$OUT/train_cuda.png" 2>/dev/null

log "moekit bench"
for a in mixtral dsv3-ep8 "dsv3-ep8 --skew zipf:1.2" dsv3-e256 qwen3-30b; do
    timeout 100 $B/moekit bench --preset $a 2>&1 | tee -a "$OUT/bench.txt" | tail -4
done
cat "$OUT/summary.txt"
