#!/usr/bin/env bash
# Side by side on one GPU in one call (issue 10, point 4): builds `moekit`, times `moekit bench` (whole layer and
# --scope mlp) on the four presets and on dsv3-ep8 / mixtral under --skew zipf:1.2, then torch._grouped_mm's expert
# MLP on moekit's counts and SonicMoE's layer (bench/anchors/anchors.py), and prints one table with TFLOP/s and
# moekit / peer ratios. Every step is bounded (LIMIT, default 540 s); a failing peer becomes a line of the table.
# usage (device, repo root; from scripts/prepare_third_party.sh and prepare_anchors.sh carry
#   [".third_party/nlohmann", ".third_party/wheels", ".anchors"]: 62.5 MiB with the tree; GoogleTest would pass the
#   64 MiB carry limit, so the build here has no tests; or carry [".anchors", "prebuilt"] with `moekit` built on the
#   workstation and packed there as prebuilt/bin.tgz: no build here):
#   bash scripts/device_anchors.sh    env: ITERS=10 CONFIGS="mixtral dsv3-ep8@zipf1.2 ..." PEERS="torch sonic"
#                                     SCOPES="layer mlp" PEER_RESERVE=200 (seconds kept for the peers)
#                                     SONIC_PASSES="layer experts" SONIC_TUNE=narrow|default|full (peer_sonic.py)
#                                     SKIP_MOEKIT=1 (peers only: no moekit rows, no report)
#                                     GEMM_TUNE=on|off (default on, as in the engine: moekit's and the per-GEMM
#                                     rows with the grouped GEMMs' configuration measured per shape, --gemm-tune)
#                                     GEMM_PRESETS="dsv3-ep8 mixtral" (the default; per GEMM, issue 10's acceptance
#                                     ratio, in the same call: bench_grouped_gemm --acceptance-only --rounds
#                                     GEMM_ROUNDS, default 12, after moekit's rows; carried prebuilt/ then needs
#                                     bench_grouped_gemm too; GEMM_PRESETS= leaves them out)
# The report ends with issue 10's acceptance checked point by point on this call's numbers (anchor_math.acceptance).
# SonicMoE's compiled kernels: its persistent object cache (QUACK_CACHE_DIR) starts from SONIC_CACHE (default
# .anchors/quack_cache.tar.xz, carried: copy an earlier call's $OUT/quack_cache.tar.xz there) where that exists, and
# SAVE_SONIC_CACHE=1 packs it into $OUT afterwards (objects only: autotuning results and locks stay behind). A call
# without it spends most of its peer time compiling (mixtral alone took 256 s on 2026-11-28 and the last three configs
# were not reached); its autotuning still runs in the call that times it (its choices are not cached).
# Results in $OUT: summary.txt, anchors.txt (the table), anchors.json, moekit/*.json|txt, torch.json, sonic.json, logs.
LIMIT=${LIMIT:-540}
. "$(dirname "$0")/device_lib.sh"
ITERS=${ITERS:-10}
GEMM_PRESETS=${GEMM_PRESETS-dsv3-ep8 mixtral}
CONFIGS=${CONFIGS:-mixtral dsv3-ep8 dsv3-e256 qwen3-30b dsv3-ep8@zipf1.2 mixtral@zipf1.2}
PEERS=${PEERS:-torch sonic}
SCOPES=${SCOPES:-layer mlp}
PEER_RESERVE=${PEER_RESERVE:-200}
GEMM_TUNE=${GEMM_TUNE:-on}
export PYTHONUNBUFFERED=1
SONIC_PASSES=${SONIC_PASSES:-layer experts}
# SonicMoE compiles its GEMM configurations in worker processes: one per core; its autotuning progress goes to the log.
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)} QUACK_PRINT_AUTOTUNING=${QUACK_PRINT_AUTOTUNING:-1}
export QUACK_CACHE_DIR=/tmp/quack_cache CUTE_DSL_CACHE_DIR=/tmp/quack_cache/cute_dsl  # quack objects, CuTe DSL JIT files
SONIC_CACHE=${SONIC_CACHE:-.anchors/quack_cache.tar.xz}
mkdir -p $CUTE_DSL_CACHE_DIR
[ -s "$SONIC_CACHE" ] && tar -xJf "$SONIC_CACHE" -C $QUACK_CACHE_DIR &&
  log "SonicMoE's kernel cache from $SONIC_CACHE: $(find $QUACK_CACHE_DIR -type f | wc -l) files"
