#!/usr/bin/env bash
# Expert parallelism on N real GPUs (issues 12 and 13: nvidia-h200-x2 with N=2, nvidia-h200-x4 with N=4), one
# process per GPU under mpirun, the NCCL transport (symmetric windows for the budgeted dispatcher). One call:
#   build; the GPU EP tests under mpirun -np N (EP=N vs the CPU oracle for allgather, alltoall and the budgeted
#   sync-free dispatcher; budgeted = alltoall bit for bit; overflow re-run; the EP step in one CUDA graph; NCCL
#   collectives); moekit layer --device cuda under mpirun vs --device cpu; the EP benchmark (weak scaling: T tokens
#   per GPU, against EP=1 on each GPU; dsv3-e256 for the dispatch payload, dsv3-ep8 and qwen3-30b; alltoall vs
#   budgeted; the transport's all-to-all of the same bytes; ECHO under zipf 1.2 with and without); moekit train
#   over NCCL vs virtual ranks and vs EP=1 (300 steps); bench_dispatch (dispatch + combine alone vs NCCL's
#   all-to-all of the same bytes). ECHO's GPU tests (test_cuda_echo) run their EP = N cases under mpirun -np N.
# Binaries: built here (cmake, `.third_party` carried) or, faster, built on the workstation against the image's
# NCCL headers and carried as prebuilt/bin.txz (moekit, bench_dispatch, the GPU test binaries, lib/libmpi_cxx.so.40).
# PARTS picks sections (default all): tests layer dispatch scaling echo train virtual suite sanitize.
# usage: N=2 MOEKIT_COMMIT=<sha> [PARTS="tests dispatch"] [LIMIT=570] scripts/device_ep_multi.sh; results in
# $OUT/summary.txt (docs/perf.md, "Expert parallelism on real GPUs").
set -o pipefail
N=${N:-2}
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT/bench"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
B=${B:-build-dev}
# Binaries built on the workstation against the device image's NCCL headers (2.28.9) and carried in prebuilt/
# (bin.txz) skip the build; the NCCL library then comes from the image's nvidia-nccl-cu13 package.
[ -f prebuilt/bin.txz ] && [ ! -x prebuilt/moekit ] && tar -xJf prebuilt/bin.txz -C prebuilt
[ -x prebuilt/moekit ] && B=prebuilt
nccl_lib=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'nccl', 'lib'))" 2>/dev/null)
[ -d "$nccl_lib" ] || nccl_lib=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1)
# prebuilt/lib (last on the path): the workstation's libmpi_cxx, only where the image lacks its own.
export LD_LIBRARY_PATH=${nccl_lib:+$nccl_lib:}${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/prebuilt/lib
LIMIT=${LIMIT:-570}
MPI="mpirun --allow-run-as-root -np $N -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x MOEKIT_DEVICE_WAIT_S -x GTEST_COLOR"
export GTEST_COLOR=no
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
echo "commit ${MOEKIT_COMMIT:-unknown}, N=$N" | tee -a "$OUT/summary.txt"
nvidia-smi -L | tee -a "$OUT/summary.txt"
if [ $B = prebuilt ]; then
  log "prebuilt binaries; NCCL from ${nccl_lib:-nowhere}"
  ldd $B/moekit | grep -E "nccl|mpi|not found" | tee -a "$OUT/summary.txt"
else
  log "build"
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
  grep -E "NCCL|MPI" "$OUT/build.log" | tee -a "$OUT/summary.txt"
  timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
fi
export MOEKIT_DEVICE_WAIT_S=20
# bounded CAP cmd...: the command under timeout, capped by what is left of LIMIT.
bounded() {
  local cap=$1 b=$((LIMIT - SECONDS - 15)); shift
  [ $b -gt "$cap" ] && b=$cap
  [ $b -gt 5 ] || { echo "skipped (time): $*" | tee -a "$OUT/summary.txt"; return 124; }
  timeout $b "$@"
}
# PARTS (default all): tests layer dispatch scaling echo train virtual suite sanitize, the sections below.
part() { [ "${PARTS:-all}" = all ] || [[ " $PARTS " == *" $1 "* ]]; }
if part tests; then
log "GPU EP tests under mpirun -np $N (NCCL)"
bounded 240 $MPI $B/test_cuda_ep --gtest_filter="*_ep${N}_*:CudaEpBudgeted.*:CudaEcho.*:NcclDeviceComm.*" >"$OUT/test_mpi.log" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
grep -cE "^\[       OK \]" "$OUT/test_mpi.log" | sed 's/^/tests OK lines (all ranks): /' | tee -a "$OUT/summary.txt"
grep -E "^\[  (PASSED|FAILED) |Failure|first at|SKIPPED \]" "$OUT/test_mpi.log" | head -24 | cut -c1-240 | tee -a "$OUT/summary.txt"
log "GPU ECHO tests under mpirun -np $N (NCCL)"
bounded 150 $MPI $B/test_cuda_echo >"$OUT/test_echo_mpi.log" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
grep -E "^\[  (PASSED|FAILED) |Failure|rank load" "$OUT/test_echo_mpi.log" | head -12 | cut -c1-240 | tee -a "$OUT/summary.txt"
fi
if part layer; then
log "moekit layer --device cuda under mpirun -np $N vs --device cpu"
for disp in allgather alltoall; do
  for d in cpu cuda; do
    launch="$MPI"; [ $d = cpu ] && launch=""
    bounded 60 $launch $B/moekit layer --device $d $( [ $d = cpu ] && echo --virtual-ranks $N ) --expert-model-parallel-size $N \
      --moe-token-dispatcher-type $disp --init random --hidden-size 256 --num-experts 16 --moe-ffn-hidden-size 128 \
      --moe-router-topk 4 --seq-length 64 --micro-batch-size $((4 * N)) --swiglu --out /tmp/mgpu_${d}_${disp}.safetensors \
      >"$OUT/layer_${d}_${disp}.log" 2>&1
    echo "layer $d $disp exit $?" | tee -a "$OUT/summary.txt"
  done
done
# The same flags on N virtual ranks of one GPU (local-gpu transport): NCCL must give the same bits.
bounded 60 $B/moekit layer --device cuda --virtual-ranks $N --expert-model-parallel-size $N --moe-token-dispatcher-type \
  alltoall --init random --hidden-size 256 --num-experts 16 --moe-ffn-hidden-size 128 --moe-router-topk 4 --seq-length 64 \
  --micro-batch-size $((4 * N)) --swiglu --out /tmp/mgpu_virtual_alltoall.safetensors >"$OUT/layer_virtual.log" 2>&1
echo "layer cuda virtual ranks exit $?" | tee -a "$OUT/summary.txt"
for disp in allgather alltoall; do
  python3 scripts/compare_safetensors.py /tmp/mgpu_cpu_$disp.safetensors /tmp/mgpu_cuda_$disp.safetensors \
    "moekit layer EP=$N $disp, cuda (NCCL) vs cpu" | tee -a "$OUT/summary.txt"
done
python3 scripts/compare_safetensors.py /tmp/mgpu_virtual_alltoall.safetensors /tmp/mgpu_cuda_alltoall.safetensors \
  "moekit layer EP=$N alltoall, cuda NCCL vs cuda virtual ranks" | tee -a "$OUT/summary.txt"
fi
if part dispatch; then
  log "dispatch + combine of the dsv3 shape (4096 tokens a rank, H 7168, top-8 of 256) vs the transport's all-to-all"
  bounded 150 $MPI $B/bench_dispatch --blocks ${DISPATCH_BLOCKS:-16,20,24,32,48} --json "$OUT/bench/dispatch.json" \
    >"$OUT/bench/dispatch.txt" 2>&1
  echo "bench_dispatch exit $?" | tee -a "$OUT/summary.txt"
  grep -vE "^\s*$" "$OUT/bench/dispatch.txt" | cut -c1-200 | head -60 | tee -a "$OUT/summary.txt"
fi
# One EP benchmark: bench NAME PRESET FLAGS...; its table rows go to the summary, its JSON to bench/NAME.json.
bench() {
  local name=$1 preset=$2; shift 2
  bounded 120 $MPI $B/moekit bench --preset $preset --expert-model-parallel-size $N --iters 10 "$@" \
    --json "$OUT/bench/$name.json" >"$OUT/bench/$name.txt" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^  [0-9]|whole|budgeted|ECHO|overflow|error" "$OUT/bench/$name.txt" | cut -c1-240 | sed "s/^/$name: /" \
    | tee -a "$OUT/summary.txt"
}
if part scaling; then
  log "moekit bench under mpirun -np $N: the dispatch payload (dsv3-e256) and weak scaling (alltoall vs budgeted f=1.25)"
  for preset in dsv3-e256 dsv3-ep8 qwen3-30b; do
    bench ${preset}_alltoall $preset --moe-token-dispatcher-type alltoall
    bench ${preset}_budgeted $preset --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 1.25
  done
fi
if part echo; then
  log "ECHO under zipf 1.2 (dsv3-ep8, budgeted f=1.25) with and without (balanced: the scaling part's dsv3-ep8_budgeted)"
  bench echo_off dsv3-ep8 --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 1.25 --skew zipf:1.2
  for slots in ${ECHO_SLOTS:-2 8}; do
    bench echo_on_$slots dsv3-ep8 --moe-token-dispatcher-type alltoall --moe-expert-rank-capacity-factor 1.25 \
      --skew zipf:1.2 --moe-enable-echo --moe-num-echo-experts $((slots * N))
  done
fi
if part train && [ "$N" = 2 ]; then
  log "moekit train --device cuda over NCCL vs virtual ranks (20 steps)"
  bounded 200 sh tests/gpu/train_cuda_mpi_np2.sh mpirun $B/moekit /tmp/train_np2 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
fi
if part train; then
log "moekit train: EP=$N over NCCL vs EP=1 on one GPU, the same global batch, 300 steps"
flags="train --device cuda --model-size demo --moe-token-dispatcher-type alltoall --steps 300 --log-every 50 \
  --eval-every 100 --seed 11 --global-batch-size $((4 * N)) --overwrite"
bounded 150 $MPI $B/moekit $flags --expert-model-parallel-size $N --out-dir /tmp/train_ep$N >"$OUT/train_ep$N.log" 2>&1
echo "train EP=$N exit $?" | tee -a "$OUT/summary.txt"
bounded 150 $B/moekit $flags --out-dir /tmp/train_ep1 >"$OUT/train_ep1.log" 2>&1
echo "train EP=1 exit $?" | tee -a "$OUT/summary.txt"
cp /tmp/train_ep$N/report.json "$OUT/bench/train_ep$N.json" 2>/dev/null
cp /tmp/train_ep1/report.json "$OUT/bench/train_ep1.json" 2>/dev/null
python3 - "$OUT/bench" $N <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
d, n = sys.argv[1], sys.argv[2]
a = [s["loss"] for s in json.load(open(f"{d}/train_ep{n}.json"))["steps"]]
b = [s["loss"] for s in json.load(open(f"{d}/train_ep1.json"))["steps"]]
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"train EP={n} (nccl) vs EP=1: {len(a)} / {len(b)} steps, loss {a[0]:.5f} -> {a[-1]:.5f} vs {b[0]:.5f} -> "
      f"{b[-1]:.5f}, largest relative difference {worst:.2e}")
