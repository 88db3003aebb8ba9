// The benchmarks' printed tables (bench/lib/bench_expert_mlp.h): host code only, no GPU needed, but built with the
// CUDA benchmarks' library. A timed column without a head of its own must still be printed: a column added for an
// A/B once reached only the JSON, and no JSON was asked for (2026-11-28).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "lib/bench_expert_mlp.h"

namespace {

nlohmann::json one_gemm_result(nlohmann::json gemm) {
    nlohmann::json r = {{"preset", "dsv3-ep8"}, {"rows", 32768}, {"min_count", 973}, {"max_count", 1090},
                        {"zipf_s", 0.0},        {"rounds", 3},   {"device", "a test"}};
    gemm["name"] = "fc1_fwd";
    gemm["op"] = "nt";
    gemm["gflop"] = 1924.1;
    r["gemms"] = nlohmann::json::array({gemm});
    return r;
}

TEST(BenchTables, GemmTableListsColumnsWithoutAHead) {
    const std::string t = moekit::cuda::bench::format_gemm_table(one_gemm_result(
        {{"auto_ms", 3.058}, {"sync_ms", 2.981}, {"dense_ms", 2.849}, {"cutlass_new_tile_ms", 3.1234},
         {"auto_ms_rounds", {3.0, 3.1, 3.2}}}));
    EXPECT_NE(t.find("fc1_fwd other columns (ms): cutlass_new_tile_ms 3.123"), std::string::npos) << t;
    // The headed columns stay in the table only, and a column's rounds (an array) are not a column.
    const std::string other = t.substr(t.find("other columns"));
    EXPECT_EQ(other.find("auto_ms"), std::string::npos) << t;
    EXPECT_EQ(other.find("dense_ms"), std::string::npos) << t;
    EXPECT_NE(t.find("3.058"), std::string::npos) << t;  // auto_ms, in its own column
}

TEST(BenchTables, GemmTableHeaderShowsThePaddedRowTiles) {
    nlohmann::json r = one_gemm_result({{"auto_ms", 3.058}, {"sync_ms", 2.981}, {"dense_ms", 2.849}});
    r["rows_on_128_row_tiles"] = 1.0612;
    EXPECT_NE(moekit::cuda::bench::format_gemm_table(r).find("counts 973..1090 (1.061x computed on 128-row tiles)"),
              std::string::npos)
        << moekit::cuda::bench::format_gemm_table(r);
}

TEST(BenchTables, GemmTableWithOnlyHeadedColumnsHasNoOtherLine) {
    const std::string t = moekit::cuda::bench::format_gemm_table(
        one_gemm_result({{"auto_ms", 3.058}, {"sync_ms", 2.981}, {"dense_ms", 2.849}, {"cutlass_pp192_ms", 3.0}}));
    EXPECT_EQ(t.find("other columns"), std::string::npos) << t;
    EXPECT_NE(t.find("0.93x"), std::string::npos) << t;  // dense / auto, the acceptance ratio
}

}  // namespace
