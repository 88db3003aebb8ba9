// CudaMoeLayer implementation (see moe_layer.h): LayerImpl<R> owns the static device buffers and
// enqueues the stage kernels; nothing here allocates, copies to the host or waits inside
// forward()/backward().
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/activation.cuh"
#include "cuda/combine.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/dispatcher.h"
#include "cuda/losses.cuh"
#include "cuda/moe_layer.h"
#include "cuda/permute.cuh"
#include "cuda/router.cuh"
#include "cuda/shared_expert.cuh"

namespace moekit::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;

// MOEKIT_EXPERT_GEMM=sync_baseline (debugging, e.g. sanitizers that cannot follow the TMA/wgmma
// kernels) makes new layers start on the synchronous baseline; default: grouped.
ExpertGemmKind default_gemm_kind() {
    const char* env = std::getenv("MOEKIT_EXPERT_GEMM");
    return env && std::string(env) == "sync_baseline" ? ExpertGemmKind::sync_baseline : ExpertGemmKind::grouped;
}

std::atomic<int> g_wgrad_overlap{-1};

// An expert GEMM over the L home groups and (ECHO) the S spare-slot groups after them in one launch: the slots take
// their weights / gradients from slot_base (GroupedGemmShape::second_from). Two launches cost an ECHO rank 2-3 % of
// its expert time (H200, bench_echo_balance, docs/perf.md).
GroupedGemmShape home_and_slots(int64_t L, int64_t S, int64_t max_rows, int64_t n, int64_t k, const void* slot_base) {
    return GroupedGemmShape{L + S, max_rows, n, k, S > 0 ? L : 0, S > 0 ? slot_base : nullptr};
}

