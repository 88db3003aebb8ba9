// Sinkhorn routing matrix on the device (Megatron sinkhorn(), §2.6), fp32 like Megatron and the CPU
// twin cpu::sinkhorn (src/cpu/sinkhorn.cpp): the whole convergence loop runs inside ONE thread
// block, so the step makes no host sync and stays graph-capturable. Padding rows are left out (the
// matrix is over the valid rows, as the CPU router). Internal to src/cuda/router.cu; tested through
// tests/gpu/test_cuda_stages.cu (matrix vs cpu::sinkhorn) and test_cuda_layer.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::cuda {

// out [T, E] fp32 = diag(d0) exp(logits) diag(d1) on the rows with padding_mask 0 (other rows 0);
// d0: [T] fp32 scratch. logits [T, E] in R (float or double; converted to float first).
template <typename R>
void sinkhorn_forward(int64_t num_tokens, int64_t num_experts, const R* logits, const uint8_t* padding_mask,
                      float* out, float* d0, cudaStream_t stream);

}  // namespace moekit::cuda
