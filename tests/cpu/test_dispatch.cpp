// The dispatcher stage alone (src/cpu/dispatch_allgather.cpp, dispatch_alltoall.cpp) on 1-4 virtual
// ranks, data movement checked exactly: every routed (token, expert) pair reaches its expert's owner
// exactly once, in Megatron's order (local expert, then source rank, then token), with its prob; combine
// sums a token's rows; and each backward is the adjoint of its forward (<f(x), y> = <x, f^T(y)>).
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/dispatcher.h"
#include "layer_test_util.h"
#include "moekit/error.h"

namespace moekit {
namespace {

using cpu::DispatchedRows;
using cpu::Dispatcher;

struct Routing {
    Matrix<double> tokens, probs;  // [T, H], [T, E]
    std::vector<uint8_t> map;      // [T, E]
};

// Rank r's tokens: hidden[t][0] = global token id (r*T + t), the rest random; a random top-k map
// (some tokens with no expert, as after dropping), probs random on the map.
Routing make_routing(int rank, int64_t T, int64_t H, int64_t E, int64_t k, uint64_t seed) {
    Routing x;
    x.tokens = test::random_matrix<double>(T, H, seed, 10 + uint64_t(rank));
    for (int64_t t = 0; t < T; ++t) x.tokens(t, 0) = double(rank * T + t);
    x.map = test::random_topk_map(T, E, k, seed * 31 + uint64_t(rank));
    for (int64_t t = 0; t < T; t += 5) std::fill_n(x.map.begin() + t * E, E, uint8_t(0));  // dropped tokens
    x.probs = Matrix<double>(T, E);
    for (int64_t i = 0; i < T * E; ++i)
        if (x.map[size_t(i)]) x.probs.data[size_t(i)] = 0.1 + uniform01(seed, 20 + uint64_t(rank), uint64_t(i));
    return x;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

class Dispatch : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Dispatch, EveryPairOnceInOrderAndBackwardIsTheAdjoint) {
    const auto [type, ranks] = GetParam();
    const int64_t T = 11, H = 5, E = 2 * ranks, k = 2;
    const uint64_t seed = 4242 + uint64_t(ranks);
    std::vector<std::string> failures(static_cast<size_t>(ranks));
    comm::run_virtual_ranks(ranks, [&](Communicator& ep) {
        const int r = ep.rank();
        std::string& fail = failures[size_t(r)];
        auto check = [&](bool ok, const std::string& what) {
            if (!ok) fail += str("rank ", r, ": ", what, "\n");
        };
        std::unique_ptr<Dispatcher<double>> d = cpu::make_dispatcher<double>(type, E, ep);
        const cpu::EpLayout& layout = d->layout();
        const Routing mine = make_routing(r, T, H, E, k, seed);
        const DispatchedRows<double> got = d->dispatch(mine.tokens, mine.probs, mine.map);

        // Expected rows: for each local expert, source ranks in order, their tokens ascending.
        std::vector<std::pair<int64_t, double>> want;  // (global token id, prob)
        std::vector<int64_t> want_offsets = {0};
        for (int64_t l = 0; l < layout.num_local_experts; ++l) {
            const int64_t e = layout.first_local_expert() + l;
            for (int src = 0; src < ranks; ++src) {
                const Routing other = make_routing(src, T, H, E, k, seed);
                for (int64_t t = 0; t < T; ++t)
                    if (other.map[size_t(t * E + e)]) want.push_back({src * T + t, other.probs(t, e)});
            }
            want_offsets.push_back(int64_t(want.size()));
        }
        check(got.offsets == want_offsets, "offsets per local expert");
        check(got.rows.rows == int64_t(want.size()) && got.probs.size() == want.size(), "row count");
        for (size_t i = 0; i < want.size() && i < size_t(got.rows.rows); ++i) {
            const int64_t id = want[i].first, src = id / T, t = id % T;
            const Routing owner = make_routing(int(src), T, H, E, k, seed);
            check(std::equal(got.rows.row(int64_t(i)), got.rows.row(int64_t(i)) + H, owner.tokens.row(t)),
                  str("row ", i, " is not token ", id, " copied exactly"));
            check(got.probs[i] == want[i].second, str("prob of row ", i));
        }

        // combine of the rows themselves: each token gets (number of its experts) x itself, exactly.
        const Matrix<double> combined = d->combine(got.rows);
        for (int64_t t = 0; t < T; ++t) {
            int64_t n = 0;
            for (int64_t e = 0; e < E; ++e) n += mine.map[size_t(t * E + e)];
            for (int64_t h = 0; h < H; ++h)
                check(combined(t, h) == double(n) * mine.tokens(t, h), str("combine of token ", t, " feature ", h));
        }

        // Adjoints, summed over ranks: <dispatch(x), g> = <x, dispatch^T(g)>, same for combine.
        const Matrix<double> g_rows = test::random_matrix<double>(got.rows.rows, H, seed, 50 + uint64_t(r));
        const std::vector<double> g_probs = test::random_vector<double>(int64_t(got.probs.size()), seed, 60 + uint64_t(r), -1, 1);
        Matrix<double> grad_tokens, grad_probs;
        d->dispatch_backward(g_rows, g_probs, grad_tokens, grad_probs);
        const Matrix<double> y = test::random_matrix<double>(T, H, seed, 70 + uint64_t(r));
        const Matrix<double> gy = d->combine_backward(y);
        double sums[4] = {dot(got.rows.data, g_rows.data) + dot(got.probs, g_probs),
                          dot(mine.tokens.data, grad_tokens.data) + dot(mine.probs.data, grad_probs.data),
                          dot(d->combine(g_rows).data, y.data),
                          dot(g_rows.data, gy.data)};
        ep.all_reduce(sums, 4);
        check(std::abs(sums[0] - sums[1]) <= 1e-12 * (1 + std::abs(sums[0])),
              str("dispatch backward is not the adjoint: ", std::to_string(sums[0]), " vs ", std::to_string(sums[1]), " (diff ", sums[0] - sums[1], ")"));
        check(std::abs(sums[2] - sums[3]) <= 1e-12 * (1 + std::abs(sums[2])),
              str("combine backward is not the adjoint: ", std::to_string(sums[2]), " vs ", std::to_string(sums[3]), " (diff ", sums[2] - sums[3], ")"));
        for (int64_t i = 0; i < T * E; ++i)
            check(mine.map[size_t(i)] || grad_probs.data[size_t(i)] == 0, "prob grad off the routing map");
    });
    for (const auto& f : failures) EXPECT_TRUE(f.empty()) << type << ", " << ranks << " ranks:\n" << f;
}

INSTANTIATE_TEST_SUITE_P(Cpu, Dispatch,
                         ::testing::Combine(::testing::Values("allgather", "alltoall"), ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                             return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks";
                         });

}  // namespace
}  // namespace moekit
