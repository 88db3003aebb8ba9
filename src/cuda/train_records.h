// RecordCollector: the host side of the CUDA training engines' record ring (train_kernels.cuh): owns the ring on
// the device, two pinned copies, and hands finished steps' records to the host without waiting on the step just
// enqueued: collect() copies the ring asynchronously and returns the copy made at the previous call (or all,
// with wait). Used by src/cuda/train_engine.cu and src/cuda/ep_train_engine.cu. Tests: tests/gpu/test_cuda_train*.cu.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/train_kernels.cuh"
#include "train/trainer.h"

namespace moekit::cuda {

class RecordCollector {
public:
    // capacity: steps between collects; layer_counts / layer_losses: per layer, the device [E] i32 counts and
    // [4] losses (double if router_fp64, else float) the record kernel copies each step; tokens_per_step: for
    // the tokens/s of the records.
    RecordCollector(int64_t capacity, int64_t layers, int64_t experts, bool router_fp64,
                    const std::vector<const int32_t*>& layer_counts, const std::vector<const void*>& layer_losses,
                    int64_t tokens_per_step);
    ~RecordCollector();
    RecordCollector(const RecordCollector&) = delete;
    RecordCollector& operator=(const RecordCollector&) = delete;

    const RecordRing& ring() const { return ring_; }
    // One more step was enqueued on `stream` (the first one starts the clock).
    void stepped(cudaStream_t stream);
    // Records of finished steps, in order (see above). Copies on `stream`.
    std::vector<train::StepRecord> collect(bool wait, cudaStream_t stream);
    // The engine continues after `step` (a loaded state): nothing before it is to be collected.
    void restart_at(int64_t step) { host_step_ = copied_step_ = step; }
    int64_t device_bytes() const { return int64_t(scalars_.bytes() + counts_.bytes()); }

private:
    struct Pinned {
        double* scalars = nullptr;
        int32_t* counts = nullptr;
        cudaEvent_t done = nullptr;
        int64_t first_step = 0, last_step = 0;
    };
    train::StepRecord record_of(const Pinned& p, int64_t step, double tokens_per_s) const;

    RecordRing ring_;
    int64_t tokens_per_step_ = 0;
    DeviceBuffer<double> scalars_;
    DeviceBuffer<int32_t> counts_;
    DeviceBuffer<const int32_t*> layer_counts_;
    DeviceBuffer<const void*> layer_losses_;
    std::array<Pinned, 2> pinned_{};
    std::vector<Pinned*> pending_;
    int next_pinned_ = 0;
    cudaEvent_t start_event_ = nullptr;
    double last_done_ms_ = 0;
    bool started_ = false;
    int64_t host_step_ = 0, copied_step_ = 0;
};

}  // namespace moekit::cuda
