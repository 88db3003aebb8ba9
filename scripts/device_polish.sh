#!/usr/bin/env bash
# Device run for cuda-polish: builds moekit + test_cuda_cmd_layer + test_cmd_layer (CUDA build), runs both tests
# (moekit layer --device cuda vs cpu; the GPU-host default device) and checks moekit bench's flag handling;
# logs under $OUT. usage (device machine, repo root, .third_party carried): scripts/device_polish.sh
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
git log -1 --format='commit %h %ci' 2>/dev/null | tee -a "$OUT/summary.txt"

cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
if ! timeout 420 cmake --build $B --target moekit test_cuda_cmd_layer test_cmd_layer >>"$OUT/build.log" 2>&1; then
    log "build failed"
    grep -E "error|Error" "$OUT/build.log" | head -40 | tee -a "$OUT/summary.txt"
    exit 1
fi
log "build ok"
for t in test_cuda_cmd_layer test_cmd_layer; do
    timeout 120 $B/$t >"$OUT/$t.log" 2>&1
    echo "$t rc=$?" | tee -a "$OUT/summary.txt"
    grep -hE '^\[  (PASSED|FAILED) |rel err|Failure|Which is|Expected|expected' "$OUT/$t.log" | head -40 \
        | tee -a "$OUT/summary.txt"
done
log "moekit bench flags (CUDA build)"
$B/moekit bench --help >"$OUT/bench_help.txt" 2>&1; echo "bench --help rc=$?" | tee -a "$OUT/summary.txt"
$B/moekit bench --itres 3 2>&1 | tee -a "$OUT/summary.txt"; echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
$B/moekit bench --preset nope 2>&1 | tee -a "$OUT/summary.txt"; echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
$B/moekit bench --preset mixtral --device cpu 2>&1 | tee -a "$OUT/summary.txt"; echo "rc=${PIPESTATUS[0]}" \
    | tee -a "$OUT/summary.txt"
exit 0
