// FlatLayout (src/train/flat_layout.h), the CUDA training engines' flat parameter layout, on the CPU: offsets are
// aligned and disjoint with the replicated tensors first; flatten/unflatten round-trip every tensor; Adam's slots
// come in the host optimizer's for_each_parameter order; each EP rank's layout holds exactly its experts, and the
// ranks' expert parts gather into the global buffer and scatter back (what checkpoints across layouts rely on).
// Random weights: Megatron's init with the printed seeds.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "moekit/weights.h"
#include "train/adam.h"
#include "train/flat_layout.h"
#include "train/train_task.h"

namespace moekit::train {
namespace {

MoeConfig layout_config() {
    MoeConfig c;
    c.hidden_size = 12, c.num_moe_experts = 8, c.moe_ffn_hidden_size = 6, c.moe_router_topk = 2;
    c.gated_linear_unit = true, c.activation_func = "silu";
    c.moe_shared_expert_intermediate_size = 10, c.moe_shared_expert_gate = true;
    c.num_layers = 3, c.seq_length = 4, c.micro_batch_size = 1;
    c.normalize();
    c.validate();
    return c;
}

std::vector<MoeWeights<float>> random_stack(const MoeConfig& c, uint64_t seed) {
    std::printf("weights: Megatron init, seed %llu\n", (unsigned long long)seed);
    std::vector<MoeWeights<float>> ws;
    for (int64_t l = 0; l < c.num_layers; ++l) ws.push_back(init_weights<float>(c, seed * 100 + uint64_t(l)));
    return ws;
}

void expect_same_tensors(const MoeWeights<float>& a, const MoeWeights<float>& b, int64_t l) {
    EXPECT_EQ(a.router_weight.data, b.router_weight.data) << "layer " << l;
    EXPECT_EQ(a.shared_fc1.data, b.shared_fc1.data) << "layer " << l;
    EXPECT_EQ(a.shared_fc2.data, b.shared_fc2.data) << "layer " << l;
    EXPECT_EQ(a.shared_gate.data, b.shared_gate.data) << "layer " << l;
    for (size_t e = 0; e < a.fc1.size(); ++e) {
        EXPECT_EQ(a.fc1[e].data, b.fc1[e].data) << "layer " << l << " expert " << e;
        EXPECT_EQ(a.fc2[e].data, b.fc2[e].data) << "layer " << l << " expert " << e;
    }
}

TEST(FlatLayout, SlotsAreAlignedDisjointReplicatedFirst) {
    const MoeConfig c = layout_config();
    for (const int64_t n : {8, 4, 2}) {
        const FlatLayout f(c, 8 - n, n);
        std::vector<std::pair<int64_t, int64_t>> ranges;
        for (int64_t l = 0; l < c.num_layers; ++l)
            for (int t = 0; t < FlatLayout::kNumTensors; ++t) {
                const FlatLayout::Slot& s = f.slot(l, FlatLayout::Tensor(t));
                EXPECT_EQ(s.offset % FlatLayout::kAlign, 0) << "layer " << l << " tensor " << t;
                const bool expert = t == FlatLayout::kFc1 || t == FlatLayout::kFc2;
                if (expert) EXPECT_GE(s.offset, f.dense_total()) << "layer " << l << " tensor " << t;
                if (!expert) EXPECT_LE(s.offset + s.numel, f.dense_total()) << "layer " << l << " tensor " << t;
                if (s.numel) ranges.emplace_back(s.offset, s.offset + s.numel);
            }
        std::sort(ranges.begin(), ranges.end());
        for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "n=" << n;
        EXPECT_LE(ranges.back().second, f.total());
        EXPECT_EQ(f.total() % 4, 0);  // Adam's float4 kernel
        EXPECT_EQ(f.slot(0, FlatLayout::kFc1).numel, n * c.fc1_rows() * c.hidden_size);
        const LayerParams p = f.params(reinterpret_cast<void*>(uintptr_t(1) << 20), 1, 0);
        EXPECT_EQ(p.fc1.shape[0], n);
        EXPECT_EQ(p.fc2.shape[0], n);
        const LayerGrads g = f.grads(reinterpret_cast<float*>(uintptr_t(1) << 20), 1, 0);
        EXPECT_EQ(static_cast<char*>(g.fc2.data) - static_cast<char*>(g.router_weight.data),
                  (f.slot(1, FlatLayout::kFc2).offset - f.slot(1, FlatLayout::kRouter).offset) * 4);
    }
}

TEST(FlatLayout, FlattenUnflattenAndAdamSlotsInTheHostOrder) {
    const MoeConfig c = layout_config();
    const std::vector<MoeWeights<float>> w = random_stack(c, 71);
    const FlatLayout f(c, 0, c.num_experts());
    const std::vector<float> flat = f.flatten(w);
    for (int64_t l = 0; l < c.num_layers; ++l) {
        MoeWeights<float> back = zero_weights(c);
        f.unflatten(flat, l, back);
        expect_same_tensors(back, w[size_t(l)], l);
    }
    // Moments equal to the weights: the state's slots must list the tensors as for_each_parameter visits them.
    TrainState s;
    f.moments_to_state(flat, flat, s);
    std::vector<std::vector<float>> want;
    for (MoeWeights<float> x : w)
        for_each_parameter(x, x, [&](float* p, const float*, size_t n) { want.emplace_back(p, p + n); });
    EXPECT_EQ(s.adam_m, want);
    EXPECT_EQ(s.adam_v, want);
    std::vector<float> m, v;
    f.moments_from_state(s, m, v);
    EXPECT_EQ(m, flat);
    EXPECT_EQ(v, flat);
}

TEST(FlatLayout, EpRanksHoldTheirExpertsAndGatherToTheGlobalBuffer) {
    const MoeConfig c = layout_config();
    const std::vector<MoeWeights<float>> w = random_stack(c, 72);
    const FlatLayout global(c, 0, c.num_experts());
    const std::vector<float> all = global.flatten(w);
    for (const int64_t ep : {2, 4, 8}) {
        const int64_t L = c.num_experts() / ep;
        std::vector<float> parts;
        std::vector<float> rank0;
        for (int64_t r = 0; r < ep; ++r) {
            const FlatLayout local(c, r * L, L);
            const std::vector<float> mine = to_local(global, local, all);
            EXPECT_EQ(mine, local.flatten(w)) << "EP=" << ep << " rank " << r;
            MoeWeights<float> back = zero_weights(c);
            local.unflatten(mine, 1, back);
            for (int64_t e = 0; e < c.num_experts(); ++e) {
                const bool held = e >= r * L && e < (r + 1) * L;
                EXPECT_EQ(back.fc1[size_t(e)].data == w[1].fc1[size_t(e)].data, held) << "EP=" << ep << " rank " << r
                                                                                      << " expert " << e;
            }
            parts.insert(parts.end(), mine.begin() + local.dense_total(), mine.end());
            if (r == 0) rank0 = mine;
        }
        EXPECT_EQ(to_global(global, FlatLayout(c, 0, L), rank0, parts), all) << "EP=" << ep;
    }
}

}  // namespace
}  // namespace moekit::train
