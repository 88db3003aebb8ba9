#!/usr/bin/env bash
# Expert parallelism on one GPU: build, the EP test (virtual ranks EP=2/4/8, both dispatchers, vs the CPU
# oracle), the whole GPU label, compute-sanitizer on the EP kernels, `moekit layer --device cuda
# --virtual-ranks 4` against the CPU, and (when asked with EP_BENCH=1) the EP benchmark.
# usage: scripts/device_ep.sh; results in $OUT (summary.txt last lines = the verdict).
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
echo "commit ${MOEKIT_COMMIT:-unknown}" | tee -a "$OUT/summary.txt"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
grep -E "NCCL|MPI" "$OUT/build.log" | tee -a "$OUT/summary.txt"
timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
log "test_cuda_ep"
timeout 300 $B/test_cuda_ep >"$OUT/test_cuda_ep.log" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
grep -E "FAILED|PASSED|Failure|error" "$OUT/test_cuda_ep.log" | head -40 | tee -a "$OUT/summary.txt"
log "ctest (all labels)"
(cd $B && timeout 300 ctest -j 8 --output-on-failure --timeout 250 2>&1) >"$OUT/ctest.log"
grep -E "tests passed|tests failed|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
log "compute-sanitizer memcheck + racecheck on the EP layer (EP=2, both dispatchers)"
for tool in memcheck racecheck; do
  MOEKIT_EXPERT_GEMM=sync_baseline timeout 200 compute-sanitizer --error-exitcode 9 --tool $tool $B/test_cuda_ep \
    --gtest_filter='*softmax_post_swiglu_ep2*:*capacity_pad_ep2*:LocalDeviceComm.*' 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
done
log "moekit layer --device cuda --virtual-ranks 4 vs --device cpu"
for d in cpu cuda; do
  for disp in allgather alltoall; do
    $B/moekit layer --device $d --virtual-ranks 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type $disp \
      --init random --hidden-size 128 --num-experts 16 --moe-ffn-hidden-size 64 --moe-router-topk 4 \
      --seq-length 64 --micro-batch-size 8 --swiglu --out /tmp/ep_${d}_${disp}.safetensors >"$OUT/layer_${d}_${disp}.log" 2>&1
    echo "layer $d $disp exit $?" | tee -a "$OUT/summary.txt"
  done
done
python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, struct, math
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); out = {}
    for k, t in h.items():
        if k == "__metadata__" or t["dtype"] != "F32": continue
        s, e = t["data_offsets"]; out[k] = struct.unpack("<%df" % ((e - s) // 4), b[8 + n + s:8 + n + e])
    return out
for disp in ("allgather", "alltoall"):
    a, c = load("/tmp/ep_cpu_%s.safetensors" % disp), load("/tmp/ep_cuda_%s.safetensors" % disp)
    worst = 0
    for k in a:
        num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[k], c[k]))); den = math.sqrt(sum(x * x for x in a[k]))
        if den > 0: worst = max(worst, num / den)
    print("moekit layer %s: cuda vs cpu worst relative error over %d tensors: %.2e" % (disp, len(a), worst))
PY
if [ "${EP_BENCH:-0}" = 1 ]; then
  log "moekit bench EP"
  timeout 300 $B/moekit bench --ep-only --json "$OUT/bench_ep.json" 2>&1 | tail -40 | tee -a "$OUT/summary.txt"
fi
log "done"
