// Host tensors. Matrix<T> is the dense row-major 2-D array the CPU reference computes on
// (T = float or double); HostTensor is a typed byte buffer with a shape, the unit of file I/O.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace moekit {

enum class DType : uint8_t { f64, f32, bf16, f16, i64, i32, u8, boolean };

const char* dtype_name(DType dtype);  // safetensors spelling: F64 F32 BF16 F16 I64 I32 U8 BOOL
size_t dtype_size(DType dtype);
bool dtype_from_name(const std::string& name, DType* out);

template <typename T>
struct Matrix {
    int64_t rows = 0, cols = 0;
    std::vector<T> data;  // [rows, cols] row-major

    Matrix() = default;
    Matrix(int64_t rows_, int64_t cols_, T fill = T(0)) : rows(rows_), cols(cols_), data(size_t(rows_ * cols_), fill) {}

    T& operator()(int64_t r, int64_t c) { return data[size_t(r * cols + c)]; }
    const T& operator()(int64_t r, int64_t c) const { return data[size_t(r * cols + c)]; }
    T* row(int64_t r) { return data.data() + r * cols; }
    const T* row(int64_t r) const { return data.data() + r * cols; }
    int64_t size() const { return rows * cols; }
    bool empty() const { return data.empty(); }
    void fill(T value) { std::fill(data.begin(), data.end(), value); }

    template <typename U>
    Matrix<U> cast() const {
        Matrix<U> out(rows, cols);
        for (size_t i = 0; i < data.size(); ++i) out.data[i] = U(data[i]);
        return out;
    }
};

// A named tensor as stored in a safetensors file: dtype, shape and little-endian bytes.
struct HostTensor {
    DType dtype = DType::f32;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;

    int64_t numel() const;
    std::string shape_string() const;  // "[4, 16]"

    // Element-wise conversion to double (any float/int dtype) and construction from doubles.
    std::vector<double> to_double() const;
    static HostTensor from_double(const std::vector<double>& values, std::vector<int64_t> shape, DType dtype);

    template <typename T>
    static HostTensor from_matrix(const Matrix<T>& m, DType dtype) {
        return from_double(std::vector<double>(m.data.begin(), m.data.end()), {m.rows, m.cols}, dtype);
    }
};

}  // namespace moekit
