#!/bin/sh
# A failure on one rank must fail every rank: rank 1 alone fails EpMpi.FailureInjectionHook; the job must exit
# non-zero and rank 0, which passed, must report the failure overall. usage: one_rank_fails.sh MPIEXEC TEST_BINARY
out=$("$1" --allow-run-as-root --oversubscribe -x ASAN_OPTIONS=detect_leaks=0 -x MOEKIT_TEST_FAIL_ON_RANK=1 -np 2 \
      "$2" --gtest_filter=EpMpi.FailureInjectionHook 2>&1)
rc=$?
echo "$out"
[ "$rc" -ne 0 ] || { echo "one_rank_fails: the job exited 0 although rank 1 failed"; exit 1; }
echo "$out" | grep -q "rank 0 of 2: passed here, FAILED overall" ||
    { echo "one_rank_fails: rank 0 did not learn of rank 1's failure"; exit 1; }
echo "one_rank_fails: rank 1's failure failed the job and rank 0's verdict"
