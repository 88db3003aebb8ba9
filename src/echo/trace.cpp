// Routing traces (see trace.h): JSON reading with errors naming the file and the key, atomic writing,
// re-homing to another EP, and the synthetic Zipf top-k generator.
#include "echo/trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include "core/rng.h"
#include "io/atomic_file.h"
#include "moekit/error.h"

namespace moekit::echo {

namespace {

constexpr uint64_t kStreamPermutation = 0xec40'0001;  // rng stream of the popularity permutation
constexpr uint64_t kStreamTokens = 0xec40'0002;       // base stream of the token draws

int64_t get_int(const nlohmann::json& j, const std::string& key, const std::string& where, const std::string& source) {
    MOEKIT_REQUIRE(j.contains(key), source, ": ", where.empty() ? "" : where + ": ", "missing key '", key, "'");
    const auto& v = j.at(key);
    MOEKIT_REQUIRE(v.is_number_integer(), source, ": key '", where.empty() ? key : where + "." + key,
                   "' must be an integer (got ", v.dump(), ")");
    return v.get<int64_t>();
}

}  // namespace

void validate(const RoutingTrace& t, const std::string& source) {
    MOEKIT_REQUIRE(t.num_experts > 0, source, ": num_experts=", t.num_experts, " must be > 0");
    MOEKIT_REQUIRE(t.ep >= 1, source, ": expert_model_parallel_size=", t.ep, " must be >= 1");
    MOEKIT_REQUIRE(t.num_experts % t.ep == 0, source, ": num_experts=", t.num_experts,
                   " must be divisible by expert_model_parallel_size=", t.ep, " (experts are homed E/EP per rank)");
    MOEKIT_REQUIRE(t.topk >= 1 && t.topk <= t.num_experts, source, ": topk=", t.topk,
                   " must be in [1, num_experts=", t.num_experts, "]");
    for (size_t i = 0; i < t.steps.size(); ++i) {
        const auto& s = t.steps[i];
        MOEKIT_REQUIRE(int64_t(s.counts.size()) == t.ep * t.num_experts, source, ": steps[", i, "].counts has ",
                       s.counts.size(), " entries, expected EP*E = ", t.ep * t.num_experts);
        for (size_t k = 0; k < s.counts.size(); ++k)
            MOEKIT_REQUIRE(s.counts[k] >= 0, source, ": steps[", i, "].counts[", k / t.num_experts, "][",
                           k % t.num_experts, "]=", s.counts[k], " must be >= 0");
    }
}

nlohmann::json to_json(const RoutingTrace& t) {
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& s : t.steps) {
        nlohmann::json rows = nlohmann::json::array();
        for (int64_t r = 0; r < t.ep; ++r)
            rows.push_back(
                std::vector<int64_t>(s.counts.begin() + r * t.num_experts, s.counts.begin() + (r + 1) * t.num_experts));
        steps.push_back({{"layer", s.layer}, {"counts", rows}});
    }
    return {{"num_experts", t.num_experts}, {"expert_model_parallel_size", t.ep}, {"topk", t.topk}, {"steps", steps}};
}

RoutingTrace trace_from_json(const nlohmann::json& j, const std::string& source) {
    MOEKIT_REQUIRE(j.is_object(), source,
                   ": a routing trace must be a JSON object with num_experts, "
                   "expert_model_parallel_size, topk and steps");
    RoutingTrace t;
    t.num_experts = get_int(j, "num_experts", "", source);
    t.ep = get_int(j, "expert_model_parallel_size", "", source);
    t.topk = get_int(j, "topk", "", source);
    MOEKIT_REQUIRE(j.contains("steps"), source, ": missing key 'steps'");
    MOEKIT_REQUIRE(j["steps"].is_array(), source, ": key 'steps' must be an array");
    MOEKIT_REQUIRE(t.num_experts > 0 && t.ep >= 1, source, ": num_experts=", t.num_experts,
                   " and expert_model_parallel_size=", t.ep, " must be positive");
    for (size_t i = 0; i < j["steps"].size(); ++i) {
        const auto& js = j["steps"][i];
        const std::string where = str("steps[", i, "]");
        MOEKIT_REQUIRE(js.is_object(), source, ": ", where, " must be an object {\"layer\": l, \"counts\": [...]}");
        RoutingTraceStep s;
        s.layer = get_int(js, "layer", where, source);
        MOEKIT_REQUIRE(js.contains("counts"), source, ": ", where, ": missing key 'counts'");
        const auto& rows = js["counts"];
        MOEKIT_REQUIRE(rows.is_array() && int64_t(rows.size()) == t.ep, source, ": ", where,
                       ".counts must be an array of expert_model_parallel_size=", t.ep, " rows (got ",
                       rows.is_array() ? str(rows.size(), " rows") : rows.type_name(), ")");
        for (size_t r = 0; r < rows.size(); ++r) {
            const auto& row = rows[r];
            MOEKIT_REQUIRE(row.is_array() && int64_t(row.size()) == t.num_experts, source, ": ", where, ".counts[", r,
                           "] must be an array of num_experts=", t.num_experts, " integers (got ",
                           row.is_array() ? str(row.size(), " entries") : row.type_name(), ")");
            for (size_t e = 0; e < row.size(); ++e) {
                MOEKIT_REQUIRE(row[e].is_number_integer() && row[e].get<int64_t>() >= 0, source, ": ", where,
                               ".counts[", r, "][", e, "]=", row[e].dump(), " must be an integer >= 0");
                s.counts.push_back(row[e].get<int64_t>());
            }
        }
        t.steps.push_back(std::move(s));
    }
    validate(t, source);
    return t;
}

