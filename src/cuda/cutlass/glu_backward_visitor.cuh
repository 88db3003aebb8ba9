// The gated activation's backward as a CUTLASS SM90 epilogue visitor, for fc2's dgrad on the ping-pong grouped GEMM
// (grouped_gemm_nn_glu_backward, grouped_gemm.h): the product's fp32 tile dA is rounded to bf16 (the value the
// unfused path stores), then each element becomes d gate (returned: CUTLASS stores it as D through its TMA
// pipeline, D = grad_fc1's left half) and d up (stored here, into the right half), with the routed row's d(prob)
// partial for this 128-column tile summed on the side. Same formulas as src/cuda/activation.cu's backward, so d gate
// and d up are the same bits. The ping-pong schedule was to hide this epilogue under the other warpgroup's main
// loop; measured, the fused dgrad is twice as slow as the unfused pair, so it is off by default (docs/perf.md).
//
// It relies on the SM90 wgmma accumulator layout of a 128-row tile on one warpgroup: a thread's elements come in
// pairs of adjacent columns of one row (so gate / up are read and d up written four bytes at a time), its four rows
// sit 0, 8, 64 and 72 below its first one, and the four lanes of a quad hold the same rows (so a row's partial is a
// shuffle over the quad). The GPU test GroupedGemm.GluBackwardEpilogueMatchesUnfused checks every output against
// the unfused pair.
#pragma once
#include <cuda_bf16.h>

#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include <cstdint>

#include "core/activation_math.h"

namespace moekit::cuda::cutlass_detail {

struct GluBackwardArgs {
    const int32_t* offsets = nullptr;         // [groups + 1]: a group's first row (CUTLASS's coordinates are per group)
    const __nv_bfloat16* fc1_out = nullptr;   // [rows, 2n] = [gate | up]
    const float* probs = nullptr;             // [rows] or null (= 1)
    __nv_bfloat16* grad_fc1 = nullptr;        // [rows, 2n]: d up goes to columns [n, 2n) from here
    float* dp_partials = nullptr;             // [rows, tiles] or null
    int n = 0;                                // the dgrad's output width (F)
    int tiles = 0;                            // partials a row: glu_backward_tiles(n)
    int act = 0;                              // Activation
};

struct GluBackwardVisitor : cutlass::epilogue::fusion::Sm90VisitorImpl<> {
    struct SharedStorage {};
    using Arguments = GluBackwardArgs;
    using Params = GluBackwardArgs;

