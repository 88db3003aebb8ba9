// Adam (Kingma & Ba, with bias correction) over every trainable tensor of MoE layers' weights.
// The expert bias is a buffer, not a parameter: Adam never touches it.
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/weights.h"

namespace moekit::train {

struct AdamOptions {
    double lr = 3e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
};

// Calls fn(param, grad, count) for each trainable tensor of `w` and its gradient `g`, in a fixed order.
template <typename Fn>
void for_each_parameter(MoeWeights<float>& w, const MoeWeights<float>& g, Fn&& fn) {
    auto visit = [&](Matrix<float>& p, const Matrix<float>& d) {
        if (!p.empty()) fn(p.data.data(), d.data.data(), p.data.size());
    };
    visit(w.router_weight, g.router_weight);
    for (size_t e = 0; e < w.fc1.size(); ++e) visit(w.fc1[e], g.fc1[e]);
    for (size_t e = 0; e < w.fc2.size(); ++e) visit(w.fc2[e], g.fc2[e]);
    visit(w.shared_fc1, g.shared_fc1);
    visit(w.shared_fc2, g.shared_fc2);
    visit(w.shared_gate, g.shared_gate);
}

class Adam {
public:
    explicit Adam(AdamOptions options) : options_(options) {}
    // One update of all layers' weights from their gradients (same order on every call).
    void step(std::vector<MoeWeights<float>>& weights, const std::vector<MoeWeights<float>>& grads);
    int64_t steps() const { return step_; }
    // The moments, one pair per parameter tensor in for_each_parameter order (empty before the first step),
    // for checkpoints; restore() continues from them.
    const std::vector<std::vector<float>>& first_moments() const { return m_; }
    const std::vector<std::vector<float>>& second_moments() const { return v_; }
    void restore(int64_t step, std::vector<std::vector<float>> m, std::vector<std::vector<float>> v);

private:
    AdamOptions options_;
    int64_t step_ = 0;
    std::vector<std::vector<float>> m_, v_;  // one moment pair per parameter tensor
};

}  // namespace moekit::train
