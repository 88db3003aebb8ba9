// The training loop (trainer.h): picks the engine, resumes from --load, steps, evaluates, collects the
// records at each logging interval (the GPU engine's only host reads), stops on a non-finite loss or
// gradient (Megatron's check-for-nan-in-loss-and-grad) or a signal, and writes --save checkpoints.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "core/flags.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "moekit/layer.h"
#include "moekit/weights.h"
#include "echo/trace.h"
#include "core/rng.h"
#include "train/checkpoint.h"
#include "train/train_engine.h"
#include "train/train_task.h"

#ifdef MOEKIT_WITH_CUDA
#include "cuda/ep_train_engine.h"
#include "cuda/train_engine.h"
#endif

namespace moekit::train {

std::vector<MoeWeights<float>> student_weights(const TrainOptions& o) {
    std::vector<MoeWeights<float>> w;
    for (int64_t l = 0; l < o.config.num_layers; ++l) {
        w.push_back(init_weights<float>(o.config, o.seed * 1000003u + uint64_t(l)));
        apply_zipf_router_skew(o, w.back());
    }
    return w;
}

void apply_zipf_router_skew(const TrainOptions& o, MoeWeights<float>& w) {
    if (!(o.skew_zipf > 0)) return;
    echo::ZipfRouting z;
    z.num_experts = o.config.num_experts();
    z.zipf_s = o.skew_zipf;
    z.seed = o.seed;
    const std::vector<int32_t> popular = echo::zipf_popularity(z);
    const double pi = 3.14159265358979323846;
    const double beta = std::sqrt(6.0) / pi * o.config.init_method_std * std::sqrt(double(o.config.hidden_size - 1));
    for (size_t i = 0; i < popular.size(); ++i)
        w.router_weight(popular[i], 0) = float(-o.skew_zipf * std::log(double(i + 1)) * beta);
}

Matrix<float> task_tokens(const TrainOptions& o, int64_t rows, uint64_t stream) {
    Matrix<float> x(rows, o.config.hidden_size);
    for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = float(normal01(o.seed, stream, i));
    if (o.skew_zipf > 0)
        for (int64_t t = 0; t < rows; ++t) x(t, 0) = 1.0f;  // the constant feature that carries the offsets
    return x;
}

void require_teacher_differs(const TrainOptions& o, double identity_mse) {
    MOEKIT_REQUIRE(std::isfinite(identity_mse) && identity_mse > 0, "--teacher-gain=", o.teacher_gain,
                   " with --init-method-std=", o.config.init_method_std,
                   ": the teacher's held-out outputs must be finite and differ from the input (MSE ", identity_mse,
                   ")");
}

MoeWeights<float> zero_weights(const MoeConfig& c) {
    MoeWeights<float> w;
    const int64_t E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), F1 = c.fc1_rows(), Fs = c.shared_ffn();
    w.router_weight = Matrix<float>(E, H);
    w.fc1.assign(size_t(E), Matrix<float>(F1, H));
    w.fc2.assign(size_t(E), Matrix<float>(H, F));
    if (Fs > 0) {
        w.shared_fc1 = Matrix<float>(Fs * (c.gated_linear_unit ? 2 : 1), H);
        w.shared_fc2 = Matrix<float>(H, Fs);
        if (c.moe_shared_expert_gate) w.shared_gate = Matrix<float>(1, H);
    }
    return w;
}

std::vector<MoeWeights<float>> teacher_weights(const TrainOptions& o) {
    std::vector<MoeWeights<float>> ws;
    const float gain = float(o.teacher_gain);
    for (int64_t l = 0; l < o.config.num_layers; ++l) {
        MoeWeights<float> w = init_weights<float>(o.config, (o.seed + 1) * 1000003u + uint64_t(l));
        apply_zipf_router_skew(o, w);  // scaled with the router below, like the logit noise
        for (auto& v : w.router_weight.data) v *= 10.0f;
        for (auto* ms : {&w.fc1, &w.fc2})
            for (auto& m : *ms)
                for (auto& v : m.data) v *= gain;
        for (auto& v : w.shared_fc1.data) v *= gain;
        for (auto& v : w.shared_fc2.data) v *= gain;
        ws.push_back(std::move(w));
    }
    return ws;
}

