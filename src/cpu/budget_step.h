// run_budgeted_step: one step (forward + backward) of a MoePipeline whose dispatcher may be the
// budgeted one (src/cpu/dispatch_budgeted.h), with megatron-moe.md §4.6's recovery: after the step
// one small all-reduce tells every rank whether any rank overflowed its receive budget; if so the
// event is logged with the factor that would have sufficed, the router state is restored, and the
// step is re-run through the synchronous alltoall path, so the results equal the dropless run.
// Used by tools/layer_ep.cpp and the EP tests (tests/budget_checks.h).
#pragma once
#include <cstdio>
#include <functional>

#include "cpu/dispatch_budgeted.h"
#include "cpu/moe_pipeline.h"

namespace moekit::cpu {

// `step` runs the whole forward + backward from scratch (it must reset what it accumulates, e.g.
// zero the grads first). `step_group`: every rank that shares the step's collectives (the world), so
// that all of them agree to re-run. Returns the end-of-step report (overflow = false without a budget).
template <typename T>
BudgetOverflowReport run_budgeted_step(MoePipeline<T>& layer, Communicator& step_group,
                                       const std::function<void()>& step) {
    auto* budgeted = dynamic_cast<BudgetStep*>(&layer.dispatcher());
    const RouterState before = layer.router_state();
    if (!budgeted || !budgeted->has_budget()) {
        step();
        return {};
    }
    budgeted->begin_step();
    step();
    BudgetOverflowReport report = budgeted->end_step(step_group);
    if (!report.overflow) return report;
    if (step_group.rank() == 0) std::fprintf(stderr, "moekit: %s\n", report.message().c_str());
    layer.router_state() = before;  // the first attempt's expert-bias and global-aux counts are undone
    budgeted->set_synchronous(true);
    budgeted->begin_step();
    try {
        step();
    } catch (...) {
        budgeted->set_synchronous(false);
        throw;
    }
    budgeted->set_synchronous(false);
    (void)budgeted->end_step(step_group);  // the synchronous path never overflows; keeps the collectives paired
    return report;
}

}  // namespace moekit::cpu
