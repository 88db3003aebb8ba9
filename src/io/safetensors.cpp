// safetensors reader and writer (format: src/io/safetensors.h). The reader rejects anything the format
// forbids: short files, a header length beyond the file, bad or non-object JSON, duplicate names,
// unknown dtypes, offsets outside the buffer, sizes that do not match shape x dtype, overlaps and holes.
// Tests: tests/cpu/test_safetensors.cpp.
#include "io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "moekit/error.h"

namespace moekit {

namespace {

// Upstream refuses headers over 100 MB; a larger length is a corrupt file, not a big model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool is_spec_dtype(const std::string& name) {
    for (const char* d :
         {"I8", "I16", "U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"})
        if (name == d) return true;
    return false;
}

struct Span {
    uint64_t begin, end;
    const std::string* name;
};

}  // namespace

SafetensorsFile parse_safetensors(const std::vector<uint8_t>& bytes, const std::string& source) {
    auto fail = [&](auto&&... parts) { return UsageError(str(source, ": ", parts...)); };
    if (bytes.size() < 8)
        throw fail("too short for a safetensors file (", bytes.size(),
                   " bytes; it starts with an 8-byte header length)");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[size_t(i)];
    if (header_len > bytes.size() - 8 || header_len > kMaxHeaderBytes)
        throw fail("header length ", header_len, " exceeds the file (", bytes.size(),
                   " bytes): truncated or not a "
                   "safetensors file");
    const char* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);

    // Duplicate names are invalid, but nlohmann keeps the last one silently: catch them while parsing.
    std::string duplicate;
    std::set<std::string> names;
    nlohmann::json::parser_callback_t on_event = [&](int depth, nlohmann::json::parse_event_t event,
                                                     nlohmann::json& parsed) {
        if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
            !names.insert(parsed.get<std::string>()).second && duplicate.empty())
            duplicate = parsed.get<std::string>();
        return true;
    };
    nlohmann::json header;
    try {
        header = nlohmann::json::parse(header_begin, header_begin + header_len, on_event);
    } catch (const nlohmann::json::exception& e) {
        throw fail("the ", header_len, "-byte header is not valid JSON (", e.what(), ")");
    }
    if (!header.is_object()) throw fail("the header is not a JSON object");
    if (!duplicate.empty()) throw fail("tensor name '", duplicate, "' appears twice in the header");

    SafetensorsFile file;
    const uint64_t data_size = bytes.size() - 8 - header_len;
    const uint8_t* data = bytes.data() + 8 + header_len;
    std::vector<Span> spans;
    for (const auto& [name, entry] : header.items()) {
        if (name == "__metadata__") {
            if (!entry.is_object()) throw fail("__metadata__ must be an object of strings");
            for (const auto& [key, value] : entry.items()) {
                if (!value.is_string()) throw fail("__metadata__ value of '", key, "' is not a string: ", value.dump());
                file.metadata[key] = value.get<std::string>();
            }
            continue;
        }
        auto bad = [&](auto&&... parts) { return fail("tensor '", name, "': ", parts...); };
        if (!entry.is_object()) throw bad("entry is not an object");
        for (const char* key : {"dtype", "shape", "data_offsets"})
            if (!entry.contains(key)) throw bad("missing \"", key, "\"");
        const auto& dtype_j = entry["dtype"];
        const auto& shape_j = entry["shape"];
        const auto& offsets_j = entry["data_offsets"];
        if (!dtype_j.is_string()) throw bad("dtype is not a string: ", dtype_j.dump());
        HostTensor t;
        const std::string dtype_name = dtype_j.get<std::string>();
        if (!dtype_from_name(dtype_name, &t.dtype)) {
            if (is_spec_dtype(dtype_name))
                throw bad("dtype ", dtype_name, " is not supported by moekit (F64 F32 BF16 F16 I64 I32 U8 BOOL)");
            throw bad("unknown dtype '", dtype_name, "'");
        }
        if (!shape_j.is_array()) throw bad("shape is not an array: ", shape_j.dump());
        uint64_t numel = 1;
        for (const auto& d : shape_j) {
            if (!d.is_number_unsigned()) throw bad("shape ", shape_j.dump(), " must hold non-negative integers");
            const uint64_t dim = d.get<uint64_t>();
            if (dim != 0 && numel > (uint64_t(1) << 62) / dim) throw bad("shape ", shape_j.dump(), " is too large");
            numel *= dim;
            t.shape.push_back(int64_t(dim));
        }
        if (!offsets_j.is_array() || offsets_j.size() != 2 || !offsets_j[0].is_number_unsigned() ||
            !offsets_j[1].is_number_unsigned())
            throw bad("data_offsets must be [begin, end] (non-negative integers), got ", offsets_j.dump());
        const uint64_t begin = offsets_j[0].get<uint64_t>(), end = offsets_j[1].get<uint64_t>();
        if (begin > end) throw bad("data_offsets [", begin, ", ", end, "] end before they begin");
        if (end > data_size)
            throw bad("data_offsets [", begin, ", ", end, "] run past the data buffer (", data_size, " bytes)");
        const uint64_t expected = numel * dtype_size(t.dtype);
        if (end - begin != expected)
            throw bad("data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes but shape ", t.shape_string(),
                      " x ", dtype_name, " needs ", expected);
        t.bytes.assign(data + begin, data + end);
        if (t.dtype == DType::boolean)
            for (uint8_t b : t.bytes)
                if (b > 1) throw bad("BOOL value ", int(b), " is neither 0 nor 1");
        auto [it, inserted] = file.tensors.emplace(name, std::move(t));
        spans.push_back({begin, end, &it->first});
    }
    // The buffer must be exactly tiled by the tensors: no overlaps (aliasing) and no holes (polyglot files).
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    uint64_t covered = 0;
    const std::string* previous = nullptr;
    for (const auto& s : spans) {
        if (s.begin < covered)
            throw fail("tensors '", *previous, "' and '", *s.name, "' overlap in the data buffer (at byte ", s.begin,
                       ")");
        if (s.begin > covered)
            throw fail("bytes [", covered, ", ", s.begin,
                       ") of the data buffer belong to no tensor (holes are invalid)");
        covered = s.end;
        previous = s.name;
    }
    if (covered != data_size)
        throw fail("bytes [", covered, ", ", data_size, ") at the end of the data buffer belong to no tensor");
    return file;
}

