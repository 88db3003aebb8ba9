// allgather dispatcher (Megatron MoEAllGatherTokenDispatcher, megatron-moe.md §1.3.1), CPU reference:
// all-gather tokens, probs and map over EP ([T, .] -> [T*EP, .], rank order), keep the columns of the
// local experts, permute; combine = unpermute into [T*EP, H] partial sums + reduce-scatter (rank-order
// sums). Backward: all-gather of the output grad; reduce-scatter of token and prob grads.
// Interface: src/cpu/dispatcher.h. Tests: tests/mpi/test_ep_mpi.cpp, tests/cpu/test_layer*.cpp (EP = 1).
#include "cpu/dispatcher.h"
#include "cpu/permute.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

template <typename T>
class AllGatherDispatcher final : public Dispatcher<T> {
public:
    AllGatherDispatcher(const EpLayout& layout, Communicator& ep) : layout_(layout), ep_(ep) {}

    const EpLayout& layout() const override { return layout_; }

    DispatchedRows<T> dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                               const std::vector<uint8_t>& routing_map) override {
        const int64_t E = layout_.num_experts, L = layout_.num_local_experts, H = tokens.cols;
        num_tokens_ = tokens.rows;
        MOEKIT_CHECK(probs.rows == num_tokens_ && probs.cols == E && int64_t(routing_map.size()) == num_tokens_ * E,
                     "dispatch: probs [", probs.rows, ", ", probs.cols, "] and map (", routing_map.size(),
                     " entries) must be [", num_tokens_, ", ", E, "]");
        hidden_ = H;
        if (layout_.ep_size == 1) {
            plan_ = build_routing_plan(routing_map, probs, num_tokens_, E);
            return {permute(tokens, plan_), plan_.permuted_probs, plan_.offsets};
        }
        // NOTE: Megatron gathers along the sequence dim, so every EP rank must hold the same T.
        const std::vector<int64_t> counts = ep_.all_gather(std::vector<int64_t>{num_tokens_});
        for (int p = 0; p < layout_.ep_size; ++p)
            MOEKIT_CHECK(counts[size_t(p)] == num_tokens_, "allgather dispatcher: EP rank ", p, " has ",
                         counts[size_t(p)], " tokens, rank ", layout_.ep_rank, " has ", num_tokens_,
                         " (all ranks of an EP group need the same S*B)");
        const int64_t global_tokens = num_tokens_ * layout_.ep_size;
        Matrix<T> hidden_g(global_tokens, H), probs_g(global_tokens, E);
        std::vector<uint8_t> map_g(size_t(global_tokens * E));
        ep_.all_gather_bytes(tokens.data.data(), tokens.size() * int64_t(sizeof(T)), hidden_g.data.data());
        ep_.all_gather_bytes(probs.data.data(), probs.size() * int64_t(sizeof(T)), probs_g.data.data());
        ep_.all_gather_bytes(routing_map.data(), int64_t(routing_map.size()), map_g.data());

        // dispatch_postprocess: the local experts' columns, then permute (expert-major, token ascending).
        const int64_t first = layout_.first_local_expert();
        Matrix<T> local_probs(global_tokens, L);
        std::vector<uint8_t> local_map(size_t(global_tokens * L));
        for (int64_t t = 0; t < global_tokens; ++t)
            for (int64_t l = 0; l < L; ++l) {
                local_probs(t, l) = probs_g(t, first + l);
                local_map[size_t(t * L + l)] = map_g[size_t(t * E + first + l)];
            }
        plan_ = build_routing_plan(local_map, local_probs, global_tokens, L);
        return {permute(hidden_g, plan_), plan_.permuted_probs, plan_.offsets};
    }

    Matrix<T> combine(const Matrix<T>& expert_out) override {
        // [T*EP, H] partial sums over this rank's experts only
        return reduce_scatter_rows(unpermute(expert_out, plan_), hidden_);
    }

    Matrix<T> combine_backward(const Matrix<T>& grad_output) override {
        if (layout_.ep_size == 1) return unpermute_backward(grad_output, plan_);
        return unpermute_backward(gather_rows(grad_output), plan_);
    }

    void dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs, Matrix<T>& grad_tokens,
                           Matrix<T>& grad_probs) override {
        const int64_t E = layout_.num_experts, L = layout_.num_local_experts;
        grad_tokens = reduce_scatter_rows(permute_backward(grad_rows, plan_), hidden_);
        Matrix<T> local = permute_probs_backward(grad_row_probs, plan_);  // [T*EP, L]
        if (layout_.ep_size == 1) {
            grad_probs = std::move(local);
            return;
        }
        Matrix<T> expanded(local.rows, E);  // other ranks' columns stay 0, so the sum is exact
        const int64_t first = layout_.first_local_expert();
        for (int64_t t = 0; t < local.rows; ++t)
            for (int64_t l = 0; l < L; ++l) expanded(t, first + l) = local(t, l);
        grad_probs = reduce_scatter_rows(expanded, E);
    }

private:
    // [T*EP, cols] blocks of T rows, block p for EP rank p -> [T, cols] summed in rank order.
    Matrix<T> reduce_scatter_rows(Matrix<T> m, int64_t cols) {
        if (layout_.ep_size == 1) return m;
        Matrix<T> out(num_tokens_, cols);
        ep_.reduce_scatter(m.data.data(), num_tokens_ * cols, out.data.data());
        return out;
    }
    Matrix<T> gather_rows(const Matrix<T>& m) {
        Matrix<T> out(m.rows * layout_.ep_size, m.cols);
        ep_.all_gather_bytes(m.data.data(), m.size() * int64_t(sizeof(T)), out.data.data());
        return out;
    }

    EpLayout layout_;
    Communicator& ep_;
    RoutingPlan<T> plan_;  // over [T*EP tokens, L local experts]
    int64_t num_tokens_ = 0, hidden_ = 0;
};

}  // namespace

template <typename T>
std::unique_ptr<Dispatcher<T>> make_allgather_dispatcher(const EpLayout& layout, Communicator& ep) {
    return std::make_unique<AllGatherDispatcher<T>>(layout, ep);
}

template std::unique_ptr<Dispatcher<float>> make_allgather_dispatcher<float>(const EpLayout&, Communicator&);
template std::unique_ptr<Dispatcher<double>> make_allgather_dispatcher<double>(const EpLayout&, Communicator&);

}  // namespace moekit::cpu
