// Which configuration a measured per-shape tuning keeps (src/cuda/gemm_tuning.cu): the rule's choice unless another
// candidate is faster by more than the noise. On a power-capped card (H100 at 700 W: 1.34-1.47 GHz while a GEMM
// runs) one kernel's time moves by 2-3 % between rounds, so a candidate must beat the rule by `margin` to replace
// it; a tie keeps what the rule, measured over many sessions, picked. Plain C++, tested on the CPU
// (tests/cpu/test_gemm_tuning.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace moekit {

// The median of a candidate's timed rounds (the upper one of an even count); NaN for none.
inline double tuning_median(std::vector<double> ms) {
    if (ms.empty()) return std::nan("");
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// Index of the candidate to keep: candidate `rule`, unless the fastest finite one takes less than (1 - margin) of
// its time (or the rule's own time is not finite: it failed to run). A candidate that failed has a non-finite time
// and is never kept. -1 when none ran.
inline int pick_tuned(const std::vector<double>& median_ms, int rule = 0, double margin = 0.02) {
    int best = -1;
    for (int i = 0; i < int(median_ms.size()); ++i)
        if (std::isfinite(median_ms[size_t(i)]) && (best < 0 || median_ms[size_t(i)] < median_ms[size_t(best)]))
            best = i;
    if (best < 0) return -1;
    const bool rule_ran = rule >= 0 && rule < int(median_ms.size()) && std::isfinite(median_ms[size_t(rule)]);
    if (rule_ran && !(median_ms[size_t(best)] < (1.0 - margin) * median_ms[size_t(rule)])) return rule;
    return best;
}

}  // namespace moekit
