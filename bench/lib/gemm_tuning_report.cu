// The measured per-shape choices in the benchmarks' reports (gemm_tuning_report.h).
#include "lib/gemm_tuning_report.h"

#include <cmath>
#include <cstdio>

#include "cuda/gemm_tuning.h"

namespace moekit::cuda::bench {

void apply_gemm_tuning(bool on) { set_gemm_tuning(on ? 1 : 0); }

nlohmann::json gemm_tuning_json() {
    nlohmann::json out = nlohmann::json::array();
    for (const GemmTuningRecord& r : gemm_tuning_records()) {
        nlohmann::json c = nlohmann::json::object();
        for (size_t i = 0; i < r.names.size(); ++i) c[r.names[i]] = std::isfinite(r.ms[i]) ? nlohmann::json(r.ms[i]) : nullptr;
        out.push_back({{"op", r.op},
                       {"groups", r.shape.num_groups},
                       {"max_rows", r.shape.max_rows},
                       {"n", r.shape.n},
                       {"k", r.shape.k},
                       {"candidates_ms", c},
                       {"rule", r.names[size_t(r.rule)]},
                       {"kept", r.names[size_t(r.kept)]}});
    }
    return out;
}

std::string format_gemm_tuning_lines(const nlohmann::json& tuning) {
    std::string out;
    char cell[96];
    for (const auto& t : tuning) {
        std::snprintf(cell, sizeof cell, "  measured choice: %s G=%lld rows=%lld n=%lld k=%lld:",
                      t["op"].get<std::string>().c_str(), (long long)t["groups"].get<int64_t>(),
                      (long long)t["max_rows"].get<int64_t>(), (long long)t["n"].get<int64_t>(),
                      (long long)t["k"].get<int64_t>());
        out += cell;
        const std::string rule = t["rule"].get<std::string>(), kept = t["kept"].get<std::string>();
        for (const auto& [name, ms] : t["candidates_ms"].items()) {
            if (ms.is_null())
                std::snprintf(cell, sizeof cell, " %s failed", name.c_str());
            else
                std::snprintf(cell, sizeof cell, " %s %.3f%s", name.c_str(), ms.get<double>(),
                              name == kept ? "*" : name == rule ? "(rule)" : "");
            out += cell;
        }
        out += kept == rule ? " (the rule's kept)\n" : " (measured choice kept)\n";
    }
    return out;
}

}  // namespace moekit::cuda::bench
