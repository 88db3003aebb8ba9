// EchoExperts (src/cpu/echo_experts.h): clone weights out from, and clone gradients back to, the home
// ranks, by all-to-all-v over EP. Both directions pack each peer's block in ascending global slot
// order, so sender and receiver agree without any metadata, and the home rank adds the clones'
// gradients in ascending slot order (deterministic, the same bits on virtual and MPI ranks).
#include "cpu/echo_experts.h"

#include "core/echo_dispatch_math.h"
#include "moekit/error.h"

namespace moekit::cpu {

namespace {
template <typename T>
void append(std::vector<T>& buf, const Matrix<T>& m) {
    buf.insert(buf.end(), m.data.begin(), m.data.end());
}
template <typename T>
void take(const std::vector<T>& buf, size_t& at, Matrix<T>& m) {
    std::copy(buf.begin() + int64_t(at), buf.begin() + int64_t(at + m.data.size()), m.data.begin());
    at += m.data.size();
}
}  // namespace

template <typename T>
void EchoExperts<T>::fetch_weights(const MoeWeights<T>& w) {
    const EchoDims& d = dispatcher_.dims();
    const echo::EchoPlan& plan = dispatcher_.plan();
    const int64_t L = d.experts_per_rank(), S = d.slots_per_rank, me = ep_.rank(), EP = d.ep;
    fc1_.assign(size_t(L + S), Matrix<T>());
    fc2_.assign(size_t(L + S), Matrix<T>());
    for (int64_t l = 0; l < L; ++l) fc1_[size_t(l)] = w.fc1[size_t(me * L + l)], fc2_[size_t(l)] = w.fc2[size_t(me * L + l)];
    // Send: for each peer, the weights of my experts cloned in its slots, ascending slot (j / S grows with
    // j, so the buffer is packed in peer order).
    const Matrix<T>& f1 = w.fc1[size_t(me * L)];
    const Matrix<T>& f2 = w.fc2[size_t(me * L)];
    const int64_t per_expert = int64_t(f1.data.size() + f2.data.size());
    std::vector<T> send;
    std::vector<int64_t> sc(size_t(EP), 0), rc(size_t(EP), 0);
    for (int64_t j = 0; j < d.num_slots(); ++j) {
        const int64_t e = plan.slot_expert[size_t(j)];
        if (e < 0) continue;
        const int64_t dst = j / S, home = d.home_rank(e);
        if (home == me) {
            append(send, w.fc1[size_t(e)]), append(send, w.fc2[size_t(e)]);
            sc[size_t(dst)] += per_expert;
            if (dst != me) traffic_.weight_bytes += per_expert * int64_t(sizeof(T));
        }
        if (dst == me) rc[size_t(home)] += per_expert;
    }
    int64_t total = 0;
    for (int64_t c : rc) total += c;
    std::vector<T> recv(static_cast<size_t>(total));
    ep_.all_to_all_v(send.data(), sc, recv.data(), rc);
    // Unpack in my slots' order; each home rank's block is in ascending slot order, as mine are.
    std::vector<size_t> at(size_t(EP), 0);
    for (int64_t src = 1; src < EP; ++src) at[size_t(src)] = at[size_t(src - 1)] + size_t(rc[size_t(src - 1)]);
    for (int64_t k = 0; k < S; ++k) {
        const int64_t e = plan.slot_expert[size_t(me * S + k)];
        if (e < 0) continue;
        Matrix<T>& a = fc1_[size_t(L + k)];
        Matrix<T>& b = fc2_[size_t(L + k)];
        a = Matrix<T>(f1.rows, f1.cols), b = Matrix<T>(f2.rows, f2.cols);
        size_t& pos = at[size_t(d.home_rank(e))];
        take(recv, pos, a), take(recv, pos, b);
    }
}

template <typename T>
void EchoExperts<T>::forward_done() {
    if (!recompute_) return;
    fc1_.clear(), fc2_.clear();
    fc1_.shrink_to_fit(), fc2_.shrink_to_fit();
}

template <typename T>
void EchoExperts<T>::begin_grads(MoeWeights<T>& grads) {
    const EchoDims& d = dispatcher_.dims();
    const echo::EchoPlan& plan = dispatcher_.plan();
    const int64_t L = d.experts_per_rank(), S = d.slots_per_rank, me = ep_.rank();
    gfc1_.assign(size_t(L + S), Matrix<T>());
    gfc2_.assign(size_t(L + S), Matrix<T>());
    for (int64_t l = 0; l < L; ++l) {
        gfc1_[size_t(l)] = std::move(grads.fc1[size_t(me * L + l)]);
        gfc2_[size_t(l)] = std::move(grads.fc2[size_t(me * L + l)]);
    }
    for (int64_t k = 0; k < S; ++k)
        if (plan.slot_expert[size_t(me * S + k)] >= 0) {
            gfc1_[size_t(L + k)] = Matrix<T>(gfc1_[0].rows, gfc1_[0].cols);
            gfc2_[size_t(L + k)] = Matrix<T>(gfc2_[0].rows, gfc2_[0].cols);
        }
}

template <typename T>
void EchoExperts<T>::finish_grads(MoeWeights<T>& grads) {
    const EchoDims& d = dispatcher_.dims();
    const echo::EchoPlan& plan = dispatcher_.plan();
    const int64_t L = d.experts_per_rank(), S = d.slots_per_rank, me = ep_.rank(), EP = d.ep;
    for (int64_t l = 0; l < L; ++l) {
        grads.fc1[size_t(me * L + l)] = std::move(gfc1_[size_t(l)]);
        grads.fc2[size_t(me * L + l)] = std::move(gfc2_[size_t(l)]);
    }
    const Matrix<T>& f1 = grads.fc1[size_t(me * L)];
    const Matrix<T>& f2 = grads.fc2[size_t(me * L)];
    const int64_t per_expert = int64_t(f1.data.size() + f2.data.size());
    // Send my slots' gradients home (ascending slot); receive the gradients of my experts' clones. Clones given
    // no tokens add nothing and are skipped (echo_clone_adds, as the CUDA layer does).
    const int32_t* slot_expert = plan.slot_expert.data();
    const int64_t* slot_tokens = plan.slot_tokens.data();
    auto adds = [&](int64_t j) { return echo_clone_adds(slot_expert, slot_tokens, j); };
    std::vector<T> send;
    std::vector<int64_t> sc(size_t(EP), 0), rc(size_t(EP), 0);
    // The send buffer is packed in destination (home rank) order, each block in ascending slot order.
    for (int64_t home = 0; home < EP; ++home)
        for (int64_t k = 0; k < S; ++k) {
            const int64_t e = plan.slot_expert[size_t(me * S + k)];
            if (!adds(me * S + k) || d.home_rank(e) != home) continue;
            append(send, gfc1_[size_t(L + k)]), append(send, gfc2_[size_t(L + k)]);
            sc[size_t(home)] += per_expert;
            if (home != me) traffic_.grad_bytes += per_expert * int64_t(sizeof(T));
        }
    for (int64_t j = 0; j < d.num_slots(); ++j) {
        const int64_t e = plan.slot_expert[size_t(j)];
        if (adds(j) && d.home_rank(e) == me) rc[size_t(j / S)] += per_expert;
    }
    int64_t total = 0;
    for (int64_t c : rc) total += c;
    std::vector<T> recv(static_cast<size_t>(total));
    ep_.all_to_all_v(send.data(), sc, recv.data(), rc);
    // Global slot order = holder rank ascending, then its slots ascending = the packed order.
    size_t at = 0;
    Matrix<T> a(f1.rows, f1.cols), b(f2.rows, f2.cols);
    for (int64_t j = 0; j < d.num_slots(); ++j) {
        const int64_t e = plan.slot_expert[size_t(j)];
        if (!adds(j) || d.home_rank(e) != me) continue;
        take(recv, at, a), take(recv, at, b);
        Matrix<T>& g1 = grads.fc1[size_t(e)];
        Matrix<T>& g2 = grads.fc2[size_t(e)];
        for (size_t i = 0; i < g1.data.size(); ++i) g1.data[i] += a.data[i];
        for (size_t i = 0; i < g2.data.size(); ++i) g2.data[i] += b.data[i];
    }
    gfc1_.clear(), gfc2_.clear();
}

template class EchoExperts<float>;
template class EchoExperts<double>;

}  // namespace moekit::cpu
