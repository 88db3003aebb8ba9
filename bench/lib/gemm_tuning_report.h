// The grouped GEMMs' measured per-shape choices (src/cuda/gemm_tuning.h) in a benchmark's JSON and table: which
// candidates each tuned shape timed, and which it kept. Host-only header (no CUDA types).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace moekit::cuda::bench {

// Turns the tuning on or off for a benchmark run (Options::gemm_tune).
void apply_gemm_tuning(bool on);
// Every shape tuned so far in this process: [{op, groups, max_rows, n, k, candidates: {name: ms}, rule, kept}].
nlohmann::json gemm_tuning_json();
// "  measured choice: nt G=32 rows=32768 n=4096 k=7168: cl-coop 3.111(rule) tma 2.999* ..." lines; "" for none.
std::string format_gemm_tuning_lines(const nlohmann::json& tuning);

}  // namespace moekit::cuda::bench
