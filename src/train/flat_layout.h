// FlatLayout: where a residual MoE stack's parameters live in the flat buffers of the CUDA training engines
// (src/cuda/train_engine.cu, src/cuda/ep_train_engine.cu): every layer's replicated tensors (router, shared fc1,
// fc2, gate) first, then every layer's expert tensors holding the experts [first, first + n) (all of them at
// EP = 1, the L local ones at EP > 1), each tensor start aligned to 64 elements. Elementwise kernels (Adam) run
// over the whole; the EP engine reduces [0, dense_total) over data-parallel and the rest over expert-data-parallel,
// and moves between a rank's layout and the global one (checkpoints) with to_global/to_local. Header-only host
// code (no CUDA), so the CPU suite tests it: tests/cpu/test_flat_layout.cpp; GPU: tests/gpu/test_cuda_train*.cu.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "core/hd.h"
#include "moekit/error.h"

#include "moekit/device_layer.h"
#include "moekit/weights.h"
#include "train/train_engine.h"

namespace moekit::train {

class FlatLayout {
public:
    enum Tensor { kRouter, kSharedFc1, kSharedFc2, kSharedGate, kFc1, kFc2, kNumTensors };
    struct Slot {
        int64_t offset = 0, numel = 0;
    };
    static constexpr int64_t kAlign = 64;  // tensor starts: 128-byte aligned bf16 (TMA wants 16), float4 Adam

    FlatLayout(const MoeConfig& config, int64_t first_expert, int64_t num_experts);

    int64_t total() const { return total_; }              // elements of one flat buffer
    int64_t dense_total() const { return dense_total_; }  // [0, dense_total): replicated; the rest: experts
    int64_t first_expert() const { return first_; }
    int64_t num_experts() const { return n_; }            // experts held (E at EP = 1)
    const Slot& slot(int64_t layer, Tensor t) const { return slots_[size_t(layer)][size_t(t)]; }
    size_t layers() const { return slots_.size(); }

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
    void moments_to_state(const std::vector<float>& m, const std::vector<float>& v, TrainState& s) const;
    void moments_from_state(const TrainState& s, std::vector<float>& m, std::vector<float>& v) const;

    // Views of layer l's parameters in a bf16 flat buffer (expert_bias left empty) and of its grads in an f32 one.
    LayerParams params(void* bf16_base, int64_t l, int device) const;
    LayerGrads grads(float* base, int64_t l, int device) const;

private:
    LayerParams views(void* base, DType dtype, int64_t l, int device) const;
    MoeConfig config_;
    int64_t first_ = 0, n_ = 0, total_ = 0, dense_total_ = 0;
    std::vector<std::array<Slot, kNumTensors>> slots_;
};

// ---- definitions ----
inline FlatLayout::FlatLayout(const MoeConfig& c, int64_t first_expert, int64_t num_experts)
    : config_(c), first_(first_expert), n_(num_experts) {
    const int64_t L = c.num_layers, E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), F1 = c.fc1_rows();
    MOEKIT_CHECK(first_expert >= 0 && num_experts > 0 && first_expert + num_experts <= E, "experts [", first_expert,
                 ", +", num_experts, ") of ", E);
    const int64_t Fs = c.shared_ffn(), Fs1 = Fs * (c.gated_linear_unit ? 2 : 1);
    const bool gate = Fs > 0 && c.moe_shared_expert_gate;
    std::array<int64_t, kNumTensors> numel{};
    numel[kRouter] = E * H, numel[kSharedFc1] = Fs1 * H, numel[kSharedFc2] = H * Fs, numel[kSharedGate] = gate ? H : 0;
    numel[kFc1] = n_ * F1 * H, numel[kFc2] = n_ * H * F;
    slots_.assign(size_t(L), {});
    auto place = [&](Tensor t) {
        for (int64_t l = 0; l < L; ++l) {
            slots_[size_t(l)][size_t(t)] = Slot{total_, numel[size_t(t)]};
            total_ = align_up(total_ + numel[size_t(t)], kAlign);
        }
    };
    for (int64_t l = 0; l < L; ++l)  // a layer's replicated tensors together, then the next layer's
        for (Tensor t : {kRouter, kSharedFc1, kSharedFc2, kSharedGate}) {
            slots_[size_t(l)][size_t(t)] = Slot{total_, numel[size_t(t)]};
            total_ = align_up(total_ + numel[size_t(t)], kAlign);
        }
    dense_total_ = total_;
    place(kFc1), place(kFc2);
}

