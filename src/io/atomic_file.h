// Atomic file output: bytes go to a temporary file in the destination's folder, are flushed to disk,
// then renamed over the destination, so a failed or interrupted run never leaves a truncated or mixed
// file. Used by every writer of results (safetensors, report.json, train.png, checkpoints).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace moekit::io {

// Writes `bytes` to `path` atomically. Throws UsageError naming `path` and the reason (a folder that
// does not exist or is not writable, a full disk); the destination is then left as it was.
void write_file_atomically(const std::string& path, std::string_view bytes);

// Renames a finished temporary folder over `path` (itself replaced when present): how a checkpoint
// folder appears whole or not at all.
void replace_directory(const std::string& tmp_path, const std::string& path);

}  // namespace moekit::io
