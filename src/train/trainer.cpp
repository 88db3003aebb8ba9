// Teacher-student training loop over LayerRunners (see trainer.h for the task).
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "core/rng.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::train {
namespace {

constexpr uint64_t kEvalStream = 0xe7a1u;  // data stream of the held-out batch

// A stack of residual MoE layers on one device.
struct MoeStack {
    std::vector<MoeWeights<float>> weights;
    std::vector<std::unique_ptr<LayerRunner>> layers;

    MoeStack(const MoeConfig& config, const std::string& device, uint64_t seed) {
        for (int64_t l = 0; l < config.num_layers; ++l) {
            weights.push_back(init_weights<float>(config, seed * 1000003u + uint64_t(l)));
            layers.push_back(make_layer_runner(config, device));
        }
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

Matrix<float> random_tokens(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream) {
    Matrix<float> x(rows, cols);
    for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = float(normal01(seed, stream, i));
    return x;
}

double mse(const Matrix<float>& a, const Matrix<float>& b) {
    double s = 0;
    for (size_t i = 0; i < a.data.size(); ++i) s += double(a.data[i] - b.data[i]) * (a.data[i] - b.data[i]);
    return s / double(std::max<size_t>(a.data.size(), 1));
}

// The teacher: same architecture, other seed, expert weights scaled by `gain` and a sharper router,
// so its map is far from the identity and its experts differ clearly.
MoeStack make_teacher(const TrainOptions& o) {
    MoeConfig config = o.config;
    MoeStack teacher(config, o.device, o.seed + 1);
    const float gain = float(o.teacher_gain);
    for (auto& w : teacher.weights) {
        for (auto& v : w.router_weight.data) v *= 10.0f;
        for (auto& m : w.fc1)
            for (auto& v : m.data) v *= gain;
        for (auto& m : w.fc2)
            for (auto& v : m.data) v *= gain;
        for (auto& v : w.shared_fc1.data) v *= gain;
        for (auto& v : w.shared_fc2.data) v *= gain;
    }
    return teacher;
}

}  // namespace

double load_imbalance(const std::vector<int64_t>& counts) {
    if (counts.empty()) return 1.0;
    double total = 0, most = 0;
    for (auto c : counts) {
        total += double(c);
        most = std::max(most, double(c));
    }
    return total > 0 ? most / (total / double(counts.size())) : 1.0;
}

TrainResult run_training(const TrainOptions& o, const ProgressFn& progress) {
    const MoeConfig& config = o.config;
    config.validate();
    MOEKIT_REQUIRE(o.steps > 0, "--steps=", o.steps, ": must be positive");
    MOEKIT_REQUIRE(config.num_layers > 0, "--num-layers=", config.num_layers, ": must be positive");
    MOEKIT_REQUIRE(config.seq_length > 0, "--seq-length=", config.seq_length, ": must be positive for moekit train");

    const int64_t num_tokens = config.seq_length * config.micro_batch_size, hidden = config.hidden_size;
    MoeStack teacher = make_teacher(o);
    MoeStack student(config, o.device, o.seed);
    Adam adam(o.adam);

    auto make_input = [&](Matrix<float> x, bool training) {
        LayerInput<float> in;
        in.hidden = std::move(x);
        in.seq_length = config.seq_length;
        in.micro_batch_size = config.micro_batch_size;
        in.training = training;
        return in;
    };
    auto teacher_targets = [&](const Matrix<float>& x) { return teacher.forward(make_input(x, false)); };

    TrainResult result;
    result.tokens_per_step = num_tokens;
    const Matrix<float> eval_x = random_tokens(num_tokens, hidden, o.seed, kEvalStream);
    const Matrix<float> eval_y = teacher_targets(eval_x);
    result.identity_mse = mse(eval_x, eval_y);
    MOEKIT_CHECK(result.identity_mse > 0, "the teacher must not be the identity");

    const auto start = std::chrono::steady_clock::now();
    for (int64_t step = 1; step <= o.steps; ++step) {
        const auto t0 = std::chrono::steady_clock::now();
        Matrix<float> x = random_tokens(num_tokens, hidden, o.seed, uint64_t(step));
        const Matrix<float> y = teacher_targets(x);
        const double x_to_y = mse(x, y);

        LayerInput<float> in = make_input(x, true);
        in.jitter_seed = uint64_t(step);
        const Matrix<float> pred = student.forward(std::move(in));
        StepRecord rec;
        rec.step = step;
        rec.loss = mse(pred, y) / x_to_y;
        for (auto& layer : student.layers) {
            RoutingSummary s = layer->summary();
            rec.tokens_per_expert.push_back(s.tokens_per_expert);
            rec.aux_loss += s.losses.aux_loss + s.losses.seq_aux_loss + s.losses.global_aux_loss;
            rec.z_loss += s.losses.z_loss;
        }

        // d MSE / d pred, on the normalised loss so the step size does not depend on the teacher's scale.
        Matrix<float> grad(pred.rows, pred.cols);
        const double scale = 2.0 / (double(pred.data.size()) * x_to_y);
        for (size_t i = 0; i < grad.data.size(); ++i) grad.data[i] = float(scale * (pred.data[i] - y.data[i]));
        std::vector<MoeWeights<float>> grads;
        for (auto& w : student.weights) grads.push_back(zeros_like(w));
        student.backward(std::move(grad), grads);
        adam.step(student.weights, grads);
        for (size_t l = 0; l < student.layers.size(); ++l) {
            student.layers[l]->update_expert_bias(student.weights[l]);
            student.layers[l]->reset_global_aux_loss_tracker();
        }

        if (o.eval_every > 0 && (step % o.eval_every == 0 || step == o.steps))
            rec.eval_loss = mse(student.forward(make_input(eval_x, false)), eval_y) / result.identity_mse;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        rec.tokens_per_s = double(num_tokens) / std::max(secs, 1e-9);
        result.steps.push_back(rec);
        if (progress) progress(o, rec);
    }
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return result;
}

}  // namespace moekit::train
