// DeviceBuffer's host copies (src/cuda/device_buffer.h) are complete for every stream when they return:
// a kernel on a non-blocking stream (as the layers and the LayerRunner use) launched right after an
// upload reads the new bytes, never the old ones. Issue 10: a plain pageable cudaMemcpy returns before its
// DMA lands, so the CudaLayerVsCpu cases could read a stale grad_output under `ctest -j 8` load.
// The same pattern through a plain cudaMemcpy is measured and printed (the hazard the wait removes).
#include <cstdio>

#include "core/rng.h"
#include "cuda/device_buffer.h"
#include "gpu/cuda_layer_test_util.h"

namespace moekit::test {
namespace {

using cuda::DeviceBuffer;

// Word i of trial `trial`: never 0 (the zero-filled start) and, up to 2^-32 per word, never the previous trial's.
MOEKIT_HD uint32_t pattern(uint64_t seed, uint64_t trial, uint64_t i) {
    return uint32_t(splitmix64(seed ^ (trial << 40) ^ i)) | 1u;
}

__global__ void count_stale_kernel(const uint32_t* __restrict__ words, int64_t n, uint64_t seed, uint64_t trial,
                                   unsigned long long* __restrict__ stale) {
    unsigned long long mine = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        mine += words[i] != pattern(seed, trial, uint64_t(i));
    if (mine) atomicAdd(stale, mine);  // an integer count: order does not matter
}

std::vector<uint32_t> host_pattern(int64_t n, uint64_t seed, uint64_t trial) {
    std::vector<uint32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = pattern(seed, trial, uint64_t(i));
    return v;
}

// Uploads `trials` patterns with `copy` and checks each on a fresh non-blocking stream right away; returns
// the number of words that still held older bytes when the kernel read them.
template <typename Copy>
unsigned long long stale_words(DeviceBuffer<uint32_t>& buf, uint64_t seed, int trials, Copy copy) {
    cudaStream_t s = nullptr;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DeviceBuffer<unsigned long long> stale(1);
    for (int trial = 0; trial < trials; ++trial) {
        const std::vector<uint32_t> v = host_pattern(buf.size(), seed, uint64_t(trial));
        copy(v);
        count_stale_kernel<<<264, 512, 0, s>>>(buf.get(), buf.size(), seed, uint64_t(trial), stale.get());
        MOEKIT_CUDA_LAUNCH_CHECK();
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // the next trial starts from this one's bytes
    }
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
    return stale.download()[0];
}

constexpr int64_t kWords = int64_t(8) << 20;  // 32 MiB: many staging chunks of a pageable copy
constexpr int kTrials = 8;

TEST(DeviceBufferUpload, NonBlockingStreamSeesEveryWordAtOnce) {
    SKIP_WITHOUT_GPU();
    const uint64_t seed = 20261123;
    SCOPED_TRACE("seed=" + std::to_string(seed));
    DeviceBuffer<uint32_t> buf(kWords);
    const unsigned long long member = stale_words(buf, seed, kTrials, [&](const std::vector<uint32_t>& v) {
        buf.upload(v);
    });
    EXPECT_EQ(member, 0ull) << "DeviceBuffer::upload returned before its bytes were on the device";
    const unsigned long long free_fn = stale_words(buf, seed + 1, kTrials, [&](const std::vector<uint32_t>& v) {
        cuda::upload(buf.get(), v);
    });
    EXPECT_EQ(free_fn, 0ull) << "cuda::upload returned before its bytes were on the device";
    // The hazard itself, for the record (not asserted: whether the DMA is still running depends on the
    // driver and the load; a non-zero count shows the race that copy_to_device's wait closes).
    const unsigned long long raw = stale_words(buf, seed + 2, kTrials, [&](const std::vector<uint32_t>& v) {
        MOEKIT_CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
    });
    std::printf("  stale words seen by a non-blocking stream after %d x %lld-word uploads: upload %llu, "
                "cuda::upload %llu, plain cudaMemcpy %llu\n",
                kTrials, static_cast<long long>(kWords), member, free_fn, raw);
}

}  // namespace
}  // namespace moekit::test
