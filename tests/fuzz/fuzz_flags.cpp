// libFuzzer target: the flag parser (src/core/flags.cpp, the MoeConfig table src/core/moe_flags.cpp) and
// validation (src/core/config.cpp). Input: command-line arguments separated by '\n', or a JSON object when it
// starts with '{' (what --config applies). Parsing must accept or throw UsageError, nothing else; an accepted
// config must survive to_json -> --config -> to_json unchanged. --config FILE arguments are dropped (no file
// access). Built and run by scripts/fuzz.sh; seeds in corpus/flags/.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/flags.h"
#include "moekit/error.h"

namespace {

// The config of `json` applied to the defaults, validated; throws UsageError when refused.
moekit::MoeConfig from_json(const nlohmann::json& json) {
    moekit::MoeConfig c;
    moekit::FlagParser p;
    moekit::add_moe_flags(p, c);
    p.apply_json(json, "fuzz.json");
    c.normalize();
    c.validate();
    return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text(reinterpret_cast<const char*>(data), size);
    moekit::MoeConfig config;
    try {
        if (!text.empty() && text[0] == '{') {
            const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
            if (json.is_discarded()) return 0;
            config = from_json(json);
        } else {
            std::vector<std::string> args;
            size_t start = 0;
            while (start <= text.size()) {
                size_t end = text.find('\n', start);
                if (end == std::string::npos) end = text.size();
                args.push_back(text.substr(start, end - start));
                start = end + 1;
            }
            std::vector<std::string> kept;
            for (size_t i = 0; i < args.size(); ++i) {
                if (args[i] == "--config") {
                    ++i;
                    continue;
                }
                if (args[i].rfind("--config=", 0) == 0 || args[i] == "--help" || args[i] == "-h") continue;
                kept.push_back(args[i]);
            }
            config = moekit::parse_moe_config(kept);
        }
    } catch (const moekit::UsageError&) {
        return 0;
    }
    // The resolved config written by every run reads back to itself.
    const nlohmann::json first = moekit::to_json(config);
    moekit::MoeConfig back;
    try {
        back = from_json(first);
    } catch (const moekit::UsageError& e) {
        std::fprintf(stderr, "a valid config's JSON was refused: %s\n%s\n", e.what(), first.dump().c_str());
        std::abort();
    }
    if (moekit::to_json(back) != first) {
        std::fprintf(stderr, "round trip changed the config:\n%s\n%s\n", first.dump().c_str(),
                     moekit::to_json(back).dump().c_str());
        std::abort();
    }
    return 0;
}
