// ECHO dispatcher (src/cpu/dispatch_echo.h): permutation 1 by global expert, all-gather of the [E]
// counts, the plan (the same on every rank), then one all-to-all-v of rows and one of probs where each
// source rank's tokens of a cloned expert are cut by the rule of src/core/echo_dispatch_math.h (first
// home, then the clones in slot order); [source][bucket] -> [bucket][source] as sort_chunks does for
// local experts. Backward and combine reverse each exchange with the same splits and send order.
#include "cpu/dispatch_echo.h"

#include <cmath>
#include <cstdio>

#include <cstring>
#include <numeric>

#include "core/dispatch_math.h"
#include "core/echo_dispatch_math.h"
#include "cpu/sort_chunks.h"
#include "moekit/error.h"

namespace moekit::cpu {

std::string EchoStepStats::to_string() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "clones=%lld rank load max/mean %.3f -> %.3f (max %lld -> %lld rows), %lld rows to clones",
                  (long long)clones, max_over_mean_before, max_over_mean_after, (long long)max_load_before,
                  (long long)max_load_after, (long long)rows_to_clones);
    return buf;
}

template <typename T>
EchoDispatcher<T>::EchoDispatcher(const EpLayout& layout, Communicator& ep, int64_t slots_per_rank,
                                  EchoAlgorithm algorithm, int64_t group_floor_rows)
    : layout_(layout), ep_(ep), algorithm_(algorithm) {
    dims_.ep = layout.ep_size;
    dims_.num_experts = layout.num_experts;
    dims_.slots_per_rank = slots_per_rank;
    dims_.group_floor_rows = group_floor_rows;
    echo::validate(dims_);
}