inline std::vector<float> FlatLayout::flatten(const std::vector<MoeWeights<float>>& ws) const {
    MOEKIT_CHECK(int64_t(ws.size()) == int64_t(slots_.size()), ws.size(), " layers of weights for ", slots_.size());
    std::vector<float> flat(size_t(total_), 0.0f);
    for (int64_t l = 0; l < int64_t(ws.size()); ++l) {
        const MoeWeights<float>& w = ws[size_t(l)];
        auto put = [&](const Matrix<float>& m, int64_t offset) { std::copy(m.data.begin(), m.data.end(), flat.begin() + offset); };
        put(w.router_weight, slot(l, kRouter).offset);
        for (int64_t i = 0; i < n_; ++i) {
            const Matrix<float>& f1 = w.fc1[size_t(first_ + i)];
            const Matrix<float>& f2 = w.fc2[size_t(first_ + i)];
            put(f1, slot(l, kFc1).offset + i * f1.size());
            put(f2, slot(l, kFc2).offset + i * f2.size());
        }
        if (slot(l, kSharedFc1).numel) put(w.shared_fc1, slot(l, kSharedFc1).offset), put(w.shared_fc2, slot(l, kSharedFc2).offset);
        if (slot(l, kSharedGate).numel) put(w.shared_gate, slot(l, kSharedGate).offset);
    }
    return flat;
}

inline void FlatLayout::unflatten(const std::vector<float>& flat, int64_t l, MoeWeights<float>& w) const {
    auto fill = [&](Matrix<float>& m, int64_t offset) {
        std::copy(flat.begin() + offset, flat.begin() + offset + m.size(), m.data.begin());
    };
    fill(w.router_weight, slot(l, kRouter).offset);
    for (int64_t i = 0; i < n_; ++i) {
        Matrix<float>& f1 = w.fc1[size_t(first_ + i)];
        Matrix<float>& f2 = w.fc2[size_t(first_ + i)];
        fill(f1, slot(l, kFc1).offset + i * f1.size());
        fill(f2, slot(l, kFc2).offset + i * f2.size());
    }
    if (slot(l, kSharedFc1).numel) fill(w.shared_fc1, slot(l, kSharedFc1).offset), fill(w.shared_fc2, slot(l, kSharedFc2).offset);
    if (slot(l, kSharedGate).numel) fill(w.shared_gate, slot(l, kSharedGate).offset);
}

inline void FlatLayout::moments_to_state(const std::vector<float>& m, const std::vector<float>& v,
                                   TrainState& s) const {
    MOEKIT_CHECK(first_ == 0 && n_ == config_.num_experts(), "a TrainState holds every expert");
    for (int64_t l = 0; l < int64_t(slots_.size()); ++l)
        for_each_adam_slot(l, [&](int64_t offset, int64_t n) {
            s.adam_m.emplace_back(m.begin() + offset, m.begin() + offset + n);
            s.adam_v.emplace_back(v.begin() + offset, v.begin() + offset + n);
        });
}

inline void FlatLayout::moments_from_state(const TrainState& s, std::vector<float>& m, std::vector<float>& v) const {
    MOEKIT_CHECK(first_ == 0 && n_ == config_.num_experts(), "a TrainState holds every expert");
    m.assign(size_t(total_), 0.0f), v.assign(size_t(total_), 0.0f);
    if (s.adam_m.empty()) return;  // a fresh state: zero moments
    size_t at = 0;
    for (int64_t l = 0; l < int64_t(slots_.size()); ++l)
        for_each_adam_slot(l, [&](int64_t offset, int64_t n) {
            MOEKIT_CHECK(at < s.adam_m.size() && at < s.adam_v.size() && int64_t(s.adam_m[at].size()) == n &&
                             int64_t(s.adam_v[at].size()) == n,
                         "checkpoint's Adam slot ", at, " does not fit this model");
            std::copy(s.adam_m[at].begin(), s.adam_m[at].end(), m.begin() + offset);
            std::copy(s.adam_v[at].begin(), s.adam_v[at].end(), v.begin() + offset);
            ++at;
        });
}