template <typename R>
class LayerImpl final : public CudaMoeLayer {
public:
    LayerImpl(const CudaLayerShape& shape, bool own_io, DeviceComm* ep)
        : shape_(shape),
          gemm_(expert_gemm(default_gemm_kind())),
          shares_gpu_with_ranks_(ep && ep->size() > 1 && ep->transport() == "local-gpu") {
        const RouterShape& r = shape.router;
        const int64_t T = r.num_tokens, H = r.hidden, E = r.num_experts, K = r.topk, B = r.micro_batch_size;
        const int64_t M = shape.max_rows, F = shape.ffn, F1 = shape.fc1_rows;
        DispatchShape ds{r, M, shape.ep_size, shape.ep_rank, shape.receive_factor};
        ds.echo_slots = shape.echo_slots, ds.echo_algorithm = shape.echo_algorithm;
        ds.echo_group_floor_rows = shape.echo_group_floor_rows;
        ds.fc1_rows = shape.fc1_rows, ds.ffn = shape.ffn;
        dispatcher_ = make_cuda_dispatcher<R>(shape.dispatcher, ds, ep);
        const int64_t L = dispatcher_->num_local_experts(), Me = dispatcher_->expert_max_rows();
        mask_.resize(T);
        if (own_io) {
            hidden_.resize(T * H), grad_output_.resize(T * H);
            router_weight_.resize(E * H), expert_bias_.resize(E), fc1_.resize(L * F1 * H), fc2_.resize(L * H * F);
            output_.resize(T * H), grad_input_.resize(T * H);
            grad_router_weight_.resize(E * H), grad_fc1_.resize(L * F1 * H), grad_fc2_.resize(L * H * F);
        }
        // The gating linear on tensor cores needs no upcast copies of x and W, only its backward's bf16 parts.
        if (r.linear_on_tensor_cores(sizeof(R) != sizeof(float)))
            grad_logits_split_.resize(T * 3 * E), weight3_.resize(3 * E * H), grad_weight3_.resize(3 * E * H);
        else
            hidden_r_.resize(T * H), weight_r_.resize(E * H);
        logits_.resize(T * E), probs_.resize(T * E);
        map_.resize(T * E), topk_idx_.resize(T * K), jitter_seed_.resize(1);
        if (r.sinkhorn) sinkhorn_.resize(T * E), sinkhorn_d0_.resize(T);
        aux_scores_.resize(T * E), aux_map_.resize(T * E), lse_.resize(T);
        score_sums_.resize(B * E), aux_counts_.resize(B * E), valid_counts_.resize(B * E), grad_coeff_.resize(B * E);
        loss_chunk_scores_.resize(loss_chunk_score_elems(r.seq_length, B, E));
        loss_chunk_counts_.resize(loss_chunk_count_elems(r.seq_length, B, E));
        z_grad_coeff_.resize(1), losses_.resize(kNumLossSlots), local_tokens_.resize(E), global_tokens_.resize(E);
        tracker_copy_.resize(2 * E), steps_copy_.resize(1);
        ga_steps_.resize(1);
        counts_.resize(E), offsets_.resize(E + 1), rank_.resize(T * E), row_token_.resize(M), row_prob_.resize(M);
        token_offsets_.resize(T + 1), token_rows_.resize(M), token_counts_.resize(T);
        plan_scratch_.resize(routing_plan_scratch_elems(T, E));
        fc1_out_.resize(Me * F1), act_out_.resize(Me * F), expert_out_.resize(Me * H);
        grad_rows_.resize(Me * H), grad_act_.resize(Me * F), grad_fc1_out_.resize(Me * F1), grad_x_rows_.resize(Me * H);
        grad_row_probs_.resize(Me), grad_probs_.resize(T * E), grad_logits_.resize(T * E);
        // Only where the fused dgrad + activation backward may run (decided here, at construction, for fc2's dgrad
        // shape) is its d(prob) partial buffer allocated; without it the backward takes the unfused pair.
        if (shape.gated_linear_unit && glu_backward_fusion_enabled(GroupedGemmShape{L, Me, F, H}))
            glu_dp_.resize(Me * glu_backward_tiles(F));
        if (shape.has_shared) {
            const int64_t Fs = shape.shared.ffn, Fs1 = shape.shared.fc1_rows();
            shared_offsets_.resize(2);
            shared_offsets_.upload({0, int32_t(T)});
            if (own_io) {
                shared_fc1_.resize(Fs1 * H), shared_fc2_.resize(H * Fs), shared_gate_.resize(H);
                grad_shared_fc1_.resize(Fs1 * H), grad_shared_fc2_.resize(H * Fs), grad_shared_gate_.resize(H);
            }
            s_fc1_out_.resize(T * Fs1), s_act_.resize(T * Fs), s_out_.resize(T * H), s_gate_.resize(T);
            s_grad_out_.resize(T * H), s_grad_act_.resize(T * Fs), s_grad_fc1_out_.resize(T * Fs1);
            s_grad_x_.resize(T * H), s_grad_logit_.resize(T), s_gate_partial_.resize(ceil_div(T, kGateChunk) * H);
        }
        MOEKIT_CUBLAS_CHECK(cublasCreate(&cublas_));
        workspace_.resize(int64_t(kCublasWorkspaceBytes));
        MOEKIT_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace_.get(), kCublasWorkspaceBytes));
        for (auto& e : events_) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
        int lowest = 0, highest = 0;
        MOEKIT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithPriority(&wgrad_, cudaStreamNonBlocking, highest));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&wgrad_fork_, cudaEventDisableTiming));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&wgrad_done_, cudaEventDisableTiming));
        fill_buffers();
    }
    ~LayerImpl() override {
        if (fork_) cudaEventDestroy(fork_);
        if (join_) cudaEventDestroy(join_);
        if (side_) cudaStreamDestroy(side_);
        if (wgrad_fork_) cudaEventDestroy(wgrad_fork_);
        if (wgrad_done_) cudaEventDestroy(wgrad_done_);
        if (wgrad_) cudaStreamDestroy(wgrad_);
        if (cublas_) cublasDestroy(cublas_);
        for (auto& e : events_)
            if (e) cudaEventDestroy(e);
    }

    const CudaLayerShape& shape() const override { return shape_; }
    const LayerBuffers& buffers() const override { return buf_; }
    void set_expert_gemm(const ExpertGemm& gemm) override { gemm_ = gemm; }
    void bind(const LayerBuffers& io) override {
        LayerBuffers& b = buf_;
        b.hidden = io.hidden, b.padding_mask = io.padding_mask ? io.padding_mask : mask_.get();
        b.jitter_seed = io.jitter_seed ? io.jitter_seed : jitter_seed_.get(), b.grad_output = io.grad_output;
        b.router_weight = io.router_weight, b.expert_bias = io.expert_bias, b.fc1 = io.fc1, b.fc2 = io.fc2;
        b.shared_fc1 = io.shared_fc1, b.shared_fc2 = io.shared_fc2, b.shared_gate = io.shared_gate;
        b.output = io.output, b.grad_input = io.grad_input, b.grad_router_weight = io.grad_router_weight;
        b.grad_fc1 = io.grad_fc1, b.grad_fc2 = io.grad_fc2, b.grad_shared_fc1 = io.grad_shared_fc1;
        b.grad_shared_fc2 = io.grad_shared_fc2, b.grad_shared_gate = io.grad_shared_gate;
    }
    LayerMemory memory() const override {
        LayerMemory m;
        m.num_tokens = shape_.router.num_tokens;
        m.workspace_bytes = int64_t(allocated_bytes());
        m.saved_activation_bytes = int64_t(saved_bytes());
        return m;
    }
    DispatchTraffic traffic() const override { return dispatcher_->traffic(); }
    BudgetStatus end_dispatch_step() override { return dispatcher_->end_step(); }
    void set_synchronous_dispatch(bool on) override { dispatcher_->set_synchronous(on); }
    EchoStepSummary echo_summary() const override { return dispatcher_->echo_summary(); }
    void force_random_echo_plans(uint64_t seed) override { dispatcher_->force_random_echo_plans(seed); }
    void save_router_trackers(cudaStream_t stream) override { copy_trackers(true, stream); }
    void restore_router_trackers(cudaStream_t stream) override { copy_trackers(false, stream); }
    void enable_stage_timing(bool on) override { timing_ = on; }
    StageTimesMs forward_times_ms() override { return times(0); }
    StageTimesMs backward_times_ms() override { return times(1); }

    void forward(cudaStream_t stream, bool training) override {
        const OwnGemmKernelScope own_kernels(shares_gpu_with_ranks_);  // virtual ranks: see grouped_gemm.h
        const GemmRuleScope rule_only(shape_.gemm_rule_only);
        const RouterShape& r = shape_.router;
        const int64_t H = r.hidden, F = shape_.ffn, F1 = shape_.fc1_rows;
        training_ = training;
        mark(stream, 0, LayerStage::router, true);
        router_forward<R>(r, router_tensors(), cublas_, stream, training);
        // The load-balancing losses read the logits and the map and write only their own buffers, which backward
        // reads: a branch of their own (side_), beside the routing plan and the dispatch, joined at the end of
        // forward. Their kernels are small and latency-bound, as the plan's are, so the two overlap (inside a
        // captured graph too: the fork and join become its edges).
        const bool losses = training && (shape_.loss.any() || r.has_expert_bias);
        if (losses) {
            MOEKIT_CUDA_CHECK(cudaEventRecord(fork_, stream));
            MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
            losses_forward<R>(r, shape_.loss, loss_tensors(), side_);
            MOEKIT_CUDA_CHECK(cudaEventRecord(join_, side_));
        }
        mark(stream, 0, LayerStage::router, false);
        mark(stream, 0, LayerStage::permute, true);
        build_routing_plan<R>(map_.get(), probs_.get(), plan(), stream);
        dispatcher_->set_expert_params(ExpertParams{buf_.fc1, buf_.fc2, buf_.grad_fc1, buf_.grad_fc2});
        // EP = 1 with the fused fc1 forward: fc1's loads gather the token rows, so dispatch leaves them unwritten.
        bool gather = false;
        if constexpr (std::is_same_v<R, float>)
            gather = shape_.gated_linear_unit && gemm_.gathers &&
                     gemm_.gathers(GroupedGemmShape{dispatcher_->num_local_experts(), dispatcher_->expert_max_rows(),
                                                    F1, H});
        dispatcher_->set_rows_deferred(gather);
        experts_ = dispatcher_->dispatch(plan(), map_.get(), probs_.get(), buf_.hidden, stream);
        mark(stream, 0, LayerStage::permute, false);
        const int64_t L = experts_.num_experts, S = experts_.num_slots, M = experts_.max_rows;
        const int32_t* offsets = experts_.offsets;
        if (shape_.has_shared) {
            mark(stream, 0, LayerStage::shared_expert, true);
            shared_expert_forward(shape_.shared, shared_tensors(), gemm_, stream);
            mark(stream, 0, LayerStage::shared_expert, false);
        }
        mark(stream, 0, LayerStage::fc1, true);
        // ECHO: the S slot groups follow the L home groups in the rows; they compute with the clone weights.
        // Gated activations with an fp32 router: the activation may ride in fc1's epilogue
        // (grouped_gemm_nt_glu_forward, set_glu_forward_fusion), leaving the activation stage empty.
        bool fused_act = false;
        if constexpr (std::is_same_v<R, float>) {
            const RowGather rows{buf_.hidden, plan().row_token, dispatcher_->expert_rows_buffer()};
            if (shape_.gated_linear_unit && gemm_.nt_glu_forward)
                fused_act = gemm_.nt_glu_forward(
                    home_and_slots(L, S, M, F1, H, experts_.slot_fc1), experts_.rows, buf_.fc1, fc1_out_.get(),
                    offsets, GluForwardEpilogue{experts_.probs, act_out_.get(), shape_.act}, stream,
                    experts_.rows_pending ? &rows : nullptr);
        }
        // Not gathered after all (the launch declined: nothing was written): the rows as dispatch writes them.
        if (experts_.rows_pending && !fused_act) dispatcher_->write_rows(plan(), buf_.hidden, stream);
        if (!fused_act)
            gemm_.nt(home_and_slots(L, S, M, F1, H, experts_.slot_fc1), experts_.rows, buf_.fc1, fc1_out_.get(),
                     offsets, stream);
        mark(stream, 0, LayerStage::fc1, false);
        mark(stream, 0, LayerStage::activation, true);
        if (!fused_act)
            activation_forward<R>(act_shape(), offsets + L + S, fc1_out_.get(), experts_.probs, act_out_.get(),
                                  stream);
        mark(stream, 0, LayerStage::activation, false);
        mark(stream, 0, LayerStage::fc2, true);
        gemm_.nt(home_and_slots(L, S, M, H, F, experts_.slot_fc2), act_out_.get(), buf_.fc2, expert_out_.get(), offsets,
                 stream);
        mark(stream, 0, LayerStage::fc2, false);
        mark(stream, 0, LayerStage::combine, true);
        dispatcher_->combine(plan(), expert_out_.get(), shape_.has_shared ? s_out_.get() : nullptr,
                             shape_.has_shared && shape_.shared.has_gate ? s_gate_.get() : nullptr, buf_.output, stream);
        mark(stream, 0, LayerStage::combine, false);
        if (losses) MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
    }

    void backward(cudaStream_t stream, const BackwardOptions& options) override {
        const OwnGemmKernelScope own_kernels(shares_gpu_with_ranks_);
        const GemmRuleScope rule_only(shape_.gemm_rule_only);
        const RouterShape& r = shape_.router;
        const bool acc = options.accumulate_param_grads;
        const int64_t H = r.hidden, F = shape_.ffn, F1 = shape_.fc1_rows;
        const int64_t L = experts_.num_experts, S = experts_.num_slots, M = experts_.max_rows;
        const int32_t* offsets = experts_.offsets;
        // The wgrads beside the dgrad chain (set_wgrad_overlap): forked from `stream` onto wgrad_, joined at the end.
        const int sms_left = S == 0 && gemm_.concurrent_wgrad && dispatcher_->backward_leaves_expert_rows() &&
                                     wgrad_overlap_enabled()
                                 ? wgrad_overlap_sms_left()
                                 : 0;
        const auto wgrad = [&](const GroupedGemmShape& g, const bf16* A, const bf16* B, float* grad) {
            if (sms_left == 0) return gemm_.tn(g, A, B, grad, offsets, wgrad_write(acc), stream);
            MOEKIT_CUDA_CHECK(cudaEventRecord(wgrad_fork_, stream));
            MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(wgrad_, wgrad_fork_, 0));
            {
                const GemmSmsLeftScope left(sms_left);
                gemm_.tn(g, A, B, grad, offsets, wgrad_write(acc), wgrad_);
            }
            MOEKIT_CUDA_CHECK(cudaEventRecord(wgrad_done_, wgrad_));
        };
        mark(stream, 1, LayerStage::combine, true);
        const bf16* grad_rows = dispatcher_->combine_backward(plan(), buf_.grad_output, grad_rows_.get(), stream);
        mark(stream, 1, LayerStage::combine, false);
        mark(stream, 1, LayerStage::fc2, true);
        // ECHO slot groups: clone weights for dgrad; their weight grads go to the slots' own buffers (fresh each
        // step, whatever acc says), which dispatch_backward adds into the home experts' grads. A slot with no rows
        // (no clone, or a clone given no tokens) is not added, so its block is not written either.
        // Gated activations without ECHO slots: the activation's backward may ride in fc2's dgrad epilogue
        // (grouped_gemm_nn_glu_backward, where it pays), leaving only the d(prob) partials to sum.
        bool fused_act = false;
        if constexpr (std::is_same_v<R, float>) {
            if (S == 0 && glu_dp_.size() > 0 && gemm_.nn_glu_backward)
                fused_act = gemm_.nn_glu_backward(
                    GroupedGemmShape{L, M, F, H}, grad_rows, buf_.fc2, offsets,
                    GluBackwardEpilogue{fc1_out_.get(), experts_.probs, grad_fc1_out_.get(), glu_dp_.get(), shape_.act},
                    stream);
        }
        if (!fused_act)
            gemm_.nn(home_and_slots(L, S, M, F, H, experts_.slot_fc2), grad_rows, buf_.fc2, grad_act_.get(), offsets,
                     stream);
        wgrad(home_and_slots(L, S, M, F, H, experts_.slot_grad_fc2), grad_rows, act_out_.get(), buf_.grad_fc2);
        mark(stream, 1, LayerStage::fc2, false);
        mark(stream, 1, LayerStage::activation, true);
        if (fused_act) {
            if constexpr (std::is_same_v<R, float>)
                activation_backward_probs_from_partials(act_shape().max_rows, offsets + L + S, glu_dp_.get(),
                                                        glu_backward_tiles(F), grad_row_probs_.get(), stream);
        } else {
            activation_backward<R>(act_shape(), offsets + L + S, fc1_out_.get(), experts_.probs, grad_act_.get(),
                                   grad_fc1_out_.get(), grad_row_probs_.get(), stream);
        }
        mark(stream, 1, LayerStage::activation, false);
        mark(stream, 1, LayerStage::fc1, true);
        gemm_.nn(home_and_slots(L, S, M, H, F1, experts_.slot_fc1), grad_fc1_out_.get(), buf_.fc1, grad_x_rows_.get(),
                 offsets, stream);
        wgrad(home_and_slots(L, S, M, H, F1, experts_.slot_grad_fc1), grad_fc1_out_.get(), experts_.rows,
              buf_.grad_fc1);
        mark(stream, 1, LayerStage::fc1, false);
        mark(stream, 1, LayerStage::permute, true);
        dispatcher_->dispatch_backward(plan(), map_.get(), grad_x_rows_.get(), grad_row_probs_.get(), buf_.grad_input,
                                       options.accumulate_grad_input, grad_probs_.get(), stream);
        mark(stream, 1, LayerStage::permute, false);
        if (shape_.has_shared) {
            mark(stream, 1, LayerStage::shared_expert, true);
            shared_expert_backward(shape_.shared, shared_tensors(), gemm_, buf_.grad_output, buf_.grad_input,
                                   stream, acc);
            mark(stream, 1, LayerStage::shared_expert, false);
        }
        mark(stream, 1, LayerStage::router, true);
        router_backward_probs<R>(r, router_tensors(), grad_probs_.get(), grad_logits_.get(), stream);
        if (training_) losses_backward<R>(r, shape_.loss, loss_tensors(), grad_logits_.get(), stream);
        router_backward_linear<R>(r, router_tensors(), grad_logits_.get(), buf_.grad_router_weight, buf_.grad_input,
                                  hidden_r_.get(), cublas_, stream, acc);
        mark(stream, 1, LayerStage::router, false);
        if (sms_left > 0) MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, wgrad_done_, 0));
    }

    LossValues read_losses() const override {
        LossValues v;
        if (!training_) return v;
        const std::vector<R> l = losses_.download();
        v.aux_loss = double(l[kAuxLoss]), v.seq_aux_loss = double(l[kSeqAuxLoss]);
        v.global_aux_loss = double(l[kGlobalAuxLoss]), v.z_loss = double(l[kZLoss]);
        return v;
    }
    std::vector<int64_t> read_tokens_per_expert() const override {
        const std::vector<int32_t> c = counts_.download();
        return std::vector<int64_t>(c.begin(), c.end());
    }
    std::vector<double> read_local_tokens_per_expert() const override { return local_tokens_.download(); }
    void reset_local_tokens_per_expert() override { zero_fill(local_tokens_.get(), local_tokens_.bytes()); }
    void reset_global_aux_loss_tracker() override {
        zero_fill(global_tokens_.get(), global_tokens_.bytes());
        zero_fill(ga_steps_.get(), ga_steps_.bytes());
    }