double load_imbalance(const std::vector<int64_t>& counts) {
    if (counts.empty()) return 1.0;
    double total = 0, most = 0;
    for (auto c : counts) {
        total += double(c);
        most = std::max(most, double(c));
    }
    return total > 0 ? most / (total / double(counts.size())) : 1.0;
}

EchoSummary echo_summary(const TrainResult& r) {
    EchoSummary s;
    double n = 0;
    for (const StepRecord& rec : r.steps)
        for (size_t l = 0; l < rec.echo_clones.size(); ++l, ++n) {
            s.clones_per_step += rec.echo_clones[l];
            s.max_over_mean_before += rec.echo_max_over_mean_before[l];
            s.max_over_mean_after += rec.echo_max_over_mean_after[l];
        }
    if (n > 0) s.clones_per_step /= n, s.max_over_mean_before /= n, s.max_over_mean_after /= n;
    return s;
}

void check_same_options(Communicator& world, const TrainOptions& o) {
    const std::string mine =
        moekit::to_json(o.config).dump() + str(" steps=", o.steps, " lr=", o.adam.lr, " b1=", o.adam.beta1, " b2=",
                                               o.adam.beta2, " eps=", o.adam.eps, " seed=", o.seed, " gain=",
                                               o.teacher_gain, " gbs=", o.global_batch_size, " eval=", o.eval_every,
                                               " load=", o.load_dir, " device=", o.device);
    const auto all = world.all_gather_v(std::vector<char>(mine.begin(), mine.end()));
    std::string differ;
    for (size_t r = 1; r < all.size(); ++r)
        if (all[r] != all[0]) differ += str(differ.empty() ? "" : ", ", r);
    MOEKIT_REQUIRE(differ.empty(), "moekit train: rank(s) ", differ,
                   " were started with other flags than rank 0: every rank must get the same flags");
}

std::unique_ptr<TrainEngine> on_world(const TrainOptions& o,
                                      const std::function<std::unique_ptr<TrainEngine>(Communicator&)>& make) {
    if (o.world) return make(*o.world);
    // One process: a world of one rank, owned by the engine's holder below.
    struct Owned final : TrainEngine {
        std::unique_ptr<Communicator> world;
        std::unique_ptr<TrainEngine> engine;
        double identity_mse() const override { return engine->identity_mse(); }
        void step() override { engine->step(); }
        void eval() override { engine->eval(); }
        std::vector<StepRecord> collect(bool wait) override { return engine->collect(wait); }
        TrainState state() override { return engine->state(); }
        void load_state(const TrainState& s) override { engine->load_state(s); }
        EngineReport report(bool measure_speed) override { return engine->report(measure_speed); }
    };
    auto owned = std::make_unique<Owned>();
    owned->world = comm::make_single_rank();
    owned->engine = make(*owned->world);
    return owned;
}

RunLayout run_layout(const TrainOptions& o) {
    RunLayout l;
    l.ranks = o.world ? o.world->size() : 1;
    l.transport = o.world ? o.world->transport() : "none";
    // On the GPU the ranks' tensors travel over the device transport the host group implies.
    if (o.device == "cuda" && o.world && o.world->size() > 1) l.transport = l.transport == "mpi" ? "nccl" : "local-gpu";
    l.expert_model_parallel_size = o.config.expert_model_parallel_size;
    const int64_t B = o.config.micro_batch_size;
    MOEKIT_REQUIRE(B > 0, "--micro-batch-size=", B, ": must be positive");
    MOEKIT_REQUIRE(l.expert_model_parallel_size >= 1 && l.ranks % l.expert_model_parallel_size == 0,
                   "--expert-model-parallel-size=", l.expert_model_parallel_size, ": must divide the ", l.ranks,
                   " rank(s) of the run (start them with mpirun -np N or --virtual-ranks N)");
    l.global_batch_size = o.global_batch_size > 0 ? o.global_batch_size : B * l.ranks;
    MOEKIT_REQUIRE(o.global_batch_size >= 0, "--global-batch-size=", o.global_batch_size, ": must not be negative");
    MOEKIT_REQUIRE(l.global_batch_size % (B * l.ranks) == 0, "--global-batch-size=", l.global_batch_size,
                   ": must be a multiple of --micro-batch-size x ranks = ", B, " x ", l.ranks, " (each rank computes "
                   "the same number of micro-batches)");
    l.micro_batches = l.global_batch_size / B;
    l.micro_batches_per_rank = l.micro_batches / l.ranks;
    return l;
}

