// A block's threads over the columns of a [n, columns] array, a column summed by several threads at once: the
// routing plan's per-expert chunk scan (permute.cu) and the loss statistics' column sums and fold (losses.cu).
// One thread walking a whole column waited on each load (qwen3-30b: 41 us of loss column statistics, 35 us of plan
// scan; ncu, H200, 2026-11-27).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::cuda {

// The threads as `parts` groups of `width` lanes (at most max_parts groups; threads past them idle): lane l of
// every group takes column l (and l + width, ... in rounds), group q the q-th run of the n items of a column. The
// runs are then combined in run order (fixed: reproducible).
struct ColumnRuns {
    int width, parts, lane, part;
    int64_t lo, hi;  // this thread's run of the items
    __device__ ColumnRuns(int64_t columns, int threads, int64_t n, int max_parts) {
        width = int(min(columns, int64_t(threads)));
        parts = min(max_parts, threads / width);
        lane = int(threadIdx.x) % width, part = int(threadIdx.x) / width;
        const int64_t per = (n + parts - 1) / parts;
        lo = min(n, int64_t(part) * per), hi = min(n, lo + per);
    }
    __device__ bool active() const { return part < parts; }
    // Slot of run q of this thread's column in a [parts, width] scratch array.
    __device__ int slot(int q) const { return q * width + lane; }
};

}  // namespace moekit::cuda
