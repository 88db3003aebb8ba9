// The local-gpu transport of DeviceComm (src/comm/device_comm.h): virtual ranks on one GPU, one host
// thread and stream each. A collective records a "ready" event on the caller's stream, publishes its
// send pointer and event through the host group (a rendezvous, no device wait), makes its stream wait
// for every peer's ready event, copies its blocks straight out of the peers' buffers, records "done",
// and waits for the peers' done events before going on, so no rank overwrites a send buffer a peer is
// still reading. Two rendezvous per collective keep every event recorded before it is re-recorded.
// Also the transport-independent helpers all_reduce_sum and sum_blocks. Tests: tests/gpu/test_cuda_ep.cu.
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/device_comm.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "moekit/error.h"

namespace moekit::cuda {
namespace {

// Virtual ranks that spin in device barriers (the budgeted dispatcher) need a hardware work queue each:
// the GPU maps streams round-robin onto CUDA_DEVICE_MAX_CONNECTIONS queues (8 unless set), and a rank
// whose stream shares a queue with a peer's spinning barrier waits behind it for ever (measured on an
// H100: 1 queue deadlocks every EP step, 8 some EP=8 steps, 32 none). The variable is read when the CUDA
// context is created, so it is raised to the maximum here, at load time, unless the user set it.
constexpr int kMaxHardwareQueues = 32;
const int hardware_queues = [] {
    const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    if (set) return std::atoi(set);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(kMaxHardwareQueues).c_str(), 0);
    return kMaxHardwareQueues;
}();

class LocalDeviceComm final : public DeviceComm {
public:
    explicit LocalDeviceComm(Communicator& host) : host_(host) {
        MOEKIT_CUDA_CHECK(cudaGetDevice(&device_));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
        MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
        // Every virtual rank must be on the same GPU (peer pointers are plain device pointers).
        const std::vector<int64_t> devices = host_.all_gather(std::vector<int64_t>{device_});
        for (int p = 0; p < host_.size(); ++p)
            MOEKIT_CHECK(devices[size_t(p)] == device_, "virtual rank ", p, " is on GPU ", devices[size_t(p)],
                         ", rank ", host_.rank(), " on GPU ", device_, ": virtual ranks share one GPU");
    }
    ~LocalDeviceComm() override {
        // Peers may still be about to enqueue waits on this rank's events (finish() ends with no rendezvous
        // after the waits): destroying them first made a peer wait on a dead handle ("context is destroyed",
        // then a crash; seen on an H100). Destruction is collective, like the communicator's collectives.
        try {
            host_.barrier();
        } catch (...) {  // a failing rank woke the others: nothing waits on these events any more
        }
        cudaEventDestroy(ready_);
        cudaEventDestroy(done_);
    }
    int rank() const override { return host_.rank(); }
    int size() const override { return host_.size(); }
    std::string transport() const override { return "local-gpu"; }
    int device() const override { return device_; }
    Communicator& host() override { return host_; }

    void all_gather(const void* send, int64_t bytes, void* recv, cudaStream_t stream) override {
        const int n = size();
        const std::vector<int64_t> peers = publish(send, stream, {bytes});
        for (int p = 0; p < n; ++p) {
            const int64_t* info = peers.data() + size_t(p) * 3;
            MOEKIT_CHECK(info[2] == bytes, "all_gather: virtual rank ", p, " gives ", info[2], " bytes, rank ",
                         rank(), " gives ", bytes);
            copy_from(p, info, 0, static_cast<char*>(recv) + int64_t(p) * bytes, bytes, stream);
        }
        finish(stream);
    }

    void all_to_all_v(const void* send, const int64_t* send_bytes, void* recv, const int64_t* recv_bytes,
                      cudaStream_t stream) override {
        const int n = size(), me = rank();
        const std::vector<int64_t> peers = publish(send, stream, std::vector<int64_t>(send_bytes, send_bytes + n));
        const size_t stride = size_t(n) + 2;
        int64_t at = 0;
        for (int p = 0; p < n; ++p) {
            const int64_t* info = peers.data() + size_t(p) * stride;
            int64_t offset = 0;  // where my block starts in p's send buffer
            for (int q = 0; q < me; ++q) offset += info[2 + q];
            MOEKIT_CHECK(info[2 + me] == recv_bytes[p], "all_to_all_v: virtual rank ", p, " sends ", info[2 + me],
                         " bytes to rank ", me, ", which expects ", recv_bytes[p]);
            copy_from(p, info, offset, static_cast<char*>(recv) + at, recv_bytes[p], stream);
            at += recv_bytes[p];
        }
        finish(stream);
    }

