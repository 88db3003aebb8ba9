// Adam update; moments are created lazily on the first step, one per parameter tensor.
#include "train/adam.h"

#include <cmath>

#include "moekit/error.h"

namespace moekit::train {

void Adam::step(std::vector<MoeWeights<float>>& weights, const std::vector<MoeWeights<float>>& grads) {
    MOEKIT_CHECK(weights.size() == grads.size(), "one gradient per layer");
    ++step_;
    const double c1 = 1.0 - std::pow(options_.beta1, double(step_));
    const double c2 = 1.0 - std::pow(options_.beta2, double(step_));
    size_t slot = 0;
    for (size_t l = 0; l < weights.size(); ++l) {
        for_each_parameter(weights[l], grads[l], [&](float* p, const float* g, size_t n) {
            if (slot == m_.size()) {
                m_.emplace_back(n, 0.0f);
                v_.emplace_back(n, 0.0f);
            }
            MOEKIT_CHECK(m_[slot].size() == n, "parameter ", slot, " changed size");
            float* m = m_[slot].data();
            float* v = v_[slot].data();
            const float b1 = float(options_.beta1), b2 = float(options_.beta2);
            const float lr_t = float(options_.lr / c1), inv_c2 = float(1.0 / c2), eps = float(options_.eps);
            for (size_t i = 0; i < n; ++i) {
                m[i] = b1 * m[i] + (1 - b1) * g[i];
                v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
                p[i] -= lr_t * m[i] / (std::sqrt(v[i] * inv_c2) + eps);
            }
            ++slot;
        });
    }
}

}  // namespace moekit::train