template <typename T>
DispatchedRows<T> EchoDispatcher<T>::dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                                              const std::vector<uint8_t>& routing_map) {
    const int64_t E = dims_.num_experts, L = dims_.experts_per_rank(), S = dims_.slots_per_rank;
    const int64_t slots = dims_.num_slots(), B = L + S, H = tokens.cols, me = layout_.ep_rank;
    const int EP = layout_.ep_size;
    hidden_ = H;
    routing_ = build_routing_plan(routing_map, probs, tokens.rows, E);
    const Matrix<T> permuted = permute(tokens, routing_);

    // Metadata and the plan: every rank plans from the same [EP, E] counts.
    counts_ = ep_.all_gather(routing_.tokens_per_expert);
    plan_ = forced_ ? echo::random_plan(dims_, counts_, forced_seed_) : echo::plan(dims_, counts_, algorithm_);
    echo::finish_and_check(plan_, counts_);  // the dispatch below relies on its sums
    const int32_t* slot_expert = plan_.slot_expert.data();
    const int64_t* home_row = plan_.home_tokens.data() + me * E;       // what this rank keeps home / sends
    const int64_t* clone_row = plan_.clone_tokens.data() + me * slots;

    // Send order: per destination rank, its buckets in order, each the segment of this rank's tokens.
    send_index_.clear();
    send_column_.clear();
    segments_.clear();
    input_splits_.assign(size_t(EP), 0);
    for (int64_t d = 0; d < EP; ++d)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t e = echo_bucket_expert(dims_, slot_expert, d, b);
            if (e < 0) continue;
            const int64_t j = d * S + (b - L);  // the slot, when b >= L
            const int64_t begin = b < L ? 0 : echo_segment_begin(dims_, slot_expert, home_row, clone_row, j);
            const int64_t n = b < L ? home_row[e] : clone_row[j];
            for (int64_t i = 0; i < n; ++i) {
                send_index_.push_back(routing_.offsets[size_t(e)] + begin + i);
                send_column_.push_back(b < L ? e : E + j);
            }
            if (n > 0) segments_.push_back({d, b, routing_.offsets[size_t(e)] + begin, n});
            input_splits_[size_t(d)] += n;
        }
    MOEKIT_CHECK(int64_t(send_index_.size()) == routing_.num_rows(), "ECHO dispatch sends ", send_index_.size(),
                 " rows of ", routing_.num_rows());

    // What arrives: per source, per bucket.
    recv_counts_.assign(size_t(EP * B), 0);
    output_splits_.assign(size_t(EP), 0);
    std::vector<int64_t> offsets(size_t(B + 1), 0);
    for (int64_t src = 0; src < EP; ++src)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t e = echo_bucket_expert(dims_, slot_expert, me, b);
            if (e < 0) continue;
            const int64_t n = b < L ? plan_.home_tokens[size_t(src * E + e)]
                                    : plan_.clone_tokens[size_t(src * slots + me * S + (b - L))];
            recv_counts_[size_t(src * B + b)] = n;
            output_splits_[size_t(src)] += n;
            offsets[size_t(b + 1)] += n;
        }
    for (int64_t b = 0; b < B; ++b) offsets[size_t(b + 1)] += offsets[size_t(b)];

    if (use_budget()) {
        MOEKIT_REQUIRE(in_step_, "--moe-expert-rank-capacity-factor: this command runs the layer without the "
                       "end-of-step overflow check and re-run (cpu::run_budgeted_step), so an over-budget step would "
                       "drop rows unnoticed; it is not supported here yet");
        MOEKIT_CHECK(H == hidden_budget_ && routing_.num_rows() <= buf_.return_rows, "the ECHO budget was sized for H=",
                     hidden_budget_, " and ", buf_.return_rows, " rows per rank; got H=", H, " and ", routing_.num_rows());
        const size_t stride = size_t(B * EP + 1);
        all_offsets_.assign(size_t(EP) * stride, 0);
        for (int64_t p = 0; p < EP; ++p)
            echo_recv_chunk_offsets(dims_, slot_expert, plan_.home_tokens.data(), plan_.clone_tokens.data(), p,
                                    &all_offsets_[size_t(p) * stride]);
        received_ = all_offsets_[size_t(me) * stride + size_t(B * EP)];
        MOEKIT_CHECK(received_ == offsets.back(), "ECHO budget layout disagrees with the plan");
        if (received_ > buf_.budget) overflow_ = true;  // peers learn it at end_step()
        peak_ = std::max(peak_, received_);
        std::vector<int64_t> row_ids(size_t(routing_.num_rows()));
        std::iota(row_ids.begin(), row_ids.end(), int64_t(0));
        put_to_receivers(permuted.data.data(), routing_.permuted_probs.data(), row_ids.data());
        const int64_t n = held_rows();
        const char* base = reinterpret_cast<const char*>(buf_.recv_words.data());
        DispatchedRows<T> out;
        out.rows = held_matrix();
        out.probs.resize(size_t(n));
        if (n > 0) std::memcpy(out.probs.data(), base + buf_.recv_probs_at, size_t(n) * sizeof(T));
        held_sources_.assign(buf_.recv_words.begin(), buf_.recv_words.begin() + n);
        out.offsets.resize(size_t(B + 1));
        for (int64_t b = 0; b <= B; ++b)
            out.offsets[size_t(b)] = std::min(all_offsets_[size_t(me) * stride + size_t(b * EP)], buf_.budget);
        return out;
    }

    std::vector<T> send_rows(send_index_.size() * size_t(H)), send_probs(send_index_.size());
    for (size_t i = 0; i < send_index_.size(); ++i) {
        const int64_t r = send_index_[i];
        std::copy(permuted.row(r), permuted.row(r) + H, send_rows.begin() + int64_t(i) * H);
        send_probs[i] = routing_.permuted_probs[size_t(r)];
    }
    const std::vector<T> recv_rows = exchange(send_rows, H, input_splits_, output_splits_);
    const std::vector<T> recv_probs = exchange(send_probs, 1, input_splits_, output_splits_);
    DispatchedRows<T> out;
    out.rows = Matrix<T>(offsets.back(), H);
    out.rows.data = sort_chunks(recv_rows, H, recv_counts_, EP, B, false);
    out.probs = sort_chunks(recv_probs, 1, recv_counts_, EP, B, false);
    out.offsets = std::move(offsets);
    return out;
}

