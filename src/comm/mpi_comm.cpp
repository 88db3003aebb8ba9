// The `mpi` transport: one process per rank under mpirun. Every MPI return code goes through
// MOEKIT_MPI_CHECK, which throws moekit::Error with the call, file:line, rank and MPI's message; the
// program's main then calls comm::abort_job (MPI_Abort), so one failing rank ends the job.
// Built only when CMake finds MPI (src/comm/mpi_stub.cpp otherwise). Local twin: src/comm/local_comm.cpp.
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit::comm {
namespace {

int world_rank_or_minus_one() {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    int r = -1;
    if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

std::string mpi_error_string(int code) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "unknown MPI error";
    return std::string(text, size_t(len));
}

}  // namespace
}  // namespace moekit::comm

// The call's text, file:line, world rank, MPI's code and message.
#define MOEKIT_MPI_CHECK(call)                                                                              \
    do {                                                                                                    \
        const int moekit_mpi_rc_ = (call);                                                                  \
        if (moekit_mpi_rc_ != MPI_SUCCESS)                                                                  \
            throw ::moekit::Error(::moekit::str(__FILE__, ":", __LINE__, ": ", #call, " failed on rank ",   \
                                                ::moekit::comm::world_rank_or_minus_one(), ": error ",     \
                                                moekit_mpi_rc_, " (",                                       \
                                                ::moekit::comm::mpi_error_string(moekit_mpi_rc_), ")"));   \
    } while (0)

namespace moekit::comm {
namespace {

int as_int(int64_t v, const char* what) {
    MOEKIT_CHECK(v >= 0 && v <= INT_MAX, what, " = ", v, " bytes does not fit MPI's int counts");
    return int(v);
}

// MPI_Win_create over the caller's memory, MPI_Put, MPI_Win_fence; freed (collectively) with the window.
class MpiWindow final : public Window {
public:
    MpiWindow(MPI_Comm comm, void* base, int64_t bytes) {
        int n = 0;
        MOEKIT_MPI_CHECK(MPI_Comm_size(comm, &n));
        peer_bytes_.resize(size_t(n));
        MOEKIT_MPI_CHECK(MPI_Allgather(&bytes, 1, MPI_INT64_T, peer_bytes_.data(), 1, MPI_INT64_T, comm));
        MOEKIT_MPI_CHECK(MPI_Win_create(base, MPI_Aint(bytes), 1, MPI_INFO_NULL, comm, &win_));
        MOEKIT_MPI_CHECK(MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN));
    }
    ~MpiWindow() override {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Win_free(&win_);  // no throw from a destructor
    }
    void fence() override { MOEKIT_MPI_CHECK(MPI_Win_fence(0, win_)); }
    void put(int peer, int64_t offset, const void* src, int64_t bytes) override {
        MOEKIT_CHECK(peer >= 0 && peer < int(peer_bytes_.size()), "window put to rank ", peer, " of ",
                     peer_bytes_.size());
        MOEKIT_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= peer_bytes_[size_t(peer)], "window put of ", bytes,
                     " bytes at offset ", offset, " past rank ", peer, "'s window of ", peer_bytes_[size_t(peer)],
                     " bytes");
        if (bytes == 0) return;
        const int n = as_int(bytes, "window put");
        MOEKIT_MPI_CHECK(MPI_Put(src, n, MPI_BYTE, peer, MPI_Aint(offset), n, MPI_BYTE, win_));
    }
    int64_t peer_bytes(int peer) const override { return peer_bytes_.at(size_t(peer)); }

private:
    MPI_Win win_ = MPI_WIN_NULL;
    std::vector<int64_t> peer_bytes_;
};

