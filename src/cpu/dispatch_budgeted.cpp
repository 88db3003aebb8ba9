// BudgetedDispatcher (src/cpu/dispatch_budgeted.h): the budgeted protocol on CPU ranks. Forward:
// permutation 1, all-gather of the [E] counts, the scan of dispatch_math.h, one fenced epoch of puts
// of rows + probs + source rows into the receivers' [l][s]-ordered buffers, clipped at the budget.
// combine and dispatch_backward put rows (and prob grads) back to the source rows; combine_backward
// moves grads like the forward. In synchronous mode (the re-run) every call is the alltoall dispatcher.
// Tests: tests/budget_checks.h via tests/mpi/test_ep_mpi.cpp and tests/cpu/test_dispatch_budgeted.cpp.
#include "cpu/dispatch_budgeted.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/dispatch_math.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

// memcpy that allows empty ranges (an empty vector's data() may be null, which memcpy must not get).
void copy_bytes(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, size_t(bytes));
}

}  // namespace

std::string BudgetOverflowReport::message() const {
    std::string ranks;
    for (int r : overflowed_ranks) ranks += str(ranks.empty() ? "" : ",", r);
    return str("EP receive budget overflow: rank(s) ", ranks, " would receive up to ", peak_rows, " rows > budget ",
               budget_rows, " (--moe-expert-rank-capacity-factor=", factor,
               "); no row was dropped: the step is re-run through the alltoall dispatcher; a factor of ",
               sufficient_factor, " would have sufficed");
}

void BudgetBuffers::create(Communicator& ep, int ep_size, int64_t tokens, int64_t topk, int64_t hidden, double factor,
                           int64_t elem_bytes, unsigned char slack_byte) {
    budget = moekit::budget_rows(tokens, topk, std::min(factor, double(ep_size)));
    return_rows = tokens * topk;  // a rank sends at most T*k rows, and gets each back once
    recv_rows_at = budget * 8;
    recv_probs_at = recv_rows_at + budget * hidden * elem_bytes;
    ret_probs_at = return_rows * hidden * elem_bytes;
    const int64_t recv_bytes = recv_probs_at + budget * elem_bytes, ret_bytes = ret_probs_at + return_rows * elem_bytes;
    recv_words.assign(size_t((recv_bytes + 7) / 8), 0);
    ret_words.assign(size_t((ret_bytes + 7) / 8), 0);
    std::memset(recv_words.data(), slack_byte, recv_words.size() * 8);
    recv_win = ep.create_window(recv_words.data(), recv_bytes);
    ret_win = ep.create_window(ret_words.data(), ret_bytes);
}

template <typename T>
BudgetedDispatcher<T>::BudgetedDispatcher(const EpLayout& layout, Communicator& ep, int64_t tokens, int64_t topk,
                                          int64_t hidden, double factor)
    : layout_(layout), ep_(ep), tokens_(tokens), topk_(topk), hidden_(hidden), factor_(factor) {
    MOEKIT_REQUIRE(factor > 0 && std::isfinite(factor), "--moe-expert-rank-capacity-factor=", factor,
                   " must be > 0 and finite");
    MOEKIT_REQUIRE(tokens > 0, "the budgeted dispatcher needs the tokens per rank (--seq-length * --micro-batch-size) "
                   "to size its receive budget, got ", tokens);
    fallback_ = make_alltoall_dispatcher<T>(layout, ep);
    buf_.create(ep, layout.ep_size, tokens, topk, hidden, factor, int64_t(sizeof(T)), kSlackByte);
}

template <typename T>
BudgetedDispatcher<T>::~BudgetedDispatcher() = default;

template <typename T>
const T* BudgetedDispatcher<T>::buffer_rows() const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(buf_.recv_words.data()) + buf_.recv_rows_at);
}
template <typename T>
const T* BudgetedDispatcher<T>::buffer_probs() const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(buf_.recv_words.data()) + buf_.recv_probs_at);
}
template <typename T>
const int64_t* BudgetedDispatcher<T>::buffer_sources() const {
    return buf_.recv_words.data();
}

template <typename T>
void BudgetedDispatcher<T>::put_to_receivers(const T* rows, const T* probs, const int64_t* sources) {
    const int EP = layout_.ep_size, me = layout_.ep_rank;
    const int64_t L = layout_.num_local_experts, t = int64_t(sizeof(T));
    buf_.recv_win->fence();
    for (int i = 0; i < EP; ++i) {
        const int p = (me + 1 + i) % EP;  // staggered peer order, as the device kernel runs it
        const int64_t* off = &all_offsets_[size_t(p) * size_t(L * EP + 1)];
        for (int64_t l = 0; l < L; ++l) {
            const int64_t e = int64_t(p) * L + l, start = plan_.offsets[size_t(e)];
            const int64_t dest = off[l * EP + me];
            const int64_t fit = rows_within_budget(dest, plan_.tokens_per_expert[size_t(e)], buf_.budget);
            if (fit == 0) continue;
            buf_.recv_win->put(p, buf_.recv_rows_at + dest * hidden_ * t, rows + start * hidden_, fit * hidden_ * t);
            if (probs) buf_.recv_win->put(p, buf_.recv_probs_at + dest * t, probs + start, fit * t);
            if (sources) buf_.recv_win->put(p, dest * 8, sources + start, fit * 8);
        }
    }
    buf_.recv_win->fence();
}