RoutingTrace read_routing_trace(const std::string& path) {
    std::ifstream in(path);
    MOEKIT_REQUIRE(in.good(), path, ": cannot open the routing trace");
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
        throw UsageError(str(path, ": not valid JSON: ", e.what()));
    }
    return trace_from_json(j, path);
}

void write_routing_trace(const std::string& path, const RoutingTrace& t) {
    validate(t, path);
    io::write_file_atomically(path, to_json(t).dump() + "\n");
}

RoutingTrace rehome(const RoutingTrace& t, int64_t new_ep, const std::string& flag) {
    MOEKIT_REQUIRE(new_ep >= 1, flag, "=", new_ep, " must be >= 1");
    MOEKIT_REQUIRE(t.num_experts % new_ep == 0, flag, "=", new_ep, ": num_experts=", t.num_experts,
                   " of the trace must be divisible by it");
    MOEKIT_REQUIRE(t.ep % new_ep == 0 || new_ep % t.ep == 0, flag, "=", new_ep,
                   " must divide or be a multiple of the trace's expert_model_parallel_size=", t.ep,
                   " (source ranks are merged or split)");
    const int64_t E = t.num_experts;
    RoutingTrace out = t;
    out.ep = new_ep;
    for (auto& s : out.steps) {
        std::vector<int64_t> c(new_ep * E, 0);
        for (int64_t r = 0; r < t.ep; ++r)
            for (int64_t e = 0; e < E; ++e) {
                const int64_t v = s.counts[r * E + e];
                if (t.ep >= new_ep) {
                    c[(r / (t.ep / new_ep)) * E + e] += v;
                } else {
                    const int64_t parts = new_ep / t.ep;
                    for (int64_t q = 0; q < parts; ++q) c[(r * parts + q) * E + e] = v / parts + (q < v % parts);
                }
            }
        s.counts = std::move(c);
    }
    return out;
}

std::vector<int32_t> zipf_popularity(const ZipfRouting& z) {
    std::vector<int32_t> perm(z.num_experts);
    std::iota(perm.begin(), perm.end(), 0);
    Rng rng(z.seed, kStreamPermutation);
    for (int64_t i = z.num_experts - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);  // Fisher-Yates
    return perm;
}

std::vector<int32_t> sample_zipf_tokens(const ZipfRouting& z, int64_t step, int64_t rank, int64_t num_tokens) {
    const int64_t E = z.num_experts, k = z.topk;
    MOEKIT_REQUIRE(k >= 1 && k <= E, "--moe-router-topk=", k, " must be in [1, --num-experts=", E, "]");
    const std::vector<int32_t> popular = zipf_popularity(z);
    std::vector<double> cdf(E);  // over popularity ranks
    double sum = 0;
    for (int64_t i = 0; i < E; ++i) cdf[i] = sum += std::pow(double(i + 1), -z.zipf_s);
    Rng rng(z.seed, kStreamTokens + uint64_t(step) * 0x1'0000'0000ull + uint64_t(rank));
    std::vector<int32_t> out(num_tokens * k);
    std::vector<uint8_t> taken(E, 0);
    std::vector<int64_t> picked(k);  // popularity ranks of the current token
    for (int64_t t = 0; t < num_tokens; ++t) {
        int32_t* row = &out[t * k];
        // Successive draws proportional to w among the experts not yet taken (= without replacement):
        // rejection of taken ones, then an exact scan of the remaining weights if rejections pile up.
        for (int64_t j = 0; j < k; ++j) {
            int64_t pick = -1;
            for (int tries = 0; tries < 64 && pick < 0; ++tries) {
                const double u = rng.uniform() * sum;
                int64_t i = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
                if (i >= E) i = E - 1;
                if (!taken[i]) pick = i;
            }
            if (pick < 0) {
                double left = 0;
                for (int64_t i = 0; i < E; ++i)
                    if (!taken[i]) left += std::pow(double(i + 1), -z.zipf_s);
                double u = rng.uniform() * left;
                for (int64_t i = 0; i < E && pick < 0; ++i) {
                    if (taken[i]) continue;
                    u -= std::pow(double(i + 1), -z.zipf_s);
                    if (u < 0) pick = i;
                }
                for (int64_t i = E - 1; pick < 0; --i)  // rounding left u >= 0: the last free one
                    if (!taken[i]) pick = i;
            }
            taken[pick] = 1;
            picked[j] = pick;
            row[j] = popular[pick];
        }
        for (int64_t j = 0; j < k; ++j) taken[picked[j]] = 0;
    }
    return out;
}

RoutingTrace synthetic_zipf_trace(const ZipfRouting& z, int64_t ep, int64_t tokens_per_rank, int64_t steps) {
    RoutingTrace t;
    t.num_experts = z.num_experts;
    t.ep = ep;
    t.topk = z.topk;
    validate(t, "--synthetic");
    for (int64_t s = 0; s < steps; ++s) {
        RoutingTraceStep st;
        st.counts.assign(ep * z.num_experts, 0);
        for (int64_t r = 0; r < ep; ++r)
            for (int32_t e : sample_zipf_tokens(z, s, r, tokens_per_rank)) ++st.counts[r * z.num_experts + e];
        t.steps.push_back(std::move(st));
    }
    return t;
}

double parse_zipf(const std::string& spec, const std::string& flag) {
    MOEKIT_REQUIRE(spec.rfind("zipf:", 0) == 0, flag, "=", spec, ": expected zipf:S (e.g. zipf:1.2)");
    const std::string v = spec.substr(5);
    char* end = nullptr;
    const double s = std::strtod(v.c_str(), &end);
    MOEKIT_REQUIRE(!v.empty() && end == v.c_str() + v.size() && std::isfinite(s) && s >= 0, flag, "=", spec,
                   ": S must be a finite number >= 0");
    return s;
}

}  // namespace moekit::echo