template <typename T>
Matrix<T> EchoDispatcher<T>::to_sources(const Matrix<T>& rows) {
    const int64_t B = dims_.experts_per_rank() + dims_.slots_per_rank;
    const std::vector<T> sorted = sort_chunks(rows.data, hidden_, recv_counts_, layout_.ep_size, B, true);
    const std::vector<T> back = exchange(sorted, hidden_, output_splits_, input_splits_);  // in send order
    Matrix<T> out(routing_.num_rows(), hidden_);
    for (size_t i = 0; i < send_index_.size(); ++i)
        std::copy(back.begin() + int64_t(i) * hidden_, back.begin() + int64_t(i + 1) * hidden_,
                  out.row(send_index_[i]));
    return out;
}

template <typename T>
Matrix<T> EchoDispatcher<T>::combine(const Matrix<T>& expert_out) {
    if (use_budget()) return unpermute(return_to_sources(expert_out, nullptr, nullptr), routing_);
    return unpermute(to_sources(expert_out), routing_);
}

template <typename T>
Matrix<T> EchoDispatcher<T>::combine_backward(const Matrix<T>& grad_output) {
    const Matrix<T> rows = unpermute_backward(grad_output, routing_);  // permutation-1 order
    if (use_budget()) {
        put_to_receivers(rows.data.data(), nullptr, nullptr);
        return held_matrix();
    }
    std::vector<T> send(send_index_.size() * size_t(hidden_));
    for (size_t i = 0; i < send_index_.size(); ++i)
        std::copy(rows.row(send_index_[i]), rows.row(send_index_[i]) + hidden_, send.begin() + int64_t(i) * hidden_);
    const std::vector<T> recv = exchange(send, hidden_, input_splits_, output_splits_);
    const int64_t B = dims_.experts_per_rank() + dims_.slots_per_rank;
    Matrix<T> out(int64_t(recv.size()) / std::max<int64_t>(1, hidden_), hidden_);
    out.data = sort_chunks(recv, hidden_, recv_counts_, layout_.ep_size, B, false);
    return out;
}

template <typename T>
void EchoDispatcher<T>::dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs,
                                          Matrix<T>& grad_tokens, Matrix<T>& grad_probs) {
    if (use_budget()) {
        MOEKIT_CHECK(int64_t(grad_row_probs.size()) == held_rows(), "grad_row_probs has ", grad_row_probs.size(),
                     " entries for ", held_rows(), " rows");
        std::vector<T> probs_back;
        grad_tokens = permute_backward(return_to_sources(grad_rows, &grad_row_probs, &probs_back), routing_);
        grad_probs = permute_probs_backward(probs_back, routing_);
        return;
    }
    grad_tokens = permute_backward(to_sources(grad_rows), routing_);
    const int64_t B = dims_.experts_per_rank() + dims_.slots_per_rank;
    const std::vector<T> sorted = sort_chunks(grad_row_probs, 1, recv_counts_, layout_.ep_size, B, true);
    const std::vector<T> back = exchange(sorted, 1, output_splits_, input_splits_);
    std::vector<T> permuted(back.size());
    for (size_t i = 0; i < send_index_.size(); ++i) permuted[size_t(send_index_[i])] = back[i];
    grad_probs = permute_probs_backward(permuted, routing_);
}

template <typename T>
std::vector<T> EchoDispatcher<T>::exchange(const std::vector<T>& send, int64_t width,
                                           const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
    return all_to_all_rows(ep_, send, width, send_rows, recv_rows);
}

template <typename T>
EchoDispatcher<T>::~EchoDispatcher() = default;

template <typename T>
void EchoDispatcher<T>::enable_budget(int64_t tokens, int64_t topk, int64_t hidden, double factor) {
    MOEKIT_REQUIRE(factor > 0 && std::isfinite(factor), "--moe-expert-rank-capacity-factor=", factor,
                   " must be > 0 and finite");
    MOEKIT_REQUIRE(tokens > 0, "the ECHO receive budget needs the tokens per rank (--seq-length * "
                   "--micro-batch-size), got ", tokens);
    budgeted_ = true;
    tokens_ = tokens, topk_ = topk, hidden_budget_ = hidden, factor_ = factor;
    buf_.create(ep_, layout_.ep_size, tokens, topk, hidden, factor, int64_t(sizeof(T)), 0);
}

