#!/usr/bin/env bash
# The whole check on a GPU machine in one call: build everything, the full ctest suite (cpu + gpu labels),
# compute-sanitizer memcheck and racecheck on the GPU test binaries (small cases), `moekit train` on cuda at
# the GPU default size (tokens/s, TFLOP/s vs dense cuBLAS, iteration vs sum of parts, memory) and at the demo
# size (one graph per iteration vs the host loop), and `moekit bench` on the acceptance presets.
# usage (device machine, repo root, .third_party carried): scripts/device_check.sh [quick]; results under $OUT:
# summary.txt, ctest.log, sanitizer.log, bench.txt, train_*.json, train_gpu.png.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
echo "commit ${MOEKIT_COMMIT:-unknown}" | tee -a "$OUT/summary.txt"

log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
if ! timeout 330 cmake --build $B >>"$OUT/build.log" 2>&1; then
    log "build failed"; grep -E "error" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"; exit 1
fi
log "ctest (all labels)"
(cd $B && timeout 300 ctest -j 8 --output-on-failure --timeout 250 2>&1) >"$OUT/ctest.log"
grep -E "tests passed|tests failed|Label Time|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)|\(Not Run\)|largest relative" \
    "$OUT/ctest.log" | tee -a "$OUT/summary.txt"

log "compute-sanitizer (small cases)"
S="timeout 120 compute-sanitizer --error-exitcode 9"
{
    $S --tool memcheck $B/test_cuda_device_layer
    $S --tool memcheck $B/test_cuda_train --gtest_filter='*GraphReplays*:*NonFinite*'
    $S --tool racecheck $B/test_cuda_train --gtest_filter='*NonFinite*'
    $S --tool memcheck $B/test_cuda_layer --gtest_filter='*softmax_post*:*shared_gate*:*capacity_pad*:*padding_mask*'
    $S --tool memcheck $B/test_cuda_graph --gtest_filter='-*Sinkhorn*'
    $S --tool memcheck $B/test_cuda_stages
    $S --tool memcheck $B/test_cuda_router_non_finite
    $S --tool racecheck $B/test_grouped_gemm --gtest_filter='*Tiny*:*OffTheTileGrid*'
    $S --tool racecheck $B/test_cuda_stages --gtest_filter='-*Sinkhorn*'
    $S --tool memcheck $B/test_echo_plan
    $S --tool racecheck $B/test_echo_plan --gtest_filter='*E256*:*GraphCapture*'
    $S --tool synccheck $B/test_echo_plan --gtest_filter='*E256*'
} >"$OUT/sanitizer.log" 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$OUT/sanitizer.log" | tee -a "$OUT/summary.txt"

DEMO="--model-size demo"
log "moekit train --device cuda, GPU default size"
timeout 200 $B/moekit train --device cuda --out-dir $B/train_gpu >"$B/train_gpu.log" 2>&1
tail -12 "$B/train_gpu.log" | tee -a "$OUT/summary.txt"
cp $B/train_gpu/report.json "$OUT/train_gpu.json" 2>/dev/null; cp $B/train_gpu/train.png "$OUT/train_gpu.png" 2>/dev/null
for lr in $LR_SWEEP; do
    log "GPU default size, --lr $lr, 600 steps"
    timeout 60 $B/moekit train --device cuda --lr $lr --steps 600 --out-dir $B/train_lr_$lr 2>&1 | grep -E "loss \(|error" \
        | tee -a "$OUT/summary.txt"
done
log "moekit train --device cuda, demo size: one graph per iteration vs the old host loop (1000 steps each)"
timeout 100 $B/moekit train --device cuda $DEMO --out-dir $B/train_demo_graph >"$B/train_demo_graph.log" 2>&1
tail -9 "$B/train_demo_graph.log" | tee -a "$OUT/summary.txt"
timeout 150 $B/moekit train --device cuda --host-loop $DEMO --out-dir $B/train_demo_host >"$B/train_demo_host.log" 2>&1
tail -6 "$B/train_demo_host.log" | tee -a "$OUT/summary.txt"
cp $B/train_demo_graph/report.json "$OUT/train_demo_graph.json" 2>/dev/null

log "ECHO planner on the GPU (E=256, S=2 per rank)"
timeout 60 $B/bench_echo_plan --json "$OUT/bench_echo_plan.json" 2>&1 | tee -a "$OUT/summary.txt" | tail -12

if [ "$1" != quick ]; then
    log "moekit bench"
    for a in mixtral dsv3-ep8 qwen3-30b; do
        timeout 100 $B/moekit bench --preset $a 2>&1 | tee -a "$OUT/bench.txt" | tail -5
    done
fi
cat "$OUT/summary.txt" | tail -5