private:
    void copy_trackers(bool save, cudaStream_t stream) {
        const int64_t E = shape_.router.num_experts;
        const auto copy = [&](void* to, const void* from, size_t bytes) {
            MOEKIT_CUDA_CHECK(cudaMemcpyAsync(save ? to : const_cast<void*>(from), save ? from : to, bytes,
                                              cudaMemcpyDeviceToDevice, stream));
        };
        copy(tracker_copy_.get(), local_tokens_.get(), size_t(E) * sizeof(double));
        copy(tracker_copy_.get() + E, global_tokens_.get(), size_t(E) * sizeof(double));
        copy(steps_copy_.get(), ga_steps_.get(), sizeof(int32_t));
    }
    ActivationShape act_shape() const {
        return ActivationShape{dispatcher_->expert_max_rows(), shape_.ffn, shape_.gated_linear_unit, shape_.act};
    }
    RouterTensors<R> router_tensors() {
        R* bias = shape_.router.has_expert_bias ? static_cast<R*>(buf_.expert_bias) : nullptr;
        RouterTensors<R> t{buf_.hidden,   buf_.router_weight, bias,         buf_.padding_mask, hidden_r_.get(),
                           weight_r_.get(), logits_.get(),    topk_idx_.get(), probs_.get(),    map_.get()};
        t.jitter_seed = buf_.jitter_seed, t.sinkhorn = sinkhorn_.get(), t.sinkhorn_d0 = sinkhorn_d0_.get();
        t.grad_logits_split = grad_logits_split_.get(), t.weight3 = weight3_.get();
        t.grad_weight3 = grad_weight3_.get();
        return t;
    }
    LossTensors<R> loss_tensors() {
        LossTensors<R> t;
        t.logits = logits_.get(), t.routing_map = map_.get(), t.padding_mask = buf_.padding_mask;
        t.aux_scores = aux_scores_.get(), t.aux_map = aux_map_.get(), t.lse = lse_.get();
        t.score_sums = score_sums_.get(), t.aux_counts = aux_counts_.get(), t.valid_counts = valid_counts_.get();
        t.grad_coeff = grad_coeff_.get(), t.z_grad_coeff = z_grad_coeff_.get(), t.losses = losses_.get();
        t.local_tokens_per_expert = shape_.router.has_expert_bias ? local_tokens_.get() : nullptr;
        t.global_tokens_per_expert = global_tokens_.get(), t.ga_steps = ga_steps_.get();
        t.chunk_scores = loss_chunk_scores_.get(), t.chunk_counts = loss_chunk_counts_.get();
        return t;
    }
    RoutingPlan<R> plan() {
        RoutingPlan<R> p;
        p.num_tokens = shape_.router.num_tokens, p.num_experts = shape_.router.num_experts, p.max_rows = shape_.max_rows;
        p.counts = counts_.get(), p.offsets = offsets_.get(), p.rank = rank_.get(), p.row_token = row_token_.get();
        p.row_prob = row_prob_.get(), p.token_offsets = token_offsets_.get(), p.token_rows = token_rows_.get();
        p.token_counts = token_counts_.get(), p.chunk_scratch = plan_scratch_.get();
        return p;
    }
    SharedExpertTensors shared_tensors() {
        SharedExpertTensors t;
        t.offsets = shared_offsets_.get(), t.x = buf_.hidden, t.fc1 = buf_.shared_fc1, t.fc2 = buf_.shared_fc2;
        t.gate = shape_.shared.has_gate ? buf_.shared_gate : nullptr;
        t.fc1_out = s_fc1_out_.get(), t.act_out = s_act_.get(), t.out = s_out_.get(), t.gate_value = s_gate_.get();
        t.grad_out_gated = s_grad_out_.get(), t.grad_act = s_grad_act_.get(), t.grad_fc1_out = s_grad_fc1_out_.get();
        t.grad_x = s_grad_x_.get(), t.grad_gate_logit = s_grad_logit_.get(), t.grad_gate_partial = s_gate_partial_.get();
        t.grad_fc1 = buf_.grad_shared_fc1, t.grad_fc2 = buf_.grad_shared_fc2, t.grad_gate = buf_.grad_shared_gate;
        return t;
    }
    // Every buffer the layer owns (+ the cuBLAS workspace), and those forward fills for backward to read.
    size_t allocated_bytes() const {
        size_t n = 0;
        auto add = [&](const auto&... bufs) { ((n += bufs.bytes()), ...); };
        add(workspace_, hidden_, grad_output_, router_weight_, fc1_, fc2_, output_, mask_, map_, aux_map_);
        add(expert_bias_, hidden_r_, weight_r_, logits_, probs_, aux_scores_, lse_, score_sums_, grad_coeff_);
        add(z_grad_coeff_, losses_, row_prob_, grad_row_probs_, grad_probs_, grad_logits_);
        add(grad_input_, grad_router_weight_, grad_fc1_, grad_fc2_, topk_idx_, aux_counts_, valid_counts_, ga_steps_);
        add(counts_, offsets_, rank_, row_token_, token_offsets_, token_rows_, token_counts_, plan_scratch_);
        add(shared_offsets_, loss_chunk_scores_, loss_chunk_counts_);
        add(local_tokens_, global_tokens_, jitter_seed_, sinkhorn_, sinkhorn_d0_, fc1_out_, act_out_);
        add(expert_out_, grad_rows_, grad_act_, grad_fc1_out_, grad_x_rows_, shared_fc1_, shared_fc2_, shared_gate_);
        add(s_fc1_out_, s_act_, s_out_, s_grad_out_, s_grad_act_, s_grad_fc1_out_, s_grad_x_, grad_shared_fc1_);
        add(grad_shared_fc2_, grad_shared_gate_, s_gate_, s_grad_logit_, s_gate_partial_, glu_dp_);
        add(grad_logits_split_, weight3_, grad_weight3_);
        return n + dispatcher_->allocated_bytes();
    }
    size_t saved_bytes() const {
        size_t n = 0;
        auto add = [&](const auto&... bufs) { ((n += bufs.bytes()), ...); };
        add(hidden_r_, weight_r_, logits_, probs_, map_, topk_idx_, aux_scores_, aux_map_, lse_, grad_coeff_);
        add(z_grad_coeff_, counts_, offsets_, row_token_, row_prob_, token_offsets_, token_rows_, sinkhorn_);
        add(fc1_out_, act_out_, s_fc1_out_, s_act_, s_out_, s_gate_);
        return n + dispatcher_->saved_bytes();
    }
    void fill_buffers() {
        LayerBuffers& b = buf_;
        b.hidden = hidden_.get(), b.padding_mask = mask_.get(), b.grad_output = grad_output_.get();
        b.jitter_seed = jitter_seed_.get(), b.sinkhorn = sinkhorn_.get();
        b.router_weight = router_weight_.get(), b.expert_bias = expert_bias_.get(), b.fc1 = fc1_.get(), b.fc2 = fc2_.get();
        b.shared_fc1 = shared_fc1_.get(), b.shared_fc2 = shared_fc2_.get(), b.shared_gate = shared_gate_.get();
        b.output = output_.get(), b.grad_input = grad_input_.get(), b.grad_router_weight = grad_router_weight_.get();
        b.grad_fc1 = grad_fc1_.get(), b.grad_fc2 = grad_fc2_.get(), b.grad_shared_fc1 = grad_shared_fc1_.get();
        b.grad_shared_fc2 = grad_shared_fc2_.get(), b.grad_shared_gate = grad_shared_gate_.get();
        b.logits = logits_.get(), b.probs = probs_.get(), b.routing_map = map_.get(), b.topk_idx = topk_idx_.get();
        b.counts = counts_.get(), b.offsets = offsets_.get(), b.row_token = row_token_.get();
        b.row_prob = row_prob_.get(), b.token_offsets = token_offsets_.get(), b.token_rows = token_rows_.get();
        b.rows = dispatcher_->expert_rows_buffer(), b.fc1_out = fc1_out_.get(), b.act_out = act_out_.get(), b.expert_out = expert_out_.get();
        b.grad_row_probs = grad_row_probs_.get(), b.grad_probs = grad_probs_.get(), b.grad_logits = grad_logits_.get();
        b.losses = losses_.get(), b.local_tokens_per_expert = local_tokens_.get();
        b.global_tokens_per_expert = global_tokens_.get(), b.ga_steps = ga_steps_.get();
    }
    // Stage timing: events [pass][stage][begin/end]; recorded only when enabled.
    void mark(cudaStream_t stream, int pass, LayerStage stage, bool begin) {
        if (!timing_) return;
        // Under stream capture an External record becomes an event node of the graph (a plain one would only mark
        // a dependency), so stage times can be read from graph replays too; eager streams refuse the flag.
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
        MOEKIT_CUDA_CHECK(cudaEventRecordWithFlags(
            event(pass, stage, begin), stream,
            capturing == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault));
        recorded_[pass][size_t(stage)] = true;
    }
    cudaEvent_t event(int pass, LayerStage stage, bool begin) {
        return events_[(size_t(pass) * size_t(LayerStage::count) + size_t(stage)) * 2 + (begin ? 0 : 1)];
    }
    StageTimesMs times(int pass) {
        StageTimesMs out{};
        for (int s = 0; s < int(LayerStage::count); ++s) {
            if (!recorded_[pass][size_t(s)]) continue;
            MOEKIT_CUDA_CHECK(cudaEventSynchronize(event(pass, LayerStage(s), false)));
            MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&out[size_t(s)], event(pass, LayerStage(s), true),
                                                   event(pass, LayerStage(s), false)));
        }
        return out;
    }

    CudaLayerShape shape_;
    ExpertGemm gemm_;
    bool shares_gpu_with_ranks_;  // virtual ranks on one GPU: the expert GEMMs keep to the own kernel
    std::unique_ptr<CudaDispatcher<R>> dispatcher_;
    ExpertInput<R> experts_;  // what the last dispatch gave the experts (backward reads it)
    LayerBuffers buf_;
    cublasHandle_t cublas_ = nullptr;
    cudaStream_t side_ = nullptr;  // forward's loss branch
    cudaEvent_t fork_ = nullptr, join_ = nullptr;
    cudaStream_t wgrad_ = nullptr;  // backward's wgrad branch (set_wgrad_overlap), at the highest priority
    cudaEvent_t wgrad_fork_ = nullptr, wgrad_done_ = nullptr;
    bool training_ = true, timing_ = false;
    std::array<cudaEvent_t, size_t(LayerStage::count) * 4> events_{};
    std::array<std::array<bool, size_t(LayerStage::count)>, 2> recorded_{};
    DeviceBuffer<uint8_t> workspace_;
    DeviceBuffer<bf16> hidden_, grad_output_, router_weight_, fc1_, fc2_, output_;
    DeviceBuffer<uint8_t> mask_, map_, aux_map_;
    DeviceBuffer<R> expert_bias_, hidden_r_, weight_r_, logits_, probs_, aux_scores_, lse_, score_sums_, grad_coeff_;
    DeviceBuffer<R> z_grad_coeff_, losses_, row_prob_, grad_row_probs_, grad_probs_, grad_logits_, loss_chunk_scores_;
    DeviceBuffer<float> grad_input_, grad_router_weight_, grad_fc1_, grad_fc2_;
    DeviceBuffer<int32_t> topk_idx_, aux_counts_, valid_counts_, ga_steps_, counts_, offsets_, rank_, row_token_;
    DeviceBuffer<int32_t> token_offsets_, token_rows_, token_counts_, plan_scratch_, shared_offsets_;
    DeviceBuffer<int32_t> loss_chunk_counts_;
    DeviceBuffer<double> local_tokens_, global_tokens_, tracker_copy_;
    DeviceBuffer<int32_t> steps_copy_;
    DeviceBuffer<uint64_t> jitter_seed_;
    DeviceBuffer<float> sinkhorn_, sinkhorn_d0_;
    DeviceBuffer<bf16> fc1_out_, act_out_, expert_out_, grad_rows_, grad_act_, grad_fc1_out_, grad_x_rows_;
    DeviceBuffer<bf16> grad_logits_split_, weight3_;  // the tensor-core gating linear's backward (router.cuh)
    DeviceBuffer<float> grad_weight3_;
    DeviceBuffer<float> glu_dp_;  // the fused dgrad + activation backward's d(prob) partials (gated, fusion on)
    DeviceBuffer<bf16> shared_fc1_, shared_fc2_, shared_gate_, s_fc1_out_, s_act_, s_out_, s_grad_out_, s_grad_act_;
    DeviceBuffer<bf16> s_grad_fc1_out_, s_grad_x_;
    DeviceBuffer<float> grad_shared_fc1_, grad_shared_fc2_, grad_shared_gate_, s_gate_, s_grad_logit_, s_gate_partial_;
};

}  // namespace