PY
fi
if part virtual; then
  log "the EP and ECHO GPU tests in one process on GPU 0: virtual ranks, EP = 2, 4, 8, every dispatcher"
  for t in test_cuda_ep test_cuda_echo; do
    CUDA_VISIBLE_DEVICES=0 bounded 240 $B/$t >"$OUT/virtual_$t.log" 2>&1
    echo "$t exit $?" | tee -a "$OUT/summary.txt"
    grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/virtual_$t.log" | head -10 | cut -c1-200 | tee -a "$OUT/summary.txt"
  done
fi
if part suite; then
  # The GPU test binaries there are (4 at a time, GPU 0); tests that run the tool get this moekit.
  log "the GPU test binaries on GPU 0"
  export MOEKIT_BINARY=$PWD/$B/moekit
  tests=$(cd $B && for f in test_cuda_* test_grouped_gemm test_device_buffer test_echo_plan; do
    [ -f "$f" ] && [ -x "$f" ] && echo "$f"; done)
  rm -f "$OUT/suite_rc.txt"
  echo "$tests" | CUDA_VISIBLE_DEVICES=0 bounded 300 \
    xargs -P 4 -I{} sh -c "$B/{} > '$OUT/suite_{}.log' 2>&1; echo \"{} exit \$?\" >> '$OUT/suite_rc.txt'"
  sort "$OUT/suite_rc.txt" | while read -r t _ rc; do
    echo "$t exit $rc $(grep -E '^\[  (PASSED|FAILED)  \] [0-9]' "$OUT/suite_$t.log" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] || grep -E "Failure|Expected|Which is" "$OUT/suite_$t.log" | head -10 | tee -a "$OUT/summary.txt"
  done
