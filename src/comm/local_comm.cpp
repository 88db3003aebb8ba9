// The `local` transport: N virtual ranks in one process, one thread each, sharing one job state.
// A collective publishes each rank's buffer pointers in its group's slots, meets at a barrier, copies
// from the peers' buffers directly, and meets again so no buffer is released while read. One mutex
// and condition variable per job, so an abort wakes every waiting rank of every group. Interface:
// include/moekit/comm.h; MPI twin: src/comm/mpi_comm.cpp. Tests: tests/cpu/test_ep_virtual.cpp (LocalComm.*).
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>

#include "cpu/parallel.h"
#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit::comm {
namespace {

struct Slot {
    const void* send = nullptr;
    const int64_t* counts = nullptr;  // all_to_all_v: send bytes per peer
    int64_t bytes = 0;                // all_gather: bytes per rank
    int split_color = 0, split_key = 0;
};

struct LocalGroup {
    std::vector<int> world_ranks;  // world rank of each group rank
    std::vector<Slot> slots;
    int arrived = 0;
    uint64_t generation = 0;
};

struct LocalJob {
    std::mutex mutex;
    std::condition_variable cv;
    bool aborted = false;
    std::string abort_reason;
    std::map<std::tuple<const LocalGroup*, uint64_t, int>, std::shared_ptr<LocalGroup>> children;  // (parent, split, color)
    std::chrono::seconds timeout{300};
};

struct WindowEntry {
    char* base = nullptr;
    int64_t bytes = 0;
};

// Peers' base pointers (one address space); the fence is the group's barrier, whose mutex orders the
// memcpys of one epoch before every read of the next.
class LocalWindow final : public Window {
public:
    LocalWindow(Communicator& group, std::vector<WindowEntry> peers) : group_(group), peers_(std::move(peers)) {}
    void fence() override { group_.barrier(); }
    void put(int peer, int64_t offset, const void* src, int64_t bytes) override {
        MOEKIT_CHECK(peer >= 0 && peer < int(peers_.size()), "window put to rank ", peer, " of ", peers_.size());
        const WindowEntry& w = peers_[size_t(peer)];
        MOEKIT_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= w.bytes, "window put of ", bytes,
                     " bytes at offset ", offset, " past rank ", peer, "'s window of ", w.bytes, " bytes");
        if (bytes > 0) std::memcpy(w.base + offset, src, size_t(bytes));
    }
    int64_t peer_bytes(int peer) const override { return peers_.at(size_t(peer)).bytes; }

private:
    Communicator& group_;
    std::vector<WindowEntry> peers_;
};

std::chrono::seconds wait_timeout() {
    const char* env = std::getenv("MOEKIT_COMM_TIMEOUT_S");
    const long s = env ? std::atol(env) : 0;
    return std::chrono::seconds(s > 0 ? s : 300);
}

class LocalCommunicator final : public Communicator {
public:
    LocalCommunicator(std::shared_ptr<LocalJob> job, std::shared_ptr<LocalGroup> group, int rank)
        : job_(std::move(job)), group_(std::move(group)), rank_(rank) {}

    int rank() const override { return rank_; }
    int size() const override { return int(group_->world_ranks.size()); }
    std::string transport() const override { return "local"; }

    void all_gather_bytes(const void* send, int64_t bytes, void* recv) override {
        if (size() == 1) {
            if (bytes > 0) std::memcpy(recv, send, size_t(bytes));
            return;
        }
        Slot s;
        s.send = send;
        s.bytes = bytes;
        publish_and_wait(s);
        std::string mismatch;
        for (int p = 0; p < size(); ++p) {
            const Slot& peer = group_->slots[size_t(p)];
            if (peer.bytes != bytes) {
                mismatch = str("all_gather: rank ", p, " gives ", peer.bytes, " bytes, rank ", rank_, " gives ", bytes);
                continue;
            }
            if (bytes > 0) std::memcpy(static_cast<char*>(recv) + p * bytes, peer.send, size_t(bytes));
        }
        wait();
        MOEKIT_CHECK(mismatch.empty(), mismatch);
    }

    void all_to_all_v_bytes(const void* send, const int64_t* send_bytes, void* recv,
                            const int64_t* recv_bytes) override {
        Slot s;
        s.send = send;
        s.counts = send_bytes;
        publish_and_wait(s);
        std::string mismatch;
        int64_t out = 0;
        for (int p = 0; p < size(); ++p) {
            const Slot& peer = group_->slots[size_t(p)];
            int64_t offset = 0;  // peer's blocks for ranks before me
            for (int q = 0; q < rank_; ++q) offset += peer.counts[q];
            const int64_t n = peer.counts[rank_];
            if (n != recv_bytes[p]) {
                mismatch = str("all_to_all_v: rank ", p, " sends ", n, " bytes to rank ", rank_, ", which expects ",
                               recv_bytes[p]);
            } else if (n > 0) {
                std::memcpy(static_cast<char*>(recv) + out, static_cast<const char*>(peer.send) + offset, size_t(n));
            }
            out += recv_bytes[p];
        }
        wait();
        MOEKIT_CHECK(mismatch.empty(), mismatch);
    }

    void barrier() override {
        if (size() > 1) wait();
    }

    [[noreturn]] void abort(const std::string& reason) override {
        {
            std::lock_guard<std::mutex> lock(job_->mutex);
            if (!job_->aborted) {
                job_->aborted = true;
                job_->abort_reason = str("virtual rank ", group_->world_ranks[size_t(rank_)], ": ", reason);
            }
        }
        job_->cv.notify_all();
        throw Error(str("virtual rank ", group_->world_ranks[size_t(rank_)], " aborted the job: ", reason));
    }