    template <class ProblemShape>
    static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
        return args;
    }
    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const& args) {
        return args.fc1_out && args.grad_fc1 && args.n % 8 == 0;
    }
    template <class ProblemShape>
    static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
        return 0;
    }
    template <class ProblemShape>
    static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                                cutlass::CudaHostAdapter* = nullptr) {
        return cutlass::Status::kSuccess;
    }

    CUTLASS_HOST_DEVICE GluBackwardVisitor() {}
    CUTLASS_HOST_DEVICE GluBackwardVisitor(Params const& params, SharedStorage const&) : params(params) {}
    Params params;

    // CTensor: the thread's element coordinates relative to its first element, (CPY, CPY_M, CPY_N, EPI_M, EPI_N);
    // Residue: the group's (M, N) minus that first element's coordinates (an element is in bounds iff its relative
    // coordinates are below it).
    template <class CTensor, class Residue, int kTileM>
    struct Callbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
        static_assert(kTileM == 128, "the row slots below are those of a 128-row tile on one warpgroup");
        static constexpr int kSlots = 4;  // the thread's rows: 0, 8, 64, 72 below its first
        CUTLASS_DEVICE static int slot(int r) { return ((r >> 6) << 1) | ((r >> 3) & 1); }
        CUTLASS_DEVICE static int slot_row(int s) { return (s >> 1) * 64 + (s & 1) * 8; }
        static constexpr int kEpiM = decltype(cute::size<3>(std::declval<CTensor>()))::value;
        // A subtile's elements a thread.
        static constexpr int kElems = decltype(cute::size(cute::take<0, 3>(std::declval<CTensor>().layout())))::value;
        static_assert(kElems % 2 == 0, "the wgmma layout gives a thread pairs of adjacent columns");

        CTensor tCcD;
        Residue residue;
        Params const& p;
        int64_t row0;   // the thread's first row in the whole [rows, .] buffers
        int64_t col0;   // its first column in [0, n)
        int n_tile;     // which partial of the row this tile writes
        int rows_left;  // rows of the group from the thread's first one on
        bool in_cols;   // the thread's columns start inside the group's N (a cluster's spare tile may not)
        float prob[kSlots];
        float dp[kSlots];
        uint32_t gate[2][kElems / 2], up[2][kElems / 2];  // bf16 pairs of the current and the next subtile

        CUTLASS_DEVICE Callbacks(CTensor c, Residue r, Params const& params, int64_t row0, int64_t col0, int n_tile)
            : tCcD(c), residue(r), p(params), row0(row0), col0(col0), n_tile(n_tile),
              rows_left(int(cute::get<0>(r))), in_cols(int(cute::get<1>(r)) > 0) {}

        CUTLASS_DEVICE static float lo(uint32_t v) { return __uint_as_float(v << 16); }
        CUTLASS_DEVICE static float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

        // Issue the gate / up loads of subtile (epi_m, epi_n) into buffer b, a subtile ahead of their use.
        CUTLASS_DEVICE void load(int epi_m, int epi_n, int b) {
            auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
            const int64_t in_cols = 2 * int64_t(p.n);
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kElems / 2; ++j) {
                const auto x = c(2 * j);
                gate[b][j] = up[b][j] = 0u;
                if (cute::elem_less(x, residue)) {
                    const __nv_bfloat16* in =
                        p.fc1_out + (row0 + cute::get<0>(x)) * in_cols + col0 + cute::get<1>(x);
                    gate[b][j] = __ldg(reinterpret_cast<const unsigned int*>(in));
                    up[b][j] = __ldg(reinterpret_cast<const unsigned int*>(in + p.n));
                }
            }
        }

        CUTLASS_DEVICE void begin() {
            CUTLASS_PRAGMA_UNROLL
            for (int s = 0; s < kSlots; ++s) {
                dp[s] = 0.f;
                prob[s] = p.probs && slot_row(s) < rows_left ? __ldg(p.probs + row0 + slot_row(s)) : 1.f;
            }
            load(0, 0, 0);
        }

        CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
            constexpr int kEpiN = decltype(cute::size<4>(std::declval<CTensor>()))::value;
            const int i = epi_n * kEpiM + epi_m;  // the collective walks epi_m fastest
            if (i + 1 < kEpiM * kEpiN) load((i + 1) % kEpiM, (i + 1) / kEpiM, (i + 1) & 1);
        }

        template <class ElementAccumulator, int kFragment>
        CUTLASS_DEVICE cutlass::Array<cutlass::bfloat16_t, kFragment> visit(
            cutlass::Array<ElementAccumulator, kFragment> const& acc, int epi_v, int epi_m, int epi_n) {
            static_assert(kFragment % 2 == 0, "pairs of columns");
            auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
            const int b = (epi_n * kEpiM + epi_m) & 1;
            const Activation act = Activation(p.act);
            const int64_t in_cols = 2 * int64_t(p.n);
            cutlass::Array<cutlass::bfloat16_t, kFragment> out;
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < kFragment; i += 2) {
                const int e = epi_v * kFragment + i;
                const auto x = c(e);
                const int r = int(cute::get<0>(x)), s = slot(r);
                __nv_bfloat16 dg[2] = {}, du[2] = {};
                if (cute::elem_less(x, residue)) {
                    const float g[2] = {lo(gate[b][e / 2]), hi(gate[b][e / 2])};
                    const float u[2] = {lo(up[b][e / 2]), hi(up[b][e / 2])};
                    CUTLASS_PRAGMA_UNROLL
                    for (int h = 0; h < 2; ++h) {
                        const float go = __bfloat162float(__float2bfloat16(float(acc[i + h])));
                        float dgf, duf, a;
                        glu_backward_and_value(act, g[h], u[h], go * prob[s], &dgf, &duf, &a);
                        dp[s] += a * go;
                        dg[h] = __float2bfloat16(dgf);
                        du[h] = __float2bfloat16(duf);
                    }
                    __nv_bfloat16* dst = p.grad_fc1 + (row0 + r) * in_cols + p.n + col0 + cute::get<1>(x);
                    *reinterpret_cast<__nv_bfloat162*>(dst) = __halves2bfloat162(du[0], du[1]);
                }
                out[i] = cutlass::bfloat16_t::bitcast(__bfloat16_as_ushort(dg[0]));
                out[i + 1] = cutlass::bfloat16_t::bitcast(__bfloat16_as_ushort(dg[1]));
            }
            return out;
        }

        // A row's partial: the quad's four lanes hold its columns of this tile.
        CUTLASS_DEVICE void end() {
            const bool writer = (threadIdx.x & 3) == 0;
            CUTLASS_PRAGMA_UNROLL
            for (int s = 0; s < kSlots; ++s) {
                float v = dp[s];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (writer && in_cols && p.dp_partials && slot_row(s) < rows_left)
                    p.dp_partials[(row0 + slot_row(s)) * p.tiles + n_tile] = v;
            }
        }
    };

    template <bool kReferenceSrc, class... Args>
    CUTLASS_DEVICE auto get_consumer_store_callbacks(
        cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
        const auto [M, N, K, L] = args.problem_shape_mnkl;
        const auto [m, n, k, l] = args.tile_coord_mnkl;
        constexpr int kTileM = decltype(cute::size<0>(args.tile_shape_mnk))::value;
        // The thread's first element: (M, N) minus its residue; rows are the group's, offset by offsets[l].
        const int64_t first_row = int64_t(M) - int64_t(cute::get<0>(args.residue_tCcD));
        const int64_t first_col = int64_t(N) - int64_t(cute::get<1>(args.residue_tCcD));
        const int64_t row0 = int64_t(__ldg(params.offsets + l)) + first_row;
        return Callbacks<decltype(args.tCcD), decltype(args.residue_tCcD), kTileM>(
            args.tCcD, args.residue_tCcD, params, row0, first_col, int(n));
    }
};

}  // namespace moekit::cuda::cutlass_detail
