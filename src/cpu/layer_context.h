// cpu::LayerContext<T>: the state behind cpu::MoeLayer<T> (include/moekit/layer.h), the
// single-process layer: a one-rank group and the pipeline on it (EP = 1, no communication).
// Owned by src/cpu/layer.cpp; the pipeline's saved tensors are in src/cpu/moe_pipeline.h.
#pragma once
#include <memory>

#include "cpu/moe_pipeline.h"
#include "moekit/comm.h"

namespace moekit::cpu {

template <typename T>
struct LayerContext {
    std::unique_ptr<Communicator> single_rank;  // a local group of one rank
    std::unique_ptr<ProcessGroups> groups;      // EP = expert_dp = dp = that rank
    std::unique_ptr<MoePipeline<T>> pipeline;
};

}  // namespace moekit::cpu