    std::unique_ptr<Communicator> split(int color, int key) override {
        Slot s;
        s.split_color = color;
        s.split_key = key;
        const uint64_t split_id = split_count_++;  // every rank splits in the same order
        std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), world rank)
        if (size() == 1) {
            members.push_back({{key, 0}, group_->world_ranks[0]});
        } else {
            publish_and_wait(s);
            for (int p = 0; p < size(); ++p)
                if (group_->slots[size_t(p)].split_color == color)
                    members.push_back({{group_->slots[size_t(p)].split_key, p}, group_->world_ranks[size_t(p)]});
            wait();
        }
        std::sort(members.begin(), members.end());
        int my_rank = 0;
        for (size_t i = 0; i < members.size(); ++i)
            if (members[i].first.second == rank_) my_rank = int(i);
        std::shared_ptr<LocalGroup> child;
        {
            std::lock_guard<std::mutex> lock(job_->mutex);
            auto& slot = job_->children[{group_.get(), split_id, color}];
            if (!slot) {
                slot = std::make_shared<LocalGroup>();
                for (const auto& m : members) slot->world_ranks.push_back(m.second);
                slot->slots.resize(members.size());
            }
            child = slot;
        }
        return std::make_unique<LocalCommunicator>(job_, child, my_rank);
    }

    std::unique_ptr<Window> create_window(void* base, int64_t bytes) override {
        MOEKIT_CHECK(bytes >= 0 && (base || bytes == 0), "create_window: ", bytes, " bytes at ", base);
        const WindowEntry mine{static_cast<char*>(base), bytes};
        std::vector<WindowEntry> peers(static_cast<size_t>(size()));
        all_gather_bytes(&mine, int64_t(sizeof(WindowEntry)), peers.data());
        return std::make_unique<LocalWindow>(*this, std::move(peers));
    }

private:
    void publish_and_wait(const Slot& s) {
        {
            std::lock_guard<std::mutex> lock(job_->mutex);
            group_->slots[size_t(rank_)] = s;
        }
        wait();
    }

    // Generation barrier over the group; throws when the job was aborted or the wait times out.
    void wait() {
        std::unique_lock<std::mutex> lock(job_->mutex);
        if (job_->aborted) throw Error(str("aborted (", job_->abort_reason, ")"));
        const uint64_t gen = group_->generation;
        if (++group_->arrived == size()) {
            group_->arrived = 0;
            ++group_->generation;
            job_->cv.notify_all();
            return;
        }
        const bool done = job_->cv.wait_for(lock, job_->timeout,
                                            [&] { return group_->generation != gen || job_->aborted; });
        if (job_->aborted) throw Error(str("aborted (", job_->abort_reason, ")"));
        if (!done) {
            const std::string reason = str("virtual rank ", group_->world_ranks[size_t(rank_)], " waited ",
                                           job_->timeout.count(), " s in a collective of a ", size(),
                                           "-rank group where only ", group_->arrived, " ranks arrived");
            job_->aborted = true;
            job_->abort_reason = reason;
            job_->cv.notify_all();
            throw Error(reason);
        }
    }

    std::shared_ptr<LocalJob> job_;
    std::shared_ptr<LocalGroup> group_;
    int rank_ = 0;
    uint64_t split_count_ = 0;
};

std::shared_ptr<LocalGroup> world_group(int n) {
    auto g = std::make_shared<LocalGroup>();
    g->world_ranks.resize(size_t(n));
    std::iota(g->world_ranks.begin(), g->world_ranks.end(), 0);
    g->slots.resize(size_t(n));
    return g;
}

}  // namespace

std::unique_ptr<Communicator> make_single_rank() {
    return std::make_unique<LocalCommunicator>(std::make_shared<LocalJob>(), world_group(1), 0);
}

void run_virtual_ranks(int n, const std::function<void(Communicator& world)>& fn) {
    MOEKIT_REQUIRE(n >= 1, "--virtual-ranks=", n, " must be >= 1");
    auto job = std::make_shared<LocalJob>();
    job->timeout = wait_timeout();
    auto group = world_group(n);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    std::vector<bool> originated(size_t(n), false);  // failed on its own, not woken by another's abort
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            // NOTE: ranks already run in parallel; their inner loops run serially (results do not
            // depend on the thread count, src/cpu/parallel.h).
            cpu::in_parallel_region() = true;
            LocalCommunicator comm(job, group, r);
            try {
                fn(comm);
            } catch (...) {
                errors[size_t(r)] = std::current_exception();
                std::lock_guard<std::mutex> lock(job->mutex);
                // Its own failure, or its own abort(); not a rank woken by another's abort.
                originated[size_t(r)] =
                    !job->aborted || job->abort_reason.rfind(str("virtual rank ", r, ": "), 0) == 0;
                if (!job->aborted) {
                    job->aborted = true;
                    job->abort_reason = str("virtual rank ", r, " failed");
                }
                job->cv.notify_all();
            }
        });
    }
    for (auto& t : threads) t.join();
    int first = -1;
    for (int r = 0; r < n && first < 0; ++r)
        if (errors[size_t(r)] && originated[size_t(r)]) first = r;
    for (int r = 0; r < n && first < 0; ++r)
        if (errors[size_t(r)]) first = r;
    if (first < 0) return;
    try {
        std::rethrow_exception(errors[size_t(first)]);
    } catch (const UsageError& e) {
        throw UsageError(str("virtual rank ", first, ": ", e.what()));
    } catch (const std::exception& e) {
        throw Error(str("virtual rank ", first, ": ", e.what()));
    }
}

}  // namespace moekit::comm
