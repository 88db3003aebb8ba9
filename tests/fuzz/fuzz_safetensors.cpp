// libFuzzer target: the safetensors reader (src/io/safetensors.cpp) on arbitrary bytes. The reader must
// accept or throw UsageError, nothing else (no crash, leak, overflow or other exception: ASan+UBSan watch);
// an accepted file must convert to doubles and round-trip through the writer to the same tensors.
// Built and run by scripts/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined); seeds in corpus/safetensors/.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "io/safetensors.h"
#include "moekit/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::vector<uint8_t> bytes(data, data + size);
    moekit::SafetensorsFile file;
    try {
        file = moekit::parse_safetensors(bytes, "fuzz");
    } catch (const moekit::UsageError&) {
        return 0;  // refused with a message: the expected outcome for most inputs
    }
    for (const auto& [name, t] : file.tensors) (void)t.to_double();
    const moekit::SafetensorsFile again = moekit::parse_safetensors(moekit::serialize_safetensors(file.tensors, file.metadata), "again");
    if (again.metadata != file.metadata || again.tensors.size() != file.tensors.size()) std::abort();
    for (const auto& [name, t] : file.tensors) {
        const auto& u = again.tensors.at(name);
        if (u.dtype != t.dtype || u.shape != t.shape || u.bytes != t.bytes) std::abort();
    }
    return 0;
}
