// The names of `moekit bench --variant`'s A/B switches (bench_layer.cu pairs each with its setter), in one list for
// the flag's check and message (tools/cmd_bench.cpp, which also builds without CUDA) and the benchmark. Plain C++.
#pragma once
#include <string>

namespace moekit::bench {

inline constexpr const char* kLayerVariantNames[] = {"glu-forward",   "glu-backward", "gather-fc1",
                                                     "tma-wgrad",     "pingpong-192", "swap-pingpong",
                                                     "wgrad-192",     "wgrad-192t",   "wgrad-split",
                                                     "wgrad-overlap", "pingpong-swapped", "long-k-coop",
                                                     "gemm-tune"};

inline bool is_layer_variant(const std::string& name) {
    for (const char* v : kLayerVariantNames)
        if (name == v) return true;
    return false;
}

// "a, b, ... or z": what the flag's error lists.
inline std::string layer_variant_list() {
    std::string s;
    constexpr int n = int(sizeof(kLayerVariantNames) / sizeof(kLayerVariantNames[0]));
    for (int i = 0; i < n; ++i) s += std::string(i == 0 ? "" : i + 1 == n ? " or " : ", ") + kLayerVariantNames[i];
    return s;
}

}  // namespace moekit::bench
