// moekit::Communicator: the one interface multi-rank code talks to (blocking collectives on host
// buffers), with two transports: `local` (N virtual ranks, one thread each, in one process) and `mpi`
// (one process per rank under mpirun). ProcessGroups carves Megatron's groups out of a world.
// No MPI header here. Implementations: src/comm/. Tests: tests/mpi/test_ep_mpi.cpp, tests/cpu/test_ep_virtual.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moekit {

enum class ReduceOp : uint8_t { sum, max };

// A one-sided window: `bytes` bytes at `base` on every rank of a group, which peers write with put().
// mpi: MPI_Win_create + MPI_Put + MPI_Win_fence; local: the peers' base pointers (one address space)
// + memcpy + a barrier, what virtual ranks on one GPU do with peer pointers. Puts land by the next
// fence; between two fences a rank neither reads nor writes its own window. The memory stays the
// caller's and must outlive the window. Used by src/cpu/dispatch_budgeted.cpp.
class Window {
public:
    virtual ~Window() = default;
    // Collective over the group: closes the epoch of puts before it and opens the next.
    virtual void fence() = 0;
    // Writes `bytes` from `src` at byte `offset` of `peer`'s window (peer may be this rank). A write
    // past the peer's window is refused (moekit::Error), never performed.
    virtual void put(int peer, int64_t offset, const void* src, int64_t bytes) = 0;
    virtual int64_t peer_bytes(int peer) const = 0;
};

// Every rank of a group calls the same collectives in the same order. The transports provide only
// the byte-moving primitives; the typed collectives below are one implementation for all of them,
// so a virtual-rank run equals an MPI run bit for bit. Reductions are deterministic: rank 0's value,
// then rank 1's added, and so on (never a tree whose shape depends on the transport).
class Communicator {
public:
    virtual ~Communicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string transport() const = 0;  // "local" | "mpi"

    // ---- transport primitives ----
    // recv [size() * bytes]: rank r's `bytes` at offset r * bytes. All ranks give the same `bytes`.
    virtual void all_gather_bytes(const void* send, int64_t bytes, void* recv) = 0;
    // send_bytes[p] bytes go to peer p, packed in peer order; recv_bytes[p] bytes arrive from p, packed
    // in peer order. send_bytes on p for me must equal my recv_bytes[p].
    virtual void all_to_all_v_bytes(const void* send, const int64_t* send_bytes, void* recv,
                                    const int64_t* recv_bytes) = 0;
    virtual void barrier() = 0;
    // Ends the whole job (all ranks, all groups) with an error naming this rank; never returns.
    [[noreturn]] virtual void abort(const std::string& reason) = 0;
    // Ranks with the same color form a new group, ordered by (key, rank) (MPI_Comm_split).
    virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
    // Collective: every rank exposes its own `bytes` at `base` (sizes may differ between ranks).
    virtual std::unique_ptr<Window> create_window(void* base, int64_t bytes) = 0;

    // ---- typed collectives (same code for every transport) ----
    void all_reduce(double* data, int64_t count, ReduceOp op = ReduceOp::sum);
    void all_reduce(float* data, int64_t count, ReduceOp op = ReduceOp::sum);
    void all_reduce(int64_t* data, int64_t count, ReduceOp op = ReduceOp::sum);

    // [size() * local.size()] in rank order; all ranks give the same count.
    template <typename T>
    std::vector<T> all_gather(const std::vector<T>& local) {
        std::vector<T> out(local.size() * size_t(size()));
        all_gather_bytes(local.data(), int64_t(local.size() * sizeof(T)), out.data());
        return out;
    }
    // Counts in elements; send/recv packed in peer order.
    template <typename T>
    void all_to_all_v(const T* send, const std::vector<int64_t>& send_counts, T* recv,
                      const std::vector<int64_t>& recv_counts) {
        std::vector<int64_t> sb(send_counts.size()), rb(recv_counts.size());
        for (size_t i = 0; i < sb.size(); ++i) sb[i] = send_counts[i] * int64_t(sizeof(T));
        for (size_t i = 0; i < rb.size(); ++i) rb[i] = recv_counts[i] * int64_t(sizeof(T));
        all_to_all_v_bytes(send, sb.data(), recv, rb.data());
    }
    // send [size() * count]: block p is this rank's contribution to rank p; recv [count] = sum over
    // ranks (in rank order) of their block for me.
    template <typename T>
    void reduce_scatter(const T* send, int64_t count, T* recv);
    // Variable-length all-gather: every rank's vector, in rank order.
    template <typename T>
    std::vector<std::vector<T>> all_gather_v(const std::vector<T>& local);
};

