// The device-resident training engine (train_engine.h): the whole `moekit train` task lives on one GPU — fp32
// master weights, their bf16 copies, Adam's moments and the gradients in flat buffers; the teacher's bf16
// weights; data generated on the device from (seed, step); every layer's activations; loss and its gradient.
// One iteration (data, teacher forward, student forward, loss, backward, Adam, expert-bias updates, record) is
// captured once and replayed as one CUDA graph; the host reads records only when collect() copies the record
// ring into pinned memory (asynchronously), and hands them over at the next collect. The student's moekit::Layer
// objects also run the teacher (eval mode, other weights, before the student's forward): one workspace per
// layer, not two. Twin: src/train/host_engine.cpp (same task, same order). Tests: tests/gpu/test_cuda_train.cu.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/bf16.h"
#include "cuda/cuda_check.h"
#include "cuda/dense_gemm.cuh"
#include "cuda/device_buffer.h"
#include "cuda/device_layer.h"
#include "cuda/event_timing.h"
#include "cuda/moe_layer.h"
#include "cuda/random_fill.h"
#include "cuda/train_engine.h"
#include "cuda/train_kernels.cuh"
#include "cuda/train_records.h"
#include "moekit/error.h"
#include "train/adam.h"
#include "train/flat_layout.h"
#include "train/train_task.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;
using train::StepRecord;
using train::TrainOptions;
using train::TrainState;

class CudaTrainEngine final : public train::TrainEngine {
public:
    explicit CudaTrainEngine(const TrainOptions& o) : o_(o), layout_(o.config, 0, o.config.num_experts()) {
        const MoeConfig& c = o.config;
        L_ = c.num_layers, T_ = c.seq_length * c.micro_batch_size, H_ = c.hidden_size, E_ = c.num_experts();
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device_));
        size_t free0 = 0, total = 0;
        MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        for (int64_t l = 0; l < L_; ++l)
            layers_.push_back(
                make_cuda_layer(train_layer_config(c), LayerBounds{c.seq_length, c.micro_batch_size}, device_));
        router_fp64_ = layers_[0]->router_dtype() == DType::f64;
        total_ = layout_.total();
        allocate();
        upload_weights(train::student_weights(o), /*teacher=*/false);
        upload_weights(train::teacher_weights(o), /*teacher=*/true);
        to_bf16(master_.get(), model_.get(), total_, stream_);

        // The held-out batch and its targets, and the loss normaliser, once.
        generate_tokens(eval_x_.get(), T_ * H_, o.seed, nullptr, train::kEvalStream, stream_);
        teacher_forward(eval_x_.get(), eval_y_.get());
        mean_squared_error(eval_x_.get(), eval_y_.get(), T_ * H_, nullptr, partials_.get(), scalars_.get() + 3, stream_);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        identity_mse_ = download(scalars_.get() + 3, 1)[0];
        require_teacher_differs(o, identity_mse_);

        if (o.use_graph) {
            train_graph_ = capture([&] { enqueue_iteration(); });
            eval_graph_ = capture([&] { enqueue_eval(); });
        }
        size_t free1 = 0;
        MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
        used_bytes_ = int64_t(free0) - int64_t(free1);
    }

    ~CudaTrainEngine() override {
        if (stream_) cudaStreamSynchronize(stream_);
        for (cudaGraphExec_t g : {train_graph_, eval_graph_})
            if (g) cudaGraphExecDestroy(g);
        records_.reset();
        layers_.clear();
        if (stream_) cudaStreamDestroy(stream_);
    }

    double identity_mse() const override { return identity_mse_; }

    void step() override {
        records_->stepped(stream_);
        if (train_graph_) {
            MOEKIT_CUDA_CHECK(cudaGraphLaunch(train_graph_, stream_));
        } else {
            enqueue_iteration();
        }
    }

    void eval() override {
        if (eval_graph_) {
            MOEKIT_CUDA_CHECK(cudaGraphLaunch(eval_graph_, stream_));
        } else {
            enqueue_eval();
        }
    }

    std::vector<StepRecord> collect(bool wait) override { return records_->collect(wait, stream_); }

    TrainState state() override {
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        TrainState s;
        s.step = download(&counters_.get()->completed, 1)[0];
        const std::vector<float> master = master_.download();
        for (int64_t l = 0; l < L_; ++l) {
            MoeWeights<float> w = train::zero_weights(o_.config);
            layout_.unflatten(master, l, w);
            if (o_.config.moe_router_enable_expert_bias) w.expert_bias = download_bias(l);
            s.weights.push_back(std::move(w));
        }
        if (s.step > 0) layout_.moments_to_state(m_.download(), v_.download(), s);
        return s;
    }

    void load_state(const TrainState& s) override {
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        upload_weights(s.weights, /*teacher=*/false);
        std::vector<float> m, v;
        layout_.moments_from_state(s, m, v);
        m_.upload(m), v_.upload(v);
        to_bf16(master_.get(), model_.get(), total_, stream_);
        const StepCounters c{s.step, s.step};
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(counters_.get(), &c, sizeof c, cudaMemcpyHostToDevice, stream_));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        records_->restart_at(s.step);
    }

    train::EngineReport report(bool measure_speed) override;

