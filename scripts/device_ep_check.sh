#!/usr/bin/env bash
# The expert-parallel GPU check in one call (fits the device's 10-minute limit: every stage is bounded and
# skipped when too little time is left): build; the budgeted dispatcher's GPU tests in fresh processes
# (bit-for-bit vs alltoall, overflow re-runs, untouched slack, one-graph EP steps, too few hardware queues
# refused); every other GPU test (the EP dispatchers vs the CPU oracle at EP=2/4/8, the EP training engine);
# the EP benchmark (alltoall vs budgeted); the ECHO planner's benchmark; the NCCL transport under mpirun
# -np 1; compute-sanitizer memcheck/racecheck on the budgeted dispatch kernels
# (phase barriers on the host: the sanitizer runs one kernel at a time, so device barriers could not meet).
# usage: MOEKIT_COMMIT=<sha> scripts/device_ep_check.sh; results in $OUT (summary.txt first).
. "$(dirname "$0")/device_lib.sh"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 280 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
log "ctest: the budgeted dispatcher's GPU tests (fresh processes; device waits bounded at ${MOEKIT_DEVICE_WAIT_S} s)"
(cd $B && timeout 150 ctest -j 2 -R "[Bb]udgeted" --output-on-failure --timeout 100 2>&1) >"$OUT/ctest_budgeted.log"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Passed|Skipped" "$OUT/ctest_budgeted.log" | cut -c1-160 | tee -a "$OUT/summary.txt"
grep -E "first at|waited more than" "$OUT/ctest_budgeted.log" | head -6 | cut -c1-300 | tee -a "$OUT/summary.txt"
left 150 "gpu ctest" && {
  log "ctest -L gpu but the budgeted dispatcher's"
  (cd $B && timeout $((LIMIT - SECONDS - 120)) ctest -L gpu -j 4 -E "[Bb]udgeted" --output-on-failure --timeout 150 2>&1) >"$OUT/ctest_gpu.log"
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Total Test time" "$OUT/ctest_gpu.log" | tee -a "$OUT/summary.txt"
}
left 60 "EP bench" && {
  log "moekit bench: EP=8 on virtual ranks, alltoall vs budgeted (f=1.25)"
  for preset in mixtral dsv3-ep8; do
    for disp in alltoall budgeted; do
      extra="--moe-token-dispatcher-type alltoall"
      [ $disp = budgeted ] && extra="$extra --moe-expert-rank-capacity-factor 1.25"
      f="$OUT/bench/ep_${preset}_8_${disp}"
      left 40 "bench $preset $disp" && timeout 40 $B/moekit bench --preset $preset --expert-model-parallel-size 8 \
        --virtual-ranks 8 $extra --iters 10 --json "$f.json" >"$f.txt" 2>&1
      cat "$f.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    done
  done
}
left 40 "planner bench" && {
  log "ECHO planner benchmark"
  timeout 40 $B/bench_echo_plan --json "$OUT/bench/bench_echo_plan.json" >"$OUT/bench/bench_echo_plan.txt" 2>&1
  tail -24 "$OUT/bench/bench_echo_plan.txt" | tee -a "$OUT/summary.txt"
}
left 30 "NCCL np1" && {
  log "NCCL transport under mpirun -np 1"
  timeout 30 mpirun --allow-run-as-root -np 1 -x LD_LIBRARY_PATH $B/test_cuda_ep --gtest_filter='NcclDeviceComm.*' 2>&1 \
    | grep -E "PASSED|FAILED|Failure|SKIPPED" | head -3 | tee -a "$OUT/summary.txt"
}
# memcheck also on the overflow test (pushes clipped at the budget); racecheck on one EP=2 case.
for run in "memcheck *softmax_post_swiglu_ep2_budgeted*:CudaEpBudgeted.Overflow*" \
           "racecheck *softmax_post_swiglu_ep2_budgeted*"; do
  set -- $run
  left 60 "$1" && {
    log "compute-sanitizer $1 on the budgeted dispatch kernels ($2)"
    MOEKIT_BUDGETED_HOST_BARRIERS=1 MOEKIT_EXPERT_GEMM=sync_baseline timeout $((LIMIT - SECONDS - 10)) compute-sanitizer \
      --error-exitcode 9 --tool $1 $B/test_cuda_ep --gtest_filter="$2" >"$OUT/sanitizer_$1.log" 2>&1
    echo "exit $?" | tee -a "$OUT/summary.txt"
    grep -E "PASSED|FAILED|SUMMARY" "$OUT/sanitizer_$1.log" | tail -4 | tee -a "$OUT/summary.txt"
  }
done
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
log "done"
