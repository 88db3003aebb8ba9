// make_dispatcher: --moe-token-dispatcher-type -> the CPU dispatcher over an EP group, and the
// EpLayout of that group (Megatron's contiguous expert blocks). Interface: src/cpu/dispatcher.h.
#include "cpu/dispatcher.h"

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

template std::unique_ptr<Dispatcher<float>> make_dispatcher<float>(const std::string&, int64_t, Communicator&);
template std::unique_ptr<Dispatcher<double>> make_dispatcher<double>(const std::string&, int64_t, Communicator&);

}  // namespace moekit::cpu
