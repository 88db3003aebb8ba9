// bfloat16 <-> float conversion (round to nearest even, NaN kept quiet), shared by host and device.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/hd.h"

namespace moekit {

MOEKIT_HD uint16_t float_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

MOEKIT_HD float bf16_bits_to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round a float to the nearest bf16 value (used to give CPU and GPU identical inputs).
MOEKIT_HD float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// A float as the sum of three bf16 values, hi + mid + lo (8 significant bits each, every remainder exact in fp32):
// an fp32 operand of a GEMM whose other operand is bf16 then runs on bf16 tensor cores with exact products and
// fp32 accumulation (the router's backward, src/cuda/router.cu). Exact but for a float whose low bits fall below
// the normal range; a non-finite float is its hi alone (inf - inf would make the others NaN).
struct Bf16x3 {
    uint16_t hi, mid, lo;
};
MOEKIT_HD Bf16x3 split_to_bf16x3(float f) {
    const uint16_t hi = float_to_bf16_bits(f);
    if ((hi & 0x7f80u) == 0x7f80u) return {hi, 0, 0};  // inf or NaN (or a float rounding up to inf)
    const float r1 = f - bf16_bits_to_float(hi);
    const uint16_t mid = float_to_bf16_bits(r1);
    const float r2 = r1 - bf16_bits_to_float(mid);
    return {hi, mid, float_to_bf16_bits(r2)};
}

}  // namespace moekit
