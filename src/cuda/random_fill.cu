// Random device fills (random_fill.h): one grid-stride kernel per dtype, element i drawn from (seed, stream, i),
// so a fill does not depend on the launch shape.
#include "core/rng.h"
#include "cuda/cuda_check.h"
#include "cuda/random_fill.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

__global__ void fill_uniform_kernel(bf16* p, size_t n, float scale, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16(float((2 * uniform01(seed, 0, i) - 1) * scale));
}
__global__ void fill_uniform_f32_kernel(float* p, size_t n, float lo, float hi, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = float(lo + (hi - lo) * uniform01(seed, 1, i));
}

}  // namespace

void fill_uniform(bf16* p, size_t n, float scale, uint64_t seed) {
    fill_uniform_kernel<<<1024, 256>>>(p, n, scale, seed);
    MOEKIT_CUDA_LAUNCH_CHECK();
}
void fill_uniform(float* p, size_t n, float lo, float hi, uint64_t seed) {
    fill_uniform_f32_kernel<<<1024, 256>>>(p, n, lo, hi, seed);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

}  // namespace moekit::cuda
