// make_dispatcher: --moe-token-dispatcher-type -> the CPU dispatcher over an EP group, and the
// EpLayout of that group (Megatron's contiguous expert blocks). Interface: src/cpu/dispatcher.h.
#include "cpu/dispatcher.h"

#include "cpu/dispatch_budgeted.h"
#include "cpu/dispatch_echo.h"

#include "moekit/error.h"

namespace moekit::cpu {

std::string EpLayout::to_string() const {
    return str("EP rank ", ep_rank, " of ", ep_size, ": experts [", first_local_expert(), ", ",
               first_local_expert() + num_local_experts, ") of ", num_experts);
}

template <typename T>
std::unique_ptr<Dispatcher<T>> make_dispatcher(const std::string& type, int64_t num_experts, Communicator& ep) {
    MOEKIT_REQUIRE(num_experts % ep.size() == 0, "--num-experts=", num_experts,
                   " must be divisible by --expert-model-parallel-size=", ep.size());
    EpLayout layout;
    layout.num_experts = num_experts;
    layout.ep_size = ep.size();
    layout.ep_rank = ep.rank();
    layout.num_local_experts = num_experts / ep.size();
    if (type == "allgather") return make_allgather_dispatcher<T>(layout, ep);
    if (type == "alltoall") return make_alltoall_dispatcher<T>(layout, ep);
    throw UsageError(str("--moe-token-dispatcher-type=", type, " must be allgather or alltoall"));
}

template <typename T>
std::unique_ptr<Dispatcher<T>> make_dispatcher(const MoeConfig& config, Communicator& ep) {
    const std::string& type = config.moe_token_dispatcher_type;
    if (config.moe_enable_echo) {  // the alltoall dispatcher with spare slots (config.cpp refuses the rest)
        MOEKIT_REQUIRE(type == "alltoall" || (type == "flex" && config.moe_expert_rank_capacity_factor),
                       "--moe-enable-echo requires --moe-token-dispatcher-type=alltoall (or flex with "
                       "--moe-expert-rank-capacity-factor), got ", type);
        const EpLayout layout = make_dispatcher<T>("alltoall", config.num_experts(), ep)->layout();
        auto echo = std::make_unique<EchoDispatcher<T>>(layout, ep, config.moe_num_echo_experts.value_or(0) / ep.size(),
                                                        echo::parse_algorithm(config.moe_echo_algorithm),
                                                        config.moe_echo_group_floor_rows);
        // EP = 1 moves no token: nothing to budget (as without ECHO).
        if (config.moe_expert_rank_capacity_factor && ep.size() > 1)
            echo->enable_budget(config.seq_length * config.micro_batch_size, config.moe_router_topk,
                                config.hidden_size, *config.moe_expert_rank_capacity_factor);
        return echo;
    }
    if (!config.moe_expert_rank_capacity_factor) return make_dispatcher<T>(type, config.num_experts(), ep);
    MOEKIT_REQUIRE(type == "alltoall" || type == "flex", "--moe-expert-rank-capacity-factor requires "
                   "--moe-token-dispatcher-type=alltoall or flex (got ", type, ")");
    // EP = 1 moves no token: nothing to budget, the alltoall dispatcher is plain permute/unpermute.
    std::unique_ptr<Dispatcher<T>> plain = make_dispatcher<T>("alltoall", config.num_experts(), ep);
    if (ep.size() == 1) return plain;
    return std::make_unique<BudgetedDispatcher<T>>(plain->layout(), ep, config.seq_length * config.micro_batch_size,
                                                   config.moe_router_topk, config.hidden_size,
                                                   *config.moe_expert_rank_capacity_factor);
}

template std::unique_ptr<Dispatcher<float>> make_dispatcher<float>(const MoeConfig&, Communicator&);
template std::unique_ptr<Dispatcher<double>> make_dispatcher<double>(const MoeConfig&, Communicator&);
template std::unique_ptr<Dispatcher<float>> make_dispatcher<float>(const std::string&, int64_t, Communicator&);
template std::unique_ptr<Dispatcher<double>> make_dispatcher<double>(const std::string&, int64_t, Communicator&);

}  // namespace moekit::cpu
