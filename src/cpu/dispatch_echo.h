// ECHO dispatcher (issue 9, MoE Echo megatron-moe.md §7), CPU reference: the alltoall dispatcher with
// spare expert slots. After the [EP, E] counts are all-gathered every rank runs the planner
// (src/echo/planner.h; identical plan everywhere), and the all-to-all sends the planned share of each
// source rank's tokens of a cloned expert to the clone's slot instead of home (which tokens: the rule of
// src/core/echo_dispatch_math.h). A rank's experts are L + S buckets: its L home experts, then its S
// slots; rows inside a bucket by source rank, then token. Combine returns every row to its position of
// permutation 1, so a token's rows are summed by original expert exactly as without ECHO. Clone
// weights and gradients: src/cpu/echo_experts.h. Tests: tests/cpu/test_echo_dispatch.cpp,
// tests/cpu/test_echo_virtual.cpp, tests/mpi/test_echo_mpi.cpp (all via tests/echo_checks.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/dispatch_budgeted.h"
#include "cpu/dispatcher.h"
#include "cpu/permute.h"
#include "echo/planner.h"

namespace moekit::cpu {

// What one step's plan did (for logs and the train report).
struct EchoStepStats {
    int64_t clones = 0;                   // slots in use
    int64_t max_load_before = 0, max_load_after = 0;  // rows of the busiest rank
    double max_over_mean_before = 1, max_over_mean_after = 1;
    int64_t rows_to_clones = 0;           // rows the plan sent to slots (all ranks)
    // "clones=2 rank load max/mean 1.50 -> 1.03 (max 24 -> 17 rows), 9 rows to clones"
    std::string to_string() const;
};

// With --moe-expert-rank-capacity-factor (enable_budget), the rows, probs and source rows go by one-sided
// puts into fixed receive buffers of ceil(T*k*f) rows laid out [bucket][source] (echo_recv_chunk_offsets),
// clipped at the budget, as the budgeted dispatcher does (src/cpu/dispatch_budgeted.h); an overflow is
// re-run through the all-to-all path above (run_budgeted_step, src/cpu/budget_step.h).
template <typename T>
class EchoDispatcher final : public Dispatcher<T>, public BudgetStep {
public:
    // slots_per_rank = S (--moe-num-echo-experts / EP).
    EchoDispatcher(const EpLayout& layout, Communicator& ep, int64_t slots_per_rank, EchoAlgorithm algorithm,
                   int64_t group_floor_rows = 0);
    ~EchoDispatcher() override;
    // Collective over EP (creates the windows): tokens = T per rank, topk = k, hidden = H, factor = f > 0.
    void enable_budget(int64_t tokens, int64_t topk, int64_t hidden, double factor);
    bool has_budget() const override { return budgeted_; }
    void begin_step() override { in_step_ = true; }
    BudgetOverflowReport end_step(Communicator& step_group) override;
    void set_synchronous(bool on) override { synchronous_ = on; }
    int64_t overflow_events() const override { return overflow_events_; }
    int64_t budget_rows() const { return buf_.budget; }
    int64_t received_rows() const { return received_; }  // rows due here in the last dispatch (with the plan)

    const EpLayout& layout() const override { return layout_; }
    // offsets of the result have L + S + 1 entries: home experts, then the slots (an empty slot has no rows).
    DispatchedRows<T> dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                               const std::vector<uint8_t>& routing_map) override;
    Matrix<T> combine(const Matrix<T>& expert_out) override;
    Matrix<T> combine_backward(const Matrix<T>& grad_output) override;
    void dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs, Matrix<T>& grad_tokens,
                           Matrix<T>& grad_probs) override;

    // Test hook: every later step draws a forced random plan (echo::random_plan) from `seed`.
    void force_random_plans(uint64_t seed) { forced_ = true, forced_seed_ = seed; }

    const EchoDims& dims() const { return dims_; }
    const echo::EchoPlan& plan() const { return plan_; }       // the last step's (identical on every rank)
    const std::vector<int64_t>& counts() const { return counts_; }  // [EP, E] all-gathered counts
    EchoStepStats stats() const;
    // This rank's routing as sent, over E + EP*S columns (column E + j = slot j): map [T, E + EP*S] and
    // probs [T, E + EP*S]. Folding column E + j into expert slot_expert[j] gives back the router's map
    // and probs (tests/echo_checks.h checks it).
    void sent_routing(std::vector<uint8_t>& map, Matrix<T>& probs) const;

private:
    Matrix<T> to_sources(const Matrix<T>& rows);  // bucket-major rows -> permutation-1 order here
    bool use_budget() const { return budgeted_ && !synchronous_; }
    // Budget mode: puts permutation-1 rows (and probs, source rows) into the receivers' buffers; returns
    // rows (and prob grads) to their sources' permutation-1 positions (rows over a budget: zeros).
    void put_to_receivers(const T* rows, const T* probs, const int64_t* sources);
    Matrix<T> return_to_sources(const Matrix<T>& rows, const std::vector<T>* probs, std::vector<T>* probs_back);
    Matrix<T> held_matrix() const;  // the held rows of the receive buffer
    int64_t held_rows() const { return received_ < buf_.budget ? received_ : buf_.budget; }
    std::vector<T> exchange(const std::vector<T>& send, int64_t width, const std::vector<int64_t>& send_rows,
                            const std::vector<int64_t>& recv_rows);

    EpLayout layout_;
    Communicator& ep_;
    EchoDims dims_;
    EchoAlgorithm algorithm_;
    bool forced_ = false;
    uint64_t forced_seed_ = 0;
    RoutingPlan<T> routing_;              // permutation 1 over [T, E]
    std::vector<int64_t> counts_;         // [EP, E]
    echo::EchoPlan plan_;
    std::vector<int64_t> send_index_;     // [N] permutation-1 row of each sent row, in send order
    std::vector<int64_t> send_column_;    // [N] column (expert e, or E + slot) of each sent row
    std::vector<int64_t> input_splits_;   // [EP] rows sent to each rank
    std::vector<int64_t> output_splits_;  // [EP] rows received from each rank
    std::vector<int64_t> recv_counts_;    // [EP src, L + S] rows received per (source, bucket)
    int64_t hidden_ = 0;

    // Budget mode (see the class comment); the buffers as in BudgetedDispatcher.
    bool budgeted_ = false, synchronous_ = false, in_step_ = false, overflow_ = false;
    int64_t tokens_ = 0, topk_ = 0, hidden_budget_ = 0, received_ = 0, peak_ = 0, overflow_events_ = 0;
    double factor_ = 0;
    BudgetBuffers buf_;  // receive/return buffers and windows (src/cpu/dispatch_budgeted.h)
    std::vector<int64_t> all_offsets_;   // [EP][(L + S) * EP + 1] every receiver's chunk offsets
    std::vector<int64_t> held_sources_;  // [held_rows] the sender's permutation-1 row of each held row
    struct Segment {
        int64_t dest, bucket, start, rows;  // rows [start, start + rows) of permutation 1 go to (dest, bucket)
    };
    std::vector<Segment> segments_;      // this rank's sends, in send order
};

}  // namespace moekit::cpu
