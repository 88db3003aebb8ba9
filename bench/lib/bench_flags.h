// Flag values of the standalone benchmarks (bench/bench_*.cu): a bad value is a moekit::UsageError naming the flag
// and the rule, which bench_main (bench_main.h) turns into exit status 2.
#pragma once
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "moekit/error.h"

namespace moekit::bench {

// An integer >= min, the whole string.
inline int64_t parse_int_flag(const std::string& flag, const std::string& v, int64_t min) {
    size_t used = 0;
    int64_t x = 0;
    try {
        x = std::stoll(v, &used);
    } catch (...) {
        used = 0;
    }
    MOEKIT_REQUIRE(used == v.size() && !v.empty() && x >= min, flag, "=", v, " must be an integer >= ", min);
    return x;
}

// A comma-separated list of such integers ("4,8").
inline std::vector<int64_t> parse_int_list_flag(const std::string& flag, const std::string& v, int64_t min) {
    std::vector<int64_t> out;
    for (size_t start = 0; start <= v.size();) {
        const size_t comma = std::min(v.find(',', start), v.size());
        out.push_back(parse_int_flag(flag, v.substr(start, comma - start), min));
        start = comma + 1;
    }
    return out;
}

// --iters N (>= 1), --warmup N (>= 0), --seed N and --json FILE, which the benchmarks share: true when `flag` was
// one of them (its value read with value()).
template <typename Value>
bool parse_run_flag(const std::string& flag, Value&& value, int& iters, int& warmup, uint64_t& seed,
                    std::string& json_path) {
    if (flag == "--iters")
        iters = int(parse_int_flag(flag, value(), 1));
    else if (flag == "--warmup")
        warmup = int(parse_int_flag(flag, value(), 0));
    else if (flag == "--seed")
        seed = uint64_t(parse_int_flag(flag, value(), 0));
    else if (flag == "--json")
        json_path = value();
    else
        return false;
    return true;
}

// --json FILE: its directory must exist (checked before the run, not after it).
inline void require_json_directory(const std::string& path) {
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    MOEKIT_REQUIRE(parent.empty() || std::filesystem::is_directory(parent), "--json=", path, ": directory ",
                   parent.string(), " does not exist");
}

}  // namespace moekit::bench
