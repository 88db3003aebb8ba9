// A tiny fork-join helper for the CPU reference: parallel_for splits [0, n) into contiguous
// chunks run on std::threads. Work items must write disjoint outputs, so results do not depend
// on the thread count (the reference stays deterministic). Nested calls run serially.
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moekit::cpu {

// Threads used by parallel_for: the hardware's, at most 16.
inline int num_threads() {
    static const int n = std::clamp(int(std::thread::hardware_concurrency()), 1, 16);
    return n;
}

inline bool& in_parallel_region() {
    thread_local bool inside = false;
    return inside;
}

// fn(begin, end) over chunks of [0, n); only splits when there are at least 2 * min_chunk items,
// so small jobs do not pay for thread start-up.
template <typename Fn>
void parallel_for(int64_t n, int64_t min_chunk, Fn&& fn) {
    if (n <= 0) return;
    const int64_t max_parts = std::max<int64_t>(1, n / std::max<int64_t>(1, min_chunk));
    const int64_t parts = in_parallel_region() ? 1 : std::min<int64_t>(num_threads(), max_parts);
    if (parts <= 1) {
        fn(int64_t(0), n);
        return;
    }
    std::vector<std::thread> threads;
    threads.reserve(size_t(parts - 1));
    auto chunk = [&](int64_t p) { return n * p / parts; };
    for (int64_t p = 1; p < parts; ++p) {
        threads.emplace_back([&, p] {
            in_parallel_region() = true;
            fn(chunk(p), chunk(p + 1));
        });
    }
    in_parallel_region() = true;
    fn(chunk(0), chunk(1));
    in_parallel_region() = false;
    for (auto& t : threads) t.join();
}

}  // namespace moekit::cpu
