# Shared preamble of the bounded device scripts (scripts/device_ep_check.sh, device_echo_check.sh): sourced,
# not run. Results go to $OUT (summary.txt first); every stage checks the time left before the device's
# 10-minute limit (LIMIT seconds, default 570) with `left N what`.
set -o pipefail
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT/bench"
export PATH=/usr/local/cuda/bin:$PATH MOEKIT_DEVICE_WAIT_S=${MOEKIT_DEVICE_WAIT_S:-10}
B=build-dev
LIMIT=${LIMIT:-570}
log() { echo "== $* (t=${SECONDS}s)" | tee -a "$OUT/summary.txt"; }
# left N: true when at least N seconds remain before LIMIT.
left() { [ $((LIMIT - SECONDS)) -ge "$1" ] || { log "skipped: $2 (too little time left)"; return 1; }; }
echo "commit ${MOEKIT_COMMIT:-unknown} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$OUT/summary.txt"
# tests_ok LOG...: the gtest tests these logs say passed (per-test lines end in "(N ms)"; gtest's closing list names
# each failure again without it).
tests_ok() { cat "$@" | grep -cE '^\[       OK \] .* ms\)$'; }
# sanitize TOOL SECONDS BINARY FILTER [TAG]: compute-sanitizer TOOL on a gtest binary (log in $OUT/TAG.log, TAG
# defaulting to TOOL), its verdict appended to $SUMMARY (default $OUT/summary.txt: a job run beside others gives its
# own), with the kernels any report names (racecheck reports hazards inside cuBLAS's nvjet kernels, the sync
# baseline's, on some shapes; leaving them out with --kernel-name-exclude crashed the sanitizer, 2026-11-26).
# GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX in the environment pick a shard of the filtered tests.
sanitize() {
  local tag=${5:-$1} sum=${SUMMARY:-$OUT/summary.txt}
  timeout "$2" compute-sanitizer --error-exitcode 9 --tool "$1" "$3" --gtest_filter="$4" >"$OUT/$tag.log" 2>&1
  echo "$tag exit $?" | tee -a "$sum"
  grep -E "PASSED|FAILED|SUMMARY" "$OUT/$tag.log" | tail -3 | tee -a "$sum"
  # A run cut by its limit prints no summary: say how far it got (tests that finished, with no report before them).
  echo "$tag: $(tests_ok "$OUT/$tag.log") tests OK, $(grep -cE '^\[  FAILED  \] .* ms\)$' "$OUT/$tag.log") failed" \
    | tee -a "$sum"
  grep -oE "(Race reported between|Invalid|Error).* at [A-Za-z_][A-Za-z0-9_]*" "$OUT/$tag.log" | sed -E 's/.* at //' \
    | sort | uniq -c | sed 's/^/  in kernel: /' | head -10 | tee -a "$sum"
}
# build_targets SECONDS TARGET...: configure $B (Release, sm_90a; extra cmake flags in CMAKE_FLAGS) and build the
# targets within SECONDS; on failure the first errors go to the summary and the script exits.
build_targets() {
  local t=$1; shift
  log "build"
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a ${CMAKE_FLAGS:-} >"$OUT/build.log" 2>&1
  timeout "$t" cmake --build $B --target "$@" >>"$OUT/build.log" 2>&1 ||
    { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
}
# gtest_run SECONDS BINARY [ARGS...]: a gtest binary of $B, its log in $OUT/BINARY.log, verdict and failures in the summary.
gtest_run() {
  local t=$1 bin=$2; shift 2
  log "$bin $*"
  timeout "$t" $B/$bin "$@" >"$OUT/$bin.log" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|Trace|exception" "$OUT/$bin.log" | head -30 | cut -c1-240 \
    | tee -a "$OUT/summary.txt"
}