template <typename T>
Matrix<T> BudgetedDispatcher<T>::return_to_sources(const Matrix<T>& rows, const std::vector<T>* probs,
                                                   std::vector<T>* probs_back) {
    MOEKIT_CHECK(rows.rows == held_rows() && rows.cols == hidden_, "rows to return are [", rows.rows, ", ", rows.cols,
                 "], this rank holds [", held_rows(), ", ", hidden_, "]");
    return buf_.return_held_rows(rows, probs, probs_back, my_offsets_.data(),
                                 layout_.num_local_experts * layout_.ep_size, layout_.ep_size, held_sources_,
                                 plan_.num_rows());
}

template <typename T>
DispatchedRows<T> BudgetedDispatcher<T>::dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                                                  const std::vector<uint8_t>& routing_map) {
    if (synchronous_) return fallback_->dispatch(tokens, probs, routing_map);
    MOEKIT_REQUIRE(in_step_, "--moe-expert-rank-capacity-factor: this command runs the layer without the "
                   "end-of-step overflow check and re-run (cpu::run_budgeted_step), so an over-budget step would "
                   "drop rows unnoticed; it is not supported here yet");
    const int64_t E = layout_.num_experts, L = layout_.num_local_experts, t = int64_t(sizeof(T));
    const int EP = layout_.ep_size, me = layout_.ep_rank;
    MOEKIT_CHECK(tokens.cols == hidden_, "tokens are [", tokens.rows, ", ", tokens.cols, "], the dispatcher was built for H=",
                 hidden_);
    plan_ = build_routing_plan(routing_map, probs, tokens.rows, E);
    const int64_t N = plan_.num_rows();
    MOEKIT_CHECK(N <= buf_.return_rows, "this rank routes ", N, " rows, more than T*k = ", buf_.return_rows,
                 " (tokens per rank ", tokens_, ", k ", topk_, ") the budgeted dispatcher was built for");
    const Matrix<T> permuted = permute(tokens, plan_);
    row_ids_.resize(size_t(N));
    std::iota(row_ids_.begin(), row_ids_.end(), int64_t(0));

    // The only metadata exchange; from it every rank knows every receiver's offsets.
    counts_ = ep_.all_gather(plan_.tokens_per_expert);  // [EP, E]
    const size_t stride = size_t(L * EP + 1);
    all_offsets_.assign(size_t(EP) * stride, 0);
    for (int p = 0; p < EP; ++p) recv_chunk_offsets(counts_.data(), EP, E, L, p, &all_offsets_[size_t(p) * stride]);
    my_offsets_.assign(all_offsets_.begin() + long(size_t(me) * stride), all_offsets_.begin() + long(size_t(me + 1) * stride));
    received_ = my_offsets_.back();
    if (received_ > buf_.budget) overflow_ = true;  // this rank's flag; peers learn it at end_step()
    peak_ = std::max(peak_, received_);

    put_to_receivers(permuted.data.data(), plan_.permuted_probs.data(), row_ids_.data());

    // The experts read the held rows with per-expert counts (the device reads the buffer in place).
    const int64_t n = held_rows();
    DispatchedRows<T> out;
    out.rows = Matrix<T>(n, hidden_);
    copy_bytes(out.rows.data.data(), buffer_rows(), n * hidden_ * t);
    out.probs.assign(buffer_probs(), buffer_probs() + n);
    held_sources_.assign(buffer_sources(), buffer_sources() + n);
    out.offsets.resize(size_t(L + 1));
    for (int64_t l = 0; l <= L; ++l) out.offsets[size_t(l)] = std::min(my_offsets_[size_t(l * EP)], buf_.budget);
    return out;
}

template <typename T>
Matrix<T> BudgetedDispatcher<T>::combine(const Matrix<T>& expert_out) {
    if (synchronous_) return fallback_->combine(expert_out);
    return unpermute(return_to_sources(expert_out, nullptr, nullptr), plan_);
}

