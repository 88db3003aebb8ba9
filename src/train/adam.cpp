// Adam update; moments are created lazily on the first step, one per parameter tensor.
#include "train/adam.h"

#include <cmath>

#include "core/adam_math.h"
#include "moekit/error.h"

namespace moekit::train {

void Adam::step(std::vector<MoeWeights<float>>& weights, const std::vector<MoeWeights<float>>& grads) {
    MOEKIT_CHECK(weights.size() == grads.size(), "one gradient per layer");
    ++step_;
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
            const AdamStep a = adam_step_constants(options_.lr, options_.beta1, options_.beta2, options_.eps, step_);
            for (size_t i = 0; i < n; ++i) p[i] = adam_update(a, g[i], m[i], v[i], p[i]);
            ++slot;
        });
    }
}

}  // namespace moekit::train

namespace moekit::train {
void Adam::restore(int64_t step, std::vector<std::vector<float>> m, std::vector<std::vector<float>> v) {
    MOEKIT_CHECK(m.size() == v.size(), "one second moment per first moment");
    step_ = step, m_ = std::move(m), v_ = std::move(v);
}
}  // namespace moekit::train
