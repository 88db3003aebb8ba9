// The data- and expert-parallel CPU engine (train_engine.h), Megatron's layout with TP = PP = CP = 1: each
// rank computes its micro-batches of the global batch (micro-batch m = rank * M + i of the step's G, i < M),
// the student's layers run through cpu::MoePipeline at --expert-model-parallel-size (the dispatchers of
// `moekit layer`), grads are summed over the groups as finalize_model_grads does and averaged over the G
// micro-batches, and Adam updates the same full weights on every rank. One rank with one micro-batch is the
// host loop's step (test). Tests: tests/cpu/test_train_ep.cpp.
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <tuple>

#include "core/flags.h"
#include "cpu/budget_step.h"
#include "cpu/moe_pipeline.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "train/adam.h"
#include "train/host_stack.h"
#include "train/train_engine.h"
#include "train/train_task.h"

namespace moekit::train {
namespace {

class EpEngine final : public TrainEngine {
public:
    EpEngine(const TrainOptions& o, Communicator& world)
        : o_(o),
          world_(world),
          layout_(run_layout(o)),
          teacher_(single_rank_config(o.config), "cpu", teacher_weights(o)),
          weights_(student_weights(o)),
          adam_(o.adam) {
        check_same_options(world_, o);
        groups_ = make_process_groups(world_, int(o.config.expert_model_parallel_size));
        for (size_t l = 0; l < weights_.size(); ++l)
            layers_.push_back(std::make_unique<cpu::MoePipeline<float>>(o.config, *groups_));
        // Every rank evaluates the same held-out micro-batch (the one of the single-rank run).
        held_ = held_out_batch(o, teacher_);
    }

    double identity_mse() const override { return held_.identity_mse; }

    void step() override {
        step_start_ = std::chrono::steady_clock::now();
        const int64_t step = ++step_;
        const int64_t L = int64_t(layers_.size()), E = o_.config.num_experts();
        const int64_t M = layout_.micro_batches_per_rank;
        std::vector<MoeWeights<float>> grads;
        for (auto& w : weights_) grads.push_back(zeros_like(w));
        // [loss, aux, z] summed over this rank's micro-batches; counts [layer][expert] likewise.
        std::vector<double> sums(3, 0.0);
        std::vector<int64_t> counts(size_t(L * E), 0);
        std::vector<double> echo(size_t(3 * L), 0.0);  // [clones, before, after][layer], summed
        // With a receive budget (--moe-expert-rank-capacity-factor) each micro-batch is one budgeted step of the
        // whole stack: an overflow in any layer restores what the micro-batch added and re-runs it through the
        // synchronous alltoall path (cpu/budget_step.h), so the run equals the one without the factor.
        const std::vector<cpu::MoePipeline<float>*> stack = pipelines();
        const bool budgeted = bool(o_.config.moe_expert_rank_capacity_factor);
        for (int64_t i = 0; i < M; ++i) {
            const auto kept = budgeted ? std::make_optional(std::make_tuple(grads, sums, counts, echo)) : std::nullopt;
            bool rerun = false;
            cpu::run_budgeted_step<float>(stack, world_, [&] {
                if (rerun) std::tie(grads, sums, counts, echo) = *kept;  // undo the overflowed attempt
                rerun = true;
                micro_batch(step, i, grads, sums, counts, echo);
            });
        }
        reduce(grads);
        finish_step(step, grads, sums, counts, echo);
    }

