// The order in which a benchmark round times its n measurements: round r runs row r of a Williams design, so over n
// rounds (2n for odd n: the rows, then their mirror images) every measurement runs directly after every other one
// equally often. With one fixed cycle (round r starting at r) each measurement always followed the same one, and the
// dense floor always followed the synchronous baseline, whose host waits let the clocks recover before it.
// Plain C++ (tests/cpu/test_balanced_order.cpp checks the design).
#pragma once
#include <algorithm>
#include <vector>

namespace moekit::bench {

inline std::vector<int> balanced_order(int n, int round) {
    std::vector<int> row(std::max(n, 0));
    // First row 0, 1, n-1, 2, n-2, ...; row r adds r to each (mod n).
    for (int j = 0, lo = 1, hi = n - 1; j < n; ++j) row[j] = ((j == 0 ? 0 : j % 2 == 1 ? lo++ : hi--) + round) % n;
    if (n % 2 == 1 && (round / n) % 2 == 1) std::reverse(row.begin(), row.end());
    return row;
}

}  // namespace moekit::bench
