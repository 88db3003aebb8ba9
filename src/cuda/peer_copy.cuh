// 16-byte copies into (or out of) peers' memory for the budgeted dispatcher and ECHO (dispatch_budgeted.cu,
// dispatch_echo.cu). Over NVLink a copy is bound by the transfers each thread has in flight: a peer pointer
// may alias the source, so a plain `d[v] = s[v]` loop waits for every load before the next one. These issue
// kPeerCopyUnroll loads before their stores (measured on two and four H200s: docs/perf.md, issues 12 and 13).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::cuda {

inline constexpr int kPeerCopyUnroll = 8;

// One row of `vecs` 16-byte vectors, by the 32 lanes of a warp.
__device__ __forceinline__ void warp_copy_vectors(const uint4* __restrict__ s, uint4* __restrict__ d, int64_t vecs,
                                                  int lane) {
    for (int64_t base = lane; base < vecs; base += 32 * kPeerCopyUnroll) {
        uint4 x[kPeerCopyUnroll];
#pragma unroll
        for (int u = 0; u < kPeerCopyUnroll; ++u)
            if (base + 32 * u < vecs) x[u] = s[base + 32 * u];
#pragma unroll
        for (int u = 0; u < kPeerCopyUnroll; ++u)
            if (base + 32 * u < vecs) d[base + 32 * u] = x[u];
    }
}

// `n` 16-byte vectors by the whole grid (grid-stride).
__device__ __forceinline__ void grid_copy_vectors(const uint4* __restrict__ s, uint4* __restrict__ d, int64_t n) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t base = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; base < n; base += stride * kPeerCopyUnroll) {
        uint4 x[kPeerCopyUnroll];
#pragma unroll
        for (int u = 0; u < kPeerCopyUnroll; ++u)
            if (base + stride * u < n) x[u] = s[base + stride * u];
#pragma unroll
        for (int u = 0; u < kPeerCopyUnroll; ++u)
            if (base + stride * u < n) d[base + stride * u] = x[u];
    }
}

}  // namespace moekit::cuda
