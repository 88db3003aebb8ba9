// allgather dispatcher on the GPU (Megatron MoEAllGatherTokenDispatcher, megatron-moe.md §1.3.1), EP > 1:
// tokens, probs and map all-gathered over EP on the device ([T, .] -> [EP*T, .], rank order), the local
// experts' columns kept and permuted with the single-GPU plan kernels; combine = per-token fp32 partial
// sums over this rank's experts, exchanged block-wise and summed in rank order (a deterministic
// reduce-scatter), + shared expert, one rounding to bf16. Backward: all-gather of the output grad;
// the same reduce-scatter for token grads; prob grads sent to their tokens' owners as [T, L] blocks.
// Every buffer is sized at construction and no count reaches the host: no sync, graph-capturable where
// the transport is. Twin: src/cpu/dispatch_allgather.cpp. Tests: tests/gpu/test_cuda_ep.cu.
#include <vector>

#include "cuda/combine.cuh"
#include "cuda/device_buffer.h"
#include "cuda/dispatch_kernels.cuh"
#include "cuda/dispatcher.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

template <typename R>
class AllGatherDispatcher final : public CudaDispatcher<R> {
public:
    AllGatherDispatcher(const DispatchShape& s, DeviceComm& ep) : s_(s), ep_(ep) {
        const int64_t EP = s.ep_size, T = s.router.num_tokens, H = s.router.hidden, E = s.router.num_experts;
        const int64_t L = s.local_experts(), G = EP * T;
        max_rows_ = EP * s.rows_per_source();
        hidden_g_.resize(G * H), probs_g_.resize(G * E), map_g_.resize(G * E), map_l_.resize(G * L);
        probs_l_.resize(G * L);
        counts_.resize(L), offsets_.resize(L + 1), rank_.resize(G * L), row_token_.resize(max_rows_);
        row_prob_.resize(max_rows_), token_offsets_.resize(G + 1), token_rows_.resize(max_rows_);
        token_counts_.resize(G), rows_.resize(max_rows_ * H), grad_g_.resize(G * H);
        plan_scratch_.resize(routing_plan_scratch_elems(G, L));
        partial_.resize(G * H), recv_.resize(G * H), sum_.resize(T * H), grad_probs_l_.resize(G * L);
        recv_probs_.resize(G * L);
    }

    std::string name() const override { return "allgather"; }
    int64_t num_local_experts() const override { return s_.local_experts(); }
    int64_t expert_max_rows() const override { return max_rows_; }
    size_t allocated_bytes() const override {
        size_t n = 0;
        auto add = [&](const auto&... b) { ((n += b.bytes()), ...); };
        add(hidden_g_, probs_g_, map_g_, map_l_, probs_l_, counts_, offsets_, rank_, row_token_, row_prob_);
        add(token_offsets_, token_rows_, token_counts_, plan_scratch_, rows_, grad_g_, partial_, recv_, sum_);
        add(grad_probs_l_, recv_probs_);
        return n;
    }
    size_t saved_bytes() const override {
        size_t n = 0;
        auto add = [&](const auto&... b) { ((n += b.bytes()), ...); };
        add(map_l_, counts_, offsets_, rank_, row_token_, row_prob_, token_offsets_, token_rows_, rows_);
        return n;
    }
    DispatchTraffic traffic() const override {
        const int64_t others = s_.ep_size - 1, T = s_.router.num_tokens, H = s_.router.hidden;
        const int64_t E = s_.router.num_experts, L = s_.local_experts();
        DispatchTraffic t;
        // forward: gathers of hidden, probs, map; combine blocks. backward: gather of grads; two reduce blocks.
        t.bytes_sent = others * T * (H * 2 + E * int64_t(sizeof(R)) + E + H * 4 + H * 2 + H * 4 + L * int64_t(sizeof(R)));
        return t;
    }
    bf16* expert_rows_buffer() override { return rows_.get(); }

    ExpertInput<R> dispatch(const RoutingPlan<R>&, const uint8_t* map, const R* probs, const bf16* hidden,
                            cudaStream_t stream) override {
        const int64_t T = s_.router.num_tokens, H = s_.router.hidden, E = s_.router.num_experts, L = s_.local_experts();
        ep_.all_gather(hidden, T * H * int64_t(sizeof(bf16)), hidden_g_.get(), stream);
        ep_.all_gather(probs, T * E * int64_t(sizeof(R)), probs_g_.get(), stream);
        ep_.all_gather(map, T * E, map_g_.get(), stream);
        select_local_columns<R>(map_g_.get(), probs_g_.get(), s_.ep_size * T, E, int64_t(s_.ep_rank) * L, L,
                                map_l_.get(), probs_l_.get(), stream);
        build_routing_plan<R>(map_l_.get(), probs_l_.get(), plan(), stream);
        permute_rows<R>(plan(), H, hidden_g_.get(), rows_.get(), stream);
        return {L, max_rows_, rows_.get(), row_prob_.get(), offsets_.get()};
    }

