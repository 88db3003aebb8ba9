// Tensor views and streams of the engine's public API: a view is a pointer with a dtype, a shape and the
// memory it lives in (host for the CPU backend, a CUDA device for the CUDA backend). Views never own
// memory. A Stream is the caller's CUDA stream as an opaque handle (no CUDA header here); the CPU
// backend runs synchronously and ignores it. Used by include/moekit/device_layer.h.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moekit/tensor.h"

namespace moekit {

enum class Backend : uint8_t { cpu, cuda };
const char* backend_name(Backend backend);

struct TensorView {
    static constexpr int kMaxDims = 4;
    void* data = nullptr;
    DType dtype = DType::f32;
    int ndim = 0;
    std::array<int64_t, kMaxDims> shape{};
    Backend backend = Backend::cpu;
    int device = 0;  // CUDA device ordinal (ignored on the CPU)

    TensorView() = default;
    TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Backend backend_ = Backend::cpu,
               int device_ = 0);

    bool empty() const { return data == nullptr; }
    int64_t numel() const;
    size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
    std::string to_string() const;  // "bf16[8, 64] on cuda:0"
    template <typename T>
    T* as() const { return static_cast<T*>(data); }
};

// The caller's stream: a cudaStream_t cast to void* (nullptr = the legacy default stream).
struct Stream {
    void* handle = nullptr;
};

}  // namespace moekit
