// run_ep_rank_step (see ep_rank_step.h): a CudaMoeLayer with its own I/O buffers over this rank's device
// communicator; the router and shared weights in full, the L local experts [ep_rank*L, +L) stacked.
#include "core/bf16.h"
#include "cuda/budget_step.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/ep_rank_step.h"
#include "cuda/moe_layer.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

void upload_bf16(bf16* dst, const float* src, size_t n) {
    std::vector<bf16> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = __nv_bfloat16_raw{float_to_bf16_bits(src[i])};
    copy_to_device(dst, v.data(), n * sizeof(bf16));  // complete for the rank's non-blocking stream
}
void upload_bf16(bf16* dst, const Matrix<float>& m) { upload_bf16(dst, m.data.data(), m.data.size()); }

// Experts [first, first + L) of `ms`, one after another.
void upload_experts(bf16* dst, const std::vector<Matrix<float>>& ms, int64_t first, int64_t L) {
    size_t at = 0;
    for (int64_t e = first; e < first + L; ++e) {
        upload_bf16(dst + at, ms[size_t(e)]);
        at += ms[size_t(e)].data.size();
    }
}
void download_experts(const float* src, std::vector<Matrix<float>>& ms, int64_t first, int64_t L) {
    size_t at = 0;
    for (int64_t e = first; e < first + L; ++e) {
        Matrix<float>& m = ms[size_t(e)];
        const std::vector<float> v = download(src + at, int64_t(m.data.size()));
        std::copy(v.begin(), v.end(), m.data.begin());
        at += m.data.size();
    }
}
void download_into(const float* src, Matrix<float>& m) {
    if (m.data.empty()) return;
    m.data = download(src, int64_t(m.data.size()));
}
template <typename R>
Matrix<float> download_probs(const void* src, int64_t T, int64_t E) {
    const std::vector<R> v = download(static_cast<const R*>(src), T * E);
    Matrix<float> m(T, E);
    for (size_t i = 0; i < v.size(); ++i) m.data[i] = float(v[i]);
    return m;
}

struct Stream {
    cudaStream_t s = nullptr;
    Stream() { MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~Stream() { cudaStreamDestroy(s); }
};

}  // namespace

EpRankStep run_ep_rank_step(const MoeConfig& config, const ProcessGroups& groups, const MoeWeights<float>& w,
                            const LayerInput<float>& in, const Matrix<float>& grad_output, uint64_t forced_echo_seed) {
    MoeConfig c = config;
    c.normalize();
    c.validate();
    std::unique_ptr<DeviceComm> ep = make_device_comm(*groups.ep);
    const int64_t S = in.seq_length, B = in.micro_batch_size, T = S * B, H = c.hidden_size, E = c.num_experts();
    MOEKIT_CHECK(in.hidden.rows == T && in.hidden.cols == H && grad_output.rows == T, "EP rank step: input [",
                 in.hidden.rows, ", ", in.hidden.cols, "] for S=", S, " B=", B, " H=", H);
    auto layer = CudaMoeLayer::create(c, S, B, /*own_io=*/true, ep.get());
    if (forced_echo_seed != 0) layer->force_random_echo_plans(forced_echo_seed);
    const CudaLayerShape& shape = layer->shape();
    const LayerBuffers& b = layer->buffers();
    const int64_t L = shape.local_experts(), first = int64_t(shape.ep_rank) * L;

    upload_bf16(b.hidden, in.hidden);
    upload_bf16(b.grad_output, grad_output);
    upload_bf16(b.router_weight, w.router_weight);
    upload_experts(b.fc1, w.fc1, first, L);
    upload_experts(b.fc2, w.fc2, first, L);
    if (shape.has_shared) {
        upload_bf16(b.shared_fc1, w.shared_fc1);
        upload_bf16(b.shared_fc2, w.shared_fc2);
        if (shape.shared.has_gate) upload_bf16(b.shared_gate, w.shared_gate);
    }
    if (shape.router.has_expert_bias) {
        if (shape.router_fp64) {
            upload(static_cast<double*>(b.expert_bias), w.expert_bias);
        } else {
            upload(static_cast<float*>(b.expert_bias), std::vector<float>(w.expert_bias.begin(), w.expert_bias.end()));
        }
    }
    std::vector<uint8_t> mask = in.padding_mask;
    if (mask.empty()) mask.assign(size_t(T), 0);
    upload(b.padding_mask, mask);
    upload(b.jitter_seed, std::vector<uint64_t>{in.jitter_seed});

    Stream stream;
    // Every rank set up before any starts: a device-wide sync on one rank (an allocation, a legacy-stream
    // copy) must not wait on a peer's spinning device barrier.
    groups.ep->barrier();
    EpRankStep r;
    const auto step = [&] {
        layer->forward(stream.s, in.training);
        layer->backward(stream.s, BackwardOptions{});
    };
    warm_up_budgeted(*layer, stream.s, step);
    const BudgetStatus budget = run_budgeted_cuda_step(*layer, stream.s, step);

    r.output = Matrix<float>(T, H);
    const std::vector<bf16> out = download(b.output, T * H);
    for (size_t i = 0; i < out.size(); ++i) r.output.data[i] = bf16_bits_to_float(__nv_bfloat16_raw(out[i]).x);
    r.grad_input = Matrix<float>(T, H);
    download_into(b.grad_input, r.grad_input);
    r.probs = shape.router_fp64 ? download_probs<double>(b.probs, T, E) : download_probs<float>(b.probs, T, E);
    r.routing_map = download(b.routing_map, T * E);
    r.grads = zeros_like(w);
    download_into(b.grad_router_weight, r.grads.router_weight);
    download_experts(b.grad_fc1, r.grads.fc1, first, L);
    download_experts(b.grad_fc2, r.grads.fc2, first, L);
    if (shape.has_shared) {
        download_into(b.grad_shared_fc1, r.grads.shared_fc1);
        download_into(b.grad_shared_fc2, r.grads.shared_fc2);
        if (shape.shared.has_gate) download_into(b.grad_shared_gate, r.grads.shared_gate);
    }
    r.summary.tokens_per_expert = layer->read_tokens_per_expert();
    if (in.training) r.summary.losses = layer->read_losses();
    const DispatchTraffic traffic = layer->traffic();
    r.bytes_sent = traffic.bytes_sent, r.host_syncs = traffic.host_syncs;
    r.budgeted = budget.budgeted, r.overflow = budget.overflow;
    r.budget_rows = budget.budget_rows, r.peak_rows = budget.peak_rows;
    const EchoStepSummary echo = layer->echo_summary();
    r.echo_clones = echo.clones, r.echo_load_before = echo.load_before, r.echo_load_after = echo.load_after;
    return r;
}

}  // namespace moekit::cuda