    void combine(const RoutingPlan<R>&, const bf16* expert_out, const bf16* shared_out, const float* shared_gate,
                 bf16* out, cudaStream_t stream) override {
        const int64_t T = s_.router.num_tokens, H = s_.router.hidden;
        combine_partial<R>(plan(), H, expert_out, partial_.get(), stream);
        reduce_scatter(T * H, stream);
        sum_blocks(recv_.get(), s_.ep_size, T * H, sum_.get(), false, stream);
        finish_combine(sum_.get(), shared_out, shared_gate, T, H, out, stream);
    }

    const bf16* combine_backward(const RoutingPlan<R>&, const bf16* grad_out, bf16* scratch,
                                 cudaStream_t stream) override {
        const int64_t T = s_.router.num_tokens, H = s_.router.hidden;
        ep_.all_gather(grad_out, T * H * int64_t(sizeof(bf16)), grad_g_.get(), stream);
        cuda::combine_backward<R>(plan(), H, grad_g_.get(), scratch, stream);
        return scratch;
    }

    void dispatch_backward(const RoutingPlan<R>&, const uint8_t*, const bf16* grad_rows, const R* grad_row_probs,
                           float* grad_input, bool accumulate, R* grad_probs, cudaStream_t stream) override {
        const int64_t T = s_.router.num_tokens, H = s_.router.hidden, L = s_.local_experts();
        permute_rows_backward<R>(plan(), H, grad_rows, partial_.get(), false, stream);
        reduce_scatter(T * H, stream);
        sum_blocks(recv_.get(), s_.ep_size, T * H, grad_input, accumulate, stream);
        scatter_row_probs_grad<R>(plan(), map_l_.get(), grad_row_probs, grad_probs_l_.get(), stream);
        const std::vector<int64_t> bytes(size_t(s_.ep_size), T * L * int64_t(sizeof(R)));
        ep_.all_to_all_v(grad_probs_l_.get(), bytes.data(), recv_probs_.get(), bytes.data(), stream);
        place_column_blocks<R>(recv_probs_.get(), s_.ep_size, T, L, grad_probs, stream);
    }

private:
    // partial_ [EP, T, H] fp32: block p goes to rank p; recv_ [EP, T, H]: block q came from rank q.
    void reduce_scatter(int64_t block, cudaStream_t stream) {
        const std::vector<int64_t> bytes(size_t(s_.ep_size), block * int64_t(sizeof(float)));
        ep_.all_to_all_v(partial_.get(), bytes.data(), recv_.get(), bytes.data(), stream);
    }
    RoutingPlan<R> plan() {
        RoutingPlan<R> p;
        p.num_tokens = s_.ep_size * s_.router.num_tokens, p.num_experts = s_.local_experts(), p.max_rows = max_rows_;
        p.counts = counts_.get(), p.offsets = offsets_.get(), p.rank = rank_.get(), p.row_token = row_token_.get();
        p.row_prob = row_prob_.get(), p.token_offsets = token_offsets_.get(), p.token_rows = token_rows_.get();
        p.token_counts = token_counts_.get(), p.chunk_scratch = plan_scratch_.get();
        return p;
    }

    DispatchShape s_;
    DeviceComm& ep_;
    int64_t max_rows_ = 0;
    DeviceBuffer<bf16> hidden_g_, rows_, grad_g_;
    DeviceBuffer<R> probs_g_, probs_l_, row_prob_, grad_probs_l_, recv_probs_;
    DeviceBuffer<uint8_t> map_g_, map_l_;
    DeviceBuffer<int32_t> counts_, offsets_, rank_, row_token_, token_offsets_, token_rows_, token_counts_;
    DeviceBuffer<int32_t> plan_scratch_;
    DeviceBuffer<float> partial_, recv_, sum_;
};

}  // namespace

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_allgather_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep) {
    return std::make_unique<AllGatherDispatcher<R>>(shape, ep);
}
template std::unique_ptr<CudaDispatcher<float>> make_allgather_cuda_dispatcher<float>(const DispatchShape&, DeviceComm&);
template std::unique_ptr<CudaDispatcher<double>> make_allgather_cuda_dispatcher<double>(const DispatchShape&,
                                                                                        DeviceComm&);

}  // namespace moekit::cuda
