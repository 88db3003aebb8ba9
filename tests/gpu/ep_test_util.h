// Helpers of the GPU expert-parallel tests (tests/gpu/test_cuda_ep.cu, test_cuda_echo.cu): where a case's
// ranks run, bitwise comparison with a readable first difference, and a zipf-skewed router.
#pragma once
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gpu/cuda_layer_test_util.h"
#include "moekit/comm.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::test {

// The ranks a case runs on: `ranks` virtual ranks on this GPU, or, when the binary was started by mpirun with
// that many processes, the MPI world (one GPU each, the NCCL transport): the same checks on real ranks
// (scripts/device_ep_multi.sh). Under mpirun with another size the case is skipped.
inline bool on_ranks(int ranks, const std::function<void(Communicator&)>& fn) {
    if (comm::mpi_launched()) {
        Communicator& world = comm::mpi_world();
        if (world.size() != ranks) return false;
        fn(world);
        return true;
    }
    comm::run_virtual_ranks(ranks, fn);
    return true;
}

// "" when equal bit for bit, else where they first differ, by how much, and how many entries differ.
inline std::string first_difference(const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
    size_t first = a.size(), n = 0;
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            if (first == a.size()) first = i;
            ++n, worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
        }
    if (n == 0) return "";
    return "first at " + std::to_string(first) + " (" + std::to_string(a[first]) + " vs " + std::to_string(b[first]) +
           "), " + std::to_string(n) + " of " + std::to_string(a.size()) + " differ, max |diff| " + std::to_string(worst);
}

// Zipf-like expert popularity through one constant input feature (as `moekit bench --skew`): feature 0 of
// every token is 1 and expert e's router weight on it is -strength * s * log(e + 1), rounded to bf16.
inline void zipf_skew(MoeWeights<float>& w, LayerInput<float>& in, double s, double strength) {
    for (int64_t e = 0; e < w.router_weight.rows; ++e)
        w.router_weight(e, 0) = round_to_bf16(float(-strength * s * std::log(double(e + 1))));
    for (int64_t t = 0; t < in.hidden.rows; ++t) in.hidden(t, 0) = 1.0f;
}

}  // namespace moekit::test
