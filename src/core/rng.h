// Counter-based random numbers (SplitMix64 hashing of (seed, stream, index)), identical on host
// and device, so that any element can be drawn independently and runs are reproducible.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/hd.h"

namespace moekit {

MOEKIT_HD uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Uniform in [0, 1) with 53 random bits.
MOEKIT_HD double uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t h = splitmix64(splitmix64(seed ^ splitmix64(stream)) + index);
    return double(h >> 11) * (1.0 / 9007199254740992.0);
}

// Standard normal by Box-Muller on two independent uniforms.
MOEKIT_HD double normal01(uint64_t seed, uint64_t stream, uint64_t index) {
    double u1 = uniform01(seed, stream, 2 * index);
    double u2 = uniform01(seed, stream, 2 * index + 1);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// A sequential generator for code that wants "the next number" (host, or one device thread).
struct Rng {
    uint64_t seed = 0, stream = 0, index = 0;
    MOEKIT_HD Rng(uint64_t seed_, uint64_t stream_ = 0) : seed(seed_), stream(stream_) {}
    MOEKIT_HD double uniform() { return uniform01(seed, stream, index++); }
    MOEKIT_HD double normal() { return normal01(seed, stream, index++); }
    MOEKIT_HD int64_t below(int64_t n) { return int64_t(uniform() * double(n)) % n; }
};

}  // namespace moekit