template <typename T>
void EchoDispatcher<T>::put_to_receivers(const T* rows, const T* probs, const int64_t* sources) {
    const int64_t EP = layout_.ep_size, me = layout_.ep_rank, t = int64_t(sizeof(T)), H = hidden_;
    const size_t stride = size_t((dims_.experts_per_rank() + dims_.slots_per_rank) * EP + 1);
    buf_.recv_win->fence();
    for (int64_t i = 0; i < EP; ++i) {
        const int64_t p = (me + 1 + i) % EP;  // staggered peer order, as the budgeted dispatcher
        for (const Segment& g : segments_) {
            if (g.dest != p) continue;
            const int64_t dest = all_offsets_[size_t(p) * stride + size_t(g.bucket * EP + me)];
            const int64_t fit = rows_within_budget(dest, g.rows, buf_.budget);
            if (fit == 0) continue;
            buf_.recv_win->put(int(p), buf_.recv_rows_at + dest * H * t, rows + g.start * H, fit * H * t);
            if (probs) buf_.recv_win->put(int(p), buf_.recv_probs_at + dest * t, probs + g.start, fit * t);
            if (sources) buf_.recv_win->put(int(p), dest * 8, sources + g.start, fit * 8);
        }
    }
    buf_.recv_win->fence();
}

template <typename T>
Matrix<T> EchoDispatcher<T>::held_matrix() const {
    const int64_t n = held_rows();
    Matrix<T> out(n, hidden_);
    if (n > 0)
        std::memcpy(out.data.data(), reinterpret_cast<const char*>(buf_.recv_words.data()) + buf_.recv_rows_at,
                    size_t(n * hidden_) * sizeof(T));
    return out;
}

template <typename T>
Matrix<T> EchoDispatcher<T>::return_to_sources(const Matrix<T>& rows, const std::vector<T>* probs,
                                               std::vector<T>* probs_back) {
    const int64_t EP = layout_.ep_size, chunks = (dims_.experts_per_rank() + dims_.slots_per_rank) * EP;
    MOEKIT_CHECK(rows.rows == held_rows() && rows.cols == hidden_, "rows to return are [", rows.rows, ", ", rows.cols,
                 "], this rank holds [", held_rows(), ", ", hidden_, "]");
    return buf_.return_held_rows(rows, probs, probs_back, &all_offsets_[size_t(layout_.ep_rank) * size_t(chunks + 1)],
                                 chunks, int(EP), held_sources_, routing_.num_rows());
}

template <typename T>
BudgetOverflowReport EchoDispatcher<T>::end_step(Communicator& step_group) {
    BudgetOverflowReport r = gather_overflow_report(step_group, overflow_, peak_, buf_.budget, factor_, tokens_, topk_);
    if (r.overflow) ++overflow_events_;
    overflow_ = false, peak_ = 0, in_step_ = false;
    return r;
}

template <typename T>
EchoStepStats EchoDispatcher<T>::stats() const {
    EchoStepStats s;
    s.clones = plan_.num_clones;
    s.max_load_before = plan_.max_before();
    s.max_load_after = plan_.max_after();
    s.max_over_mean_before = plan_.max_over_mean_before();
    s.max_over_mean_after = plan_.max_over_mean_after();
    for (int64_t t : plan_.slot_tokens) s.rows_to_clones += t;
    return s;
}

template <typename T>
void EchoDispatcher<T>::sent_routing(std::vector<uint8_t>& map, Matrix<T>& probs) const {
    const int64_t cols = dims_.num_experts + dims_.num_slots(), T_ = routing_.num_tokens;
    map.assign(size_t(T_ * cols), 0);
    probs = Matrix<T>(T_, cols);
    for (size_t i = 0; i < send_index_.size(); ++i) {
        const int64_t r = send_index_[i], t = routing_.row_token[size_t(r)], c = send_column_[i];
        map[size_t(t * cols + c)] += 1;  // a second row of (t, c) would show as 2
        probs(t, c) = routing_.permuted_probs[size_t(r)];
    }
}

template class EchoDispatcher<float>;
template class EchoDispatcher<double>;

}  // namespace moekit::cpu
