// Dispatcher stage (Megatron MoETokenDispatcher, megatron-moe.md §1.3), CPU reference: permute a
// rank's routed tokens, move them to the EP ranks that own their experts, and back (combine +
// unpermute), with the backward of both. Implementations: dispatch_allgather.cpp, dispatch_alltoall.cpp;
// at EP = 1 both are the single-rank permute/unpermute (no communication). Tests: tests/cpu/test_dispatch.cpp,
// tests/mpi/test_ep_mpi.cpp.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/comm.h"
#include "moekit/config.h"
#include "moekit/tensor.h"

namespace moekit::cpu {

// Which experts an EP rank owns: Megatron's contiguous block [ep_rank * L, ep_rank * L + L).
struct EpLayout {
    int64_t num_experts = 0;        // E
    int64_t num_local_experts = 0;  // L = E / EP
    int ep_size = 1, ep_rank = 0;

    int64_t first_local_expert() const { return int64_t(ep_rank) * num_local_experts; }
    int owner_of(int64_t expert) const { return int(expert / num_local_experts); }
    std::string to_string() const;
};

// What the experts get: rows grouped by local expert (expert-major; inside an expert by source rank,
// then by token index, the order of Megatron's sort_chunks).
template <typename T>
struct DispatchedRows {
    Matrix<T> rows;                  // [N_local, H] expert input rows
    std::vector<T> probs;            // [N_local] routing prob of each row (applied inside the experts)
    std::vector<int64_t> offsets;    // [L + 1] first row of each local expert
};

// All-to-all-v over `ep` of rows of `width` elements; the splits count rows per peer. Used by the alltoall
// and ECHO dispatchers.
template <typename T>
std::vector<T> all_to_all_rows(Communicator& ep, const std::vector<T>& send, int64_t width,
                               const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
    std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
    int64_t total = 0;
    for (size_t p = 0; p < sc.size(); ++p) sc[p] = send_rows[p] * width;
    for (size_t p = 0; p < rc.size(); ++p) rc[p] = recv_rows[p] * width, total += rc[p];
    std::vector<T> recv(static_cast<size_t>(total));
    ep.all_to_all_v(send.data(), sc, recv.data(), rc);
    return recv;
}

// One dispatcher per layer; dispatch() records the routing of the step (plans, split sizes) that
// combine() and the backward calls reuse, as Megatron's dispatcher objects do.
template <typename T>
class Dispatcher {
public:
    virtual ~Dispatcher() = default;
    virtual const EpLayout& layout() const = 0;
    // tokens [T, H], probs [T, E] dense (zero off the map), routing_map [T, E] -> this rank's expert rows.
    virtual DispatchedRows<T> dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                                       const std::vector<uint8_t>& routing_map) = 0;
    // Expert outputs [N_local, H] -> output [T, H] of this rank's tokens (sum of a token's expert rows).
    virtual Matrix<T> combine(const Matrix<T>& expert_out) = 0;
    // Backward of combine: grad [T, H] -> grad of the expert outputs [N_local, H].
    virtual Matrix<T> combine_backward(const Matrix<T>& grad_output) = 0;
    // Backward of dispatch: row grads [N_local, H] and row-prob grads [N_local] -> grad_tokens [T, H]
    // and grad_probs [T, E] (dense, zero off the map); both overwritten.
    virtual void dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs,
                                   Matrix<T>& grad_tokens, Matrix<T>& grad_probs) = 0;
};

// --moe-token-dispatcher-type allgather | alltoall over the EP group `ep` (kept by reference).
template <typename T>
std::unique_ptr<Dispatcher<T>> make_dispatcher(const std::string& type, int64_t num_experts, Communicator& ep);
// The dispatcher a (validated) config selects: with --moe-expert-rank-capacity-factor and EP > 1 the
// budgeted one (src/cpu/dispatch_budgeted.h; alltoall or flex); flex without tokens to move (EP = 1)
// is the alltoall one; otherwise as above. Collective over `ep`.
template <typename T>
std::unique_ptr<Dispatcher<T>> make_dispatcher(const MoeConfig& config, Communicator& ep);

template <typename T>
std::unique_ptr<Dispatcher<T>> make_allgather_dispatcher(const EpLayout& layout, Communicator& ep);
template <typename T>
std::unique_ptr<Dispatcher<T>> make_alltoall_dispatcher(const EpLayout& layout, Communicator& ep);

}  // namespace moekit::cpu
