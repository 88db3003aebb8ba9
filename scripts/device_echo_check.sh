#!/usr/bin/env bash
# The GPU ECHO check in one call (issue 9; bounded to the device's 10-minute limit): build; the ECHO and
# budgeted-dispatcher GPU tests in fresh processes; compute-sanitizer memcheck on the ECHO kernels; the
# EP benchmark under zipf 1.2 skew with ECHO vs without (receive factor 1.25); the simulated EP step
# (bench_echo_balance: busiest rank's expert time with ECHO vs forced balance) and the planner benchmark.
# usage: MOEKIT_COMMIT=<sha> [FULL=1] [EP_BENCH=0] scripts/device_echo_check.sh; results in $OUT (summary.txt
# first). FULL=1 runs the whole GPU suite (ctest -L gpu) instead of the ECHO/budgeted list; EP_BENCH=0 skips
# the EP benchmark.
. "$(dirname "$0")/device_lib.sh"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
targets="moekit test_cuda_echo test_cuda_ep"
[ -f bench/bench_echo_balance.cu ] && targets="$targets bench_echo_balance"
timeout 280 cmake --build $B --target $targets bench_echo_plan >>"$OUT/build.log" 2>&1 \
  || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
if [ "${FULL:-0}" = 1 ]; then  # the whole GPU suite (every test a fresh process) instead of the list below
  log "build (all targets)"
  timeout 280 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head | tee -a "$OUT/summary.txt"; exit 1; }
  log "ctest -L gpu"
  (cd $B && timeout 260 ctest -L gpu -j 4 --output-on-failure --timeout 150 2>&1) >"$OUT/ctest_gpu.log"
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Total Test time" "$OUT/ctest_gpu.log" | tee -a "$OUT/summary.txt"
  grep -E "plain cudaMemcpy|rank load max/mean" "$OUT/ctest_gpu.log" | head -8 | cut -c1-200 | tee -a "$OUT/summary.txt"
  left 60 "sinkhorn repeat" && {
    log "sinkhorn / fp64 layer cases, 10 repeats"
    timeout 50 $B/test_cuda_layer --gtest_filter='*sinkhorn*:*fp64*' --gtest_repeat=10 2>&1 | grep -cE "^\[       OK" | sed 's/^/OK runs: /' | tee -a "$OUT/summary.txt"
  }
  TESTS_DONE=1
fi
[ "${TESTS_DONE:-0}" = 1 ] || { log "GPU tests: ECHO and the budgeted dispatcher (fresh processes)"
for run in "test_cuda_echo CudaEcho.EqualsDropless*" "test_cuda_echo CudaEcho.CapacityFactor*" \
           "test_cuda_ep CudaEcho.WholeStep*" "test_cuda_ep CudaEpBudgeted.*" "test_cuda_ep *softmax_post_swiglu_ep8_budgeted*"; do
  set -- $run
  log "-- $1 $2"
  timeout 100 $B/$1 --gtest_filter="$2" >"$OUT/t.log" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|rank load|waited more|exception|first at" "$OUT/t.log" | head -14 \
    | cut -c1-240 | tee -a "$OUT/summary.txt"
  cat "$OUT/t.log" >>"$OUT/tests.log"
done
}
left 120 "memcheck" && {
  log "compute-sanitizer memcheck on the ECHO kernels (host barriers, EP=4 and 8)"
  MOEKIT_BUDGETED_HOST_BARRIERS=1 MOEKIT_EXPERT_GEMM=sync_baseline timeout 150 compute-sanitizer --error-exitcode 9 \
    --tool memcheck $B/test_cuda_echo --gtest_filter='CudaEcho.CapacityFactor*:CudaEcho.ForcedRandom*' >"$OUT/sanitizer_echo.log" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "PASSED|FAILED|SUMMARY" "$OUT/sanitizer_echo.log" | tail -3 | tee -a "$OUT/summary.txt"
}
# Under zipf 1.2 at EP=8: ECHO on the budgeted dispatcher (f=1.25), the budgeted one without ECHO (overflows:
# re-run), and the synchronous alltoall (dropless, 1 host sync per step). dsv3-e256 does not fit 8 virtual
# ranks on one GPU (its experts' fp32 grads alone are 45 GB).
[ "${EP_BENCH:-1}" = 1 ] && for run in "qwen3-30b echo" "qwen3-30b budgeted" "qwen3-30b alltoall" "dsv3-ep8 echo" "dsv3-ep8 budgeted" "dsv3-ep8 alltoall"; do
  set -- $run
  left 50 "bench $run" || continue
  extra="--skew zipf:1.2"
  [ $2 != alltoall ] && extra="$extra --moe-expert-rank-capacity-factor 1.25"
  [ $2 = echo ] && extra="$extra --moe-enable-echo --moe-num-echo-experts 16"
  f="$OUT/bench/ep_$1_8_$2"
  log "moekit bench --preset $1 EP=8 $2 (zipf 1.2)"
  timeout 45 $B/moekit bench --preset $1 --expert-model-parallel-size 8 --virtual-ranks 8 \
    --moe-token-dispatcher-type alltoall $extra --iters 5 --json "$f.json" >"$f.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "whole|ECHO|budgeted|rror|overflow|^  [0-9]" "$f.txt" | cut -c1-240 | tee -a "$OUT/summary.txt"
done
for alg in waterfill greedy; do
  [ -x $B/bench_echo_balance ] && left 45 "bench_echo_balance $alg" && {
    log "bench_echo_balance --algorithm $alg (simulated EP step, rank by rank)"
    timeout 60 $B/bench_echo_balance --ep 4,8 --skew zipf:1.2 --algorithm $alg --json "$OUT/bench/echo_balance_$alg.json" \
      >"$OUT/bench/echo_balance_$alg.txt" 2>&1
    echo "exit $?" | tee -a "$OUT/summary.txt"
    tail -32 "$OUT/bench/echo_balance_$alg.txt" | cut -c1-220 | tee -a "$OUT/summary.txt"
  }
done
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
log "done"
