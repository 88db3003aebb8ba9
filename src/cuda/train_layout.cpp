// TrainLayout (see train_layout.h): offsets, host copies into and out of the flat layout, views.
#include "cuda/train_layout.h"

#include <algorithm>

#include "core/hd.h"
#include "moekit/error.h"

namespace moekit::cuda {

TrainLayout::TrainLayout(const MoeConfig& c, int64_t first_expert, int64_t num_experts)
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

std::vector<float> TrainLayout::flatten(const std::vector<MoeWeights<float>>& ws) const {
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

void TrainLayout::unflatten(const std::vector<float>& flat, int64_t l, MoeWeights<float>& w) const {
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

void TrainLayout::moments_to_state(const std::vector<float>& m, const std::vector<float>& v,
                                   train::TrainState& s) const {
    MOEKIT_CHECK(first_ == 0 && n_ == config_.num_experts(), "a TrainState holds every expert");
    for (int64_t l = 0; l < int64_t(slots_.size()); ++l)
        for_each_adam_slot(l, [&](int64_t offset, int64_t n) {
            s.adam_m.emplace_back(m.begin() + offset, m.begin() + offset + n);
            s.adam_v.emplace_back(v.begin() + offset, v.begin() + offset + n);
        });
}

void TrainLayout::moments_from_state(const train::TrainState& s, std::vector<float>& m, std::vector<float>& v) const {
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
LayerParams TrainLayout::views(void* base, DType dtype, int64_t l, int device) const {
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

LayerParams TrainLayout::params(void* bf16_base, int64_t l, int device) const {
    return views(bf16_base, DType::bf16, l, device);
}

LayerGrads TrainLayout::grads(float* base, int64_t l, int device) const {
    const LayerParams v = views(base, DType::f32, l, device);
    LayerGrads g;
    g.router_weight = v.router_weight, g.fc1 = v.fc1, g.fc2 = v.fc2;
    g.shared_fc1 = v.shared_fc1, g.shared_fc2 = v.shared_fc2, g.shared_gate = v.shared_gate;
    return g;
}

}  // namespace moekit::cuda