fi
if part sanitize; then
  # One process, virtual ranks on GPU 0, host barriers (the sanitizer runs one kernel at a time, so spinning
  # device barriers could never meet): the push / return copies, clipped pushes on overflow, ECHO's clone copies.
  for run in "memcheck test_cuda_ep *softmax_post_swiglu_ep2_budgeted*:CudaEpBudgeted.Overflow*" \
             "racecheck test_cuda_ep *softmax_post_swiglu_ep2_budgeted*" \
             "memcheck test_cuda_echo CudaEcho.CapacityFactor*:CudaEcho.ForcedRandom*"; do
    set -- $run
    log "compute-sanitizer $1 on $2 ($3)"
    MOEKIT_BUDGETED_HOST_BARRIERS=1 MOEKIT_EXPERT_GEMM=sync_baseline CUDA_VISIBLE_DEVICES=0 bounded 200 \
      compute-sanitizer --error-exitcode 9 --tool $1 $B/$2 --gtest_filter="$3" >"$OUT/sanitizer_$1_$2.log" 2>&1
    echo "exit $?" | tee -a "$OUT/summary.txt"
    grep -E "PASSED|FAILED|SUMMARY" "$OUT/sanitizer_$1_$2.log" | tail -3 | tee -a "$OUT/summary.txt"
  done
fi
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
log "done"