namespace {

std::unique_ptr<TrainEngine> make_engine(const TrainOptions& o, const RunLayout& layout, std::string* name) {
    if (layout.ranks > 1 || layout.micro_batches > 1) {
        const std::string where = str(layout.ranks, " rank(s) (", layout.transport, "), EP=",
                                      layout.expert_model_parallel_size, ", ", layout.micro_batches_per_rank,
                                      " micro-batch(es) per rank");
        MOEKIT_REQUIRE(!o.host_loop, "--host-loop: not with several ranks (", layout.ranks,
                       ") or micro-batches per step (--global-batch-size=", layout.global_batch_size, ")");
        if (o.device == "cuda") {
            MOEKIT_REQUIRE(cuda_device_available(), "--device cuda: no CUDA device is visible on this machine",
#ifdef MOEKIT_WITH_CUDA
                           ""
#else
                           " (this moekit was built without CUDA)"
#endif
            );
#ifdef MOEKIT_WITH_CUDA
            *name = "data/expert-parallel, device-resident, eager: " + where;
            return cuda::make_cuda_ep_train_engine(o);
#endif
        }
        *name = "data/expert-parallel host loop (CPU reference): " + where;
        return make_ep_engine(o);
    }
    MOEKIT_REQUIRE(o.device != "cuda" || !o.config.moe_enable_echo,
                   "--moe-enable-echo: not supported yet on --device cuda by moekit train (the GPU ECHO runs in "
                   "moekit layer and moekit bench with EP > 1; --device cpu trains with it)");
    MOEKIT_REQUIRE(o.device != "cuda" || !o.config.moe_router_force_load_balancing,
                   "--moe-router-force-load-balancing: not supported yet on --device cuda (the CPU router has it; "
                   "--device cpu runs it)");
    MOEKIT_REQUIRE(o.device != "cuda" || o.host_loop || !(o.skew_zipf > 0),
                   "--skew: not supported yet by the device-resident CUDA engine (its tokens are drawn on the GPU); "
                   "--host-loop or --device cpu run it");
    if (o.device == "cuda" && !o.host_loop) {
        MOEKIT_REQUIRE(cuda_device_available(), "--device cuda: no CUDA device is visible on this machine",
#ifdef MOEKIT_WITH_CUDA
                       ""
#else
                       " (this moekit was built without CUDA)"
#endif
        );
#ifdef MOEKIT_WITH_CUDA
        *name = o.use_graph ? "device-resident, one CUDA graph per iteration" : "device-resident, eager";
        return cuda::make_cuda_train_engine(o);
#else
        throw UsageError("--device cuda: this moekit was built without CUDA (no nvcc at configure time)");
#endif
    }
    *name = o.device == "cuda" ? "host loop over the CUDA layer (host copies every call)" : "host loop (CPU reference)";
    return make_host_engine(o);
}

}  // namespace