void set_wgrad_overlap(int on) { g_wgrad_overlap = on; }
bool wgrad_overlap_enabled() {
    const int set = g_wgrad_overlap.load();
    if (set >= 0) return set > 0;
    static const bool env = [] {
        const char* v = std::getenv("MOEKIT_WGRAD_OVERLAP");
        if (!v) return false;
        MOEKIT_REQUIRE(std::string(v) == "0" || std::string(v) == "1", "MOEKIT_WGRAD_OVERLAP=", v,
                       ": expected 0 (the wgrads in line) or 1 (beside the dgrad chain)");
        return std::string(v) == "1";
    }();
    return env;
}
int wgrad_overlap_sms_left() {
    static const int sms = [] {
        const char* env = std::getenv("MOEKIT_WGRAD_OVERLAP_SMS");
        if (!env) return kWgradOverlapSmsLeft;
        char* end = nullptr;
        const long v = std::strtol(env, &end, 10);
        const int half = grouped_gemm_sm_count() / 2;
        MOEKIT_REQUIRE(end != env && *end == '\0' && v >= 1 && v <= half, "MOEKIT_WGRAD_OVERLAP_SMS=", env,
                       ": expected the SMs the overlapped wgrads leave, 1..", half, " (half this device)");
        return int(v);
    }();
    return sms;
}

