// RecordCollector (see train_records.h).
#include <algorithm>

#include "cuda/train_records.h"
#include "moekit/error.h"

namespace moekit::cuda {

RecordCollector::RecordCollector(int64_t capacity, int64_t layers, int64_t experts, bool router_fp64,
                                 const std::vector<const int32_t*>& layer_counts,
                                 const std::vector<const void*>& layer_losses, int64_t tokens_per_step)
    : tokens_per_step_(tokens_per_step) {
    MOEKIT_CHECK(int64_t(layer_counts.size()) == layers && int64_t(layer_losses.size()) == layers, "record sources of ",
                 layer_counts.size(), " layers for ", layers);
    ring_.capacity = std::max<int64_t>(capacity, 1);
    ring_.num_layers = int(layers), ring_.num_experts = int(experts), ring_.router_fp64 = router_fp64;
    scalars_.resize(ring_.capacity * kRecordScalars), counts_.resize(ring_.capacity * layers * experts);
    layer_counts_.resize(layers), layer_losses_.resize(layers);
    layer_counts_.upload(layer_counts), layer_losses_.upload(layer_losses);
    ring_.scalars = scalars_.get(), ring_.counts = counts_.get();
    ring_.layer_counts = layer_counts_.get(), ring_.layer_losses = layer_losses_.get();
    for (Pinned& p : pinned_) {
        MOEKIT_CUDA_CHECK(cudaMallocHost(&p.scalars, scalars_.bytes()));
        MOEKIT_CUDA_CHECK(cudaMallocHost(&p.counts, counts_.bytes()));
        MOEKIT_CUDA_CHECK(cudaEventCreate(&p.done));
    }
    MOEKIT_CUDA_CHECK(cudaEventCreate(&start_event_));
}

RecordCollector::~RecordCollector() {
    for (Pinned& p : pinned_) {
        if (p.done) cudaEventSynchronize(p.done);
        if (p.scalars) cudaFreeHost(p.scalars);
        if (p.counts) cudaFreeHost(p.counts);
        if (p.done) cudaEventDestroy(p.done);
    }
    if (start_event_) cudaEventDestroy(start_event_);
}

void RecordCollector::stepped(cudaStream_t stream) {
    if (!started_) {
        MOEKIT_CUDA_CHECK(cudaEventRecord(start_event_, stream));
        started_ = true;
    }
    ++host_step_;
}

std::vector<train::StepRecord> RecordCollector::collect(bool wait, cudaStream_t stream) {
    std::vector<train::StepRecord> out;
    if (host_step_ > copied_step_) {
        // Copy the ring asynchronously into the pinned buffer not holding the pending copy.
        Pinned& p = pinned_[size_t(next_pinned_)];
        next_pinned_ ^= 1;
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(p.scalars, scalars_.get(), scalars_.bytes(), cudaMemcpyDeviceToHost, stream));
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(p.counts, counts_.get(), counts_.bytes(), cudaMemcpyDeviceToHost, stream));
        MOEKIT_CUDA_CHECK(cudaEventRecord(p.done, stream));
        p.first_step = copied_step_ + 1, p.last_step = host_step_;
        copied_step_ = host_step_;
        pending_.push_back(&p);
    }
    // Hand over every copy but the newest (long finished: the GPU is at most one interval behind), or all.
    while (pending_.size() > (wait ? 0u : 1u)) {
        Pinned& p = *pending_.front();
        pending_.erase(pending_.begin());
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(p.done));
        // Times from the run's start event (never re-recorded): the pinned buffers' events are reused.
        float since_start_ms = 0;
        MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&since_start_ms, start_event_, p.done));
        const double ms = double(since_start_ms) - last_done_ms_;
        last_done_ms_ = since_start_ms;
        const double tokens_per_s =
            double(tokens_per_step_) * double(p.last_step - p.first_step + 1) / std::max(ms * 1e-3, 1e-12);
        for (int64_t s = p.first_step; s <= p.last_step; ++s) out.push_back(record_of(p, s, tokens_per_s));
    }
    return out;
}

train::StepRecord RecordCollector::record_of(const Pinned& p, int64_t step, double tokens_per_s) const {
    const int64_t slot = (step - 1) % ring_.capacity;
    const double* s = p.scalars + slot * kRecordScalars;
    MOEKIT_CHECK(int64_t(s[kRecStep]) == step, "record ring slot ", slot, " holds step ", s[kRecStep], ", not ", step);
    train::StepRecord r;
    r.step = step, r.loss = s[kRecLoss], r.eval_loss = s[kRecEval], r.aux_loss = s[kRecAux], r.z_loss = s[kRecZ];
    r.grads_finite = s[kRecFinite] != 0.0, r.tokens_per_s = tokens_per_s;
    const int64_t L = ring_.num_layers, E = ring_.num_experts;
    const int32_t* c = p.counts + slot * L * E;
    for (int64_t l = 0; l < L; ++l) r.tokens_per_expert.emplace_back(c + l * E, c + (l + 1) * E);
    return r;
}

}  // namespace moekit::cuda
