// The CUDA data/expert-parallel training engine (train_engine.h): `moekit train --device cuda` on several ranks
// (--virtual-ranks N on ONE GPU over the local-gpu transport, mpirun -np N with one GPU per process over NCCL) or
// with several micro-batches per step. Megatron's layout and semantics as the CPU EP engine has them
// (src/train/ep_engine.cpp, the twin): rank r computes micro-batches r·M .. r·M + M − 1 of the global batch; the
// student's layers run at --expert-model-parallel-size through the CUDA dispatchers (moekit::Layer on views, the
// L = E / EP local experts per rank); router and shared grads are summed over data-parallel and the local experts'
// over expert-data-parallel on the device (all_reduce_sum: rank order, the same bits on every rank), then Adam
// (replicated on the replicated tensors, each rank's on its own experts) takes the mean over the G micro-batches.
// Expert-bias counts are summed over data-parallel. Eager: the alltoall dispatcher syncs with the host. Reuses the
// single-GPU engine's kernels (train_kernels.cuh), layout (train/flat_layout.h) and records (train_records.h).
// Tests: tests/gpu/test_cuda_train_ep.cu.
#include <algorithm>
#include <optional>
#include <utility>

#include "comm/device_comm.h"
#include "core/bf16.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/device_layer.h"
#include "cuda/ep_train_engine.h"
#include "cuda/ep_train_kernels.cuh"
#include "cuda/moe_layer.h"
#include "cuda/train_kernels.cuh"
#include "cuda/train_records.h"
#include "moekit/comm.h"
#include "moekit/error.h"
#include "train/flat_layout.h"
#include "train/train_task.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;
using train::StepRecord;
using train::TrainOptions;
using train::TrainState;

MoeConfig single_rank_config(MoeConfig c) {
    c.expert_model_parallel_size = 1;  // the teacher runs whole on every rank
    return c;
}

std::vector<bf16> to_bf16_host(const std::vector<float>& v) {
    std::vector<bf16> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = __nv_bfloat16_raw{float_to_bf16_bits(v[i])};
    return b;
}