const char* layer_stage_name(LayerStage stage) {
    switch (stage) {
        case LayerStage::router: return "router";
        case LayerStage::permute: return "permute";
        case LayerStage::shared_expert: return "shared_expert";
        case LayerStage::fc1: return "fc1";
        case LayerStage::activation: return "activation";
        case LayerStage::fc2: return "fc2";
        case LayerStage::combine: return "combine";
        case LayerStage::count: break;
    }
    return "?";
}

CudaLayerShape CudaLayerShape::from_config(const MoeConfig& c, int64_t seq_length, int64_t micro_batch_size) {
    CudaLayerShape s;
    s.router = RouterShape::from_config(c, seq_length, micro_batch_size);
    s.loss = LossShape::from_config(c);
    s.ffn = c.expert_ffn();
    s.gated_linear_unit = c.gated_linear_unit;
    s.fc1_rows = c.fc1_rows();
    s.gemm_rule_only = c.deterministic_mode;
    MOEKIT_REQUIRE(activation_from_name(c.activation_func.c_str(), &s.act), "--activation-func=", c.activation_func,
                   ": --device cuda supports gelu, silu, relu, squared_relu");
    s.has_shared = c.shared_ffn() > 0;
    if (s.has_shared) {
        s.shared = SharedExpertShape{s.router.num_tokens, c.hidden_size, c.shared_ffn(), c.gated_linear_unit,
                                     c.moe_shared_expert_gate, s.act};
    }
    s.max_rows = s.router.max_rows();
    s.router_fp64 = c.moe_router_dtype && *c.moe_router_dtype == "fp64";
    s.dispatcher = c.moe_token_dispatcher_type;
    s.receive_factor = c.moe_expert_rank_capacity_factor ? *c.moe_expert_rank_capacity_factor : 0.0;
    s.ep_size = int(c.expert_model_parallel_size);
    MOEKIT_REQUIRE(s.ep_size >= 1 && s.router.num_experts % s.ep_size == 0, "--expert-model-parallel-size=", s.ep_size,
                   " must divide --num-experts=", s.router.num_experts);
    if (c.moe_enable_echo && s.ep_size > 1) {
        s.echo_slots = c.moe_num_echo_experts.value_or(0) / s.ep_size;
        s.echo_algorithm = c.moe_echo_algorithm == "greedy" ? EchoAlgorithm::greedy : EchoAlgorithm::waterfill;
        s.echo_group_floor_rows = c.moe_echo_group_floor_rows;
        MOEKIT_REQUIRE(!c.moe_echo_recompute_expert_dispatch, "--moe-echo-recompute-expert-dispatch: not supported on "
                       "--device cuda yet (each CUDA layer keeps its own spare-slot buffers); use the CPU backend");
    }
    return s;
}