    // One micro-batch of this rank: data, teacher, the student's stack forward, loss, backward into `grads`;
    // adds its loss terms to `sums`, its routing counts to `counts` and its ECHO statistics to `echo`.
    void micro_batch(int64_t step, int64_t i, std::vector<MoeWeights<float>>& grads, std::vector<double>& sums,
                     std::vector<int64_t>& counts, std::vector<double>& echo) {
        const int64_t L = int64_t(layers_.size()), E = o_.config.num_experts();
        const int64_t T = held_.x.rows, M = layout_.micro_batches_per_rank;
        {
            const uint64_t stream = data_stream(step, int64_t(world_.rank()) * M + i);
            const Matrix<float> x = task_tokens(o_, T, stream);
            const Matrix<float> y = teacher_.forward(stack_input(o_.config, x, false));
            const double x_to_y = mse(x, y);
            LayerInput<float> in = stack_input(o_.config, x, true);
            in.jitter_seed = stream;
            const Matrix<float> pred = forward(std::move(in));
            sums[0] += mse(pred, y) / x_to_y;
            for (int64_t l = 0; l < L; ++l) {
                const RoutingSummary s = layers_[size_t(l)]->summary();
                for (int64_t e = 0; e < E; ++e) counts[size_t(l * E + e)] += s.tokens_per_expert[size_t(e)];
                sums[1] += s.losses.aux_loss + s.losses.seq_aux_loss + s.losses.global_aux_loss;
                sums[2] += s.losses.z_loss;
                if (cpu::EchoDispatcher<float>* d = layers_[size_t(l)]->echo_dispatcher()) {
                    const cpu::EchoStepStats st = d->stats();
                    echo[size_t(l)] += double(st.clones);
                    echo[size_t(L + l)] += st.max_over_mean_before;
                    echo[size_t(2 * L + l)] += st.max_over_mean_after;
                }
            }
            // d loss_m / d pred, as the host loop's step (its normaliser is the micro-batch's own).
            Matrix<float> grad(pred.rows, pred.cols);
            const double scale = 2.0 / (double(pred.data.size()) * x_to_y);
            for (size_t k = 0; k < grad.data.size(); ++k) grad.data[k] = float(scale * (pred.data[k] - y.data[k]));
            backward(std::move(grad), grads);
        }
    }

    // The step's reductions, record and optimizer after this rank's micro-batches.
    void finish_step(int64_t step, std::vector<MoeWeights<float>>& grads, std::vector<double>& sums,
                     std::vector<int64_t>& counts, std::vector<double>& echo) {
        const int64_t L = int64_t(layers_.size()), E = o_.config.num_experts();
        const int64_t M = layout_.micro_batches_per_rank;
        // Per-micro-batch values, averaged over the global batch as Megatron averages its micro-batch losses.
        world_.all_reduce(sums.data(), int64_t(sums.size()));
        world_.all_reduce(counts.data(), int64_t(counts.size()));
        if (o_.config.moe_enable_echo) world_.all_reduce(echo.data(), int64_t(echo.size()));
        const double G = double(layout_.micro_batches);
        StepRecord rec;
        rec.step = step;
        rec.loss = sums[0] / G;
        rec.aux_loss = sums[1] / G;
        rec.z_loss = sums[2] / G;
        for (int64_t l = 0; l < L; ++l)
            rec.tokens_per_expert.emplace_back(counts.begin() + l * E, counts.begin() + (l + 1) * E);
        if (o_.config.moe_enable_echo)
            for (int64_t l = 0; l < L; ++l) {
                const double n = double(M) * double(world_.size());  // every rank's micro-batches
                rec.echo_clones.push_back(echo[size_t(l)] / n);
                rec.echo_max_over_mean_before.push_back(echo[size_t(L + l)] / n);
                rec.echo_max_over_mean_after.push_back(echo[size_t(2 * L + l)] / n);
            }
        rec.grads_finite = all_finite(grads);  // the same full grads on every rank
        adam_.step(weights_, grads);
        for (size_t l = 0; l < layers_.size(); ++l) {
            layers_[l]->update_expert_bias(weights_[l]);  // counts of the whole global batch (dp all-reduce)
            layers_[l]->reset_global_aux_loss_tracker();
        }
        records_.push_back(std::move(rec));
        time_last_record();
    }

    void eval() override {
        MOEKIT_CHECK(!records_.empty(), "eval() records with the last step");
        // Rank 0's value for all: every rank ran the same tokens, the record must not depend on the rank.
        Matrix<float> pred;  // a budgeted step too: an overflow re-runs it synchronously
        cpu::run_budgeted_step<float>(pipelines(), world_, [&] { pred = forward(stack_input(o_.config, held_.x, false)); });
        double loss = mse(pred, held_.y) / held_.identity_mse;
        loss = world_.all_gather(std::vector<double>{loss})[0];
        records_.back().eval_loss = loss;
        time_last_record();
    }

    std::vector<StepRecord> collect(bool) override { return std::exchange(records_, {}); }