class CudaEpTrainEngine final : public train::TrainEngine {
public:
    CudaEpTrainEngine(const TrainOptions& o, Communicator& world)
        : o_(o), world_(world), run_(train::run_layout(o)), global_(o.config, 0, o.config.num_experts()) {
        const MoeConfig& c = o.config;
        L_ = c.num_layers, T_ = c.seq_length * c.micro_batch_size, H_ = c.hidden_size, E_ = c.num_experts();
        const int ep = int(c.expert_model_parallel_size);
        train::check_same_options(world_, o);
        MOEKIT_REQUIRE(world_.size() == 1 || c.aux_loss_coeff("global_aux_loss") == 0,
                       "--moe-router-load-balancing-type global_aux_loss on --device cuda with ", world_.size(),
                       " ranks: its token counts are reduced over data-parallel ranks inside the loss, which the "
                       "CUDA layer does not do yet; use --device cpu");
        groups_ = make_process_groups(world_, ep);
        // The device communicators first: over NCCL they pick this process's GPU.
        if (ep > 1) ep_comm_ = make_device_comm(*groups_->ep);
        if (world_.size() > 1) dp_comm_ = ep == world_.size() ? nullptr : make_device_comm(*groups_->dp);
        if (groups_->expert_dp->size() > 1) edp_comm_ = make_device_comm(*groups_->expert_dp);
        dp_ = world_.size() > 1 ? (dp_comm_ ? dp_comm_.get() : ep_comm_.get()) : nullptr;
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device_));
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

        const LayerBounds bounds{c.seq_length, c.micro_batch_size};
        const MoeConfig lc = train_layer_config(c);
        for (int64_t l = 0; l < L_; ++l) layers_.push_back(make_cuda_layer(lc, bounds, device_, ep_comm_.get()));
        teacher_layer_ = make_cuda_layer(single_rank_config(lc), bounds, device_);  // eval only: one serves every layer
        router_fp64_ = layers_[0]->router_dtype() == DType::f64;
        const int64_t local = layers_[0]->local_experts();
        local_ = std::make_unique<train::FlatLayout>(c, int64_t(groups_->ep_rank()) * local, local);
        allocate();
        upload_student(train::student_weights(o), std::nullopt);
        teacher_.upload(to_bf16_host(global_.flatten(train::teacher_weights(o))));

        // The held-out batch (the same on every rank), its targets, and the loss normaliser, once.
        generate_tokens(eval_x_.get(), T_ * H_, o.seed, nullptr, train::kEvalStream, stream_);
        teacher_forward(eval_x_.get(), eval_y_.get());
        mean_squared_error(eval_x_.get(), eval_y_.get(), T_ * H_, nullptr, partials_.get(), scalars_.get() + 3, stream_);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        identity_mse_ = download(scalars_.get() + 3, 1)[0];
        train::require_teacher_differs(o, identity_mse_);
    }

    ~CudaEpTrainEngine() override {
        if (stream_) cudaStreamSynchronize(stream_);
        records_.reset();
        layers_.clear(), teacher_layer_.reset();
        if (stream_) cudaStreamDestroy(stream_);
    }

    double identity_mse() const override { return identity_mse_; }

    void step() override {
        records_->stepped(stream_);
        const int64_t step = ++host_step_, M = run_.micro_batches_per_rank;
        begin_step(counters_.get(), stream_);
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(sums_.get(), 0, sums_.bytes(), stream_));
        for (int64_t i = 0; i < M; ++i) {
            const uint64_t data = train::data_stream(step, int64_t(world_.rank()) * M + i);
            generate_tokens(x_.get(), T_ * H_, o_.seed, nullptr, data, stream_);
            store_i64(jitter_.get(), int64_t(data), stream_);  // the CPU EP engine's jitter seed
            teacher_forward(x_.get(), y_.get());
            student_forward(x_.get(), /*training=*/true);
            loss_and_grad();
            student_backward();
            add_micro_batch(sums_.get(), scalars_.get() + 1, layer_losses_.get(), router_fp64_, layer_counts_.get(), L_,
                            E_, stream_);
        }
        reduce();
        optimizer();
        record_step(records_->ring(), counters_.get(), means_.get(), nonfinite_.get(), stream_);
    }

    void eval() override {
        student_forward(eval_x_.get(), /*training=*/false);
        mean_squared_error(h_.get(), eval_y_.get(), T_ * H_, scalars_.get() + 3, partials_.get(), scalars_.get() + 2,
                           stream_);
        const double* loss = scalars_.get() + 2;
        if (dp_) {  // rank 0's value for all (every rank ran the same tokens; the record must not depend on it)
            dp_->all_gather(scalars_.get() + 2, sizeof(double), gathered_.get(), stream_);
            loss = gathered_.get();
        }
        record_eval(records_->ring(), counters_.get(), loss, stream_);
    }

    std::vector<StepRecord> collect(bool wait) override { return records_->collect(wait, stream_); }

    // Collective over the EP group: the other ranks' experts are gathered, so the state is global.
    TrainState state() override {
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        TrainState s;
        s.step = download(&counters_.get()->completed, 1)[0];
        const std::vector<float> master = to_global(master_.download());
        for (int64_t l = 0; l < L_; ++l) {
            MoeWeights<float> w = train::zero_weights(o_.config);
            global_.unflatten(master, l, w);
            if (o_.config.moe_router_enable_expert_bias) w.expert_bias = download_bias(l);
            s.weights.push_back(std::move(w));
        }
        std::vector<float> m = to_global(m_.download()), v = to_global(v_.download());
        if (s.step > 0) global_.moments_to_state(m, v, s);
        return s;
    }

    // Every rank reads the same global state and keeps its part.
    void load_state(const TrainState& s) override {
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        std::vector<float> m, v;
        global_.moments_from_state(s, m, v);
        upload_student(s.weights, std::make_pair(to_local(m), to_local(v)));
        const StepCounters c{s.step, s.step};
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(counters_.get(), &c, sizeof c, cudaMemcpyHostToDevice, stream_));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        host_step_ = s.step;
        records_->restart_at(s.step);
    }

    train::EngineReport report(bool) override {
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        train::EngineReport r;  // memory only: the speed measurements replay a captured graph (one rank)
        r.layer_workspace_bytes = layers_[0]->memory().workspace_bytes;
        r.saved_bytes_per_token = layers_[0]->memory().saved_bytes_per_token();
        r.device_bytes = owned_bytes();
        return r;
    }

