// TrainLayout: where a residual MoE stack's parameters live in the flat buffers of the CUDA training engines
// (src/cuda/train_engine.cu, src/cuda/ep_train_engine.cu): every layer's replicated tensors (router, shared fc1,
// fc2, gate) first, then every layer's expert tensors holding the experts [first, first + n) (all of them at
// EP = 1, the L local ones at EP > 1), each tensor start aligned to 64 elements. Elementwise kernels (Adam) run
// over the whole; the EP engine reduces [0, dense_total) over data-parallel and the rest over expert-data-parallel.
// Host-only header. Tests: tests/gpu/test_cuda_train.cu, tests/gpu/test_cuda_train_ep.cu.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "moekit/device_layer.h"
#include "moekit/weights.h"
#include "train/train_engine.h"

namespace moekit::cuda {

class TrainLayout {
public:
    enum Tensor { kRouter, kSharedFc1, kSharedFc2, kSharedGate, kFc1, kFc2, kNumTensors };
    struct Slot {
        int64_t offset = 0, numel = 0;
    };
    static constexpr int64_t kAlign = 64;  // tensor starts: 128-byte aligned bf16 (TMA wants 16), float4 Adam

    TrainLayout(const MoeConfig& config, int64_t first_expert, int64_t num_experts);

    int64_t total() const { return total_; }              // elements of one flat buffer
    int64_t dense_total() const { return dense_total_; }  // [0, dense_total): replicated; the rest: experts
    int64_t first_expert() const { return first_; }
    int64_t num_experts() const { return n_; }            // experts held (E at EP = 1)
    const Slot& slot(int64_t layer, Tensor t) const { return slots_[size_t(layer)][size_t(t)]; }

    // The layers' weights (the held experts of each) in the flat layout; zeros in the padding.
    std::vector<float> flatten(const std::vector<MoeWeights<float>>& weights) const;
    // Layer l's tensors from a flat buffer into w (the held experts only; expert_bias untouched).
    void unflatten(const std::vector<float>& flat, int64_t l, MoeWeights<float>& w) const;
    // fn(offset, numel) for each of Adam's slots of layer l in the host optimizer's order (for_each_parameter:
    // router, fc1 expert by expert, fc2 likewise, shared fc1, fc2, gate), the held experts only.
    template <typename Fn>
    void for_each_adam_slot(int64_t l, Fn&& fn) const {
        fn(slot(l, kRouter).offset, slot(l, kRouter).numel);
        for (Tensor t : {kFc1, kFc2})
            for (int64_t e = 0; e < n_; ++e) fn(slot(l, t).offset + e * (slot(l, t).numel / n_), slot(l, t).numel / n_);
        for (Tensor t : {kSharedFc1, kSharedFc2, kSharedGate})
            if (slot(l, t).numel) fn(slot(l, t).offset, slot(l, t).numel);
    }
    // Adam's moments as TrainState holds them (one vector per slot, all layers) and back; the layout must hold
    // every expert (a state is global).
    void moments_to_state(const std::vector<float>& m, const std::vector<float>& v, train::TrainState& s) const;
    void moments_from_state(const train::TrainState& s, std::vector<float>& m, std::vector<float>& v) const;

    // Views of layer l's parameters in a bf16 flat buffer (expert_bias left empty) and of its grads in an f32 one.
    LayerParams params(void* bf16_base, int64_t l, int device) const;
    LayerGrads grads(float* base, int64_t l, int device) const;

private:
    LayerParams views(void* base, DType dtype, int64_t l, int device) const;
    MoeConfig config_;
    int64_t first_ = 0, n_ = 0, total_ = 0, dense_total_ = 0;
    std::vector<std::array<Slot, kNumTensors>> slots_;
};

}  // namespace moekit::cuda
