#!/usr/bin/env bash
# Probe: does the budgeted overflow deadlock depend on hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS)?
OUT=${OUT:-/tmp/moekit-out}; mkdir -p $OUT
export PATH=/usr/local/cuda/bin:$PATH
B=build-dev
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a >"$OUT/build.log" 2>&1
timeout 150 cmake --build $B --target test_cuda_ep >>"$OUT/build.log" 2>&1 || { tail -5 $OUT/build.log; exit 1; }
export MOEKIT_DEVICE_WAIT_S=3
run() { echo "== $*"; env "$@" timeout 60 $B/test_cuda_ep --gtest_filter='CudaEpBudgeted.*' --gtest_repeat=2 2>&1 | grep -E "^\[  (PASSED|FAILED) |waited more" | sort | uniq -c | cut -c1-200; }
run CUDA_DEVICE_MAX_CONNECTIONS=1
run CUDA_DEVICE_MAX_CONNECTIONS=8
run CUDA_DEVICE_MAX_CONNECTIONS=32
run CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
run CUDA_DEVICE_MAX_CONNECTIONS=8 CUDA_MODULE_LOADING=EAGER