private:
    // ---- set-up ----
    void allocate() {
        const int64_t total = local_->total(), n = T_ * H_, dp = dp_ ? dp_->size() : 1;
        const int64_t edp = edp_comm_ ? edp_comm_->size() : 1;
        master_.resize(total), m_.resize(total), v_.resize(total), grads_.resize(total), model_.resize(total);
        teacher_.resize(global_.total());
        x_.resize(n), y_.resize(n), h_.resize(n), g_.resize(n), eval_x_.resize(n), eval_y_.resize(n);
        out_.resize(n), gb_.resize(n);
        xb_.resize(size_t(L_));
        for (auto& b : xb_) b.resize(n);
        for (int64_t l = 0; l < L_; ++l) {
            bias32_.emplace_back(router_fp64_ ? 0 : E_);
            bias64_.emplace_back(router_fp64_ ? E_ : 0);
        }
        teacher_bias32_.resize(router_fp64_ ? 0 : E_), teacher_bias64_.resize(router_fp64_ ? E_ : 0);
        scalars_.resize(4), partials_.resize(kReduceBlocks), counters_.resize(1), nonfinite_.resize(1), jitter_.resize(1);
        const int64_t count = step_sum_count(L_, E_);
        sums_.resize(count), means_.resize(1 + 4 * L_), counts_.resize(L_ * E_);
        gathered_.resize(dp * std::max(count, E_)), flags_.resize(dp);
        grad_scratch_.resize(std::max(dp > 1 ? dp * local_->dense_total() : 0,
                                      edp > 1 ? edp * (total - local_->dense_total()) : 0));
        std::vector<const int32_t*> layer_counts, record_counts;
        std::vector<const void*> layer_losses, record_losses;
        for (int64_t l = 0; l < L_; ++l) {
            layer_counts.push_back(layers_[size_t(l)]->results().tokens_per_expert.as<const int32_t>());
            layer_losses.push_back(layers_[size_t(l)]->results().losses.data);
            record_counts.push_back(counts_.get() + l * E_);
            record_losses.push_back(means_.get() + 1 + 4 * l);
        }
        layer_counts_.resize(L_), layer_losses_.resize(L_);
        layer_counts_.upload(layer_counts), layer_losses_.upload(layer_losses);
        // The records read the step's reduced values (double losses), over the whole global batch.
        records_ = std::make_unique<RecordCollector>(o_.log_interval, L_, E_, /*router_fp64=*/true, record_counts,
                                                     record_losses, T_ * run_.micro_batches);
    }

    // The student's weights (this rank's experts) and, given, Adam's moments in the local layout (else zeros).
    void upload_student(const std::vector<MoeWeights<float>>& ws,
                        const std::optional<std::pair<std::vector<float>, std::vector<float>>>& moments) {
        MOEKIT_CHECK(int64_t(ws.size()) == L_, ws.size(), " layers of weights for ", L_, " layers");
        master_.upload(local_->flatten(ws));
        for (int64_t l = 0; l < L_ && o_.config.moe_router_enable_expert_bias; ++l) {
            const std::vector<double>& b = ws[size_t(l)].expert_bias;
            MOEKIT_CHECK(int64_t(b.size()) == E_, "expert_bias of layer ", l);
            if (router_fp64_) {
                bias64_[size_t(l)].upload(b);
            } else {
                bias32_[size_t(l)].upload(std::vector<float>(b.begin(), b.end()));
            }
        }
        if (moments) {
            m_.upload(moments->first), v_.upload(moments->second);
        } else {
            zero_fill(m_.get(), m_.bytes());
            zero_fill(v_.get(), v_.bytes());
        }
        // The uploads ran on the legacy stream (a pageable copy may return before its DMA lands): wait for them
        // before this rank's stream reads the master weights.
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        to_bf16(master_.get(), model_.get(), local_->total(), stream_);
    }

    std::vector<double> download_bias(int64_t l) const {
        if (router_fp64_) return bias64_[size_t(l)].download();
        const std::vector<float> b = bias32_[size_t(l)].download();
        return std::vector<double>(b.begin(), b.end());
    }

    // ---- local (this rank's experts) <-> global (every expert) flat buffers (train/flat_layout.h) ----
    // The EP ranks' expert parts are gathered over the EP group (a host collective).
    std::vector<float> to_global(const std::vector<float>& local) {
        if (groups_->ep_size() == 1) return local;
        const std::vector<float> parts =
            groups_->ep->all_gather(std::vector<float>(local.begin() + local_->dense_total(), local.end()));
        return train::to_global(global_, *local_, local, parts);
    }
    std::vector<float> to_local(const std::vector<float>& global) const {
        if (groups_->ep_size() == 1) return global;
        return train::to_local(global_, *local_, global);
    }

    // ---- views ----
    TensorView dev(void* p, DType d, std::initializer_list<int64_t> dims) const {
        return TensorView(p, d, dims, Backend::cuda, device_);
    }
    TensorView bias_view(int64_t l, bool teacher) {
        if (router_fp64_) return dev(teacher ? teacher_bias64_.get() : bias64_[size_t(l)].get(), DType::f64, {E_});
        return dev(teacher ? teacher_bias32_.get() : bias32_[size_t(l)].get(), DType::f32, {E_});
    }
    LayerParams params(int64_t l, bool teacher) {
        LayerParams p = teacher ? global_.params(teacher_.get(), l, device_) : local_->params(model_.get(), l, device_);
        if (o_.config.moe_router_enable_expert_bias) p.expert_bias = bias_view(l, teacher);
        return p;
    }

    // ---- one micro-batch (the single-GPU engine's order) ----
    void teacher_forward(const float* in, float* out) {
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(T_ * H_) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        for (int64_t l = 0; l < L_; ++l) layer_forward(*teacher_layer_, params(l, true), l, out, false);
    }
    void student_forward(const float* in, bool training) {
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(h_.get(), in, size_t(T_ * H_) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        for (int64_t l = 0; l < L_; ++l) layer_forward(*layers_[size_t(l)], params(l, false), l, h_.get(), training);
    }
    void layer_forward(Layer& layer, const LayerParams& p, int64_t l, float* h, bool training) {
        to_bf16(h, xb_[size_t(l)].get(), T_ * H_, stream_);
        ForwardArgs a;
        a.input = dev(xb_[size_t(l)].get(), DType::bf16, {T_, H_});
        a.output = dev(out_.get(), DType::bf16, {T_, H_});
        a.jitter_seed = dev(jitter_.get(), DType::i64, {1});
        a.training = training;
        layer.forward(p, a, Stream{stream_});
        add_bf16(h, out_.get(), T_ * H_, stream_);
    }
    void loss_and_grad() {
        const int64_t n = T_ * H_;
        mean_squared_error(x_.get(), y_.get(), n, nullptr, partials_.get(), scalars_.get() + 0, stream_);
        mean_squared_error(h_.get(), y_.get(), n, scalars_.get() + 0, partials_.get(), scalars_.get() + 1, stream_);
        mse_grad(h_.get(), y_.get(), n, scalars_.get() + 0, g_.get(), stream_);
    }
    void student_backward() {  // grads accumulate over the rank's micro-batches
        for (int64_t l = L_ - 1; l >= 0; --l) {
            to_bf16(g_.get(), gb_.get(), T_ * H_, stream_);
            BackwardArgs a;
            a.grad_output = dev(gb_.get(), DType::bf16, {T_, H_});
            a.grad_input = dev(g_.get(), DType::f32, {T_, H_});
            a.accumulate_grad_input = true;  // d/dh_l = d/dh_{l+1} + MoE_l'ᵀ d/dh_{l+1}
            layers_[size_t(l)]->backward(params(l, false), local_->grads(grads_.get(), l, device_), a, Stream{stream_});
        }
    }

    // ---- the step's end ----
    // finalize_model_grads: replicated grads summed over data-parallel, the local experts' over expert-data-
    // parallel; the record's sums over data-parallel. The mean over the G micro-batches is Adam's grad_scale.
    void reduce() {
        const int64_t dense = local_->dense_total(), count = step_sum_count(L_, E_);
        if (dp_) {
            all_reduce_sum(*dp_, grads_.get(), dense, grad_scratch_.get(), stream_);
            dp_->all_gather(sums_.get(), count * int64_t(sizeof(double)), gathered_.get(), stream_);
            sum_rank_blocks(gathered_.get(), dp_->size(), count, sums_.get(), stream_);
        }
        if (edp_comm_)
            all_reduce_sum(*edp_comm_, grads_.get() + dense, local_->total() - dense, grad_scratch_.get(), stream_);
        finish_step_sums(sums_.get(), L_, E_, 1.0 / double(run_.micro_batches), means_.get(), counts_.get(), stream_);
    }
    void optimizer() {
        const train::AdamOptions& a = o_.adam;
        AdamArgs args{a.lr, a.beta1, a.beta2, a.eps};
        args.grad_scale = 1.0 / double(run_.micro_batches);
        adam_step(args, counters_.get(), master_.get(), m_.get(), v_.get(), grads_.get(), model_.get(), local_->total(),
                  nonfinite_.get(), stream_);
        if (dp_) {  // a non-finite expert grad is seen by its owners only: every rank takes the OR
            dp_->all_gather(nonfinite_.get(), sizeof(int32_t), flags_.get(), stream_);
            or_flags(flags_.get(), dp_->size(), nonfinite_.get(), stream_);
        }
        for (int64_t l = 0; l < L_; ++l) {
            if (o_.config.moe_router_enable_expert_bias && dp_) {  // the global batch's counts (Megatron: over dp)
                double* counts = layers_[size_t(l)]->inner().buffers().local_tokens_per_expert;
                dp_->all_gather(counts, E_ * int64_t(sizeof(double)), gathered_.get(), stream_);
                sum_rank_blocks(gathered_.get(), dp_->size(), E_, counts, stream_);
            }
            layers_[size_t(l)]->update_expert_bias(bias_view(l, false), Stream{stream_});
            layers_[size_t(l)]->reset_global_aux_loss_tracker(Stream{stream_});
        }
    }

    int64_t owned_bytes() const {
        int64_t n = 0;
        auto add = [&](const auto&... b) { ((n += int64_t(b.bytes())), ...); };
        add(master_, m_, v_, grads_, model_, teacher_, x_, y_, h_, g_, eval_x_, eval_y_, out_, gb_, grad_scratch_);
        add(scalars_, partials_, counters_, nonfinite_, jitter_, sums_, means_, counts_, gathered_, flags_);
        for (const auto& b : xb_) n += int64_t(b.bytes());
        for (int64_t l = 0; l < L_; ++l) n += int64_t(bias32_[size_t(l)].bytes() + bias64_[size_t(l)].bytes());
        for (const auto& layer : layers_) n += layer->memory().workspace_bytes;
        return n + teacher_layer_->memory().workspace_bytes + records_->device_bytes();
    }

    TrainOptions o_;
    Communicator& world_;
    train::RunLayout run_;
    train::FlatLayout global_;                  // every expert: the teacher, checkpoints
    std::unique_ptr<train::FlatLayout> local_;  // this rank's experts: the student's flat buffers
    std::unique_ptr<ProcessGroups> groups_;
    std::unique_ptr<DeviceComm> ep_comm_, dp_comm_, edp_comm_;
    DeviceComm* dp_ = nullptr;  // data-parallel (the world; the EP communicator when EP = world), null on one rank
    int64_t L_ = 0, T_ = 0, H_ = 0, E_ = 0, host_step_ = 0;
    int device_ = 0;
    bool router_fp64_ = false;
    cudaStream_t stream_ = nullptr;
    std::vector<std::unique_ptr<CudaLayer>> layers_;
    std::unique_ptr<CudaLayer> teacher_layer_;
    DeviceBuffer<float> master_, m_, v_, grads_, x_, y_, h_, g_, eval_x_, eval_y_, grad_scratch_;
    DeviceBuffer<bf16> model_, teacher_, out_, gb_;
    std::vector<DeviceBuffer<bf16>> xb_;
    std::vector<DeviceBuffer<float>> bias32_;
    std::vector<DeviceBuffer<double>> bias64_;
    DeviceBuffer<float> teacher_bias32_;
    DeviceBuffer<double> teacher_bias64_;
    DeviceBuffer<double> scalars_, partials_;  // scalars: x_to_y, loss, eval loss, identity MSE
    DeviceBuffer<double> sums_, means_, gathered_;
    DeviceBuffer<int32_t> counts_, nonfinite_, flags_;
    DeviceBuffer<int64_t> jitter_;
    DeviceBuffer<StepCounters> counters_;
    DeviceBuffer<const int32_t*> layer_counts_;
    DeviceBuffer<const void*> layer_losses_;
    std::unique_ptr<RecordCollector> records_;
    double identity_mse_ = 0;
};

}  // namespace

std::unique_ptr<train::TrainEngine> make_cuda_ep_train_engine(const TrainOptions& options) {
    return train::on_world(options, [&](Communicator& world) -> std::unique_ptr<train::TrainEngine> {
        return std::make_unique<CudaEpTrainEngine>(options, world);
    });
}

}  // namespace moekit::cuda
