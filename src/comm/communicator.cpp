// The typed collectives of moekit::Communicator (include/moekit/comm.h), written once on top of the
// transport primitives so every transport computes the same bits: reductions gather all ranks'
// values and fold them in rank order. Also Megatron's process groups. Tests: tests/cpu/test_ep_virtual.cpp, tests/mpi/test_ep_mpi.cpp.
#include <algorithm>
#include <cstdlib>

#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit {

namespace {
template <typename T>
void all_reduce_impl(Communicator& c, T* data, int64_t count, ReduceOp op) {
    const int n = c.size();
    if (n == 1 || count == 0) return;
    std::vector<T> all(size_t(n * count));
    c.all_gather_bytes(data, count * int64_t(sizeof(T)), all.data());
    for (int64_t i = 0; i < count; ++i) {
        T acc = all[size_t(i)];
        for (int p = 1; p < n; ++p) {
            const T v = all[size_t(p * count + i)];
            acc = op == ReduceOp::sum ? T(acc + v) : std::max(acc, v);
        }
        data[i] = acc;
    }
}
}  // namespace

void Communicator::all_reduce(double* data, int64_t count, ReduceOp op) { all_reduce_impl(*this, data, count, op); }
void Communicator::all_reduce(float* data, int64_t count, ReduceOp op) { all_reduce_impl(*this, data, count, op); }
void Communicator::all_reduce(int64_t* data, int64_t count, ReduceOp op) { all_reduce_impl(*this, data, count, op); }

std::unique_ptr<ProcessGroups> make_process_groups(Communicator& world, int ep_size) {
    const int n = world.size(), r = world.rank();
    MOEKIT_REQUIRE(ep_size >= 1 && n % ep_size == 0, "--expert-model-parallel-size=", ep_size,
                   " must divide the number of ranks (", n, ")");
    auto g = std::make_unique<ProcessGroups>();
    g->world = &world;
    g->dp = &world;  // TP = CP = PP = 1: every rank holds a different micro-batch
    if (ep_size == n) {
        g->ep = &world;
    } else {
        g->owned.push_back(world.split(r / ep_size, r));
        g->ep = g->owned.back().get();
    }
    g->owned.push_back(world.split(r % ep_size, r));  // same EP rank, stride EP
    g->expert_dp = g->owned.back().get();
    return g;
}

}  // namespace moekit

namespace moekit::comm {

bool mpi_launched() {
    for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
        if (std::getenv(var)) return true;
    return false;
}

}  // namespace moekit::comm
