#!/usr/bin/env bash
# ncu on the own TMA kernel's wgrad (tn), bulk tensor stores (staged) vs register stores (direct) schedule, on one preset's shapes
# (bench_grouped_gemm, first launches of each instantiation): speed of light, warp stall reasons, memory.
# usage: MOEKIT_COMMIT=<sha> [PRESET=dsv3-ep8] scripts/device_ncu_tn.sh; reports in $OUT.
. "$(dirname "$0")/device_lib.sh"
PRESET=${PRESET:-dsv3-ep8}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DMOEKIT_TESTS=OFF >"$OUT/build.log" 2>&1
timeout 330 cmake --build $B --target bench_grouped_gemm >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head; exit 1; }
for v in "staged|staged" "direct|direct"; do
  IFS='|' read -r label epilogue <<<"$v"
  left 90 "ncu $label" || break
  log "ncu $label"
  MOEKIT_GEMM_EPILOGUE=$epilogue MOEKIT_GEMM_KERNEL=tma timeout 200 $NCU --kernel-name-base mangled \
    --kernel-name "regex:tma_kernelILNS1_2OpE2ELi1E" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section LaunchStats \
    $B/bench_grouped_gemm --preset $PRESET --iters 1 >"$OUT/ncu_$label.txt" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "Duration|Throughput|Pipe|Stall|Issued|Eligible|Active Warps|Hit Rate|No Eligible|Registers|Shared Memory Config" \
    "$OUT/ncu_$label.txt" | head -60 | tee -a "$OUT/summary.txt"
done
log done
