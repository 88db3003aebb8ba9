// safetensors reader and writer (format: src/io/safetensors.h). The reader rejects anything the format
// forbids: short files, a header length beyond the file, a NUL in the header, bad or non-object JSON,
// duplicate names, unknown dtypes, offsets outside the buffer, sizes that do not match shape x dtype
// (checked 64-bit), overlaps and holes; from a path it checks the header before reading the body and
// refuses folders and devices. The writer writes atomically (io/atomic_file.h).
// Tests: tests/cpu/test_safetensors.cpp.
#include "io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>

#include "core/checked_math.h"
#include "io/atomic_file.h"
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

namespace {

// One tensor of a checked header: dtype and shape in `tensor` (no bytes yet) and its byte span.
struct Entry {
    std::string name;
    HostTensor tensor;
    uint64_t begin = 0, end = 0;
};

struct Header {
    std::vector<Entry> entries;
    std::map<std::string, std::string> metadata;
};

// The header length from the first 8 bytes, checked against the file size before anything else is read.
uint64_t header_length(const uint8_t* first8, uint64_t file_size, const std::string& source) {
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | first8[i];
    if (header_len > file_size - 8 || header_len > kMaxHeaderBytes)
        throw UsageError(str(source, ": header length ", header_len, " exceeds the file (", file_size,
                             " bytes): truncated or not a safetensors file"));
    return header_len;
}

// Parses and checks the JSON header against a data buffer of `data_size` bytes: every entry's dtype,
// shape (numel x element size in checked arithmetic) and offsets, and that the tensors tile the buffer
// exactly. Nothing here allocates more than the header itself, so a hostile header costs nothing.
Header parse_header(const char* text, uint64_t header_len, uint64_t data_size, const std::string& source) {
    auto fail = [&](auto&&... parts) { return UsageError(str(source, ": ", parts...)); };
    // JSON text holds no NUL byte, and nlohmann's parser takes one as the end of input: bytes after it would be
    // hidden from the checks below (a polyglot file), so a NUL anywhere in the header is refused.
    if (const void* nul = std::memchr(text, 0, header_len))
        throw fail("the header holds a NUL byte at offset ", static_cast<const char*>(nul) - text,
                   " (a safetensors header is JSON text, padded with spaces only)");
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
        header = nlohmann::json::parse(text, text + header_len, on_event);
    } catch (const nlohmann::json::exception& e) {
        throw fail("the ", header_len, "-byte header is not valid JSON (", e.what(), ")");
    }
    if (!header.is_object()) throw fail("the header is not a JSON object");
    if (!duplicate.empty()) throw fail("tensor name '", duplicate, "' appears twice in the header");

    Header out;
    for (const auto& item : header.items()) {
        const std::string& name = item.key();  // not a structured binding: clang 14 cannot capture those
        const auto& entry = item.value();
        if (name == "__metadata__") {
            if (!entry.is_object()) throw fail("__metadata__ must be an object of strings");
            for (const auto& [key, value] : entry.items()) {
                if (!value.is_string()) throw fail("__metadata__ value of '", key, "' is not a string: ", value.dump());
                out.metadata[key] = value.get<std::string>();
            }
            continue;
        }
        // The writer (and every Megatron state dict) has no empty name: accepting one would give a file that
        // moekit reads but cannot write back (found by tests/fuzz/fuzz_safetensors.cpp).
        if (name.empty()) throw fail("a tensor has an empty name");
        auto bad = [&](auto&&... parts) { return fail("tensor '", name, "': ", parts...); };
        if (!entry.is_object()) throw bad("entry is not an object");
        for (const char* key : {"dtype", "shape", "data_offsets"})
            if (!entry.contains(key)) throw bad("missing \"", key, "\"");
        const auto& dtype_j = entry["dtype"];
        const auto& shape_j = entry["shape"];
        const auto& offsets_j = entry["data_offsets"];
        if (!dtype_j.is_string()) throw bad("dtype is not a string: ", dtype_j.dump());
        Entry e;
        e.name = name;
        HostTensor& t = e.tensor;
        const std::string dtype_name = dtype_j.get<std::string>();
        if (!dtype_from_name(dtype_name, &t.dtype)) {
            if (is_spec_dtype(dtype_name))
                throw bad("dtype ", dtype_name, " is not supported by moekit (F64 F32 BF16 F16 I64 I32 U8 BOOL)");
            throw bad("unknown dtype '", dtype_name, "'");
        }
        if (!shape_j.is_array()) throw bad("shape is not an array: ", shape_j.dump());
        // numel and numel x element size in checked int64 arithmetic: a shape whose byte size wraps (to 0,
        // say) would otherwise pass the offsets check and reach the tensor code with no bytes.
        std::optional<int64_t> nbytes = int64_t(dtype_size(t.dtype));
        for (const auto& d : shape_j) {
            if (!d.is_number_unsigned()) throw bad("shape ", shape_j.dump(), " must hold non-negative integers");
            const uint64_t dim = d.get<uint64_t>();
            if (dim > uint64_t(INT64_MAX)) throw bad("shape ", shape_j.dump(), " is too large");
            nbytes = nbytes ? checked_mul(*nbytes, int64_t(dim)) : nbytes;
            t.shape.push_back(int64_t(dim));
        }
        if (!nbytes)
            throw bad("shape ", shape_j.dump(), " x ", dtype_name, " is too large (its byte size overflows 64 bits)");
        if (!offsets_j.is_array() || offsets_j.size() != 2 || !offsets_j[0].is_number_unsigned() ||
            !offsets_j[1].is_number_unsigned())
            throw bad("data_offsets must be [begin, end] (non-negative integers), got ", offsets_j.dump());
        e.begin = offsets_j[0].get<uint64_t>(), e.end = offsets_j[1].get<uint64_t>();
        if (e.begin > e.end) throw bad("data_offsets [", e.begin, ", ", e.end, "] end before they begin");
        if (e.end > data_size)
            throw bad("data_offsets [", e.begin, ", ", e.end, "] run past the data buffer (", data_size, " bytes)");
        if (e.end - e.begin != uint64_t(*nbytes))
            throw bad("data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin, " bytes but shape ",
                      t.shape_string(), " x ", dtype_name, " needs ", *nbytes);
        out.entries.push_back(std::move(e));
    }
    // The buffer must be exactly tiled by the tensors: no overlaps (aliasing) and no holes (polyglot files).
    std::vector<Span> spans;
    for (const auto& e : out.entries) spans.push_back({e.begin, e.end, &e.name});
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    uint64_t covered = 0;
    const std::string* previous = nullptr;
    for (const auto& sp : spans) {
        if (sp.begin < covered)
            throw fail("tensors '", *previous, "' and '", *sp.name, "' overlap in the data buffer (at byte ", sp.begin,
                       ")");
        if (sp.begin > covered)
            throw fail("bytes [", covered, ", ", sp.begin,
                       ") of the data buffer belong to no tensor (holes are invalid)");
        covered = sp.end;
        previous = sp.name;
    }
    if (covered != data_size)
        throw fail("bytes [", covered, ", ", data_size, ") at the end of the data buffer belong to no tensor");
    return out;
}

