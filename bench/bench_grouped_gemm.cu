// Grouped expert GEMMs per preset: fc1/fc2 forward, dgrad and wgrad timed for the grouped wgmma and mma.sync
// kernels, the synchronous cuBLAS baseline and dense cuBLAS GEMMs of the same FLOPs (the floor).
// usage: bench_grouped_gemm [--preset NAME|all] [--skew zipf:S] [--even] [--gemm NAME] [--iters N] [--warmup N]
//                           [--seed N] [--rounds R] [--json FILE] [--mlp] [--acceptance-only] [--gemm-tune on|off]
// (--gemm: one of fc1_fwd fc2_fwd fc2_dgrad fc2_wgrad fc1_dgrad fc1_wgrad only, e.g. under a profiler).
// (--rounds: every column timed once a round, rounds interleaved, the median printed; default 3).
// (--mlp: also the expert-MLP forward+backward table of `moekit bench`, without building the moekit tool).
// (--even: every expert T·k/E rows instead of routed counts: no tile computes padding rows; not with --skew).
// (--acceptance-only: only the per-shape choice, the sync baseline and dense cuBLAS, each round three measurements
//  close in time; the other columns print nan).
// (--gemm-tune: on (default), the auto column is the configuration measured per shape on this device at its first
//  launch, src/cuda/gemm_tuning.h, printed under the table; off, choose_for_shape's rule alone).
#include <cstdio>
#include <string>

#include "io/atomic_file.h"
#include "lib/bench_expert_mlp.h"
#include "lib/bench_flags.h"
#include "lib/bench_main.h"
#include "moekit/error.h"

int main(int argc, char** argv) {
    using namespace moekit::cuda::bench;
    std::string preset = "all", json_path;
    Options o;
    o.rounds = 3;
    bool mlp = false;
    return moekit::cuda::bench::bench_main("bench_grouped_gemm", [&]() -> int {
        for (int i = 1; i < argc; ++i) {
            std::string a = argv[i];
            auto value = [&]() -> std::string {
                MOEKIT_REQUIRE(i + 1 < argc, a, " needs a value");
                return argv[++i];
            };
            if (a == "--preset")
                preset = value();
            else if (a == "--skew")
                o.zipf_s = parse_skew(value());
            else if (a == "--rounds")
                o.rounds = int(moekit::bench::parse_int_flag(a, value(), 1));
            else if (moekit::bench::parse_run_flag(a, value, o.iters, o.warmup, o.seed, json_path))
                continue;  // --iters, --warmup, --seed, --json: the flags every benchmark shares
            else if (a == "--mlp")
                mlp = true;
            else if (a == "--even")
                o.even = true;
            else if (a == "--gemm")
                o.only_gemm = value();
            else if (a == "--acceptance-only")
                o.acceptance_only = true;
            else if (a == "--gemm-tune") {
                const std::string v = value();
                MOEKIT_REQUIRE(v == "on" || v == "off", "--gemm-tune=", v, " must be on or off");
                o.gemm_tune = v == "on";
            }
            else
                throw moekit::UsageError("unknown flag " + a);
        }
        MOEKIT_REQUIRE(o.rounds <= 100, "--rounds=", o.rounds, " must be at most 100");
        if (!json_path.empty()) moekit::bench::require_json_directory(json_path);
        MOEKIT_REQUIRE(!(o.even && o.zipf_s > 0), "--even gives every expert the same rows: not with --skew");
        if (preset != "all") find_preset(preset);  // an unknown name is a usage error (exit 2), not an empty run
        nlohmann::json all = nlohmann::json::array();
        for (auto& p : presets()) {
            if (preset != "all" && preset != p.name) continue;
            auto r = bench_gemms(p, o);
            std::printf("%s", format_gemm_table(r).c_str());
            std::fflush(stdout);
            all.push_back(r);
            if (mlp) {
                auto m = bench_expert_mlp(p, o);
                std::printf("%s", format_mlp_table(m).c_str());
                std::fflush(stdout);
                all.push_back(m);
            }
        }
        if (!json_path.empty()) moekit::io::write_file_atomically(json_path, all.dump(1) + "\n");
        return 0;
    });
}