std::string CudaLayerShape::to_string() const {
    return str("CudaLayerShape{", router.to_string(), " F=", ffn, gated_linear_unit ? " glu" : "", " act=",
               activation_name(act), " shared=", has_shared ? shared.ffn : 0, " max_rows=", max_rows,
               router_fp64 ? " fp64" : " fp32", "}");
}

namespace {
// The kernels whose shared memory grows with the expert count (route: a token's scores a warp; the aux-score
// pass alike; the routing plan: a chunk's map slice): past the device's opt-in limit their launches would fail
// with a CUDA error inside a step. The expert count is the user's input, so the layer is refused here, naming
// the flag (exit 2).
void require_experts_fit_shared_memory(const CudaLayerShape& s) {
    int dev = 0, optin = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    const int64_t E = s.router.num_experts;
    auto require = [&](const char* kernel, size_t bytes, size_t limit) {
        MOEKIT_REQUIRE(bytes <= limit, "--num-experts=", E, ": the CUDA ", kernel, " over ", E, " experts (",
                       s.router_fp64 ? "fp64" : "fp32", " router) needs ", bytes,
                       " bytes of shared memory a block, more than the ", limit, " it may take on this GPU");
    };
    require("router's top-k", route_smem_bytes(s.router, s.router_fp64), size_t(optin));
    if (s.loss.need_aux())
        require("aux-loss scores", aux_scores_smem_bytes(E, s.router_fp64), size_t(optin));
    require("routing plan", size_t(plan_fill_smem_bytes(s.router.num_tokens, E)),
            size_t(std::min<int64_t>(kPlanMaxSmem, optin)));
}
}  // namespace