class MpiCommunicator final : public Communicator {
public:
    MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
        MOEKIT_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
        MOEKIT_MPI_CHECK(MPI_Comm_size(comm_, &size_));
        // Errors come back as codes (checked), not MPI's default abort-without-a-message.
        MOEKIT_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    }
    ~MpiCommunicator() override {
        int fin = 0;
        MPI_Finalized(&fin);
        if (owned_ && !fin) MPI_Comm_free(&comm_);  // no throw from a destructor
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string transport() const override { return "mpi"; }

    void all_gather_bytes(const void* send, int64_t bytes, void* recv) override {
        // Equal sizes are a precondition of MPI_Allgather: check them first so a mismatch is an error, not UB.
        int64_t mine = bytes;
        std::vector<int64_t> all(static_cast<size_t>(size_));
        MOEKIT_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, comm_));
        for (int p = 0; p < size_; ++p)
            MOEKIT_CHECK(all[size_t(p)] == bytes, "all_gather: rank ", p, " gives ", all[size_t(p)], " bytes, rank ",
                         rank_, " gives ", bytes);
        const int n = as_int(bytes, "all_gather block");
        MOEKIT_MPI_CHECK(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
    }

    void all_to_all_v_bytes(const void* send, const int64_t* send_bytes, void* recv,
                            const int64_t* recv_bytes) override {
        const size_t n = static_cast<size_t>(size_);
        std::vector<int> sc(n), sd(n), rc(n), rd(n);
        int64_t so = 0, ro = 0;
        for (int p = 0; p < size_; ++p) {
            sc[size_t(p)] = as_int(send_bytes[p], "all_to_all_v send block");
            rc[size_t(p)] = as_int(recv_bytes[p], "all_to_all_v receive block");
            sd[size_t(p)] = as_int(so, "all_to_all_v send offset");
            rd[size_t(p)] = as_int(ro, "all_to_all_v receive offset");
            so += send_bytes[p];
            ro += recv_bytes[p];
        }
        MOEKIT_MPI_CHECK(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, comm_));
    }

    void barrier() override { MOEKIT_MPI_CHECK(MPI_Barrier(comm_)); }

    [[noreturn]] void abort(const std::string& reason) override {
        std::fprintf(stderr, "moekit: rank %d of %d aborts the job: %s\n", world_rank_or_minus_one(), size_,
                     reason.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        std::abort();
    }

    std::unique_ptr<Communicator> split(int color, int key) override {
        MPI_Comm child;
        MOEKIT_MPI_CHECK(MPI_Comm_split(comm_, color, key, &child));
        return std::make_unique<MpiCommunicator>(child, true);
    }

    std::unique_ptr<Window> create_window(void* base, int64_t bytes) override {
        return std::make_unique<MpiWindow>(comm_, base, bytes);
    }

private:
    MPI_Comm comm_;
    bool owned_ = false;
    int rank_ = 0, size_ = 1;
};

MpiCommunicator* g_world = nullptr;

// Open MPI 4.1's shared-memory one-sided components (osc sm, and osc rdma through the same segments)
// fail to create windows on disjoint groups split from one communicator on one host (two EP groups:
// "A system call failed during shared memory initialization ... open(2)", then MPI_ERR_WIN; reproduced
// with a 30-line MPI program). Its point-to-point component works, so it is chosen unless the user set
// OMPI_MCA_osc. Only windows (src/cpu/dispatch_budgeted.cpp) use it; other MPIs are left alone.
void prefer_working_osc_component() {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(version, &len) != MPI_SUCCESS) return;  // callable before MPI_Init
    if (std::string(version, size_t(len)).find("Open MPI v4.") == std::string::npos) return;
    setenv("OMPI_MCA_osc", "pt2pt", /*overwrite=*/0);
}

void finalize_at_exit() {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) MPI_Finalize();
}

}  // namespace

Communicator& mpi_world() {
    if (!g_world) {
        int init = 0;
        MOEKIT_MPI_CHECK(MPI_Initialized(&init));
        if (!init) {
            prefer_working_osc_component();
            // FUNNELED: the CPU layer runs worker threads (src/cpu/parallel.h), but only this thread calls MPI.
            int provided = MPI_THREAD_SINGLE;
            MOEKIT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
            std::atexit(finalize_at_exit);
        }
        g_world = new MpiCommunicator(MPI_COMM_WORLD, false);  // lives until exit (MPI_Finalize order)
    }
    return *g_world;
}

bool mpi_active() {
    if (!g_world) return false;
    int fin = 0;
    MPI_Finalized(&fin);
    return !fin;
}

std::string mpi_rank_label() {
    if (!mpi_active() || g_world->size() == 1) return "";
    return str("rank ", g_world->rank(), " of ", g_world->size());
}

void abort_job(int exit_code) {
    if (mpi_active() && g_world->size() > 1) {
        std::fflush(stdout);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, exit_code);
    }
    std::exit(exit_code);
}

}  // namespace moekit::comm
