#!/usr/bin/env bash
# Where one preset's layer step spends its time, kernel by kernel, on a carried prebuilt moekit: Nsight Systems
# (when the image has it) sums each kernel's time over graph-replayed steps; Nsight Compute reads each kernel of the
# first eager step once (duration, DRAM and SM throughput as % of peak, grid, registers), so the memory-bound passes
# can be held against the copy bandwidth. usage: MOEKIT_COMMIT=<sha> [PRESET=qwen3-30b] [NCU_COUNT=160]
# [PROFILE_S=200] scripts/device_profile.sh (after unpacking prebuilt/moekit); results in $OUT/profile_*.
. "$(dirname "$0")/device_lib.sh"
PRESET=${PRESET:-qwen3-30b}
BIN=${MOEKIT_BINARY:-prebuilt/moekit}
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ] && left 120 "nsys"; then
  log "nsys $PRESET"
  timeout "${PROFILE_S:-200}" "$NSYS" profile --trace cuda --cuda-graph-trace node -o "$OUT/profile_$PRESET" \
    --force-overwrite true "$BIN" bench --preset "$PRESET" --iters 5 >"$OUT/profile_nsys.log" 2>&1
  echo "nsys exit $?" | tee -a "$OUT/summary.txt"
  "$NSYS" stats --report cuda_gpu_kern_sum --format csv -o "$OUT/profile_$PRESET" "$OUT/profile_$PRESET.nsys-rep" \
    >>"$OUT/profile_nsys.log" 2>&1
  rm -f "$OUT/profile_$PRESET.nsys-rep" "$OUT/profile_$PRESET.sqlite"
else
  log "no nsys on this image"
fi
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if left 90 "ncu"; then
  log "ncu $PRESET, first ${NCU_COUNT:-160} kernels"
  timeout $((LIMIT - SECONDS - 20)) "$NCU" --csv --kernel-name-base demangled --launch-count "${NCU_COUNT:-160}" \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,dram__bytes.sum \
    "$BIN" bench --preset "$PRESET" --iters 1 >"$OUT/profile_ncu.csv" 2>"$OUT/profile_ncu.err"
  echo "ncu exit $?" | tee -a "$OUT/summary.txt"
fi
log "done"
