// The host training loop (train_engine.h): a student stack of LayerRunners on any device, the teacher as a
// second stack, data, loss and Adam on the host. The CPU reference run of `moekit train`, and with
// --host-loop the old CUDA path (weights and activations cross the bus every call) kept for comparison.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"
#include "train/adam.h"
#include "train/host_stack.h"
#include "train/train_engine.h"
#include "train/train_task.h"

namespace moekit::train {
namespace {

class HostEngine final : public TrainEngine {
public:
    explicit HostEngine(const TrainOptions& o)
        : o_(o),
          teacher_(o.config, o.device, teacher_weights(o)),
          student_(o.config, o.device, student_weights(o)),
          adam_(o.adam) {
        held_ = held_out_batch(o, teacher_);
    }

    double identity_mse() const override { return held_.identity_mse; }

    void step() override {
        step_start_ = std::chrono::steady_clock::now();
        const int64_t step = ++step_;
        const Matrix<float> x = task_tokens(o_, held_.x.rows, uint64_t(step));
        const Matrix<float> y = teacher_.forward(stack_input(o_.config, x, false));
        const double x_to_y = mse(x, y);

        LayerInput<float> in = stack_input(o_.config, x, true);
        in.jitter_seed = uint64_t(step);
        const Matrix<float> pred = student_.forward(std::move(in));
        StepRecord rec;
        rec.step = step;
        rec.loss = mse(pred, y) / x_to_y;
        for (auto& layer : student_.layers) {
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
        for (auto& w : student_.weights) grads.push_back(zeros_like(w));
        student_.backward(std::move(grad), grads);
        rec.grads_finite = all_finite(grads);
        adam_.step(student_.weights, grads);
        for (size_t l = 0; l < student_.layers.size(); ++l) {
            student_.layers[l]->update_expert_bias(student_.weights[l]);
            student_.layers[l]->reset_global_aux_loss_tracker();
        }
        records_.push_back(std::move(rec));
        time_last_record();
    }

    void eval() override {
        MOEKIT_CHECK(!records_.empty(), "eval() records with the last step");
        const Matrix<float> pred = student_.forward(stack_input(o_.config, held_.x, false));
        records_.back().eval_loss = mse(pred, held_.y) / held_.identity_mse;
        time_last_record();
    }

    std::vector<StepRecord> collect(bool) override { return std::exchange(records_, {}); }

    TrainState state() override {
        TrainState s;
        s.step = step_;
        s.weights = student_.weights;
        s.adam_m = adam_.first_moments();
        s.adam_v = adam_.second_moments();
        return s;
    }
    void load_state(const TrainState& s) override {
        MOEKIT_CHECK(s.weights.size() == student_.weights.size(), "checkpoint has ", s.weights.size(), " layers");
        step_ = s.step;
        student_.weights = s.weights;
        adam_.restore(s.step, s.adam_m, s.adam_v);
    }
    EngineReport report(bool) override { return {}; }

private:
    // Tokens per second of the last step, its evaluation included.
    void time_last_record() {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start_).count();
        records_.back().tokens_per_s = double(held_.x.rows) / std::max(secs, 1e-9);
    }
    TrainOptions o_;
    MoeStack teacher_, student_;
    Adam adam_;
    HeldOutBatch held_;
    int64_t step_ = 0;
    std::vector<StepRecord> records_;
    std::chrono::steady_clock::time_point step_start_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_host_engine(const TrainOptions& options) {
    return std::make_unique<HostEngine>(options);
}

}  // namespace moekit::train
