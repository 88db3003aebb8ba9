// Routing traces: per step and layer, counts[r][e] = tokens of source rank r routed to expert e (experts
// homed in order, E/EP per rank). JSON format (issue 9):
//   {"num_experts": E, "expert_model_parallel_size": EP, "topk": k,
//    "steps": [{"layer": l, "counts": [[c_0_0, ..., c_0_{E-1}], ..., [c_{EP-1}_0, ...]]}, ...]}
// Read by `moekit plan` (tools/cmd_plan.cpp); written by train/bench through write_routing_trace().
// A synthetic Zipf generator stands in for a real router. Tests: tests/cpu/test_cmd_plan.cpp.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moekit::echo {

struct RoutingTraceStep {
    int64_t layer = 0;
    std::vector<int64_t> counts;  // [EP, E] row-major (source rank major)
};

struct RoutingTrace {
    int64_t num_experts = 0;  // E
    int64_t ep = 1;           // EP source ranks, E % EP == 0
    int64_t topk = 1;         // k (informational; counts of a rank sum to tokens * k)
    std::vector<RoutingTraceStep> steps;
};

// Checks the shape rules; `source` (file name) prefixes every UsageError.
void validate(const RoutingTrace& t, const std::string& source);
nlohmann::json to_json(const RoutingTrace& t);
// Throws UsageError naming `source` and the key (e.g. "steps[2].counts[1]") that breaks the format.
RoutingTrace trace_from_json(const nlohmann::json& j, const std::string& source);
RoutingTrace read_routing_trace(const std::string& path);
// Written atomically (io::write_file_atomically); the call the train/bench --routing-trace writers make.
void write_routing_trace(const std::string& path, const RoutingTrace& t);

// Re-homes the counts onto `new_ep` ranks (E % new_ep == 0): source rows are merged in consecutive groups
// (new_ep divides EP) or each row is split into EP/new_ep near-equal rows (EP divides new_ep, the first
// rows get the remainder). Other ratios throw UsageError naming `flag`.
RoutingTrace rehome(const RoutingTrace& t, int64_t new_ep, const std::string& flag);

// Token-level synthetic routing: expert popularity w_i = 1 / (i + 1)^zipf_s over a random permutation of
// the experts (fixed for the whole trace), each token draws k distinct experts without replacement
// proportionally to w. Deterministic in seed.
struct ZipfRouting {
    int64_t num_experts = 0, topk = 1;
    double zipf_s = 1.0;
    uint64_t seed = 0;
};
// The experts of `num_tokens` tokens of (step, rank): [num_tokens, k], each row distinct experts.
std::vector<int32_t> sample_zipf_tokens(const ZipfRouting& z, int64_t step, int64_t rank, int64_t num_tokens);
// The popularity order: popular[i] = expert with weight 1 / (i + 1)^s.
std::vector<int32_t> zipf_popularity(const ZipfRouting& z);
RoutingTrace synthetic_zipf_trace(const ZipfRouting& z, int64_t ep, int64_t tokens_per_rank, int64_t steps);
// "zipf:1.2" -> 1.2; throws UsageError naming `flag` otherwise.
double parse_zipf(const std::string& spec, const std::string& flag);

}  // namespace moekit::echo
