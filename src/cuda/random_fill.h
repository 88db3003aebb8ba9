// fill_uniform: device arrays filled with counter-based random numbers (core/rng.h uniform01 of (seed, index)),
// never all zeros (zeros time faster than real data). Launched on the legacy default stream. Inputs of the
// training engine's dense-GEMM floor (train_engine.cu) and of the benchmarks (bench/lib); exercised by
// tests/gpu/test_cuda_train.cu's speed report and `moekit bench`.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace moekit::cuda {

// bf16 uniform in [-scale, scale) (random stream 0).
void fill_uniform(__nv_bfloat16* p, size_t n, float scale, uint64_t seed);
// fp32 uniform in [lo, hi) (random stream 1).
void fill_uniform(float* p, size_t n, float lo, float hi, uint64_t seed);

}  // namespace moekit::cuda