private:
    // ---- set-up ----
    void allocate() {
        master_.resize(total_), m_.resize(total_), v_.resize(total_), grads_.resize(total_);
        model_.resize(total_), teacher_.resize(total_);
        const int64_t n = T_ * H_;
        x_.resize(n), y_.resize(n), h_.resize(n), g_.resize(n), eval_x_.resize(n), eval_y_.resize(n);
        out_.resize(n), gb_.resize(n);
        xb_.resize(size_t(L_));
        for (auto& b : xb_) b.resize(n);
        for (int64_t l = 0; l < L_; ++l) {
            bias32_.emplace_back(router_fp64_ ? 0 : E_);
            bias64_.emplace_back(router_fp64_ ? E_ : 0);
        }
        teacher_bias32_.resize(router_fp64_ ? 0 : E_), teacher_bias64_.resize(router_fp64_ ? E_ : 0);
        scalars_.resize(4), partials_.resize(kReduceBlocks), counters_.resize(1), nonfinite_.resize(1);
        // The record ring: one slot per step of a logging interval.
        std::vector<const int32_t*> counts;
        std::vector<const void*> losses;
        for (auto& layer : layers_) {
            counts.push_back(layer->results().tokens_per_expert.as<const int32_t>());
            losses.push_back(layer->results().losses.data);
        }
        records_ = std::make_unique<RecordCollector>(o_.log_interval, L_, E_, router_fp64_, counts, losses, T_);
    }

    void upload_weights(const std::vector<MoeWeights<float>>& ws, bool teacher) {
        MOEKIT_CHECK(int64_t(ws.size()) == L_, ws.size(), " layers of weights for ", L_, " layers");
        const std::vector<float> flat = layout_.flatten(ws);
        for (int64_t l = 0; l < L_ && !teacher && o_.config.moe_router_enable_expert_bias; ++l) {
            const MoeWeights<float>& w = ws[size_t(l)];
            MOEKIT_CHECK(int64_t(w.expert_bias.size()) == E_, "expert_bias of layer ", l);
            if (router_fp64_) {
                bias64_[size_t(l)].upload(w.expert_bias);
            } else {
                bias32_[size_t(l)].upload(std::vector<float>(w.expert_bias.begin(), w.expert_bias.end()));
            }
        }
        if (teacher) {
            std::vector<bf16> b(flat.size());
            for (size_t i = 0; i < flat.size(); ++i) b[i] = __nv_bfloat16_raw{float_to_bf16_bits(flat[i])};
            teacher_.upload(b);
        } else {
            master_.upload(flat);
        }
    }

    std::vector<double> download_bias(int64_t l) const {
        if (router_fp64_) return bias64_[size_t(l)].download();
        const std::vector<float> b = bias32_[size_t(l)].download();
        return std::vector<double>(b.begin(), b.end());
    }

    // ---- views ----
    TensorView dev(void* p, DType d, std::initializer_list<int64_t> dims) const {
        return TensorView(p, d, dims, Backend::cuda, device_);
    }
    LayerParams params(int64_t l, bool teacher) {
        LayerParams p = layout_.params(teacher ? teacher_.get() : model_.get(), l, device_);
        if (o_.config.moe_router_enable_expert_bias) p.expert_bias = bias_view(l, teacher);
        return p;
    }
    TensorView bias_view(int64_t l, bool teacher) {
        if (router_fp64_) return dev(teacher ? teacher_bias64_.get() : bias64_[size_t(l)].get(), DType::f64, {E_});
        return dev(teacher ? teacher_bias32_.get() : bias32_[size_t(l)].get(), DType::f32, {E_});
    }
    LayerGrads grads(int64_t l) { return layout_.grads(grads_.get(), l, device_); }

    // ---- the iteration ----
    // out = in + sum of the teacher's layers (residual stream in fp32, each layer's input rounded to bf16).
    void teacher_forward(const float* in, float* out) {
        const int64_t n = T_ * H_;
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        for (int64_t l = 0; l < L_; ++l) layer_forward(l, /*teacher=*/true, out, /*training=*/false);
    }
    void student_forward(const float* in, bool training) {
        const int64_t n = T_ * H_;
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(h_.get(), in, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        for (int64_t l = 0; l < L_; ++l) layer_forward(l, /*teacher=*/false, h_.get(), training);
    }
    void layer_forward(int64_t l, bool teacher, float* h, bool training) {
        const int64_t n = T_ * H_;
        to_bf16(h, xb_[size_t(l)].get(), n, stream_);
        ForwardArgs a;
        a.input = dev(xb_[size_t(l)].get(), DType::bf16, {T_, H_});
        a.output = dev(out_.get(), DType::bf16, {T_, H_});
        a.jitter_seed = dev(&counters_.get()->current, DType::i64, {1});  // the host loop's step number
        a.training = training;
        layers_[size_t(l)]->forward(params(l, teacher), a, Stream{stream_});
        add_bf16(h, out_.get(), n, stream_);
    }
    void student_backward() {
        const int64_t n = T_ * H_;
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_));
        for (int64_t l = L_ - 1; l >= 0; --l) {
            to_bf16(g_.get(), gb_.get(), n, stream_);
            BackwardArgs a;
            a.grad_output = dev(gb_.get(), DType::bf16, {T_, H_});
            a.grad_input = dev(g_.get(), DType::f32, {T_, H_});
            a.accumulate_grad_input = true;  // d/dh_l = d/dh_{l+1} + MoE_l'ᵀ d/dh_{l+1}
            layers_[size_t(l)]->backward(params(l, false), grads(l), a, Stream{stream_});
        }
    }
    void loss_and_grad() {
        const int64_t n = T_ * H_;
        mean_squared_error(x_.get(), y_.get(), n, nullptr, partials_.get(), scalars_.get() + 0, stream_);
        mean_squared_error(h_.get(), y_.get(), n, scalars_.get() + 0, partials_.get(), scalars_.get() + 1, stream_);
        mse_grad(h_.get(), y_.get(), n, scalars_.get() + 0, g_.get(), stream_);
    }
    void optimizer() {
        const train::AdamOptions& a = o_.adam;
        adam_step(AdamArgs{a.lr, a.beta1, a.beta2, a.eps}, counters_.get(), master_.get(), m_.get(), v_.get(),
                  grads_.get(), model_.get(), total_, nonfinite_.get(), stream_);
        for (int64_t l = 0; l < L_; ++l) {
            layers_[size_t(l)]->update_expert_bias(bias_view(l, false), Stream{stream_});
            layers_[size_t(l)]->reset_global_aux_loss_tracker(Stream{stream_});
        }
    }
    void enqueue_iteration() {
        begin_step(counters_.get(), stream_);
        generate_tokens(x_.get(), T_ * H_, o_.seed, counters_.get(), 0, stream_);
        teacher_forward(x_.get(), y_.get());
        student_forward(x_.get(), /*training=*/true);
        loss_and_grad();
        student_backward();
        optimizer();
        record_step(records_->ring(), counters_.get(), scalars_.get() + 1, nonfinite_.get(), stream_);
    }
    void enqueue_eval() {
        student_forward(eval_x_.get(), /*training=*/false);
        mean_squared_error(h_.get(), eval_y_.get(), T_ * H_, scalars_.get() + 3, partials_.get(), scalars_.get() + 2,
                           stream_);
        record_eval(records_->ring(), counters_.get(), scalars_.get() + 2, stream_);
    }

    // Captures fn's work on the stream in global mode (any host sync inside fails the capture).
    template <typename Fn>
    cudaGraphExec_t capture(Fn&& fn) {
        cudaGraph_t graph = nullptr;
        MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
        try {
            fn();
        } catch (...) {
            cudaStreamEndCapture(stream_, &graph);
            if (graph) cudaGraphDestroy(graph);
            throw;
        }
        MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
        cudaGraphExec_t exec = nullptr;
        MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
        MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
        return exec;
    }

    int64_t owned_bytes() const {
        int64_t n = 0;
        auto add = [&](const auto&... b) { ((n += int64_t(b.bytes())), ...); };
        add(master_, m_, v_, grads_, model_, teacher_, x_, y_, h_, g_, eval_x_, eval_y_, out_, gb_);
        add(scalars_, partials_, counters_, nonfinite_, teacher_bias32_, teacher_bias64_);
        n += records_->device_bytes();
        for (const auto& b : xb_) n += int64_t(b.bytes());
        for (int64_t l = 0; l < L_; ++l) n += int64_t(bias32_[size_t(l)].bytes() + bias64_[size_t(l)].bytes());
        for (const auto& layer : layers_) n += layer->memory().workspace_bytes;
        return n;
    }

    TrainOptions o_;
    int64_t L_ = 0, T_ = 0, H_ = 0, E_ = 0, total_ = 0;
    int device_ = 0;
    bool router_fp64_ = false;
    cudaStream_t stream_ = nullptr;
    std::vector<std::unique_ptr<CudaLayer>> layers_;
    train::FlatLayout layout_;
    DeviceBuffer<float> master_, m_, v_, grads_, x_, y_, h_, g_, eval_x_, eval_y_;
    DeviceBuffer<bf16> model_, teacher_, out_, gb_;
    std::vector<DeviceBuffer<bf16>> xb_;
    std::vector<DeviceBuffer<float>> bias32_;
    std::vector<DeviceBuffer<double>> bias64_;
    DeviceBuffer<float> teacher_bias32_;
    DeviceBuffer<double> teacher_bias64_;
    DeviceBuffer<double> scalars_, partials_;  // scalars: x_to_y, loss, eval loss, identity MSE
    DeviceBuffer<StepCounters> counters_;
    DeviceBuffer<int32_t> nonfinite_;
    std::unique_ptr<RecordCollector> records_;
    int64_t used_bytes_ = 0;
    cudaGraphExec_t train_graph_ = nullptr, eval_graph_ = nullptr;
    double identity_mse_ = 0;
};

