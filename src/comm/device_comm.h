// DeviceComm: stream-ordered collectives on GPU memory for the CUDA EP layer, with two transports:
// `local-gpu` (N virtual ranks, one thread and one stream each, on ONE GPU: peers' buffers are read
// directly, streams ordered by events; src/comm/local_device_comm.cu) and `nccl` (one process per GPU
// under mpirun, unique id sent over MPI; src/comm/nccl_device_comm.cu). Host metadata (split sizes,
// verdicts) goes over the host Communicator the DeviceComm was made from. Every rank calls the same
// collectives in the same order. CUDA-aware internal header (never included by include/moekit/).
// Tests: tests/gpu/test_cuda_ep.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/comm.h"

namespace moekit::cuda {

// Symmetric memory for device-initiated transfers: the same number of bytes on every rank, and every
// peer's buffer addressable from this rank's kernels (local-gpu: the other virtual ranks' allocations on
// the same GPU; nccl: ncclMemAlloc + a NCCL_WIN_COLL_SYMMETRIC window, peers reached through NVLink/P2P).
// Zero-filled at allocation. Freed by the destructor, which every rank reaches after its last use.
class SymmetricBuffer {
public:
    virtual ~SymmetricBuffer() = default;
    void* local() const { return peers_[size_t(rank_)]; }
    void* peer(int q) const { return peers_[size_t(q)]; }
    const std::vector<void*>& peers() const { return peers_; }  // [size()] rank q's buffer, as seen here
    int64_t bytes() const { return bytes_; }

protected:
    std::vector<void*> peers_;
    int rank_ = 0;
    int64_t bytes_ = 0;
};
class DeviceComm {
public:
    virtual ~DeviceComm() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string transport() const = 0;  // "local-gpu" | "nccl"
    virtual int device() const = 0;             // the CUDA device of this rank
    virtual Communicator& host() = 0;           // host collectives over the same ranks

    // recv [size() * bytes]: rank r's `bytes` at r * bytes. Enqueued on `stream`; no host wait.
    virtual void all_gather(const void* send, int64_t bytes, void* recv, cudaStream_t stream) = 0;
    // send_bytes[p] bytes to peer p and recv_bytes[p] from p, both packed in peer order; host arrays of
    // size() entries. My send_bytes[p] must equal p's recv_bytes[me] (checked where the transport can).
    virtual void all_to_all_v(const void* send, const int64_t* send_bytes, void* recv, const int64_t* recv_bytes,
                              cudaStream_t stream) = 0;
    // Collective: `bytes` (the same on every rank) of symmetric memory.
    virtual std::unique_ptr<SymmetricBuffer> alloc_symmetric(int64_t bytes) = 0;
};

// Virtual rank `host.rank()` of `host.size()` on the current GPU; collective over `host` (a local group).
std::unique_ptr<DeviceComm> make_local_device_comm(Communicator& host);
// One rank per GPU over NCCL; collective over `host` (an MPI group). UsageError when built without NCCL.
std::unique_ptr<DeviceComm> make_nccl_device_comm(Communicator& host);
bool nccl_available();  // built with NCCL
// The transport a host group implies: local -> local-gpu, mpi -> nccl.
std::unique_ptr<DeviceComm> make_device_comm(Communicator& host);

// Deterministic all-reduce (sum) of `count` fp32 values: all-gather into `scratch` [size() * count],
// then every rank adds the blocks in rank order (the same bits on every rank and transport).
void all_reduce_sum(DeviceComm& comm, float* data, int64_t count, float* scratch, cudaStream_t stream);
// Sum of `blocks` consecutive [count] fp32 blocks of `in`, in block order, into out (= or +=).
void sum_blocks(const float* in, int64_t blocks, int64_t count, float* out, bool accumulate, cudaStream_t stream);

}  // namespace moekit::cuda