std::unique_ptr<CudaMoeLayer> CudaMoeLayer::create(const MoeConfig& config, int64_t seq_length,
                                                   int64_t micro_batch_size, bool own_io, DeviceComm* ep) {
    MoeConfig c = config;
    c.normalize();
    MOEKIT_REQUIRE(!c.add_bias_linear, "--add-bias-linear: not supported on --device cuda");
    CudaLayerShape shape = CudaLayerShape::from_config(c, seq_length, micro_batch_size);
    shape.router.validate();
    require_experts_fit_shared_memory(shape);
    if (shape.ep_size > 1) {
        MOEKIT_CHECK(ep && ep->size() == shape.ep_size, "--expert-model-parallel-size=", shape.ep_size,
                     ": the CUDA layer needs a device communicator over ", shape.ep_size, " ranks, got ",
                     ep ? ep->size() : 0);
        shape.ep_rank = ep->rank();
        MOEKIT_REQUIRE(c.aux_loss_coeff("global_aux_loss") == 0, "--moe-router-load-balancing-type global_aux_loss "
                       "with --expert-model-parallel-size > 1 is not supported on --device cuda yet (its token counts "
                       "are reduced over data-parallel ranks inside the loss); use the CPU backend");
    }
    if (shape.router_fp64) return std::make_unique<LayerImpl<double>>(shape, own_io, ep);
    return std::make_unique<LayerImpl<float>>(shape, own_io, ep);
}

}  // namespace moekit::cuda
