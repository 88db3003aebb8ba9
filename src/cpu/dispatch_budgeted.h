// Budgeted (sync-free style) dispatcher, the CPU twin of issue 8's device dispatcher: the [EP, E]
// count matrix is all-gathered, every rank derives all receive offsets from it (src/core/dispatch_math.h),
// and senders put their rows, probs and source rows straight into the receivers' fixed-size buffers
// of budget = ceil(T*k*f) rows (one-sided Window of include/moekit/comm.h: MPI_Put + fences over MPI,
// peer pointers + barriers on virtual ranks). Overflow: nothing is written past a budget, the receiver
// sets its flag, end_step() all-reduces the flags, the caller re-runs the step on the alltoall path
// (src/cpu/budget_step.h). Tests: tests/budget_checks.h (MPI and virtual ranks), tests/cpu/test_dispatch_budgeted.cpp.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/dispatcher.h"
#include "cpu/permute.h"

namespace moekit::cpu {

// What the end-of-step all-reduce tells every rank.
struct BudgetOverflowReport {
    bool overflow = false;              // some rank would have received more rows than its budget
    int64_t budget_rows = 0;            // per rank (the same on every rank)
    int64_t peak_rows = 0;              // most rows any rank of the group would have received this step
    std::vector<int> overflowed_ranks;  // ranks (of the step group) whose flag was set
    double factor = 0;                  // the configured factor
    double sufficient_factor = 0;       // smallest factor (0.01 steps) whose budget holds peak_rows
    std::string message() const;        // one line for the log
};

// A rank's budgeted receive buffer and return buffer with their one-sided windows, the layout both budgeted
// dispatchers (this one and the ECHO one, src/cpu/dispatch_echo.h) put into. Receive: [source row int64 x
// budget][rows x budget*H][probs x budget]; return: [rows x T*k*H][probs x T*k]; int64 words keep every region
// aligned. budget = ceil(T*k*min(f, EP)) aligned (a rank never receives more than EP*T*k rows, so a larger
// factor buys nothing; the factor reported stays the configured one).
struct BudgetBuffers {
    int64_t budget = 0, return_rows = 0;
    int64_t recv_rows_at = 0, recv_probs_at = 0, ret_probs_at = 0;  // byte offsets of the regions
    std::vector<int64_t> recv_words, ret_words;
    std::unique_ptr<Window> recv_win, ret_win;

    // Collective over `ep` (creates the windows); elem_bytes = sizeof(T). The receive buffer's slack holds
    // `slack_byte` until a row lands there.
    void create(Communicator& ep, int ep_size, int64_t tokens, int64_t topk, int64_t hidden, double factor,
                int64_t elem_bytes, unsigned char slack_byte);

    // Collective: the held rows [held, H] (and their probs) back to their sources' permutation-1 positions by
    // one put per chunk. offsets [chunks + 1]: this rank's chunk offsets (chunk c comes from source c % ep_size,
    // unclipped); sources [held]: each held row's row at its source. Returns the [N, H] rows that came back
    // here (rows over a budget come back as zeros: the re-run replaces the step), their probs in probs_back.
    template <typename T>
    Matrix<T> return_held_rows(const Matrix<T>& rows, const std::vector<T>* probs, std::vector<T>* probs_back,
                          const int64_t* offsets, int64_t chunks, int ep_size, const std::vector<int64_t>& sources,
                          int64_t N);
};

// The end-of-step verdict of a budgeted dispatcher, collective over `step_group`: one all-reduce (max) of
// each rank's peak if it overflowed and of the peak itself. Shared by the budgeted and ECHO dispatchers.
BudgetOverflowReport gather_overflow_report(Communicator& step_group, bool overflowed, int64_t peak, int64_t budget_rows,
                                            double factor, int64_t tokens, int64_t topk);

// The step protocol of a dispatcher with a receive budget (this one, and the ECHO dispatcher with
// --moe-expert-rank-capacity-factor, src/cpu/dispatch_echo.h), driven by run_budgeted_step (budget_step.h).
class BudgetStep {
public:
    virtual ~BudgetStep() = default;
    virtual bool has_budget() const { return true; }
    virtual void begin_step() = 0;
    virtual BudgetOverflowReport end_step(Communicator& step_group) = 0;
    virtual void set_synchronous(bool on) = 0;
    virtual int64_t overflow_events() const = 0;
};

template <typename T>
class BudgetedDispatcher final : public Dispatcher<T>, public BudgetStep {
public:
    // Bytes the receive buffer's slack holds until a row lands there (tests check it is untouched).
    static constexpr unsigned char kSlackByte = 0xFF;

