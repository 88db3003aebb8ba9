#!/usr/bin/env bash
# Expert parallelism on one GPU: build, the EP test (virtual ranks EP=2/4/8, both dispatchers, vs the CPU
# oracle), the whole GPU label, compute-sanitizer on the EP kernels, `moekit layer --device cuda
# --virtual-ranks 4` against the CPU, (EP_BENCH=1) the EP benchmark, and EP=1 against the layer before the
# pipeline when .ep_baseline/ holds that tree (git archive 695b969 | tar -x -C .ep_baseline; carried).
# usage: scripts/device_ep.sh; results in $OUT (summary.txt last lines = the verdict).
set -o pipefail
# N > 1 real GPUs (issues 12, 13): the multi-GPU script.
if [ "${N:-1}" -gt 1 ]; then exec bash "$(dirname "$0")/device_ep_multi.sh"; fi
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
log "NCCL transport under mpirun -np 1 (one GPU here; -np 2 needs two)"
timeout 120 mpirun --allow-run-as-root -np 1 -x LD_LIBRARY_PATH $B/test_cuda_ep --gtest_filter='NcclDeviceComm.*' 2>&1 \
  | grep -E "PASSED|FAILED|SKIPPED|Failure|error" | head -5 | tee -a "$OUT/summary.txt"
if [ "${SKIP_CTEST:-0}" != 1 ]; then
  log "ctest (all labels)"
  (cd $B && timeout 300 ctest -j 8 --output-on-failure --timeout 250 2>&1) >"$OUT/ctest.log"
  grep -E "tests passed|tests failed|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
fi
log "moekit layer --device cuda --virtual-ranks 4 vs --device cpu"
for d in cpu cuda; do
  for disp in allgather alltoall; do
    $B/moekit layer --device $d --virtual-ranks 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type $disp \
      --init random --hidden-size 128 --num-experts 16 --moe-ffn-hidden-size 64 --moe-router-topk 4 \
      --seq-length 64 --micro-batch-size 8 --swiglu --out /tmp/ep_${d}_${disp}.safetensors >"$OUT/layer_${d}_${disp}.log" 2>&1
    echo "layer $d $disp exit $?" | tee -a "$OUT/summary.txt"
  done
done
# Per tensor: the relative error of cuda vs cpu, worst three shown, and the single-rank (EP=1) cuda vs cpu
# run of the same flags for scale.
for d in cpu cuda; do
  $B/moekit layer --device $d --init random --hidden-size 128 --num-experts 16 --moe-ffn-hidden-size 64 \
    --moe-router-topk 4 --seq-length 64 --micro-batch-size 8 --swiglu --out /tmp/ep1_${d}.safetensors >/dev/null 2>&1
done
for disp in allgather alltoall; do
  python3 scripts/compare_safetensors.py /tmp/ep_cpu_$disp.safetensors /tmp/ep_cuda_$disp.safetensors \
    "moekit layer EP=4 $disp, cuda vs cpu" | tee -a "$OUT/summary.txt"
done
python3 scripts/compare_safetensors.py /tmp/ep1_cpu.safetensors /tmp/ep1_cuda.safetensors \
  "moekit layer EP=1 (one rank), cuda vs cpu" | tee -a "$OUT/summary.txt"
if [ "${EP_BENCH:-0}" = 1 ]; then
  log "moekit bench: EP=4 and 8 on virtual ranks (alltoall, allgather, budgeted f=1.25)"
  mkdir -p "$OUT/bench"
  for preset in mixtral qwen3-30b dsv3-ep8; do
    for ep in 4 8; do
      for disp in alltoall allgather budgeted; do
        extra="--moe-token-dispatcher-type $disp"
        [ $disp = budgeted ] && extra="--moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 1.25"
        f="$OUT/bench/ep_${preset}_${ep}_${disp}"
        timeout 120 $B/moekit bench --preset $preset --expert-model-parallel-size $ep --virtual-ranks $ep $extra \
          --iters 10 --json "$f.json" >"$f.txt" 2>&1
        grep -E "whole|budgeted|error" "$f.txt" | sed "s/^/$preset EP=$ep $disp: /" | tee -a "$OUT/summary.txt"
      done
    done
  done
