// require_fits_in_host_memory (see host_memory.h): MoeConfig's estimate against sysconf's physical pages.
#include "core/host_memory.h"

#include <unistd.h>

#include "core/checked_math.h"
#include "moekit/error.h"

namespace moekit {

int64_t host_memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return 0;
    return checked_mul(pages, page).value_or(INT64_MAX);
}

void require_fits_in_host_memory(const MoeConfig& config, int64_t tokens, int64_t copies, int64_t bytes_per_value) {
    const int64_t have = host_memory_bytes();
    if (have <= 0) return;  // unknown: the static bound of validate() still holds
    const auto per_layer = config.memory_estimate_bytes(tokens);
    const auto need = checked_product({per_layer, copies, bytes_per_value / 4 > 0 ? bytes_per_value / 4 : 1});
    if (need && *need <= have) return;
    const int64_t gib = int64_t(1) << 30;
    throw UsageError(str("the layer (--num-experts=", config.num_experts(), ", --hidden-size=", config.hidden_size,
                         ", expert FFN size ", config.expert_ffn(),
                         tokens > 0 ? str(", ", tokens, " tokens") : std::string(), copies > 1 ? str(", x", copies) : "",
                         ") needs at least ", need ? str(*need / gib, " GiB") : std::string("more than 2^63 bytes"),
                         " but this host has ", have / gib, " GiB of memory"));
}

}  // namespace moekit
