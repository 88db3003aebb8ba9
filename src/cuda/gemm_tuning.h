// The grouped GEMMs' per-shape choice measured on the running device (grouped_gemm.cu's launch): where tuning is
// on, the first launch of a shape outside a graph capture times the candidate configurations on its own operands
// (candidate 0 = choose_for_shape's rule, which a candidate must beat by 2 %: core/gemm_tuning_math.h), launches the
// kept one, and every later launch of that shape on that device, captured or not, takes it; a shape first launched
// inside a capture keeps the rule for good (the graph and later eager launches compute the same bits). Why: the rule
// was tuned on H200s and an H100 (lower DRAM bandwidth, a 700 W cap) ranks the same configurations differently
// (docs/perf.md: ping-pong took 1.6x cooperative's time there on long reductions); a measured choice follows the card
// it runs on. On by default; off (MOEKIT_GEMM_TUNE=0, set_gemm_tuning(0), `--gemm-tune off` in the benches), a
// launch's choice is the rule's, the same in every process (bitwise reproducible across runs). Tuning synchronises
// the host with the stream, so it only happens where the launch is eager; a tn tunes only where it overwrites its
// gradient (accumulating candidates would add into it), and a launch with the fused epilogues, a second operand base,
// a partial grid or an unaligned C keeps the rule. Tests: tests/gpu/test_grouped_gemm.cu (the tuned backend on every
// shape, against the oracle).
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_cutlass.h"

namespace moekit::cuda {

enum class GroupedGemmKernel;  // grouped_gemm_kernels.cuh

// 1 = tune and take measured choices, 0 = the rule only (measured choices kept, not used); -1 (default) =
// MOEKIT_GEMM_TUNE=1|0, else 1. Defined beside the other switches of the choice (grouped_gemm.cu).
void set_gemm_tuning(int on);
bool gemm_tuning_enabled();

// One tuned shape: every candidate's median time over the rounds (NaN: it could not run), which was kept.
struct GemmTuningRecord {
    std::string op;  // "nt", "nn", "tn"
    GroupedGemmShape shape;
    int device = 0;
    std::vector<std::string> names;  // bench_grouped_gemm's column names: "cl-coop", "tma", ...
    std::vector<double> ms;
    int rule = 0, kept = 0;  // indices into names / ms
};
std::vector<GemmTuningRecord> gemm_tuning_records();  // in the order tuned, this process
void clear_gemm_tuning();                             // forgets every measured choice (tests)

// What grouped_gemm.cu's launch asks (not for other callers).
struct GemmChoice {
    GroupedGemmKernel kernel;
    CutlassConfig config;
    std::string name;
};
namespace gemm_tuning_detail {
// The measured choice of (op, shape) on the current device, if tuned or kept: true and *out set.
bool lookup(const char* op, const GroupedGemmShape& s, GemmChoice* out);
// Fixes `rule` as (op, shape)'s choice on the current device without timing anything (its first launch is inside a
// graph capture, where the host cannot wait): no record; clear_gemm_tuning forgets it.
void keep(const char* op, const GroupedGemmShape& s, const GemmChoice& rule);
// Times run(c) for every candidate on `stream` (one warm launch each, the rule back to back for a quarter second so
// the clock is the one under sustained load, then five interleaved rounds of two launches queued without a wait),
// records the result and returns the kept candidate (not yet launched for the caller's result). A candidate that
// throws is left out. candidates[0] is the rule's choice.
GemmChoice tune(const char* op, const GroupedGemmShape& s, const std::vector<GemmChoice>& candidates,
                const std::function<void(const GemmChoice&)>& run, cudaStream_t stream);
}  // namespace gemm_tuning_detail

}  // namespace moekit::cuda
