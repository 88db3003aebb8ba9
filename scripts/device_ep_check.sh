#!/usr/bin/env bash
# The expert-parallel GPU check in one call: build; the whole ctest suite (GPU EP tests: virtual ranks EP=2/4/8
# for every dispatcher vs the CPU oracle, the budgeted one vs alltoall bit for bit, overflow re-runs, one-graph
# EP steps; the EP training engine); the NCCL transport under mpirun -np 1; `moekit train --device cuda` on 4
# virtual ranks; the EP benchmark (alltoall vs budgeted); the ECHO planner's benchmark; compute-sanitizer on the
# budgeted dispatch kernels. usage: MOEKIT_COMMIT=<sha> scripts/device_ep_check.sh; results in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT/bench"
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
echo "commit ${MOEKIT_COMMIT:-unknown}" | tee -a "$OUT/summary.txt"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
log "ctest (all labels) but the budgeted dispatcher's"
(cd $B && MOEKIT_DEVICE_WAIT_S=5 timeout 240 ctest -j 8 -E "[Bb]udgeted" --output-on-failure --timeout 120 2>&1) >"$OUT/ctest.log"
grep -E "tests passed|tests failed|^ *(cpu|gpu) +=|\(Failed\)|\(Timeout\)" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
log "ctest: the budgeted dispatcher's GPU tests (fresh processes; a device wait is bounded at 5 s)"
(cd $B && MOEKIT_DEVICE_WAIT_S=5 timeout 200 ctest -j 4 -R "[Bb]udgeted" --output-on-failure --timeout 45 2>&1) >"$OUT/ctest_budgeted.log"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$OUT/ctest_budgeted.log" | tee -a "$OUT/summary.txt"
grep -E "first at|waited more than" "$OUT/ctest_budgeted.log" | head -6 | cut -c1-300 | tee -a "$OUT/summary.txt"
log "ECHO planner benchmark"
timeout 60 $B/bench_echo_plan --json "$OUT/bench/bench_echo_plan.json" >"$OUT/bench/bench_echo_plan.txt" 2>&1
tail -24 "$OUT/bench/bench_echo_plan.txt" | tee -a "$OUT/summary.txt"
log "NCCL transport under mpirun -np 1"
timeout 60 mpirun --allow-run-as-root -np 1 -x LD_LIBRARY_PATH $B/test_cuda_ep --gtest_filter='NcclDeviceComm.*' 2>&1 \
  | grep -E "PASSED|FAILED|Failure" | head -3 | tee -a "$OUT/summary.txt"
log "moekit train --device cuda, EP=4 on 4 virtual ranks (demo size, 100 steps)"
timeout 120 $B/moekit train --device cuda --model-size demo --expert-model-parallel-size 4 --virtual-ranks 4 \
  --moe-token-dispatcher-type alltoall --steps 100 --log-every 25 --out-dir /tmp/ep4 --overwrite >"$OUT/train_ep4.log" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"; grep -iE "layout|loss|tokens/s|error" "$OUT/train_ep4.log" | tail -6 | tee -a "$OUT/summary.txt"
log "moekit bench: EP on virtual ranks, alltoall vs budgeted (f=1.25)"
for preset in mixtral qwen3-30b dsv3-ep8; do
  for run in "8 alltoall" "8 budgeted" "4 budgeted"; do
    set -- $run; ep=$1; disp=$2
    extra="--moe-token-dispatcher-type alltoall"
    [ $disp = budgeted ] && extra="$extra --moe-expert-rank-capacity-factor 1.25"
    f="$OUT/bench/ep_${preset}_${ep}_${disp}"
    MOEKIT_DEVICE_WAIT_S=5 timeout 60 $B/moekit bench --preset $preset --expert-model-parallel-size $ep \
      --virtual-ranks $ep $extra --iters 10 --json "$f.json" >"$f.txt" 2>&1
    grep -E "whole|budgeted|error" "$f.txt" | cut -c1-260 | sed "s/^/$preset EP=$ep $disp: /" | tee -a "$OUT/summary.txt"
  done
done
log "compute-sanitizer on the budgeted dispatch kernels (EP=2)"
for tool in memcheck racecheck; do
  MOEKIT_DEVICE_WAIT_S=20 MOEKIT_EXPERT_GEMM=sync_baseline timeout 90 compute-sanitizer --error-exitcode 9 --tool $tool \
    $B/test_cuda_ep --gtest_filter='*softmax_post_swiglu_ep2_budgeted*' 2>&1 | tail -2 \
    | tee -a "$OUT/summary.txt"
done
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
log "done"
