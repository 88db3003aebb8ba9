#!/usr/bin/env bash
# Per-instruction warp-stall samples (ncu source page, SASS) of the own TMA kernel's wgrad (tn), staged and
# direct epilogue, on one preset's first tn launch; the 25 most-sampled instructions of each into the summary.
# usage: MOEKIT_COMMIT=<sha> [PRESET=dsv3-ep8] scripts/device_ncu_sass.sh; results in $OUT.
. "$(dirname "$0")/device_lib.sh"
PRESET=${PRESET:-dsv3-ep8}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DMOEKIT_TESTS=OFF >"$OUT/build.log" 2>&1
timeout 330 cmake --build $B --target bench_grouped_gemm >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head; exit 1; }
for v in "staged|staged" "direct|direct"; do
  IFS='|' read -r label epilogue <<<"$v"
  left 90 "ncu $label" || break
  log "ncu source page $label"
  MOEKIT_GEMM_EPILOGUE=$epilogue MOEKIT_GEMM_KERNEL=tma timeout 200 $NCU --kernel-name-base mangled \
    --kernel-name "regex:tma_kernelILNS1_2OpE2ELi1E" --launch-count 1 --section SourceCounters \
    --section WarpStateStats --page source --print-source sass --csv \
    $B/bench_grouped_gemm --preset $PRESET --iters 1 >"$OUT/sass_$label.csv" 2>"$OUT/ncu_$label.err"
  echo "exit $?" | tee -a "$OUT/summary.txt"
  python3 - "$OUT/sass_$label.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if r]
hdr = next((i for i, r in enumerate(rows) if any("Source" == c.strip('"') for c in r)), None)
if hdr is None:
    print("no source table; first lines:", rows[:3]); sys.exit()
h = rows[hdr]
def col(name):
    return next((i for i, c in enumerate(h) if c.startswith(name)), None)
src, samp = col("Source"), col("Warp Stall Sampling (All")
print("columns:", [c for c in h][:24])
data = []
for r in rows[hdr + 1:]:
    try: data.append((float(r[samp]), r))
    except (ValueError, IndexError, TypeError): pass
tot = sum(d[0] for d in data) or 1
for s, r in sorted(data, key=lambda x: -x[0])[:25]:
    print(f"{100*s/tot:5.1f}%  {r[src][:90]}")
PY
done
log done
