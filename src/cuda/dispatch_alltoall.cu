// alltoall dispatcher on the GPU (Megatron MoEAlltoAllTokenDispatcher, megatron-moe.md §1.3.2), EP > 1:
// the synchronous baseline. Permutation 1 by global expert (= by destination rank), then the [E] counts
// go to the host (one stream sync, as Megatron's .cpu() of the split sizes), are all-gathered over EP on
// the host, and give the split sizes; rows and probs travel by all-to-all-v; sort_chunks reorders
// [source][local expert] -> [local expert][source]. Combine runs the inverse sort, the reverse exchange
// and the single-GPU combine on the source rank, so a token's rows are summed in ascending expert order
// exactly as at EP = 1. Backward reverses each exchange with the forward's splits.
// Twin: src/cpu/dispatch_alltoall.cpp. Tests: tests/gpu/test_cuda_ep.cu.
#include <vector>

#include "cuda/combine.cuh"
#include "cuda/device_buffer.h"
#include "cuda/dispatch_kernels.cuh"
#include "cuda/dispatcher.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

template <typename R>
class AllToAllDispatcher final : public CudaDispatcher<R> {
public:
    AllToAllDispatcher(const DispatchShape& s, DeviceComm& ep)
        : s_(s), ep_(ep), host_counts_(size_t(s.router.num_experts)), host_offsets_(size_t(s.local_experts() + 1)),
          host_chunks_(size_t(2 * s.ep_size * s.local_experts())) {
        const int64_t M = s.plan_max_rows, H = s.router.hidden, L = s.local_experts();
        max_rows_ = s.ep_size * s.rows_per_source();
        send_rows_.resize(M * H), back_rows_.resize(M * H), back_probs_.resize(M);
        recv_rows_.resize(max_rows_ * H), rows_.resize(max_rows_ * H), recv_probs_.resize(max_rows_);
        probs_.resize(max_rows_), offsets_.resize(L + 1), chunks_.resize(2 * s.ep_size * L);
    }

    std::string name() const override { return "alltoall"; }
    int64_t num_local_experts() const override { return s_.local_experts(); }
    int64_t expert_max_rows() const override { return max_rows_; }
    size_t allocated_bytes() const override {
        size_t n = 0;
        auto add = [&](const auto&... b) { ((n += b.bytes()), ...); };
        add(send_rows_, back_rows_, back_probs_, recv_rows_, rows_, recv_probs_, probs_, offsets_, chunks_);
        return n;
    }
    size_t saved_bytes() const override { return rows_.bytes() + probs_.bytes() + offsets_.bytes() + chunks_.bytes(); }
    DispatchTraffic traffic() const override { return traffic_; }
    bf16* expert_rows_buffer() override { return rows_.get(); }

    ExpertInput<R> dispatch(const RoutingPlan<R>& plan, const uint8_t*, const R*, const bf16* hidden,
                            cudaStream_t stream) override {
        const int64_t H = s_.router.hidden, L = s_.local_experts();
        permute_rows<R>(plan, H, hidden, send_rows_.get(), stream);
        plan_splits(plan, stream);
        exchange(send_rows_.get(), H * int64_t(sizeof(bf16)), input_splits_, recv_rows_.get(), output_splits_, stream);
        exchange(plan.row_prob, int64_t(sizeof(R)), input_splits_, recv_probs_.get(), output_splits_, stream);
        copy_row_chunks(recv_rows_.get(), rows_.get(), H * int64_t(sizeof(bf16)), to_expert_major(), chunk_count(), stream);
        copy_row_chunks(recv_probs_.get(), probs_.get(), int64_t(sizeof(R)), to_expert_major(), chunk_count(), stream);
        return {L, max_rows_, rows_.get(), probs_.get(), offsets_.get()};
    }

    void combine(const RoutingPlan<R>& plan, const bf16* expert_out, const bf16* shared_out, const float* shared_gate,
                 bf16* out, cudaStream_t stream) override {
        const int64_t H = s_.router.hidden;
        to_sources(expert_out, H * int64_t(sizeof(bf16)), recv_rows_.get(), back_rows_.get(), stream);
        combine_forward<R>(plan, H, back_rows_.get(), shared_out, shared_gate, out, stream);
    }

    const bf16* combine_backward(const RoutingPlan<R>& plan, const bf16* grad_out, bf16* scratch,
                                 cudaStream_t stream) override {
        const int64_t H = s_.router.hidden;
        cuda::combine_backward<R>(plan, H, grad_out, back_rows_.get(), stream);
        exchange(back_rows_.get(), H * int64_t(sizeof(bf16)), input_splits_, recv_rows_.get(), output_splits_, stream);
        copy_row_chunks(recv_rows_.get(), scratch, H * int64_t(sizeof(bf16)), to_expert_major(), chunk_count(), stream);
        return scratch;
    }