template <typename T>
Matrix<T> BudgetedDispatcher<T>::combine_backward(const Matrix<T>& grad_output) {
    if (synchronous_) return fallback_->combine_backward(grad_output);
    const Matrix<T> rows = unpermute_backward(grad_output, plan_);  // [N, H] permutation-1 order
    put_to_receivers(rows.data.data(), nullptr, nullptr);
    const int64_t n = held_rows();
    Matrix<T> out(n, hidden_);
    copy_bytes(out.data.data(), buffer_rows(), n * hidden_ * int64_t(sizeof(T)));
    return out;
}

template <typename T>
void BudgetedDispatcher<T>::dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs,
                                              Matrix<T>& grad_tokens, Matrix<T>& grad_probs) {
    if (synchronous_) return fallback_->dispatch_backward(grad_rows, grad_row_probs, grad_tokens, grad_probs);
    MOEKIT_CHECK(int64_t(grad_row_probs.size()) == held_rows(), "grad_row_probs has ", grad_row_probs.size(),
                 " entries for ", held_rows(), " rows");
    std::vector<T> probs_back;
    grad_tokens = permute_backward(return_to_sources(grad_rows, &grad_row_probs, &probs_back), plan_);
    grad_probs = permute_probs_backward(probs_back, plan_);
}

BudgetOverflowReport gather_overflow_report(Communicator& step_group, bool overflowed, int64_t peak, int64_t budget_rows,
                                            double factor, int64_t tokens, int64_t topk) {
    const int G = step_group.size();
    // Slot r: rank r's peak if it overflowed (else 0); slot G: the group's peak. One all-reduce (max).
    std::vector<int64_t> v(size_t(G + 1), 0);
    v[size_t(step_group.rank())] = overflowed ? peak : 0;
    v[size_t(G)] = peak;
    step_group.all_reduce(v.data(), G + 1, ReduceOp::max);
    BudgetOverflowReport r;
    r.budget_rows = budget_rows;
    r.factor = factor;
    r.peak_rows = v[size_t(G)];
    for (int g = 0; g < G; ++g)
        if (v[size_t(g)] > 0) r.overflowed_ranks.push_back(g);
    r.overflow = !r.overflowed_ranks.empty();
    r.sufficient_factor = sufficient_factor(r.peak_rows, tokens, topk);
    return r;
}

template <typename T>
BudgetOverflowReport BudgetedDispatcher<T>::end_step(Communicator& step_group) {
    BudgetOverflowReport r = gather_overflow_report(step_group, overflow_, peak_, buf_.budget, factor_, tokens_, topk_);
    if (r.overflow) ++overflow_events_;
    overflow_ = false;
    peak_ = 0;
    in_step_ = false;
    return r;
}

template <typename T>
Matrix<T> BudgetBuffers::return_held_rows(const Matrix<T>& rows, const std::vector<T>* probs,
                                          std::vector<T>* probs_back, const int64_t* offsets, int64_t chunks,
                                          int ep_size, const std::vector<int64_t>& sources, int64_t N) {
    const int64_t H = rows.cols, t = int64_t(sizeof(T));
    char* ret = reinterpret_cast<char*>(ret_words.data());
    std::memset(ret, 0, size_t(N * H * t));
    if (probs_back) std::memset(ret + ret_probs_at, 0, size_t(N * t));
    ret_win->fence();
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t c0 = std::min(offsets[c], budget), c1 = std::min(offsets[c + 1], budget);
        if (c1 <= c0) continue;
        // A chunk is one expert's (or slot's) rows of one source: contiguous there, so one put per chunk.
        const int64_t first = sources[size_t(c0)];
        for (int64_t r = c0; r < c1; ++r)
            MOEKIT_CHECK(sources[size_t(r)] == first + (r - c0), "source rows of chunk ", c, " not contiguous");
        ret_win->put(int(c % ep_size), first * H * t, rows.row(c0), (c1 - c0) * H * t);
        if (probs) ret_win->put(int(c % ep_size), ret_probs_at + first * t, probs->data() + c0, (c1 - c0) * t);
    }
    ret_win->fence();
    Matrix<T> back(N, H);
    copy_bytes(back.data.data(), ret, N * H * t);
    if (probs_back) {
        probs_back->resize(size_t(N));
        copy_bytes(probs_back->data(), ret + ret_probs_at, N * t);
    }
    return back;
}
template Matrix<float> BudgetBuffers::return_held_rows(const Matrix<float>&, const std::vector<float>*,
                                                       std::vector<float>*, const int64_t*, int64_t, int,
                                                       const std::vector<int64_t>&, int64_t);
template Matrix<double> BudgetBuffers::return_held_rows(const Matrix<double>&, const std::vector<double>*,
                                                        std::vector<double>*, const int64_t*, int64_t, int,
                                                        const std::vector<int64_t>&, int64_t);

template class BudgetedDispatcher<float>;
template class BudgetedDispatcher<double>;

}  // namespace moekit::cpu
