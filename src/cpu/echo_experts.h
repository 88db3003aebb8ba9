// ECHO expert weights and gradients on one EP rank (issue 9, deliver 3, CPU twin): the weights of the
// L + S local buckets (home experts, then the clones, whose weights come from their home ranks by one
// all-to-all-v), and in backward the clone gradients sent back to the home ranks and added to the home
// experts' gradients (in global slot order) before reduce_gradients or any optimizer sees them. With
// --moe-echo-recompute-expert-dispatch the clone weights are dropped after forward and sent again in
// backward. Used by src/cpu/moe_pipeline.cpp. Tests: tests/echo_checks.h (virtual and MPI ranks).
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/dispatch_echo.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::cpu {

struct EchoTraffic {
    int64_t weight_bytes = 0;  // clone weights sent to other ranks (all sends of this rank, cumulative)
    int64_t grad_bytes = 0;    // clone gradients sent back to other ranks (cumulative)
};

template <typename T>
class EchoExperts {
public:
    EchoExperts(const EchoDispatcher<T>& dispatcher, Communicator& ep, bool recompute)
        : dispatcher_(dispatcher), ep_(ep), recompute_(recompute) {}

    // Collective over EP, after the dispatch of the step: home weights copied, clone weights received.
    void fetch_weights(const MoeWeights<T>& w);
    void forward_done();  // recompute: the clone buffers are released until backward fetches again
    bool needs_fetch() const { return fc1_.empty(); }
    size_t count() const { return fc1_.size(); }  // L + S
    const Matrix<T>* fc1() const { return fc1_.data(); }
    const Matrix<T>* fc2() const { return fc2_.data(); }

    // Backward: the home experts' gradient accumulators are moved in (no copy), the slots' start at
    // zero; the returned arrays [L + S] go to experts_backward. finish_grads moves the home ones back
    // and adds every clone's gradient into its home expert (collective over EP).
    Matrix<T>* grad_fc1() { return gfc1_.data(); }
    Matrix<T>* grad_fc2() { return gfc2_.data(); }
    void begin_grads(MoeWeights<T>& grads);
    void finish_grads(MoeWeights<T>& grads);

    const EchoTraffic& traffic() const { return traffic_; }

private:
    const EchoDispatcher<T>& dispatcher_;
    Communicator& ep_;
    bool recompute_;
    std::vector<Matrix<T>> fc1_, fc2_;    // [L + S]
    std::vector<Matrix<T>> gfc1_, gfc2_;  // [L + S] during backward
    EchoTraffic traffic_;
};

}  // namespace moekit::cpu