// Measures, after the run: the iteration replayed alone, its parts each timed alone, the expert GEMMs
// through the layers' stage timing, and a dense cuBLAS GEMM of the same shape. It runs steps, so it
// comes last (the trainer calls it after the final checkpoint).
train::EngineReport CudaTrainEngine::report(bool measure_speed) {
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    train::EngineReport r;
    r.device_bytes = owned_bytes();
    r.device_used_bytes = used_bytes_;
    r.layer_workspace_bytes = layers_[0]->memory().workspace_bytes;
    r.saved_bytes_per_token = layers_[0]->memory().saved_bytes_per_token();
    if (!train_graph_ || !measure_speed) return r;
    const int warm = 2, iters = 10;
    r.iteration_ms = time_ms([&] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(train_graph_, stream_)); }, stream_, warm, iters);
    const double data_teacher = time_ms([&] {
        generate_tokens(x_.get(), T_ * H_, o_.seed, counters_.get(), 0, stream_);
        teacher_forward(x_.get(), y_.get());
    }, stream_, warm, iters);
    const double fwd = time_ms([&] { student_forward(x_.get(), true); }, stream_, warm, iters);
    const double loss = time_ms([&] { loss_and_grad(); }, stream_, warm, iters);
    const double bwd = time_ms([&] { student_backward(); }, stream_, warm, iters);
    const double opt = time_ms([&] { optimizer(); }, stream_, warm, iters);
    r.parts_ms = data_teacher + fwd + loss + bwd + opt;
    char buf[256];
    std::snprintf(buf, sizeof buf, "data+teacher fwd %.3f, student fwd %.3f, loss %.3f, student bwd %.3f, adam+bias %.3f ms",
                  data_teacher, fwd, loss, bwd, opt);
    r.parts = buf;

    // Expert GEMMs (fc1 and fc2, forward and backward) of every student layer, from the stage events.
    for (auto& layer : layers_) layer->inner().enable_stage_timing(true);
    student_forward(x_.get(), true);
    loss_and_grad();
    student_backward();
    for (auto& layer : layers_) {
        const StageTimesMs f = layer->inner().forward_times_ms(), b = layer->inner().backward_times_ms();
        for (LayerStage s : {LayerStage::fc1, LayerStage::fc2}) r.expert_gemm_ms += f[size_t(s)] + b[size_t(s)];
        layer->inner().enable_stage_timing(false);
    }
    const MoeConfig& c = o_.config;
    const int64_t rows = T_ * c.moe_router_topk, F = c.expert_ffn(), F1 = c.fc1_rows();
    const double fwd_flops = 2.0 * double(rows) * double(F1 * H_ + H_ * F);  // one layer's expert GEMMs, forward
    r.expert_gemm_tflops = 3.0 * fwd_flops * double(L_) / (r.expert_gemm_ms * 1e-3) / 1e12;
    r.model_tflops = 4.0 * fwd_flops * double(L_) / (r.iteration_ms * 1e-3) / 1e12;  // student 3x + teacher 1x

    // The dense floor: cuBLAS bf16 GEMMs of the expert shapes with all rows in one group.
    {
        DeviceBuffer<bf16> a(rows * std::max(H_, F)), w1(F1 * H_), w2(H_ * F), c1(rows * std::max(F1, H_));
        fill_uniform(a.get(), size_t(a.size()), 1.f, 5), fill_uniform(w1.get(), size_t(w1.size()), 0.02f, 6);
        fill_uniform(w2.get(), size_t(w2.size()), 0.02f, 7);
        const double dense = time_ms([&] {
            dense_gemm(gemm_detail::Op::kNT, rows, F1, H_, a.get(), w1.get(), c1.get(), stream_);
            dense_gemm(gemm_detail::Op::kNT, rows, H_, F, a.get(), w2.get(), c1.get(), stream_);
        }, stream_, warm, iters);
        r.dense_cublas_tflops = fwd_flops / (dense * 1e-3) / 1e12;
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    return r;
}

}  // namespace

std::unique_ptr<train::TrainEngine> make_cuda_train_engine(const TrainOptions& options) {
    return std::make_unique<CudaTrainEngine>(options);
}

}  // namespace moekit::cuda