template <typename T>
void Communicator::reduce_scatter(const T* send, int64_t count, T* recv) {
    const int n = size();
    std::vector<int64_t> counts(size_t(n), count);
    std::vector<T> blocks(size_t(n * count));  // [n, count]: rank p's block for me
    all_to_all_v(send, counts, blocks.data(), counts);
    for (int64_t i = 0; i < count; ++i) {
        T acc = blocks[size_t(i)];
        for (int p = 1; p < n; ++p) acc = acc + blocks[size_t(p * count + i)];
        recv[i] = acc;
    }
}

template <typename T>
std::vector<std::vector<T>> Communicator::all_gather_v(const std::vector<T>& local) {
    const int n = size();
    const std::vector<int64_t> sizes = all_gather(std::vector<int64_t>{int64_t(local.size())});
    std::vector<T> send;
    for (int p = 0; p < n; ++p) send.insert(send.end(), local.begin(), local.end());
    std::vector<int64_t> send_counts(size_t(n), int64_t(local.size()));
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    std::vector<T> recv(static_cast<size_t>(total));
    all_to_all_v(send.data(), send_counts, recv.data(), sizes);
    std::vector<std::vector<T>> out(static_cast<size_t>(n));
    int64_t offset = 0;
    for (int p = 0; p < n; ++p) {
        out[size_t(p)].assign(recv.begin() + offset, recv.begin() + offset + sizes[size_t(p)]);
        offset += sizes[size_t(p)];
    }
    return out;
}

// Megatron's process groups with TP = CP = PP = 1 (parallel_state order tp-cp-ep-dp): EP groups are
// blocks of `ep` consecutive ranks; the expert-data-parallel group of a rank holds the ranks with the
// same EP rank (world / EP of them, stride EP); the data-parallel group is the world. Expert grads
// are reduced over expert_dp; router, shared-expert and gate grads, expert-bias counts and
// global_aux_loss token counts over dp. With EP = world, expert_dp has one rank.
struct ProcessGroups {
    Communicator* world = nullptr;
    Communicator* ep = nullptr;
    Communicator* expert_dp = nullptr;
    Communicator* dp = nullptr;
    std::vector<std::unique_ptr<Communicator>> owned;  // the split groups

    int ep_size() const { return ep->size(); }
    int ep_rank() const { return ep->rank(); }
};
// Collective over `world`; ep_size must divide world.size() (UsageError naming the flag otherwise).
std::unique_ptr<ProcessGroups> make_process_groups(Communicator& world, int ep_size);

namespace comm {

// One rank alone (a local group of size 1): what a single-process layer runs on.
std::unique_ptr<Communicator> make_single_rank();

// Runs fn(world) on n virtual ranks, one thread each, over the local transport. If any rank throws,
// the others are woken out of their collectives and the first failure is rethrown, its message
// prefixed with "virtual rank r: " (a UsageError stays a UsageError). Waits are bounded: a rank that
// waits MOEKIT_COMM_TIMEOUT_S seconds (default 300) in a collective throws, naming the missing ranks.
void run_virtual_ranks(int n, const std::function<void(Communicator& world)>& fn);

// ---- MPI (one process per rank) ----
bool mpi_launched();  // this process was started by mpirun (OMPI_/PMI_/PMIX_ environment)
// The MPI world; initialises MPI on first use and finalises it at exit. UsageError without MPI.
Communicator& mpi_world();
bool mpi_active();  // mpi_world() has been created and MPI is not finalised
// "rank r of N" of the active MPI world, or "" when MPI is not active or has one rank.
std::string mpi_rank_label();
// Ends every rank of the MPI job with this exit code (MPI_Abort); exits the process when MPI is not active.
[[noreturn]] void abort_job(int exit_code);

}  // namespace comm
}  // namespace moekit
