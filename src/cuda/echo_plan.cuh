// ECHO planner on the device: global counts [EP, E] int64 (already on the device) -> the plan, in ONE
// thread block with no host sync and no allocation, so it can be captured in a CUDA graph. Runs the
// helpers of src/core/echo_plan_math.h in the same order as the CPU executor (src/echo/planner.cpp), so
// the two plans are equal bit for bit. Test: tests/gpu/test_echo_plan.cu. Bench: bench/bench_echo_plan.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/echo_plan_math.h"

namespace moekit::cuda {

// Device arrays of a plan (shapes as echo::EchoPlan, src/echo/planner.h).
struct EchoDevicePlan {
    int32_t* slot_expert = nullptr;       // [EP*S] expert cloned by slot j (on rank j / S), -1 = empty
    int64_t* slot_tokens = nullptr;       // [EP*S] tokens of slot j
    int64_t* clone_tokens = nullptr;      // [EP (source), EP*S]
    int64_t* home_tokens = nullptr;       // [EP (source), E]
    int64_t* rank_load_before = nullptr;  // [EP]
    int64_t* rank_load_after = nullptr;   // [EP]
    int64_t* summary = nullptr;           // [2]: target, number of clones
};

// counts: [EP, E] int64 on the device. Enqueues one kernel on `stream`; throws UsageError for dims the
// one-block planner cannot take (echo::validate's rules, shared memory over 48 KiB).
void echo_plan(const EchoDims& dims, EchoAlgorithm algorithm, const int64_t* counts, const EchoDevicePlan& plan,
               cudaStream_t stream);

// Loads the planner's kernel now (outside a step whose device barriers spin; dispatch_budgeted.cu).
void echo_plan_preload();

// Where the planner's time goes (bench_echo_plan --profile): the same plan from an instantiation that
// stamps the SM clock (clock64, cycles) at the start and after each phase. profile: device int64
// [kEchoPlanProfileSize] = kEchoPlanPhases + 1 stamps, then search rounds, then listed experts.
constexpr int kEchoPlanPhases = 5;
constexpr int kEchoPlanProfileSize = kEchoPlanPhases + 3;
inline const char* echo_plan_phase_name(int phase) {
    constexpr const char* kNames[kEchoPlanPhases] = {"stats (totals, loads)", "walk list + receivers",
                                                     "search rounds", "recorded walk (thread 0)",
                                                     "split + loads after"};
    return phase >= 0 && phase < kEchoPlanPhases ? kNames[phase] : "?";
}
void echo_plan_profiled(const EchoDims& dims, EchoAlgorithm algorithm, const int64_t* counts,
                        const EchoDevicePlan& plan, int64_t* profile, cudaStream_t stream);

}  // namespace moekit::cuda