    // Collective over `ep` (creates the windows). tokens = T rows per rank (seq_length * micro_batch_size),
    // topk = k, hidden = H, factor = f > 0: budget = ceil(T*k*f) rows aligned to kBudgetRowAlign.
    BudgetedDispatcher(const EpLayout& layout, Communicator& ep, int64_t tokens, int64_t topk, int64_t hidden,
                       double factor);
    ~BudgetedDispatcher() override;

    const EpLayout& layout() const override { return layout_; }
    DispatchedRows<T> dispatch(const Matrix<T>& tokens, const Matrix<T>& probs,
                               const std::vector<uint8_t>& routing_map) override;
    Matrix<T> combine(const Matrix<T>& expert_out) override;
    Matrix<T> combine_backward(const Matrix<T>& grad_output) override;
    void dispatch_backward(const Matrix<T>& grad_rows, const std::vector<T>& grad_row_probs, Matrix<T>& grad_tokens,
                           Matrix<T>& grad_probs) override;

    // Opens a step: dispatch() refuses to run outside one, so no caller can use the budget without
    // the end-of-step overflow check (an overflow would otherwise go unnoticed: a silent drop).
    void begin_step() override { in_step_ = true; }
    // End of step, collective over `step_group` (every rank that shares the step's collectives): one
    // all-reduce (max) of each rank's overflow flag and peak; clears the flags; counts an overflow.
    BudgetOverflowReport end_step(Communicator& step_group) override;
    // While on, the four calls run the synchronous alltoall dispatcher (the re-run after an overflow).
    void set_synchronous(bool on) override { synchronous_ = on; }
    bool synchronous() const { return synchronous_; }
    int64_t overflow_events() const override { return overflow_events_; }

    // ---- inspection (tests) ----
    int64_t budget_rows() const { return buf_.budget; }
    double factor() const { return factor_; }
    bool overflowed() const { return overflow_; }        // this rank's flag since the last end_step
    int64_t received_rows() const { return received_; }  // rows that were due here in the last dispatch
    const std::vector<int64_t>& count_matrix() const { return counts_; }  // [EP, E] of the last dispatch
    const std::vector<int64_t>& chunk_offsets() const { return my_offsets_; }  // [L*EP + 1], chunk l*EP + s
    // The receive buffer as the last dispatch left it: rows [budget, H], probs [budget], source rows
    // [budget] (the sender's permutation-1 row of each row); rows past received_rows() untouched.
    const T* buffer_rows() const;
    const T* buffer_probs() const;
    const int64_t* buffer_sources() const;

private:
    // Puts permutation-1 rows [N, H] (and probs and source rows when given) into the receivers'
    // buffers at the offsets of the scan, clipped at the budget; between two fences.
    void put_to_receivers(const T* rows, const T* probs, const int64_t* sources);
    // Puts this rank's received rows (and probs) back to their sources' return buffers; returns them
    // there [N, H] (rows that never arrived anywhere: zeros).
    Matrix<T> return_to_sources(const Matrix<T>& rows, const std::vector<T>* probs, std::vector<T>* probs_back);
    int64_t held_rows() const { return received_ < buf_.budget ? received_ : buf_.budget; }

    EpLayout layout_;
    Communicator& ep_;
    int64_t tokens_, topk_, hidden_;
    double factor_;
    std::unique_ptr<Dispatcher<T>> fallback_;  // the synchronous alltoall path
    bool synchronous_ = false;
    bool in_step_ = false;

    BudgetBuffers buf_;

    RoutingPlan<T> plan_;                 // permutation 1 of this rank's tokens
    std::vector<int64_t> row_ids_;        // [N] 0..N-1: the source rows sent along with the rows
    std::vector<int64_t> counts_;         // [EP, E]
    std::vector<int64_t> all_offsets_;    // [EP][L*EP + 1] every receiver's chunk offsets
    std::vector<int64_t> my_offsets_;     // [L*EP + 1] this rank's
    std::vector<int64_t> held_sources_;   // [held_rows] source rows of what this rank holds
    int64_t received_ = 0;
    bool overflow_ = false;
    int64_t peak_ = 0;
    int64_t overflow_events_ = 0;
};

}  // namespace moekit::cpu