M="$OUT/moekit"; mkdir -p "$M"
A="python3 bench/anchors/anchors.py"
# A build dir with the tests needs the carried GoogleTest; without it, a build dir of its own without tests.
B=build-dev; TESTS=""
[ -d .third_party/googletest ] || { B=build-anchors; TESTS="-DMOEKIT_TESTS=OFF"; }

# SonicMoE's wheels are cp312: check the image's python first, install in the background during the build.
PYV=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1)
log "python3 $PYV ($(command -v python3)); torch $(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)"
SONIC_SKIP=""; S=/tmp/anchors_site
if [ "$PYV" != 3.12 ]; then SONIC_SKIP="python3 is $PYV, the carried wheels are for 3.12"
elif [ ! -s .anchors/cutlass_dsl_libs.tar.xz ]; then SONIC_SKIP=".anchors not carried (scripts/prepare_anchors.sh)"
else
  ( rm -rf $S && mkdir -p $S && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S \
      .anchors/wheels/*.whl && tar -xJf .anchors/cutlass_dsl_libs.tar.xz -C $S && echo ok ) >"$OUT/sonic_install.log" 2>&1 &
  INSTALL_PID=$!
fi

# A `moekit` built here and carried in prebuilt/ (scripts/device_prebuilt.sh: stripped, or packed as bin.tgz) spares
# the build's minutes for the peers' autotuning, and .third_party need not travel: carry [".anchors", "prebuilt"].
[ -f prebuilt/bin.tgz ] && tar -xzf prebuilt/bin.tgz -C prebuilt
[ -f prebuilt/bin.txz ] && [ ! -x prebuilt/moekit ] && tar -xJf prebuilt/bin.txz -C prebuilt  # scripts/pack_prebuilt.sh moekit
if [ -x prebuilt/moekit ]; then
  B=prebuilt; BUILD_RC=0
  log "moekit from prebuilt/ (no build)"
else
  log "build moekit ($B)"
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a $TESTS >"$OUT/build.log" 2>&1 &&
    timeout $((LIMIT - SECONDS - PEER_RESERVE - 60)) cmake --build $B --target moekit \
      ${GEMM_PRESETS:+bench_grouped_gemm} >>"$OUT/build.log" 2>&1
  BUILD_RC=$?
fi
[ $BUILD_RC = 0 ] || { log "build failed or timed out (rc $BUILD_RC): no moekit rows"; grep -E "error" "$OUT/build.log" | head -10 | tee -a "$OUT/summary.txt"; }

[ "${SKIP_MOEKIT:-0}" = 1 ] && BUILD_RC=skipped
if [ $BUILD_RC = 0 ]; then
  for c in $CONFIGS; do
    preset=${c%%@*}; skew=""
    [ "$c" != "$preset" ] && skew="--skew zipf:${c##*@zipf}"
    for scope in $SCOPES; do
      f="$M/${c/@/_}_$scope"
      left $((PEER_RESERVE + 30)) "moekit bench $c $scope" || continue
      timeout $((LIMIT - SECONDS - PEER_RESERVE)) $B/moekit bench --preset $preset $skew --scope $scope \
        --iters $ITERS --gemm-tune $GEMM_TUNE --json "$f.json" >"$f.txt" 2>&1
      rc=$?
      echo "moekit bench $c --scope $scope: rc $rc, t=${SECONDS}s; $(grep -E 'fwd\+bwd' "$f.txt" | head -1 | cut -c1-150)" \
        | tee -a "$OUT/summary.txt"
      [ $rc = 0 ] || rm -f "$f.json"
    done
  done
fi

# Per GEMM on GEMM_PRESETS: the per-shape choice against dense cuBLAS of the same total shape, rounds interleaved.
if [ $BUILD_RC = 0 ]; then
  for p in ${GEMM_PRESETS:-}; do
    [ -x $B/bench_grouped_gemm ] || { log "no $B/bench_grouped_gemm: per-GEMM rows skipped"; break; }
    left $((PEER_RESERVE + 45)) "bench_grouped_gemm $p" || break
    timeout $((LIMIT - SECONDS - PEER_RESERVE)) $B/bench_grouped_gemm --preset $p --acceptance-only --gemm-tune $GEMM_TUNE \
      --rounds ${GEMM_ROUNDS:-12} --json "$M/gemm_$p.json" >"$M/gemm_$p.txt" 2>&1
    echo "bench_grouped_gemm $p --acceptance-only: rc $?, t=${SECONDS}s" | tee -a "$OUT/summary.txt"
    grep -E "^  (gemm|fc)" "$M/gemm_$p.txt" | tee -a "$OUT/summary.txt"
  done
fi

REPORT_PEERS=""
for peer in $PEERS; do
  left 20 "$peer" || { REPORT_PEERS="$REPORT_PEERS --peer $peer=$OUT/$peer.json:skipped"; continue; }
  # torch gets what it needs (about a minute); sonic the rest, less 15 s for the report.
  budget=$((LIMIT - SECONDS - 15)); [ $peer = torch ] && echo "$PEERS" | grep -q sonic && budget=$((budget / 3))
  log "$peer ($budget s)"
  extra=""; env=""; sonic_args=""
  if [ $peer = sonic ]; then
    [ -n "${INSTALL_PID:-}" ] && { wait $INSTALL_PID; tail -1 "$OUT/sonic_install.log" | grep -q ok ||
      SONIC_SKIP="install: $(grep -v '^$' "$OUT/sonic_install.log" | tail -1 | cut -c1-150)"; }
    [ -n "$SONIC_SKIP" ] && extra="--skip-reason"
    sonic_args="--sonic-passes $SONIC_PASSES"
    env="PYTHONPATH=$S:$S/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # Start no config later than this: a SonicMoE config may spend 30+ s compiling, a torch one a few seconds.
  margin=15; [ $peer = sonic ] && margin=45
  env $env timeout $budget $A $peer --moekit-dir "$M" --configs $CONFIGS --iters $ITERS \
    --deadline-s $((budget - margin > 10 ? budget - margin : 10)) --out "$OUT/$peer.json" ${sonic_args:-} ${extra:+$extra "$SONIC_SKIP"} \
    >"$OUT/$peer.log" 2>&1
  rc=$?
  # A peer process that dies goes on from the next config in a new process (SonicMoE's autotuner hung and then
  # crashed on mixtral, 2026-11-28, exit 139, and no other config ran), twice at most while time is left; a timeout
  # (124, 137) ends it.
  tries=0
  while [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] && [ $tries -lt 2 ] && left $((margin + 30)) "$peer again"
  do
    tries=$((tries + 1)); budget=$((LIMIT - SECONDS - 15)); [ $peer = torch ] && budget=$((budget / 3))
    log "$peer again after exit $rc ($budget s)"
    env $env timeout $budget $A $peer --moekit-dir "$M" --configs $CONFIGS --iters $ITERS \
      --deadline-s $((budget - margin > 10 ? budget - margin : 10)) --out "$OUT/$peer.json" ${sonic_args:-} \
      --resume-after $rc >>"$OUT/$peer.log" 2>&1
    rc=$?
  done
  echo "$peer: rc $rc, t=${SECONDS}s" | tee -a "$OUT/summary.txt"
  grep -E "^anchors " "$OUT/$peer.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
  REPORT_PEERS="$REPORT_PEERS --peer $peer=$OUT/$peer.json:$rc"
done

if [ "${SAVE_SONIC_CACHE:-0}" = 1 ]; then
  tar -cJf "$OUT/quack_cache.tar.xz" --exclude='*.autotune.json' --exclude='*.lock' -C $QUACK_CACHE_DIR . &&
    log "SonicMoE's kernel cache: $(find $QUACK_CACHE_DIR -type f | wc -l) files, $(stat -c %s "$OUT/quack_cache.tar.xz") bytes packed"
fi
[ "${SKIP_MOEKIT:-0}" = 1 ] && { log "done (peers only)"; exit 0; }
log "report"
$A report --moekit-dir "$M" --configs $CONFIGS --scopes $SCOPES $REPORT_PEERS --json "$OUT/anchors.json" \
  --table "$OUT/anchors.txt" 2>&1 | tee -a "$OUT/summary.txt"
# The device tool returns a limited number of files: moekit's per-config JSON and text travel as one archive.
tar -czf "$OUT/moekit.tar.gz" -C "$OUT" moekit && rm -rf "$M"
log "done"
