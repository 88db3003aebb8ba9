#!/bin/sh
# `mpirun -np 2 moekit train --device cuda --expert-model-parallel-size 2` (one GPU per process, NCCL) against the
# same run on 2 virtual ranks of one GPU (local-gpu): the reports say nccl / local-gpu, and the loss curves agree
# (both transports sum in rank order; 1e-6 relative). Skips (exit 77) with fewer than 2 GPUs.
# Usage: train_cuda_mpi_np2.sh MPIEXEC MOEKIT OUT_DIR. Registered by CMakeLists.txt (label gpu).
set -u
mpiexec=$1 moekit=$2 out=$3
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${gpus:-0}" -lt 2 ]; then
    echo "train_cuda_mpi_np2: ${gpus:-0} GPU(s) visible, 2 needed: skipped"
    exit 77
fi
rm -rf "$out" && mkdir -p "$out" || exit 1
flags="train --device cuda --model-size demo --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall \
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --steps 20 --log-every 5 --eval-every 10 --seed 7"
# shellcheck disable=SC2086
"$mpiexec" --allow-run-as-root -np 2 "$moekit" $flags --out-dir "$out/nccl" || { echo "mpirun run failed"; exit 1; }
# shellcheck disable=SC2086
"$moekit" $flags --virtual-ranks 2 --out-dir "$out/local" || { echo "virtual-rank run failed"; exit 1; }
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
n, l = (json.load(open(f"{out}/{d}/report.json")) for d in ("nccl", "local"))
assert n["layout"]["transport"] == "nccl", n["layout"]
assert l["layout"]["transport"] == "local-gpu", l["layout"]
a = [s["loss"] for s in n["steps"]]
b = [s["loss"] for s in l["steps"]]
assert len(a) == len(b) == 20, (len(a), len(b))
worst = max(abs(x - y) / y for x, y in zip(a, b))
print(f"mpirun (nccl) vs virtual ranks (local-gpu), 20 steps: largest relative loss difference {worst:.2e}; "
      f"loss {a[0]:.4f} -> {a[-1]:.4f}")
assert worst <= 1e-6, worst
assert a[-1] < a[0]
PY
