// The nccl transport of DeviceComm (src/comm/device_comm.h): one process per GPU under mpirun. Rank 0's
// ncclUniqueId travels over the host (MPI) group; the GPU is local rank modulo the visible GPUs;
// all_gather = ncclAllGather, all_to_all_v = one ncclGroup of ncclSend/ncclRecv. Every NCCL call is
// checked; a failure aborts the communicator (ncclCommAbort) before the error is thrown, so peers do not
// wait on it forever (mpirun then ends the job). Built only where CMake found NCCL (MOEKIT_WITH_NCCL);
// otherwise make_nccl_device_comm refuses with what is missing. Tests: tests/gpu/test_cuda_ep.cu.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/device_comm.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "moekit/error.h"

#if MOEKIT_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

namespace moekit::cuda {

#if MOEKIT_WITH_NCCL
namespace {

#define MOEKIT_NCCL_CHECK(expr) MOEKIT_CHECK_GEN(expr, ncclSuccess, ncclResult_t, ncclGetErrorString)

// The node-local rank (OpenMPI / PMIx / Slurm), to pick this process's GPU; -1 when unknown.
int local_rank_from_env() {
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
        if (const char* v = std::getenv(name)) return std::atoi(v);
    return -1;
}

// Peers' addresses of a symmetric window, as the NCCL device API computes them (LSA = this node's GPUs).
__global__ void peer_pointers_kernel(ncclWindow_t win, int n, void** out) {
    for (int q = threadIdx.x; q < n; q += blockDim.x) out[q] = ncclGetPeerPointer(win, 0, q);
}

// ncclMemAlloc (cuMem, what symmetric windows require) registered as a NCCL_WIN_COLL_SYMMETRIC window.
class NcclSymmetric final : public SymmetricBuffer {
public:
    NcclSymmetric(ncclComm_t comm, Communicator& host, int64_t bytes) : comm_(comm), host_(host) {
        rank_ = host.rank(), bytes_ = bytes;
        const size_t n = size_t(std::max<int64_t>(bytes, 1));
        MOEKIT_NCCL_CHECK(ncclMemAlloc(&mem_, n));
        zero_fill(mem_, n);
        MOEKIT_NCCL_CHECK(ncclCommWindowRegister(comm_, mem_, n, &win_, NCCL_WIN_COLL_SYMMETRIC));
        void** dev = nullptr;
        MOEKIT_CUDA_CHECK(cudaMalloc(&dev, sizeof(void*) * size_t(host.size())));
        peer_pointers_kernel<<<1, 64>>>(win_, host.size(), dev);
        MOEKIT_CUDA_LAUNCH_CHECK();
        peers_.resize(size_t(host.size()));
        MOEKIT_CUDA_CHECK(cudaMemcpy(peers_.data(), dev, sizeof(void*) * peers_.size(), cudaMemcpyDeviceToHost));
        MOEKIT_CUDA_CHECK(cudaFree(dev));
    }
    ~NcclSymmetric() override {
        try {
            host_.barrier();  // no peer writes here any more
        } catch (...) {
        }
        if (win_) ncclCommWindowDeregister(comm_, win_);
        if (mem_) ncclMemFree(mem_);
    }

private:
    ncclComm_t comm_;
    Communicator& host_;
    void* mem_ = nullptr;
    ncclWindow_t win_ = nullptr;
};

class NcclDeviceComm final : public DeviceComm {
public:
    explicit NcclDeviceComm(Communicator& host) : host_(host) {
        int gpus = 0;
        MOEKIT_CUDA_CHECK(cudaGetDeviceCount(&gpus));
        MOEKIT_REQUIRE(gpus > 0, "EP over NCCL: rank ", host.rank(), " sees no GPU");
        const int local = local_rank_from_env();
        // One GPU per process: NCCL (2.28) refuses two ranks of a communicator on one GPU, so say it first.
        MOEKIT_REQUIRE(local < gpus, "EP over NCCL: rank ", host.rank(), " is local rank ", local, " on a node with ",
                       gpus, " visible GPU(s); start at most one process per GPU (mpirun -np <= GPUs per node), or "
                       "use --virtual-ranks N on one GPU");
        device_ = (local >= 0 ? local : host.rank()) % gpus;
        MOEKIT_CUDA_CHECK(cudaSetDevice(device_));
        ncclUniqueId id{};
        if (host.rank() == 0) MOEKIT_NCCL_CHECK(ncclGetUniqueId(&id));
        std::vector<char> all(sizeof(id) * size_t(host.size()));
        host.all_gather_bytes(&id, int64_t(sizeof(id)), all.data());
        std::memcpy(&id, all.data(), sizeof(id));  // rank 0's
        MOEKIT_NCCL_CHECK(ncclCommInitRank(&comm_, host.size(), id, host.rank()));
    }
    ~NcclDeviceComm() override {
        if (comm_) ncclCommDestroy(comm_);
    }
    int rank() const override { return host_.rank(); }
    int size() const override { return host_.size(); }
    std::string transport() const override { return "nccl"; }
    int device() const override { return device_; }
    Communicator& host() override { return host_; }

    void all_gather(const void* send, int64_t bytes, void* recv, cudaStream_t stream) override {
        check(ncclAllGather(send, recv, size_t(bytes), ncclUint8, comm_, stream), "ncclAllGather");
    }
    void all_to_all_v(const void* send, const int64_t* send_bytes, void* recv, const int64_t* recv_bytes,
                      cudaStream_t stream) override {
        check(ncclGroupStart(), "ncclGroupStart");
        int64_t s = 0, r = 0;
        for (int p = 0; p < size(); ++p) {
            if (send_bytes[p])
                check(ncclSend(static_cast<const char*>(send) + s, size_t(send_bytes[p]), ncclUint8, p, comm_, stream),
                      "ncclSend");
            if (recv_bytes[p])
                check(ncclRecv(static_cast<char*>(recv) + r, size_t(recv_bytes[p]), ncclUint8, p, comm_, stream),
                      "ncclRecv");
            s += send_bytes[p], r += recv_bytes[p];
        }
        check(ncclGroupEnd(), "ncclGroupEnd");
    }

    std::unique_ptr<SymmetricBuffer> alloc_symmetric(int64_t bytes) override {
        return std::make_unique<NcclSymmetric>(comm_, host_, bytes);
    }

private:
    void check(ncclResult_t result, const char* what) {
        if (result == ncclSuccess) return;
        const std::string message = str("EP rank ", rank(), ": ", what, " failed: ", ncclGetErrorString(result), " (",
                                        ncclGetLastError(comm_), ")");
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(message);
    }

    Communicator& host_;
    int device_ = 0;
    ncclComm_t comm_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }
std::unique_ptr<DeviceComm> make_nccl_device_comm(Communicator& host) { return std::make_unique<NcclDeviceComm>(host); }

#else

bool nccl_available() { return false; }
std::unique_ptr<DeviceComm> make_nccl_device_comm(Communicator& host) {
    throw UsageError(str("expert parallelism on the GPU across processes (rank ", host.rank(), " of ", host.size(),
                         ") needs NCCL, and this build has none: install NCCL (nccl.h + libnccl, e.g. the "
                         "nvidia-nccl-cu13 Python package) and re-run cmake, or use --virtual-ranks N on one GPU"));
}

#endif

}  // namespace moekit::cuda
