#!/usr/bin/env bash
# ncu on the own TMA kernel's wgrad (tn), bulk tensor stores (staged) vs register stores (direct), on one preset's
# first tn launch (bench_grouped_gemm): speed of light, warp stall reasons, memory, scheduler; with SASS=1 also the
# source page (per-instruction warp-stall samples), the 25 most-sampled instructions of each into the summary.
# usage: MOEKIT_COMMIT=<sha> [PRESET=dsv3-ep8] [SASS=1] scripts/device_ncu_tn.sh; reports in $OUT.
. "$(dirname "$0")/device_lib.sh"
PRESET=${PRESET:-dsv3-ep8}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
CMAKE_FLAGS=-DMOEKIT_TESTS=OFF build_targets 330 bench_grouped_gemm
ncu_tn() {  # ncu_tn EPILOGUE NCU-ARGS...: one profile of the first tn launch, output on stdout
  local epilogue=$1; shift
  MOEKIT_GEMM_EPILOGUE=$epilogue MOEKIT_GEMM_KERNEL=tma timeout 200 $NCU --kernel-name-base mangled \
    --kernel-name "regex:tma_kernelILNS1_2OpE2ELi1E" --launch-count 1 "$@" \
    $B/bench_grouped_gemm --preset $PRESET --iters 1
}
for e in staged direct; do
  left 90 "ncu $e" || break
  log "ncu $e"
  ncu_tn $e --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section LaunchStats >"$OUT/ncu_$e.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "Duration|Throughput|Pipe|Stall|Issued|Eligible|Active Warps|Hit Rate|No Eligible|Registers|Shared Memory Config" \
    "$OUT/ncu_$e.txt" | head -60 | tee -a "$OUT/summary.txt"
  [ "${SASS:-0}" = 1 ] && left 60 "ncu source page $e" && {
    log "ncu source page $e"
    ncu_tn $e --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      >"$OUT/sass_$e.csv" 2>"$OUT/ncu_sass_$e.err"
    python3 - "$OUT/sass_$e.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if r]
hdr = next((i for i, r in enumerate(rows) if "Source" in r), None)
if hdr is None:
    print("no source table; first lines:", rows[:3]); sys.exit()
h = rows[hdr]
src, samp = h.index("Source"), next(i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All"))
data = []
for r in rows[hdr + 1:]:
    try: data.append((float(r[samp]), r[src]))
    except (ValueError, IndexError): pass
tot = sum(d[0] for d in data) or 1
for n, text in sorted(data, key=lambda x: -x[0])[:25]:
    print(f"{100 * n / tot:5.1f}%  {text[:90]}")
PY
  }
done
log done
