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

}  // namespace moekit