TrainResult run_training(const TrainOptions& o, const ProgressFn& progress) {
    const MoeConfig& config = o.config;
    config.validate();
    MOEKIT_REQUIRE(o.steps > 0, "--steps=", o.steps, ": must be positive");
    MOEKIT_REQUIRE(config.num_layers > 0, "--num-layers=", config.num_layers, ": must be positive");
    MOEKIT_REQUIRE(config.seq_length > 0, "--seq-length=", config.seq_length, ": must be positive for moekit train");
    MOEKIT_REQUIRE(o.log_interval > 0, "--log-every=", o.log_interval, ": must be positive");
    MOEKIT_REQUIRE(o.save_interval >= 0, "--save-interval=", o.save_interval, ": must not be negative");
    MOEKIT_REQUIRE(o.save_interval == 0 || !o.save_dir.empty(), "--save-interval=", o.save_interval,
                   ": needs --save DIR");

    TrainResult result;
    result.layout = run_layout(o);
    result.tokens_per_step = config.seq_length * result.layout.global_batch_size;
    // Under several ranks every rank runs this loop in step; rank 0 alone reports and saves.
    Communicator* world = o.world && o.world->size() > 1 ? o.world : nullptr;
    const bool rank0 = !world || world->rank() == 0;
    std::unique_ptr<TrainEngine> engine = make_engine(o, result.layout, &result.engine);
    result.identity_mse = engine->identity_mse();
    if (!o.load_dir.empty()) {
        Checkpoint ck = load_checkpoint(o.load_dir, o);
        MOEKIT_REQUIRE(ck.state.step <= o.steps, "--load=", o.load_dir, ": the checkpoint is at step ", ck.state.step,
                       ", past --steps=", o.steps);
        engine->load_state(ck.state);
        result.resumed_from = ck.state.step;
        result.steps = std::move(ck.history);
    }

    // Appends finished records; false (and result.failure set) when one is not finite.
    auto take = [&](std::vector<StepRecord> records) {
        for (StepRecord& rec : records) {
            result.steps.push_back(std::move(rec));
            const StepRecord& r = result.steps.back();
            if (progress && rank0) progress(o, r);
            const bool bad_eval = r.eval_loss != -1 && !std::isfinite(r.eval_loss);
            if (result.failure.empty() && (!std::isfinite(r.loss) || !r.grads_finite || bad_eval)) {
                const std::string what = !std::isfinite(r.loss) ? str("the loss is ", r.loss)
                                         : !r.grads_finite      ? std::string("a gradient is not finite")
                                                                : str("the held-out loss is ", r.eval_loss);
                result.failure = str("step ", r.step, ": ", what, " (check-for-nan-in-loss-and-grad); training stopped");
            }
        }
        return result.failure.empty();
    };

    const auto start = std::chrono::steady_clock::now();
    for (int64_t step = result.resumed_from + 1; step <= o.steps; ++step) {
        engine->step();
        if (o.eval_every > 0 && (step % o.eval_every == 0 || step == o.steps)) engine->eval();
        int64_t stop_sig = o.stop_signal ? o.stop_signal->load() : 0;
        // A signal reaches the ranks at different steps: they stop together after the same one.
        if (world) world->all_reduce(&stop_sig, 1, ReduceOp::max);
        const bool stop = stop_sig != 0;
        const bool save = !o.save_dir.empty() && o.save_interval > 0 && step % o.save_interval == 0;
        if (step % o.log_interval == 0 || save || stop) {
            if (!take(engine->collect(save || stop))) break;
        }
        if (save) {
            TrainState state = engine->state();  // every rank: the GPU EP engine gathers its experts
            if (rank0) save_checkpoint(o.save_dir, o, state, result.steps);
        }
        if (stop) {
            result.signal = int(stop_sig);
            break;
        }
    }
    const bool finite = take(engine->collect(true));
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t last = result.steps.empty() ? 0 : result.steps.back().step;
    if (finite && !o.save_dir.empty() && last > result.resumed_from &&
        (o.save_interval == 0 || last % o.save_interval != 0)) {
        TrainState state = engine->state();  // every rank (collective on the GPU EP engine)
        if (rank0) save_checkpoint(o.save_dir, o, state, result.steps);
    }
    // Speed is measured only after a run that ended normally (a stopped or failed one exits at once).
    result.perf = std::make_shared<EngineReport>(engine->report(finite && result.signal == 0));
    return result;
}

}  // namespace moekit::train
