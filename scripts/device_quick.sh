#!/usr/bin/env bash
# A short GPU check after merges: build, the whole ctest suite, the NaN refusal of `moekit layer --device cuda`,
# and the non-finite training run under compute-sanitizer memcheck. usage: scripts/device_quick.sh; results in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
echo "commit ${MOEKIT_COMMIT:-unknown}" | tee -a "$OUT/summary.txt"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20; exit 1; }
log "ctest (all labels)"
(cd $B && timeout 240 ctest -j 8 --output-on-failure --timeout 200 2>&1) >"$OUT/ctest.log"
grep -E "tests passed|tests failed|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
log "moekit layer --device cuda with a NaN in router.weight"
$B/moekit layer --device cpu --init random --hidden-size 8 --num-experts 4 --moe-ffn-hidden-size 8 --seq-length 4 \
    --save-weights /tmp/nan_w.safetensors --out /tmp/nan_ref.safetensors >/dev/null 2>&1
python3 - <<'PY'
import json, struct
b = bytearray(open("/tmp/nan_w.safetensors", "rb").read())
n = struct.unpack("<Q", b[:8])[0]
t = json.loads(b[8:8 + n])["router.weight"]
assert t["dtype"] == "F32"
struct.pack_into("<f", b, 8 + n + t["data_offsets"][0] + 4 * 5, float("nan"))  # element 5
open("/tmp/nan_w.safetensors", "wb").write(b)
PY
$B/moekit layer --device cuda --hidden-size 8 --num-experts 4 --moe-ffn-hidden-size 8 --seq-length 4 \
    --weights /tmp/nan_w.safetensors --out /tmp/nan_out.safetensors >"$OUT/nan_layer.log" 2>&1
echo "exit status $? : $(tail -1 "$OUT/nan_layer.log")" | tee -a "$OUT/summary.txt"
log "compute-sanitizer memcheck: a NaN arising inside GPU training steps"
timeout 120 compute-sanitizer --error-exitcode 9 --tool memcheck $B/test_cuda_train --gtest_filter='*NonFinite*' \
    2>&1 | grep -E "ERROR SUMMARY|PASSED|FAILED" | tee -a "$OUT/summary.txt"