// The checked header's tensors filled from the data buffer (size checked by parse_header).
SafetensorsFile fill(Header header, const uint8_t* data, const std::string& source) {
    SafetensorsFile file;
    file.metadata = std::move(header.metadata);
    for (auto& e : header.entries) {
        HostTensor& t = e.tensor;
        t.bytes.assign(data + e.begin, data + e.end);
        if (t.dtype == DType::boolean)
            for (uint8_t b : t.bytes)
                if (b > 1) throw UsageError(str(source, ": tensor '", e.name, "': BOOL value ", int(b),
                                                " is neither 0 nor 1"));
        file.tensors.emplace(e.name, std::move(t));
    }
    return file;
}

}  // namespace

SafetensorsFile parse_safetensors(const std::vector<uint8_t>& bytes, const std::string& source) {
    if (bytes.size() < 8)
        throw UsageError(str(source, ": too short for a safetensors file (", bytes.size(),
                             " bytes; it starts with an 8-byte header length)"));
    const uint64_t header_len = header_length(bytes.data(), bytes.size(), source);
    Header header = parse_header(reinterpret_cast<const char*>(bytes.data() + 8), header_len,
                                 bytes.size() - 8 - header_len, source);
    return fill(std::move(header), bytes.data() + 8 + header_len, source);
}

SafetensorsFile read_safetensors(const std::string& path) {
    namespace fs = std::filesystem;
    // A folder, a device (/dev/zero) or a pipe is no file to read: refused before reading, by its kind.
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    MOEKIT_REQUIRE(!ec && fs::exists(st), path, ": cannot open (", ec ? ec.message() : "no such file", ")");
    MOEKIT_REQUIRE(!fs::is_directory(st), path, ": is a directory, not a safetensors file");
    MOEKIT_REQUIRE(fs::is_regular_file(st), path, ": is not a regular file (a device or a pipe); give a safetensors file");
    std::ifstream in(path, std::ios::binary);
    MOEKIT_REQUIRE(in.good(), path, ": cannot open (", std::strerror(errno), ")");
    const uint64_t size = fs::file_size(path, ec);
    MOEKIT_REQUIRE(!ec, path, ": cannot read its size (", ec.message(), ")");
    auto read_exactly = [&](uint8_t* dst, uint64_t n) {
        in.read(reinterpret_cast<char*>(dst), std::streamsize(n));
        MOEKIT_REQUIRE(uint64_t(in.gcount()) == n, path, ": read error (the file changed or shrank while read)");
    };
    // Header first, checked against the file size; the body is read only once the header is known good.
    MOEKIT_REQUIRE(size >= 8, path, ": too short for a safetensors file (", size,
                   " bytes; it starts with an 8-byte header length)");
    uint8_t first8[8];
    read_exactly(first8, 8);
    const uint64_t header_len = header_length(first8, size, path);
    std::vector<char> text(header_len);
    read_exactly(reinterpret_cast<uint8_t*>(text.data()), header_len);
    Header header = parse_header(text.data(), header_len, size - 8 - header_len, path);
    std::vector<uint8_t> data(size - 8 - header_len);
    read_exactly(data.data(), data.size());
    return fill(std::move(header), data.data(), path);
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
    // Temp file + rename: a failed or interrupted write leaves the old file (or none), never half a file.
    io::write_file_atomically(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

}  // namespace moekit