    void dispatch_backward(const RoutingPlan<R>& plan, const uint8_t* map, const bf16* grad_rows,
                           const R* grad_row_probs, float* grad_input, bool accumulate, R* grad_probs,
                           cudaStream_t stream) override {
        const int64_t H = s_.router.hidden;
        to_sources(grad_rows, H * int64_t(sizeof(bf16)), recv_rows_.get(), back_rows_.get(), stream);
        permute_rows_backward<R>(plan, H, back_rows_.get(), grad_input, accumulate, stream);
        to_sources(grad_row_probs, int64_t(sizeof(R)), recv_probs_.get(), back_probs_.get(), stream);
        scatter_row_probs_grad<R>(plan, map, back_probs_.get(), grad_probs, stream);
    }

private:
    // The one host sync of the step: this rank's [E] counts -> [EP, E] on every rank -> split sizes,
    // the local experts' offsets and the chunk tables of both sorts .
    void plan_splits(const RoutingPlan<R>& plan, cudaStream_t stream) {
        const int EP = s_.ep_size;
        const int64_t E = s_.router.num_experts, L = s_.local_experts(), first = int64_t(s_.ep_rank) * L;
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(host_counts_.data(), plan.counts, size_t(E) * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, stream));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<int64_t> mine(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) mine[size_t(e)] = host_counts_[size_t(e)];
        const std::vector<int64_t> all = ep_.host().all_gather(mine);  // [EP, E]
        input_splits_.assign(size_t(EP), 0), output_splits_.assign(size_t(EP), 0);
        for (int64_t e = 0; e < E; ++e) input_splits_[size_t(e / L)] += mine[size_t(e)];
        std::vector<int64_t> recv(size_t(EP * L));  // [src, l]
        int64_t total = 0;
        for (int src = 0; src < EP; ++src)
            for (int64_t l = 0; l < L; ++l) {
                recv[size_t(src * L + l)] = all[size_t(src * E + first + l)];
                output_splits_[size_t(src)] += recv[size_t(src * L + l)];
                total += recv[size_t(src * L + l)];
            }
        MOEKIT_CHECK(total <= max_rows_, "alltoall dispatcher: EP rank ", s_.ep_rank, " receives ", total,
                     " rows, more than its bound of ", max_rows_);
        // [src][l] (as received) and [l][src] (expert-major) chunk starts; forward and inverse tables.
        std::vector<int64_t> src_major(size_t(EP * L)), expert_major(size_t(EP * L));
        int64_t at = 0;
        for (int64_t c = 0; c < EP * L; ++c) src_major[size_t(c)] = at, at += recv[size_t(c)];
        at = 0;
        host_offsets_[0] = 0;
        for (int64_t l = 0; l < L; ++l) {
            for (int src = 0; src < EP; ++src) expert_major[size_t(src * L + l)] = at, at += recv[size_t(src * L + l)];
            host_offsets_[size_t(l + 1)] = int32_t(at);
        }
        for (int64_t c = 0; c < EP * L; ++c) {
            host_chunks_[size_t(c)] = {src_major[size_t(c)], expert_major[size_t(c)], recv[size_t(c)]};
            host_chunks_[size_t(EP * L + c)] = {expert_major[size_t(c)], src_major[size_t(c)], recv[size_t(c)]};
        }
        // Pageable sources: the copies are staged before they return, so the host arrays can be reused.
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(offsets_.get(), host_offsets_.data(), host_offsets_.size() * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream));
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(chunks_.get(), host_chunks_.data(), host_chunks_.size() * sizeof(RowChunk),
                                          cudaMemcpyHostToDevice, stream));
        // Rows that leave this rank, forward (rows + probs) and back (rows), and both again in backward.
        int64_t rows_out = 0, rows_in = 0;
        for (int p = 0; p < EP; ++p)
            if (p != s_.ep_rank) rows_out += input_splits_[size_t(p)], rows_in += output_splits_[size_t(p)];
        const int64_t row = s_.router.hidden * int64_t(sizeof(bf16)), prob = int64_t(sizeof(R));
        traffic_.bytes_sent = rows_out * (2 * row + prob) + rows_in * (2 * row + prob);
        traffic_.host_syncs = 1;
    }
    const RowChunk* to_expert_major() const { return chunks_.get(); }
    const RowChunk* to_source_major() const { return chunks_.get() + chunk_count(); }
    int64_t chunk_count() const { return int64_t(s_.ep_size) * s_.local_experts(); }

    // Expert-major rows -> their source ranks, in permutation-1 order there.
    void to_sources(const void* rows, int64_t row_bytes, void* scratch, void* back, cudaStream_t stream) {
        copy_row_chunks(rows, scratch, row_bytes, to_source_major(), chunk_count(), stream);
        exchange(scratch, row_bytes, output_splits_, back, input_splits_, stream);
    }
    void exchange(const void* send, int64_t row_bytes, const std::vector<int64_t>& send_rows, void* recv,
                  const std::vector<int64_t>& recv_rows, cudaStream_t stream) {
        std::vector<int64_t> sb(send_rows.size()), rb(recv_rows.size());
        for (size_t p = 0; p < sb.size(); ++p) sb[p] = send_rows[p] * row_bytes, rb[p] = recv_rows[p] * row_bytes;
        ep_.all_to_all_v(send, sb.data(), recv, rb.data(), stream);
    }

    DispatchShape s_;
    DeviceComm& ep_;
    int64_t max_rows_ = 0;
    std::vector<int32_t> host_counts_, host_offsets_;
    std::vector<RowChunk> host_chunks_;
    std::vector<int64_t> input_splits_, output_splits_;  // rows to / from each EP rank
    DispatchTraffic traffic_;
    DeviceBuffer<bf16> send_rows_, back_rows_, recv_rows_, rows_;
    DeviceBuffer<R> back_probs_, recv_probs_, probs_;
    DeviceBuffer<int32_t> offsets_;
    DeviceBuffer<RowChunk> chunks_;
};

}  // namespace

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_alltoall_cuda_dispatcher(const DispatchShape& shape, DeviceComm& ep) {
    return std::make_unique<AllToAllDispatcher<R>>(shape, ep);
}
template std::unique_ptr<CudaDispatcher<float>> make_alltoall_cuda_dispatcher<float>(const DispatchShape&, DeviceComm&);
template std::unique_ptr<CudaDispatcher<double>> make_alltoall_cuda_dispatcher<double>(const DispatchShape&,
                                                                                       DeviceComm&);

}  // namespace moekit::cuda
