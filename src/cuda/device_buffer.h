// DeviceBuffer<T>: an owning cudaMalloc'd array sized once, outside any layer step (the sync-free
// path never allocates). Host copies here are synchronous and only for set-up, tests and the
// LayerRunner interface: an upload or zero fill is complete, for every stream, when it returns.
// Used by src/cuda/moe_layer.cu and the GPU tests (tests/gpu/test_device_buffer.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/cuda_check.h"

namespace moekit::cuda {

// Zeroes device memory and waits for it. cudaMemset may still be running when it returns, and the layers'
// streams are non-blocking (no implicit order with the legacy stream): without the wait a kernel or copy on
// another stream could see the memory before it is zero (a tracker copy into a fresh layer lost to a late
// fill was seen under load). Only the legacy stream is waited for, never a peer's spinning kernel.
inline void zero_fill(void* p, size_t bytes) {
    if (bytes == 0) return;
    MOEKIT_CUDA_CHECK(cudaMemset(p, 0, bytes));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

// Copies host memory to the device and waits until the bytes are there. A plain cudaMemcpy from pageable
// memory (every std::vector here) returns once the data sit in the driver's staging buffer, while the DMA
// into device memory may still run on the legacy stream (CUDA runtime API, "API synchronization
// behavior"); the layers' streams are non-blocking, so a kernel enqueued right after could read the old
// contents (issue 10: the runner's last upload before backward, grad_output, is read by its first kernel).
// Same rule and same wait as zero_fill.
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    MOEKIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

template <typename T>
class DeviceBuffer {
public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(int64_t count) { resize(count); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        swap(o);
        return *this;
    }
    ~DeviceBuffer() {
        if (ptr_) cudaFree(ptr_);
    }

    // Frees and reallocates (contents undefined) unless the size is unchanged; zero-filled.
    void resize(int64_t count) {
        if (count == count_ && ptr_) return;
        if (ptr_) MOEKIT_CUDA_CHECK(cudaFree(ptr_));
        ptr_ = nullptr;
        count_ = count;
        if (count > 0) {
            MOEKIT_CUDA_CHECK(cudaMalloc(&ptr_, size_t(count) * sizeof(T)));
            zero_fill(ptr_, size_t(count) * sizeof(T));
        }
    }
    void upload(const std::vector<T>& host) {
        MOEKIT_CHECK(int64_t(host.size()) == count_, "upload of ", host.size(), " elements into a buffer of ", count_);
        copy_to_device(ptr_, host.data(), bytes());
    }
    std::vector<T> download() const { return download(count_); }
    std::vector<T> download(int64_t count) const {
        MOEKIT_CHECK(count <= count_, "download of ", count, " elements from a buffer of ", count_);
        std::vector<T> host(static_cast<size_t>(count));
        if (count) MOEKIT_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, size_t(count) * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }

    T* get() { return ptr_; }
    const T* get() const { return ptr_; }
    int64_t size() const { return count_; }
    size_t bytes() const { return size_t(count_) * sizeof(T); }

private:
    void swap(DeviceBuffer& o) noexcept {
        std::swap(ptr_, o.ptr_);
        std::swap(count_, o.count_);
    }
    T* ptr_ = nullptr;
    int64_t count_ = 0;
};

// Host copies of raw device arrays (tests, runner; never inside a step). A download waits for its own copy
// only: synchronise the stream that wrote the array first.
template <typename T>
std::vector<T> download(const T* device, int64_t count) {
    std::vector<T> host(static_cast<size_t>(count));
    if (count) MOEKIT_CUDA_CHECK(cudaMemcpy(host.data(), device, size_t(count) * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
}
template <typename T>
void upload(T* device, const std::vector<T>& host) {
    copy_to_device(device, host.data(), host.size() * sizeof(T));
}

}  // namespace moekit::cuda
