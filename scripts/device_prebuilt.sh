#!/usr/bin/env bash
# One bounded device call on binaries built on the workstation (nvcc 13.0 = the device image's; sm_90a), carried in
# the git-ignored prebuilt/ (`make -C build <targets>`, then `BUILD=build scripts/pack_prebuilt.sh <targets>`:
# prebuilt/bin.txz, unpacked here first; saves the device build's ~5 minutes).
# Runs STEPS, a ';'-separated list of "label|ENV=V ...|command" (command relative to prebuilt/, e.g.
# "test_grouped_gemm --gtest_filter=*Wgrad*"), each bounded by the time left; a "sanitize:TOOL" label runs
# compute-sanitizer TOOL on the command instead. usage: MOEKIT_COMMIT=<sha> STEPS=... scripts/device_prebuilt.sh;
# results in $OUT (summary.txt first, one log a step). STEP_S=N bounds each step to N seconds.
. "$(dirname "$0")/device_lib.sh"
B=prebuilt
[ -f $B/bin.tgz ] && tar -xzf $B/bin.tgz -C $B
[ -f $B/bin.txz ] && tar -xJf $B/bin.txz -C $B  # scripts/pack_prebuilt.sh
# Binaries of an NCCL build need the image's NCCL (nvidia-nccl-cu13); prebuilt/lib holds a carried libmpi_cxx.
nccl_lib=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${nccl_lib:+$nccl_lib:}${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/$B/lib
export MOEKIT_BINARY=${MOEKIT_BINARY:-$PWD/$B/moekit}  # the tool tests run the carried moekit
# The lines of a step's log that go to the summary: gtest verdicts and failures, the benchmarks' table rows.
SUMMARY_LINES='^\[  (PASSED|FAILED) |Failure|Expected|Which is|^EP=|^  (configuration|ECHO|forced|busiest|acceptance)'
SUMMARY_LINES+='|^  (fc|gemm)|wgrad|^moekit|interleaved|balanced order|roofline|ERROR SUMMARY'
SUMMARY_LINES+='|^  tiles|^  strips|cudaMemset|^fp32'
IFS=';' read -ra steps <<<"${STEPS:?STEPS is empty}"
i=0
for st in "${steps[@]}"; do
  IFS='|' read -r label envs cmd <<<"$st"
  i=$((i + 1))
  left 30 "$label" || break
  log "$label: $envs $cmd"
  budget=$((LIMIT - SECONDS - 10))
  [ "${STEP_S:-0}" -gt 0 ] && [ "$STEP_S" -lt $budget ] && budget=$STEP_S  # a hung step costs STEP_S at most
  if [[ $label == sanitize:* ]]; then
    env $envs timeout $budget compute-sanitizer --error-exitcode 9 --tool "${label#sanitize:}" $B/$cmd >"$OUT/step$i.log" 2>&1
  else
    env $envs timeout $budget $B/$cmd >"$OUT/step$i.log" 2>&1
  fi
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "$SUMMARY_LINES" "$OUT/step$i.log" | head -40 | cut -c1-230 | tee -a "$OUT/summary.txt"
done
tar -czf "$OUT/steps.tar.gz" -C "$OUT" $(cd "$OUT" && ls step*.log) && rm -f "$OUT"/step*.log
log "done"
