// safetensors files (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
// N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data buffer (offsets relative to its start). The reader checks everything and throws
// UsageError naming the file and the problem. Tests: tests/cpu/test_safetensors.cpp.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

struct SafetensorsFile {
    std::map<std::string, HostTensor> tensors;
    std::map<std::string, std::string> metadata;  // "__metadata__" (string -> string)
};

// Parses a whole file's bytes; `source` names it in errors ("W.safetensors: ...").
SafetensorsFile parse_safetensors(const std::vector<uint8_t>& bytes, const std::string& source);
SafetensorsFile read_safetensors(const std::string& path);

// Tensors in name order, contiguous, header padded with spaces to a multiple of 8 bytes.
std::vector<uint8_t> serialize_safetensors(const std::map<std::string, HostTensor>& tensors,
                                           const std::map<std::string, std::string>& metadata = {});
void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace moekit
