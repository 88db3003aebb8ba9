// run_budgeted_step: one step (forward + backward) of a MoePipeline whose dispatcher may be the
// budgeted one (src/cpu/dispatch_budgeted.h), with megatron-moe.md §4.6's recovery: after the step
// one small all-reduce tells every rank whether any rank overflowed its receive budget; if so the
// event is logged with the factor that would have sufficed, the router state is restored, and the
// step is re-run through the synchronous alltoall path, so the results equal the dropless run.
// Used by tools/layer_ep.cpp and the EP tests (tests/budget_checks.h).
#pragma once
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "cpu/dispatch_budgeted.h"
#include "cpu/moe_pipeline.h"

namespace moekit::cpu {

// `step` runs the whole forward + backward from scratch (it must reset what it accumulates, e.g.
// zero the grads first). `step_group`: every rank that shares the step's collectives (the world), so
// that all of them agree to re-run. Returns the end-of-step report (overflow = false without a budget).
// For a stack of layers run as one step (moekit train's micro-batch: every layer forward, the loss, every
// layer backward) an overflow in any layer re-runs the whole step with every layer synchronous. The
// end-of-step collectives run layer by layer in the same order on every rank. Returns the merged report
// (overflow if any layer overflowed; the largest peak).
template <typename T>
BudgetOverflowReport run_budgeted_step(const std::vector<MoePipeline<T>*>& layers, Communicator& step_group,
                                       const std::function<void()>& step) {
    std::vector<BudgetStep*> budgeted;
    std::vector<RouterState> before;
    for (MoePipeline<T>* l : layers) {
        auto* b = dynamic_cast<BudgetStep*>(&l->dispatcher());
        budgeted.push_back(b && b->has_budget() ? b : nullptr);
        before.push_back(l->router_state());
    }
    const auto end_all = [&] {  // the report of the layer that overflowed with the largest peak (or peaked)
        BudgetOverflowReport merged;
        bool any = false;
        for (BudgetStep* b : budgeted) {
            if (!b) continue;
            BudgetOverflowReport r = b->end_step(step_group);
            if (!any || (r.overflow && !merged.overflow) ||
                (r.overflow == merged.overflow && r.peak_rows > merged.peak_rows))
                merged = std::move(r);
            any = true;
        }
        return merged;
    };
    const auto set_all = [&](bool synchronous) {
        for (BudgetStep* b : budgeted)
            if (b) b->set_synchronous(synchronous), b->begin_step();
    };
    set_all(false);
    step();
    BudgetOverflowReport report = end_all();
    if (!report.overflow) return report;
    if (step_group.rank() == 0) std::fprintf(stderr, "moekit: %s\n", report.message().c_str());
    for (size_t l = 0; l < layers.size(); ++l) layers[l]->router_state() = before[l];
    set_all(true);
    try {
        step();
    } catch (...) {
        for (BudgetStep* b : budgeted)
            if (b) b->set_synchronous(false);
        throw;
    }
    (void)end_all();
    for (BudgetStep* b : budgeted)
        if (b) b->set_synchronous(false);
    return report;
}

// One layer: the stack of one.
template <typename T>
BudgetOverflowReport run_budgeted_step(MoePipeline<T>& layer, Communicator& step_group,
                                       const std::function<void()>& step) {
    return run_budgeted_step<T>(std::vector<MoePipeline<T>*>{&layer}, step_group, step);
}

}  // namespace moekit::cpu