    std::unique_ptr<SymmetricBuffer> alloc_symmetric(int64_t bytes) override {
        // Symmetric memory is for device-initiated transfers, whose barriers spin (see hardware_queues).
        MOEKIT_REQUIRE(hardware_queues > size(), "CUDA_DEVICE_MAX_CONNECTIONS=", hardware_queues, " gives ", size(),
                       " virtual ranks too few hardware queues for device barriers (a rank would wait behind a "
                       "peer's spinning barrier): it must exceed the virtual ranks; unset it, or set it to ",
                       kMaxHardwareQueues);
        return std::make_unique<LocalSymmetric>(host_, bytes);
    }

private:
    // cudaMalloc on every virtual rank; the pointers are exchanged through the host group (one address space).
    class LocalSymmetric final : public SymmetricBuffer {
    public:
        LocalSymmetric(Communicator& host, int64_t bytes) : host_(host) {
            const std::vector<int64_t> sizes = host.all_gather(std::vector<int64_t>{bytes});
            for (int64_t b : sizes)
                MOEKIT_CHECK(b == bytes, "symmetric allocation: virtual ranks ask for different sizes (", b, " vs ",
                             bytes, " bytes)");
            void* mine = nullptr;
            if (bytes > 0) {
                MOEKIT_CUDA_CHECK(cudaMalloc(&mine, size_t(bytes)));
                zero_fill(mine, size_t(bytes));
            }
            const std::vector<int64_t> all = host.all_gather(std::vector<int64_t>{int64_t(reinterpret_cast<intptr_t>(mine))});
            for (int64_t p : all) peers_.push_back(reinterpret_cast<void*>(intptr_t(p)));
            rank_ = host.rank(), bytes_ = bytes;
        }
        ~LocalSymmetric() override {
            // Every rank frees only after every rank is done with every buffer (no peer writes after this).
            try {
                host_.barrier();
            } catch (...) {
            }
            if (local()) cudaFree(local());
        }

    private:
        Communicator& host_;
    };

    // Rendezvous 1: every rank's [send pointer, ready event, extra...] once its stream has the data.
    std::vector<int64_t> publish(const void* send, cudaStream_t stream, const std::vector<int64_t>& extra) {
        MOEKIT_CUDA_CHECK(cudaEventRecord(ready_, stream));
        std::vector<int64_t> mine{int64_t(reinterpret_cast<intptr_t>(send)), int64_t(reinterpret_cast<intptr_t>(ready_))};
        mine.insert(mine.end(), extra.begin(), extra.end());
        return host_.all_gather(mine);
    }
    void copy_from(int peer, const int64_t* info, int64_t offset, void* dst, int64_t bytes, cudaStream_t stream) {
        if (bytes == 0) return;
        if (peer != rank())
            MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(intptr_t(info[1])), 0));
        const char* src = reinterpret_cast<const char*>(intptr_t(info[0])) + offset;
        MOEKIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream));
    }
    // Rendezvous 2: nobody goes on (and overwrites its send buffer) before every reader is done.
    void finish(cudaStream_t stream) {
        MOEKIT_CUDA_CHECK(cudaEventRecord(done_, stream));
        const std::vector<int64_t> dones =
            host_.all_gather(std::vector<int64_t>{int64_t(reinterpret_cast<intptr_t>(done_))});
        for (int p = 0; p < size(); ++p)
            if (p != rank())
                MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(intptr_t(dones[size_t(p)])), 0));
    }

    Communicator& host_;
    int device_ = 0;
    cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

__global__ void sum_blocks_kernel(const float* __restrict__ in, int64_t blocks, int64_t count, float* out,
                                  bool accumulate) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
        float acc = in[i];
        for (int64_t b = 1; b < blocks; ++b) acc += in[b * count + i];
        out[i] = accumulate ? out[i] + acc : acc;
    }
}

}  // namespace

std::unique_ptr<DeviceComm> make_local_device_comm(Communicator& host) {
    return std::make_unique<LocalDeviceComm>(host);
}

std::unique_ptr<DeviceComm> make_device_comm(Communicator& host) {
    if (host.transport() == "mpi") return make_nccl_device_comm(host);
    return make_local_device_comm(host);
}

void sum_blocks(const float* in, int64_t blocks, int64_t count, float* out, bool accumulate, cudaStream_t stream) {
    if (count == 0) return;
    const int threads = 256;
    const int64_t grid = std::min<int64_t>((count + threads - 1) / threads, 4096);
    sum_blocks_kernel<<<unsigned(grid), threads, 0, stream>>>(in, blocks, count, out, accumulate);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void all_reduce_sum(DeviceComm& comm, float* data, int64_t count, float* scratch, cudaStream_t stream) {
    if (comm.size() == 1 || count == 0) return;
    comm.all_gather(data, count * int64_t(sizeof(float)), scratch, stream);
    sum_blocks(scratch, comm.size(), count, data, false, stream);
}

}  // namespace moekit::cuda
