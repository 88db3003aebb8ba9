// Adam's element update (Kingma & Ba, bias-corrected), written once for the host optimizer
// (src/train/adam.cpp) and the device one (src/cuda/train_kernels.cu), so both round alike.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/hd.h"

namespace moekit {

struct AdamStep {
    float b1, b2, lr_t, inv_c2, eps;  // lr_t = lr / (1 - beta1^t), inv_c2 = 1 / (1 - beta2^t)
};

// The constants of step t (1-based), computed in double as the host always has.
MOEKIT_HD AdamStep adam_step_constants(double lr, double beta1, double beta2, double eps, int64_t t) {
    const double c1 = 1.0 - pow(beta1, double(t)), c2 = 1.0 - pow(beta2, double(t));
    return AdamStep{float(beta1), float(beta2), float(lr / c1), float(1.0 / c2), float(eps)};
}

// Updates the moments in place and returns the new parameter.
MOEKIT_HD float adam_update(const AdamStep& a, float g, float& m, float& v, float p) {
    m = a.b1 * m + (1 - a.b1) * g;
    v = a.b2 * v + (1 - a.b2) * g * g;
    return p - a.lr_t * m / (sqrtf(v * a.inv_c2) + a.eps);
}

}  // namespace moekit