// Views over `base` (element size of `dtype`) at this layout's offsets, shaped as LayerParams.
inline LayerParams FlatLayout::views(void* base, DType dtype, int64_t l, int device) const {
    const int64_t H = config_.hidden_size, F = config_.expert_ffn(), F1 = config_.fc1_rows();
    auto* bytes = static_cast<char*>(base);
    auto view = [&](Tensor t, std::initializer_list<int64_t> dims) {
        return TensorView(bytes + slot(l, t).offset * int64_t(dtype_size(dtype)), dtype, dims, Backend::cuda, device);
    };
    LayerParams p;
    p.router_weight = view(kRouter, {config_.num_experts(), H});
    p.fc1 = view(kFc1, {n_, F1, H});
    p.fc2 = view(kFc2, {n_, H, F});
    if (slot(l, kSharedFc1).numel) {
        p.shared_fc1 = view(kSharedFc1, {slot(l, kSharedFc1).numel / H, H});
        p.shared_fc2 = view(kSharedFc2, {H, slot(l, kSharedFc2).numel / H});
    }
    if (slot(l, kSharedGate).numel) p.shared_gate = view(kSharedGate, {1, H});
    return p;
}

inline LayerParams FlatLayout::params(void* bf16_base, int64_t l, int device) const {
    return views(bf16_base, DType::bf16, l, device);
}

inline LayerGrads FlatLayout::grads(float* base, int64_t l, int device) const {
    const LayerParams v = views(base, DType::f32, l, device);
    LayerGrads g;
    g.router_weight = v.router_weight, g.fc1 = v.fc1, g.fc2 = v.fc2;
    g.shared_fc1 = v.shared_fc1, g.shared_fc2 = v.shared_fc2, g.shared_gate = v.shared_gate;
    return g;
}

// The global flat buffer (every expert) from this rank's local one (the replicated part) and `expert_parts`:
// every EP rank's expert part [dense_total, total) of its local buffer, in EP rank order (an all-gather).
inline std::vector<float> to_global(const FlatLayout& global, const FlatLayout& local, const std::vector<float>& mine,
                                    const std::vector<float>& expert_parts) {
    const int64_t dense = local.dense_total(), part = local.total() - dense, n = local.num_experts();
    const int64_t E = global.num_experts(), layers = int64_t(global.layers());
    MOEKIT_CHECK(dense == global.dense_total() && E % n == 0 && int64_t(expert_parts.size()) == part * (E / n) &&
                     int64_t(mine.size()) == local.total(),
                 "to_global: ", expert_parts.size(), " expert values from ", E / n, " ranks of ", part);
    std::vector<float> out(size_t(global.total()), 0.0f);
    std::copy(mine.begin(), mine.begin() + dense, out.begin());
    for (int64_t l = 0; l < layers; ++l)
        for (FlatLayout::Tensor t : {FlatLayout::kFc1, FlatLayout::kFc2}) {
            const int64_t per = global.slot(l, t).numel / E;
            for (int64_t e = 0; e < E; ++e) {  // expert e is local expert e % n of EP rank e / n
                const int64_t from = (e / n) * part + local.slot(l, t).offset - dense + (e % n) * per;
                std::copy(expert_parts.begin() + from, expert_parts.begin() + from + per,
                          out.begin() + global.slot(l, t).offset + e * per);
            }
        }
    return out;
}

// This rank's local flat buffer (the replicated part and its experts) from the global one.
inline std::vector<float> to_local(const FlatLayout& global, const FlatLayout& local, const std::vector<float>& all) {
    const int64_t dense = local.dense_total(), first = local.first_expert(), E = global.num_experts();
    MOEKIT_CHECK(dense == global.dense_total() && int64_t(all.size()) == global.total(), "to_local: ", all.size(),
                 " values for a global layout of ", global.total());
    std::vector<float> out(size_t(local.total()), 0.0f);
    std::copy(all.begin(), all.begin() + dense, out.begin());
    for (int64_t l = 0; l < int64_t(global.layers()); ++l)
        for (FlatLayout::Tensor t : {FlatLayout::kFc1, FlatLayout::kFc2}) {
            const int64_t from = global.slot(l, t).offset + first * (global.slot(l, t).numel / E);
            std::copy(all.begin() + from, all.begin() + from + local.slot(l, t).numel,
                      out.begin() + local.slot(l, t).offset);
        }
    return out;
}

}  // namespace moekit::train
