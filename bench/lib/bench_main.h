// The error contract every standalone benchmark's main() shares (bench/bench_*.cu), as the moekit tool's: the body
// runs; a moekit::UsageError (a bad flag or value) exits 2 with "NAME: error: ...", any other exception exits 1 with
// "NAME: ..."; otherwise the body's own exit status.
#pragma once
#include <cstdio>
#include <exception>

#include "moekit/error.h"

namespace moekit::cuda::bench {

template <typename Body>
int bench_main(const char* name, Body&& body) {
    try {
        return body();
    } catch (const moekit::UsageError& e) {
        std::fprintf(stderr, "%s: error: %s\n", name, e.what());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", name, e.what());
        return 1;
    }
}

}  // namespace moekit::cuda::bench
