// alltoall dispatcher (Megatron MoEAlltoAllTokenDispatcher, megatron-moe.md §1.3.2), CPU reference:
// permutation 1 by global expert, all-gather of the [E] counts over EP (the only metadata exchange),
// all-to-all-v of rows and probs with host split sizes, sort_chunks to [local expert][source rank];
// combine runs the inverse sort, the reverse all-to-all and unpermute on the source rank, so a
// token's expert rows are summed in ascending expert order exactly as at EP = 1. Backward reverses
// each exchange with the forward's splits. Interface: src/cpu/dispatcher.h. Tests: tests/mpi/test_ep_mpi.cpp.
#include "cpu/dispatcher.h"
#include "cpu/permute.h"
#include "cpu/sort_chunks.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

template <typename T>
class AllToAllDispatcher final : public Dispatcher<T> {
public:
    AllToAllDispatcher(const EpLayout& layout, Communicator& ep) : layout_(layout), ep_(ep) {}

    const EpLayout& layout() const override { return layout_; }

    DispatchedRows<T> dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                               const std::vector<uint8_t>& routing_map) override {
        const int64_t E = layout_.num_experts, L = layout_.num_local_experts, H = tokens.cols;
        const int EP = layout_.ep_size;
        hidden_ = H;
        // Permutation 1: rows grouped by global expert, hence by destination rank.
        plan_ = build_routing_plan(routing_map, probs, tokens.rows, E);
        Matrix<T> permuted = permute(tokens, plan_);
        if (EP == 1) return {std::move(permuted), plan_.permuted_probs, plan_.offsets};

        // Metadata: every rank's [E] counts -> rows this rank receives from each source per local expert.
        const std::vector<int64_t> all_counts = ep_.all_gather(plan_.tokens_per_expert);  // [EP, E]
        input_splits_.assign(size_t(EP), 0);
        output_splits_.assign(size_t(EP), 0);
        recv_counts_.assign(size_t(EP * L), 0);  // [EP src, L]
        for (int64_t e = 0; e < E; ++e) input_splits_[size_t(layout_.owner_of(e))] += plan_.tokens_per_expert[size_t(e)];
        const int64_t first = layout_.first_local_expert();
        std::vector<int64_t> offsets(size_t(L + 1), 0);
        for (int src = 0; src < EP; ++src)
            for (int64_t l = 0; l < L; ++l) {
                const int64_t n = all_counts[size_t(src * E + first + l)];
                recv_counts_[size_t(src * L + l)] = n;
                output_splits_[size_t(src)] += n;
                offsets[size_t(l + 1)] += n;
            }
        for (int64_t l = 0; l < L; ++l) offsets[size_t(l + 1)] += offsets[size_t(l)];

        // A2A #1 tokens, A2A #2 probs, then permutation 2 (sort_chunks [src][l] -> [l][src]).
        std::vector<T> recv_rows = exchange(permuted.data, H, input_splits_, output_splits_);
        std::vector<T> recv_probs = exchange(plan_.permuted_probs, 1, input_splits_, output_splits_);
        DispatchedRows<T> out;
        out.rows = Matrix<T>(offsets.back(), H);
        out.rows.data = sort_chunks(recv_rows, H, recv_counts_, EP, L, false);
        out.probs = sort_chunks(recv_probs, 1, recv_counts_, EP, L, false);
        out.offsets = std::move(offsets);
        return out;
    }

    Matrix<T> combine(const Matrix<T>& expert_out) override {
        if (layout_.ep_size == 1) return unpermute(expert_out, plan_);
        return unpermute(to_sources(expert_out), plan_);
    }

    Matrix<T> combine_backward(const Matrix<T>& grad_output) override {
        Matrix<T> rows = unpermute_backward(grad_output, plan_);  // [N, H] in permutation-1 order
        if (layout_.ep_size == 1) return rows;
        const int64_t L = layout_.num_local_experts;
        const std::vector<T> recv = exchange(rows.data, hidden_, input_splits_, output_splits_);
        Matrix<T> out(int64_t(recv.size()) / std::max<int64_t>(1, hidden_), hidden_);
        out.data = sort_chunks(recv, hidden_, recv_counts_, layout_.ep_size, L, false);
        return out;
    }

    void dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs, Matrix<T>& grad_tokens,
                           Matrix<T>& grad_probs) override {
        if (layout_.ep_size == 1) {
            grad_tokens = permute_backward(grad_rows, plan_);
            grad_probs = permute_probs_backward(grad_row_probs, plan_);
            return;
        }
        grad_tokens = permute_backward(to_sources(grad_rows), plan_);
        const std::vector<T> sorted = sort_chunks(grad_row_probs, 1, recv_counts_, layout_.ep_size,
                                                  layout_.num_local_experts, true);
        grad_probs = permute_probs_backward(exchange(sorted, 1, output_splits_, input_splits_), plan_);
    }

private:
    // Rows [N_local, H] in [l][src] order -> back to their source ranks, in permutation-1 order [N, H].
    Matrix<T> to_sources(const Matrix<T>& rows) {
        const std::vector<T> sorted =
            sort_chunks(rows.data, hidden_, recv_counts_, layout_.ep_size, layout_.num_local_experts, true);
        Matrix<T> back(plan_.num_rows(), hidden_);
        back.data = exchange(sorted, hidden_, output_splits_, input_splits_);
        return back;
    }

    std::vector<T> exchange(const std::vector<T>& send, int64_t width, const std::vector<int64_t>& send_rows,
                            const std::vector<int64_t>& recv_rows) {
        return all_to_all_rows(ep_, send, width, send_rows, recv_rows);
    }

    EpLayout layout_;
    Communicator& ep_;
    RoutingPlan<T> plan_;                 // permutation 1 over [T, E]
    std::vector<int64_t> input_splits_;   // [EP] rows sent to each rank
    std::vector<int64_t> output_splits_;  // [EP] rows received from each rank
    std::vector<int64_t> recv_counts_;    // [EP, L] rows received per (source, local expert)
    int64_t hidden_ = 0;
};

}  // namespace

template <typename T>
std::unique_ptr<Dispatcher<T>> make_alltoall_dispatcher(const EpLayout& layout, Communicator& ep) {
    return std::make_unique<AllToAllDispatcher<T>>(layout, ep);
}

template std::unique_ptr<Dispatcher<float>> make_alltoall_dispatcher<float>(const EpLayout&, Communicator&);
template std::unique_ptr<Dispatcher<double>> make_alltoall_dispatcher<double>(const EpLayout&, Communicator&);

}  // namespace moekit::cpu