SafetensorsFile read_safetensors(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOEKIT_REQUIRE(in.good(), path, ": cannot open (", std::strerror(errno), ")");
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    MOEKIT_REQUIRE(!in.bad(), path, ": read error");
    return parse_safetensors(bytes, path);
}

std::vector<uint8_t> serialize_safetensors(const std::map<std::string, HostTensor>& tensors,
                                           const std::map<std::string, std::string>& metadata) {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const auto& [name, t] : tensors) {
        MOEKIT_CHECK(name != "__metadata__" && !name.empty(), "invalid tensor name '", name, "'");
        MOEKIT_CHECK(t.bytes.size() == size_t(t.numel()) * dtype_size(t.dtype), "tensor '", name, "' ",
                     t.shape_string(), " ", dtype_name(t.dtype), " has ", t.bytes.size(), " bytes");
        header[name] = {
            {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
        offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned (spaces are allowed)
    std::vector<uint8_t> out(8 + text.size() + offset);
    for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(text.size()) >> (8 * i));
    std::memcpy(out.data() + 8, text.data(), text.size());
    uint8_t* p = out.data() + 8 + text.size();
    for (const auto& [name, t] : tensors) {
        if (!t.bytes.empty()) std::memcpy(p, t.bytes.data(), t.bytes.size());
        p += t.bytes.size();
    }
    return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
    const auto bytes = serialize_safetensors(tensors, metadata);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    MOEKIT_REQUIRE(out.good(), path, ": cannot write (", std::strerror(errno), ")");
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    out.close();
    MOEKIT_REQUIRE(out.good(), path, ": write failed (disk full?)");
}

}  // namespace moekit
