// HostTensor: dtype names and element conversion for file I/O.
#include <cstring>

#include "core/bf16.h"
#include "moekit/error.h"
#include "moekit/tensor.h"

namespace moekit {

namespace {
struct DTypeInfo {
    DType dtype;
    const char* name;
    size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::f64, "F64", 8}, {DType::f32, "F32", 4}, {DType::bf16, "BF16", 2}, {DType::f16, "F16", 2},
    {DType::i64, "I64", 8}, {DType::i32, "I32", 4}, {DType::u8, "U8", 1},     {DType::boolean, "BOOL", 1},
};

// IEEE half <-> float (only for reading/writing F16 files).
float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: renormalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; --exp; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_half(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint16_t sign = uint16_t((u >> 16) & 0x8000);
    int32_t exp = int32_t((u >> 23) & 0xff) - 127 + 15;
    uint32_t mant = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return uint16_t(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return sign;
        mant |= 0x800000;
        uint32_t shift = uint32_t(14 - exp);
        uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) ++half;
        return uint16_t(sign | half);
    }
    uint32_t half = (uint32_t(exp) << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
    return uint16_t(sign | half);
}
}  // namespace

const char* dtype_name(DType dtype) {
    for (auto& d : kDTypes)
        if (d.dtype == dtype) return d.name;
    return "?";
}

size_t dtype_size(DType dtype) {
    for (auto& d : kDTypes)
        if (d.dtype == dtype) return d.size;
    return 0;
}

bool dtype_from_name(const std::string& name, DType* out) {
    for (auto& d : kDTypes)
        if (name == d.name) {
            *out = d.dtype;
            return true;
        }
    return false;
}

int64_t HostTensor::numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
}

std::string HostTensor::shape_string() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

std::vector<double> HostTensor::to_double() const {
    const int64_t n = numel();
    MOEKIT_CHECK(int64_t(bytes.size()) == n * int64_t(dtype_size(dtype)), "tensor byte size mismatch");
    std::vector<double> out(static_cast<size_t>(n));
    const uint8_t* p = bytes.data();
    for (int64_t i = 0; i < n; ++i) {
        switch (dtype) {
            case DType::f64: { double v; std::memcpy(&v, p + 8 * i, 8); out[i] = v; break; }
            case DType::f32: { float v; std::memcpy(&v, p + 4 * i, 4); out[i] = v; break; }
            case DType::bf16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = bf16_bits_to_float(v); break; }
            case DType::f16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = half_to_float(v); break; }
            case DType::i64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); out[i] = double(v); break; }
            case DType::i32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); out[i] = v; break; }
            case DType::u8:
            case DType::boolean: out[i] = p[i]; break;
        }
    }
    return out;
}

HostTensor HostTensor::from_double(const std::vector<double>& values, std::vector<int64_t> shape, DType dtype) {
    HostTensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    MOEKIT_CHECK(t.numel() == int64_t(values.size()), "shape ", t.shape_string(), " does not hold ", values.size(), " values");
    const size_t es = dtype_size(dtype);
    t.bytes.resize(values.size() * es);
    uint8_t* p = t.bytes.data();
    for (size_t i = 0; i < values.size(); ++i) {
        const double x = values[i];
        switch (dtype) {
            case DType::f64: std::memcpy(p + 8 * i, &x, 8); break;
            case DType::f32: { float v = float(x); std::memcpy(p + 4 * i, &v, 4); break; }
            case DType::bf16: { uint16_t v = float_to_bf16_bits(float(x)); std::memcpy(p + 2 * i, &v, 2); break; }
            case DType::f16: { uint16_t v = float_to_half(float(x)); std::memcpy(p + 2 * i, &v, 2); break; }
            case DType::i64: { int64_t v = int64_t(x); std::memcpy(p + 8 * i, &v, 8); break; }
            case DType::i32: { int32_t v = int32_t(x); std::memcpy(p + 4 * i, &v, 4); break; }
            case DType::u8:
            case DType::boolean: p[i] = uint8_t(x != 0 ? (dtype == DType::boolean ? 1 : x) : 0); break;
        }
    }
    return t;
}

}  // namespace moekit