fi
if [ -d .ep_baseline ] && [ "${EP1_BASELINE:-1}" = 1 ]; then
  mkdir -p "$OUT/bench"
  log "EP=1 through the pipeline vs the layer before it (.ep_baseline = 695b969), same call, alternating"
  ln -sfn "$PWD/.third_party" .ep_baseline/.third_party
  (cd .ep_baseline && cmake -S . -B build-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
     >"$OUT/build_base.log" 2>&1 && timeout 300 cmake --build build-base --target moekit >>"$OUT/build_base.log" 2>&1) \
     || { echo "baseline build failed" | tee -a "$OUT/summary.txt"; }
  for preset in mixtral dsv3-ep8 qwen3-30b; do
    for round in 1 2; do
      for which in base new; do
        bin=$B/moekit; [ $which = base ] && bin=.ep_baseline/build-base/moekit
        timeout 120 $bin bench --preset $preset --iters 10 --json "$OUT/bench/ep1_${which}_${preset}_${round}.json" >/dev/null 2>&1
      done
    done
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys, statistics
out = sys.argv[1]
for preset in ("mixtral", "dsv3-ep8", "qwen3-30b"):
    row = {}
    for which in ("base", "new"):
        g, e = [], []
        for rnd in (1, 2):
            try: j = json.load(open("%s/bench/ep1_%s_%s_%d.json" % (out, which, preset, rnd)))
            except Exception as ex: continue
            g.append(j["grouped"]["graph_fwd_bwd_ms"]); e.append(j["grouped"]["eager_fwd_bwd_ms"])
        row[which] = (min(g) if g else float("nan"), min(e) if e else float("nan"))
    b, n = row["base"], row["new"]
    print("%-10s graph fwd+bwd: before %.3f ms, pipeline %.3f ms (x%.3f); eager: %.3f vs %.3f (x%.3f)"
          % (preset, b[0], n[0], n[0] / b[0], b[1], n[1], n[1] / b[1]))
PY
fi
log "ECHO planner: GPU tests and benchmark"
timeout 120 $B/test_echo_plan 2>&1 | grep -E "PASSED|FAILED|Failure" | head -5 | tee -a "$OUT/summary.txt"
timeout 120 $B/bench_echo_plan --json "$OUT/bench_echo_plan.json" > "$OUT/bench_echo_plan.txt" 2>&1
tail -30 "$OUT/bench_echo_plan.txt" | tee -a "$OUT/summary.txt"
log "compute-sanitizer memcheck + racecheck on the EP dispatch kernels (EP=2, every dispatcher)"
for tool in memcheck racecheck; do
  MOEKIT_DEVICE_WAIT_S=60 MOEKIT_EXPERT_GEMM=sync_baseline timeout 240 compute-sanitizer --error-exitcode 9 --tool $tool \
    $B/test_cuda_ep --gtest_filter='*softmax_post_swiglu_ep2*:*capacity_pad_ep2*:LocalDeviceComm.*' 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
done
log "budgeted dispatch kernels under sanitizers (EP=2 graph + overflow tests)"
for tool in memcheck racecheck; do
  MOEKIT_DEVICE_WAIT_S=60 MOEKIT_EXPERT_GEMM=sync_baseline timeout 300 compute-sanitizer --error-exitcode 9 --tool $tool \
    $B/test_cuda_ep --gtest_filter='*budgeted_ep2*:CudaEpBudgeted.ReceiveBuffer*' 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
done
(cd "$OUT" && tar czf bench.tgz bench 2>/dev/null && rm -rf bench)
log "done"