    TrainState state() override {
        TrainState s;
        s.step = step_;
        s.weights = weights_;
        s.adam_m = adam_.first_moments();
        s.adam_v = adam_.second_moments();
        return s;
    }
    void load_state(const TrainState& s) override {
        MOEKIT_CHECK(s.weights.size() == weights_.size(), "checkpoint has ", s.weights.size(), " layers");
        step_ = s.step;
        weights_ = s.weights;
        adam_.restore(s.step, s.adam_m, s.adam_v);
    }
    EngineReport report(bool) override { return {}; }

private:
    static MoeConfig single_rank_config(MoeConfig c) {
        c.expert_model_parallel_size = 1;  // the teacher runs whole on every rank
        c.moe_enable_echo = false;         // and needs no spare slots (ECHO does not change the numbers)
        c.moe_num_echo_experts.reset();
        c.moe_echo_recompute_expert_dispatch = false;
        return c;
    }

    std::vector<cpu::MoePipeline<float>*> pipelines() {
        std::vector<cpu::MoePipeline<float>*> p;
        for (auto& l : layers_) p.push_back(l.get());
        return p;
    }
    Matrix<float> forward(LayerInput<float> in) {
        for (size_t l = 0; l < layers_.size(); ++l) {
            const Matrix<float> out = layers_[l]->forward(weights_[l], in);
            for (size_t i = 0; i < out.data.size(); ++i) in.hidden.data[i] += out.data[i];
        }
        return in.hidden;
    }
    void backward(Matrix<float> grad, std::vector<MoeWeights<float>>& grads) {
        for (size_t l = layers_.size(); l-- > 0;) {
            const Matrix<float> through = layers_[l]->backward(weights_[l], grad, grads[l]);
            for (size_t i = 0; i < grad.data.size(); ++i) grad.data[i] += through.data[i];
        }
    }

    // finalize_model_grads (router/shared over dp, local experts over expert-dp), then the experts of the
    // other EP ranks gathered so every rank holds the whole gradient, then the mean over the G micro-batches.
    void reduce(std::vector<MoeWeights<float>>& grads) {
        for (size_t l = 0; l < layers_.size(); ++l) {
            layers_[l]->reduce_gradients(grads[l]);
            gather_experts(layers_[l]->layout(), grads[l]);
        }
        if (layout_.micro_batches == 1) return;
        const float inv = 1.0f / float(layout_.micro_batches);
        for (auto& g : grads) {
            for (Matrix<float>* m : {&g.router_weight, &g.shared_fc1, &g.shared_fc2, &g.shared_gate})
                for (float& v : m->data) v *= inv;
            for (auto* ms : {&g.fc1, &g.fc2})
                for (auto& m : *ms)
                    for (float& v : m.data) v *= inv;
        }
    }
    void gather_experts(const cpu::EpLayout& ep, MoeWeights<float>& g) {
        if (ep.ep_size == 1) return;
        std::vector<float> local;
        for (int64_t e = ep.first_local_expert(); e < ep.first_local_expert() + ep.num_local_experts; ++e)
            for (const Matrix<float>* m : {&g.fc1[size_t(e)], &g.fc2[size_t(e)]})
                local.insert(local.end(), m->data.begin(), m->data.end());
        const std::vector<float> all = groups_->ep->all_gather(local);
        size_t at = 0;
        for (int64_t e = 0; e < ep.num_experts; ++e)  // owner by owner, each its block in order
            for (Matrix<float>* m : {&g.fc1[size_t(e)], &g.fc2[size_t(e)]}) {
                std::copy(all.begin() + long(at), all.begin() + long(at + m->data.size()), m->data.begin());
                at += m->data.size();
            }
    }

    void time_last_record() {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start_).count();
        records_.back().tokens_per_s =
            double(held_.x.rows * layout_.micro_batches) / std::max(secs, 1e-9);
    }
    TrainOptions o_;
    Communicator& world_;
    RunLayout layout_;
    MoeStack teacher_;
    std::unique_ptr<ProcessGroups> groups_;
    std::vector<MoeWeights<float>> weights_;  // every expert on every rank (replicated optimizer)
    std::vector<std::unique_ptr<cpu::MoePipeline<float>>> layers_;
    Adam adam_;
    HeldOutBatch held_;
    int64_t step_ = 0;
    std::vector<StepRecord> records_;
    std::chrono::steady_clock::time_point step_start_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_ep_engine(const TrainOptions& options) {
    MOEKIT_REQUIRE(options.device == "cpu", "--device=", options.device,
                   ": several ranks or micro-batches per step run on --device cpu only (not yet on cuda)");
    return on_world(options, [&](Communicator& world) -> std::unique_ptr<TrainEngine> {
        return std::make_unique<EpEngine>(options, world);
    });
}

}  // namespace moekit::train
