#!/usr/bin/env bash
# Expert parallelism on N real GPUs (issues 12 and 13: nvidia-h200-x2 with N=2, nvidia-h200-x4 with N=4), one
# process per GPU under mpirun, the NCCL transport (symmetric windows for the budgeted dispatcher). One call:
#   build; the GPU EP tests under mpirun -np N (EP=N vs the CPU oracle for allgather, alltoall and the budgeted
#   sync-free dispatcher; budgeted = alltoall bit for bit; overflow re-run; the EP step in one CUDA graph; NCCL
#   collectives); moekit layer --device cuda under mpirun vs --device cpu; the EP benchmark (weak scaling: T tokens
#   per GPU, against EP=1 on each GPU; dsv3-e256 for the dispatch payload, dsv3-ep8 and qwen3-30b; alltoall vs
#   budgeted; the transport's all-to-all of the same bytes; ECHO under zipf 1.2 with and without); moekit train
#   over NCCL vs virtual ranks. ECHO's GPU tests (test_cuda_echo) run their EP = N cases under mpirun -np N.
# usage: N=2 MOEKIT_COMMIT=<sha> scripts/device_ep_multi.sh; results in $OUT/summary.txt.
set -o pipefail
N=${N:-2}
OUT=${OUT:-/tmp/moekit-out}
mkdir -p "$OUT/bench"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
B=build-dev
MPI="mpirun --allow-run-as-root -np $N -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x MOEKIT_DEVICE_WAIT_S"
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
echo "commit ${MOEKIT_COMMIT:-unknown}, N=$N" | tee -a "$OUT/summary.txt"
nvidia-smi -L | tee -a "$OUT/summary.txt"
log "build"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
grep -E "NCCL|MPI" "$OUT/build.log" | tee -a "$OUT/summary.txt"
timeout 300 cmake --build $B >>"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20 | tee -a "$OUT/summary.txt"; exit 1; }
export MOEKIT_DEVICE_WAIT_S=20
log "GPU EP tests under mpirun -np $N (NCCL)"
timeout 300 $MPI $B/test_cuda_ep --gtest_filter="*_ep${N}_*:CudaEpBudgeted.*:NcclDeviceComm.*" >"$OUT/test_mpi.log" 2>&1
echo "exit $?" | tee -a "$OUT/summary.txt"
grep -E "^\[  (PASSED|FAILED) |Failure|first at" "$OUT/test_mpi.log" | head -20 | cut -c1-240 | tee -a "$OUT/summary.txt"
if [ "$N" -ge 2 ]; then
  log "GPU ECHO tests under mpirun -np $N (NCCL)"
  timeout 200 $MPI $B/test_cuda_echo >"$OUT/test_echo_mpi.log" 2>&1
  echo "exit $?" | tee -a "$OUT/summary.txt"
  grep -E "^\[  (PASSED|FAILED) |Failure|rank load" "$OUT/test_echo_mpi.log" | head -12 | cut -c1-240 | tee -a "$OUT/summary.txt"
  for echo in "" "--moe-enable-echo --moe-num-echo-experts $((2 * N))"; do
    timeout 120 $MPI $B/moekit bench --preset dsv3-ep8 --expert-model-parallel-size $N --moe-token-dispatcher-type alltoall \
      --moe-expert-rank-capacity-factor 1.25 --skew zipf:1.2 $echo --iters 10 >"$OUT/bench/echo_$N${echo:+_on}.txt" 2>&1
    grep -E "whole|ECHO|overflow|budgeted|error" "$OUT/bench/echo_$N${echo:+_on}.txt" | cut -c1-240 \
      | sed "s/^/dsv3-ep8 zipf 1.2 ${echo:+ECHO}: /" | tee -a "$OUT/summary.txt"
  done
fi
log "moekit layer --device cuda under mpirun -np $N vs --device cpu"
for disp in allgather alltoall; do
  for d in cpu cuda; do
    launch="$MPI"; [ $d = cpu ] && launch=""
    $launch $B/moekit layer --device $d $( [ $d = cpu ] && echo --virtual-ranks $N ) --expert-model-parallel-size $N \
      --moe-token-dispatcher-type $disp --init random --hidden-size 256 --num-experts 16 --moe-ffn-hidden-size 128 \
      --moe-router-topk 4 --seq-length 64 --micro-batch-size $((4 * N)) --swiglu --out /tmp/mgpu_${d}_${disp}.safetensors \
      >"$OUT/layer_${d}_${disp}.log" 2>&1
    echo "layer $d $disp exit $?" | tee -a "$OUT/summary.txt"
  done
done
for disp in allgather alltoall; do
  python3 scripts/compare_safetensors.py /tmp/mgpu_cpu_$disp.safetensors /tmp/mgpu_cuda_$disp.safetensors \
    "moekit layer EP=$N $disp, cuda (NCCL) vs cpu" | tee -a "$OUT/summary.txt"
done
log "moekit bench under mpirun -np $N (weak scaling; alltoall vs budgeted f=1.25)"
for preset in dsv3-e256 dsv3-ep8 qwen3-30b; do
  for disp in alltoall budgeted; do
    extra="--moe-token-dispatcher-type alltoall"
    [ $disp = budgeted ] && extra="$extra --moe-expert-rank-capacity-factor 1.25"
    f="$OUT/bench/ep_${preset}_${N}_${disp}"
    timeout 120 $MPI $B/moekit bench --preset $preset --expert-model-parallel-size $N $extra --iters 10 \
      --json "$f.json" >"$f.txt" 2>&1
    grep -E "whole|budgeted|error" "$f.txt" | cut -c1-260 | sed "s/^/$preset $disp: /" | tee -a "$OUT/summary.txt"
  done
done
if [ "$N" = 2 ]; then
  log "moekit train --device cuda over NCCL vs virtual ranks"
  timeout 300 sh tests/gpu/train_cuda_mpi_np2.sh mpirun $B/moekit /tmp/train_np2 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
fi
(cd "$OUT" && tar czf bench.tgz bench && rm -rf bench)
log "done"
