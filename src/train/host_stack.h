// Pieces the host-side training engines share (src/train/host_engine.cpp, src/train/ep_engine.cpp): a
// residual stack of LayerRunners (the teacher everywhere, the student of the host loop), the data draw,
// the MSE and the gradient finiteness check. Tests: tests/cpu/test_train*.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "moekit/layer.h"
#include "moekit/weights.h"
#include "train/train_task.h"

namespace moekit::train {

// A stack of residual MoE layers on one device.
struct MoeStack {
    std::vector<MoeWeights<float>> weights;
    std::vector<std::unique_ptr<LayerRunner>> layers;

    MoeStack(const MoeConfig& config, const std::string& device, std::vector<MoeWeights<float>> w)
        : weights(std::move(w)) {
        for (size_t l = 0; l < weights.size(); ++l) layers.push_back(make_layer_runner(config, device));
    }

    // h <- h + MoE_l(h) for every layer.
    Matrix<float> forward(LayerInput<float> in) {
        for (size_t l = 0; l < layers.size(); ++l) {
            Matrix<float> out = layers[l]->forward(weights[l], in);
            for (size_t i = 0; i < out.data.size(); ++i) in.hidden.data[i] += out.data[i];
        }
        return in.hidden;
    }

    // d/dh_l = d/dh_{l+1} + MoE_l'ᵀ d/dh_{l+1}, from the last layer down; grads accumulate.
    void backward(Matrix<float> grad, std::vector<MoeWeights<float>>& grads) {
        for (size_t l = layers.size(); l-- > 0;) {
            Matrix<float> through = layers[l]->backward(weights[l], grad, grads[l]);
            for (size_t i = 0; i < grad.data.size(); ++i) grad.data[i] += through.data[i];
        }
    }
};

inline Matrix<float> random_tokens(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream) {
    Matrix<float> x(rows, cols);
    for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = float(normal01(seed, stream, i));
    return x;
}

inline double mse(const Matrix<float>& a, const Matrix<float>& b) {
    double s = 0;
    for (size_t i = 0; i < a.data.size(); ++i) s += double(a.data[i] - b.data[i]) * (a.data[i] - b.data[i]);
    return s / double(std::max<size_t>(a.data.size(), 1));
}

// A layer input of the run's micro-batch shape.
inline LayerInput<float> stack_input(const MoeConfig& c, Matrix<float> x, bool training) {
    LayerInput<float> in;
    in.hidden = std::move(x);
    in.seq_length = c.seq_length;
    in.micro_batch_size = c.micro_batch_size;
    in.training = training;
    return in;
}

// The held-out micro-batch (data stream kEvalStream), the teacher's targets for it, and MSE(x, y): the loss
// normaliser, checked finite and positive.
struct HeldOutBatch {
    Matrix<float> x, y;
    double identity_mse = 0;
};
inline HeldOutBatch held_out_batch(const TrainOptions& o, MoeStack& teacher) {
    HeldOutBatch b;
    b.x = task_tokens(o, o.config.seq_length * o.config.micro_batch_size, kEvalStream);
    b.y = teacher.forward(stack_input(o.config, b.x, false));
    b.identity_mse = mse(b.x, b.y);
    require_teacher_differs(o, b.identity_mse);
    return b;
}

inline bool all_finite(const std::vector<MoeWeights<float>>& grads) {
    for (const auto& g : grads)
        for (const Matrix<float>* m : {&g.router_weight, &g.shared_fc1, &g.shared_fc2, &g.shared_gate})
            for (float v : m->data)
                if (!std::isfinite(v)) return false;
    for (const auto& g : grads)
        for (const auto* ms : {&g.fc1, &g.fc2})
            for (const auto& m : *ms)
                for (float v : m.data)
                    if (!std::isfinite(v)) return false;
    return true;
}

}  // namespace moekit::train
