// The host-memory bound of a run: refuses a layer whose forward+backward needs more bytes than the
// machine has (MoeConfig::memory_estimate_bytes), before anything is allocated, instead of running
// until the allocator or the OOM killer stops it. Used by `moekit layer`; usable by `moekit train`.
// Tests: tests/cpu/test_config.cpp (HostMemory*).
#pragma once
#include <cstdint>
#include <string>

#include "moekit/config.h"

namespace moekit {

// Physical memory of this host in bytes (0 when unknown).
int64_t host_memory_bytes();

// Throws UsageError naming the shape flags and both sizes when `copies` layers of `tokens` tokens
// (fp32, or fp64 with bytes_per_value 8) need more than this host's memory.
void require_fits_in_host_memory(const MoeConfig& config, int64_t tokens, int64_t copies = 1,
                                 int64_t bytes_per_value = 4);

}  // namespace moekit
