// CUTLASS SM90 pointer-array grouped GEMMs behind grouped_gemm_cutlass.h. One template per product (nt, nn, tn),
// instantiated in grouped_gemm_cutlass_{nt,nn,tn}.cu with the three tile configurations each, and the small groups'
// swapped nt / nn (SwapAB) in grouped_gemm_cutlass_swap_{nt,nn}.cu.
// Sync-free: a one-block kernel turns the device offsets into CUTLASS's per-group problem shapes, pointers and
// strides (in a per-stream argument buffer), and CUTLASS is given no host shapes: its persistent grid covers the
// SMs and its group scheduler reads the shapes on the device. Empty groups get no tiles (M = 0); for wgrad without
// accumulation (WgradWrite::overwrite) their gradient block is zeroed by a separate kernel (CUTLASS would leave K = 0
// accumulators unset).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cstdint>
#include <type_traits>

#include "core/wgrad_split_math.h"
#include "cuda/cuda_check.h"
#include "cuda/grouped_gemm_cutlass.h"
#include "cuda/cutlass/glu_backward_visitor.cuh"
#include "cuda/cutlass/tma_store_evict_first.cuh"

namespace moekit::cuda::cutlass_detail {

enum class Op { kNT, kNN, kTN };

// Operand layouts in CUTLASS's terms (A is M x K, B is N x K, C/D are M x N):
//   nt: C[rows, n] = A[rows, k] · W[n, k]ᵀ      A row-major, B column-major (both K-major), D bf16
//   nn: C[rows, n] = A[rows, k] · W[k, n]       A row-major, B row-major (N-major), D bf16
//   tn: C[m, n] (+)= A[rows, m]ᵀ · B[rows, n]   A column-major, B row-major (both MN-major), C/D fp32
// Transposed tn (PingpongWideTransposed): Cᵀ[n, m] (+)= B[rows, n]ᵀ · A[rows, m], so the gradient's m fills
// CUTLASS's N: A' = B, B' = A (the same layouts, both MN-major), C/D column-major (Cᵀ column-major is C).
// Swapped (nt / nn only, SwapAB configurations): the transposed product Cᵀ[n, rows] = W[g] · A[rows, k]ᵀ, so the
// weights fill CUTLASS's M and a group's token rows its N:
//   nt: A' = W[n, k] row-major (K-major), B' = A column-major (K-major), D' = Cᵀ column-major
//   nn: A' = W[k, n]ᵀ column-major (M-major), B' = A column-major (K-major), D' = Cᵀ column-major
template <Op kOp, bool kSwap = false>
struct OpTraits {
    using LayoutA = std::conditional_t<kOp == Op::kTN || (kSwap && kOp == Op::kNN), cutlass::layout::ColumnMajor,
                                       cutlass::layout::RowMajor>;
    using LayoutB = std::conditional_t<kOp == Op::kNT || (kSwap && kOp != Op::kTN), cutlass::layout::ColumnMajor,
                                       cutlass::layout::RowMajor>;
    using LayoutD = std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
    using ElementC = std::conditional_t<kOp == Op::kTN, float, void>;  // void: no source operand
    using ElementD = std::conditional_t<kOp == Op::kTN, float, cutlass::bfloat16_t>;
};

// A tile configuration: the schedule (two consumer warpgroups on one tile, or taking tiles in turn), the tile
// M x N (k-steps of 64), the cluster, and whether the product is computed transposed (OpTraits' kSwap).
struct CooperativeSchedule {
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PingpongSchedule {
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
template <class Schedule, int kM, int kN, int kClusterM, int kClusterN, bool kTransposed = false>
struct TileConfig {
    using Kernel = typename Schedule::Kernel;
    using Epilogue = typename Schedule::Epilogue;
    using Tile = cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::_64>;
    using Cluster = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
    static constexpr bool transposed = kTransposed;
    static constexpr int cluster_ctas = kClusterM * kClusterN;
};
using Cooperative = TileConfig<CooperativeSchedule, 128, 256, 1, 2>;
using CooperativeTall = TileConfig<CooperativeSchedule, 256, 128, 1, 2>;
// wgrad (tn) on a 2x2 cluster: both operand tiles multicast (a small group's tile loads half its B rows).
using Cooperative2x2 = TileConfig<CooperativeSchedule, 128, 256, 2, 2>;
using Pingpong = TileConfig<PingpongSchedule, 128, 128, 1, 2>;
// 128x192 tiles on ping-pong (kPingpongWide): each warpgroup computes a whole tile, 192 accumulators a thread.
using PingpongWide = TileConfig<PingpongSchedule, 128, 192, 1, 2>;
// A wgrad computed transposed (kPingpongWideTransposed, OpTraits' kSwap for tn): PingpongWide's tile with its 192
// columns along the gradient's m, for a gradient whose m pads little in them and whose n does not (qwen3-30b fc1:
// 1536 x 2048). 192 rows of the gradient a tile instead (a 192x128 tile, three m64 wgmmas where this one issues two
// n192 ones) was slower than 128x128 (H200, 2026-11-28).
using PingpongWideTransposed = TileConfig<PingpongSchedule, 128, 192, 1, 2, true>;
// Small groups computed transposed (OpTraits' kSwap): 128 weight rows by 192 token rows a tile. A group of ~128
// rows (dsv3-e256: 100..156) then fills one tile whose 128-row side holds weights, and each weight tile is read
// once; the 256x128 tile spent half its math on padding rows and was compute-bound where the weights' bytes should
// bound it. Measured on an H200 (docs/perf.md, 2026-11-27): 192 token rows beat 128 / 160 / 224 / 256 (dsv3-e256
// layer 30.4-30.6 ms vs 35.4 / 32.4 / 37.3 / 33.7; the 256x128 tile 33.7-34.1). The 2x1 cluster multicasts the
// token tile to the CTA of the next 128 weight rows (single CTAs: 31.7 ms).
using SwapAB = TileConfig<CooperativeSchedule, 128, 192, 2, 1, true>;
// kSwapAB's product and tile on ping-pong (kSwapPingpong): each warpgroup a whole tile, 192 accumulators a thread.
using SwapABPingpong = TileConfig<PingpongSchedule, 128, 192, 2, 1, true>;
template <class Config>
constexpr bool swapped() {
    return Config::transposed;
}

// The collective epilogue `Epi` (as CUTLASS's builder made it) with its shared-to-global TMA copy replaced by
// `StoreOp`.
template <class Epi, class StoreOp>
struct WithStoreOp;
template <int kStagesC, int kStagesD, int kFragment, bool kReuseC, bool kDelay, int kWarpGroups, class Tile,
          class EpiTile, class EC, class StrideC, class ED, class StrideD, class Callbacks, class G2S, class AtomC,
          class S2R, class S2G, class AtomD, class R2S, class CopyAtomC, class R2R, class StoreOp>
struct WithStoreOp<cutlass::epilogue::collective::CollectiveEpilogue<
                       cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<kStagesC, kStagesD, kFragment, kReuseC, kDelay,
                                                                         kWarpGroups>,
                       Tile, EpiTile, EC, StrideC, ED, StrideD, Callbacks, G2S, AtomC, S2R, S2G, AtomD, R2S, CopyAtomC,
                       R2R>,
                   StoreOp> {
    using type = cutlass::epilogue::collective::CollectiveEpilogue<
        cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<kStagesC, kStagesD, kFragment, kReuseC, kDelay, kWarpGroups>,
        Tile, EpiTile, EC, StrideC, ED, StrideD, Callbacks, G2S, AtomC, S2R, StoreOp, AtomD, R2S, CopyAtomC, R2R>;
};

enum class Stores { kPlain, kEvictFirst };

// Fusion: void = D = the product (LinearCombination), else the epilogue visitor to run instead
// (GluBackwardVisitor: fc2's dgrad with the gated activation's backward).
template <Op kOp, class Config, Stores kStores = Stores::kPlain, class Fusion = void>
struct GemmFor {
    using Traits = OpTraits<kOp, swapped<Config>()>;
    using ElementAB = cutlass::bfloat16_t;
    using ElementC = typename Traits::ElementC;
    using ElementD = typename Traits::ElementD;
    static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
    static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;
    using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, typename Traits::LayoutD*, kAlignC,
        ElementD, typename Traits::LayoutD*, kAlignD, typename Config::Epilogue,
        std::conditional_t<std::is_void_v<Fusion>,
                           cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>, Fusion>>::
        CollectiveOp;
    using CollectiveEpilogue = std::conditional_t<kStores == Stores::kEvictFirst,
                                                  typename WithStoreOp<BuiltEpilogue, TmaStoreEvictFirst>::type,
                                                  BuiltEpilogue>;
    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, typename Traits::LayoutA*, 8, ElementAB,
        typename Traits::LayoutB*, 8, float, typename Config::Tile, typename Config::Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        typename Config::Kernel>::CollectiveOp;
    using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using Shape = typename ProblemShape::UnderlyingProblemShape;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideC = typename Kernel::InternalStrideC;
    using StrideD = typename Kernel::InternalStrideD;
    using NonVoidC = std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>;
};

// Per-group arguments in device memory (carved from one per-stream buffer).
template <class G>
struct GroupArgs {
    typename G::Shape* shapes;
    const typename G::ElementAB** ptr_a;
    const typename G::ElementAB** ptr_b;
    const typename G::NonVoidC** ptr_c;
    typename G::ElementD** ptr_d;
    typename G::StrideA* stride_a;
    typename G::StrideB* stride_b;
    typename G::StrideC* stride_c;
    typename G::StrideD* stride_d;
};

// Every stride type here has exactly one dynamic mode among (M|N, K): the leading dimension.
template <class Stride>
__device__ Stride leading(int64_t ld) {
    Stride s{};
    if constexpr (std::is_same_v<std::decay_t<decltype(cute::get<0>(s))>, int64_t>)
        cute::get<0>(s) = ld;
    else
        cute::get<1>(s) = ld;
    return s;
}

// Which groups a launch computes: all (kAll), or one half of a kSplitBySize pair: the cooperative launch's
// (kCooperative) or the ping-pong launch's (kPingpong); core/wgrad_split_math.h.
enum class Share { kAll, kCooperative, kPingpong };

// One thread per group. nt/nn: shape.k = reduction, n = output columns; tn: shape.k = m (output rows per group).
template <Op kOp, class G, bool kSwap>
__global__ void fill_group_args(GroupArgs<G> a, const int32_t* offsets, int groups, int n, int k,
                                const __nv_bfloat16* A, const __nv_bfloat16* B, void* C, int second_from,
                                const void* second, Share share, WgradSplit split, int ldd) {
    using AB = typename G::ElementAB;
    const auto* A_ = reinterpret_cast<const AB*>(A);
    const auto* B_ = reinterpret_cast<const AB*>(B);
    auto* D_ = static_cast<typename G::ElementD*>(C);
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        const int64_t r0 = offsets[g], all = offsets[g + 1] - r0;
        const int64_t rows = share == Share::kAll ? all : wgrad_split_rows(all, split, share == Share::kCooperative);
        if constexpr (kOp == Op::kTN) {
            // CUTLASS's M x N is the gradient's m x n (m = shape.k), or n x m transposed (kSwap: Cᵀ = Bᵀ · A, whose
            // column-major Cᵀ is C): either way C's rows are n elements apart.
            const int M = kSwap ? n : k, N = kSwap ? k : n;
            a.shapes[g] = typename G::Shape(rows > 0 ? M : 0, N, int(rows));
            a.ptr_a[g] = kSwap ? B_ + r0 * n : A_ + r0 * k;
            a.ptr_b[g] = kSwap ? A_ + r0 * k : B_ + r0 * n;
            a.ptr_d[g] = group_block(D_, second, second_from, g, int64_t(k) * n);
            a.ptr_c[g] = a.ptr_d[g];
            a.stride_a[g] = leading<typename G::StrideA>(M);
            a.stride_b[g] = leading<typename G::StrideB>(N);
            a.stride_c[g] = leading<typename G::StrideC>(n);
        } else if constexpr (kSwap) {  // Cᵀ = W · Aᵀ: M = n (weights), N = the group's rows
            a.shapes[g] = typename G::Shape(rows > 0 ? n : 0, int(rows), k);
            a.ptr_a[g] = group_block(B_, second, second_from, g, int64_t(n) * k);
            a.ptr_b[g] = A_ + r0 * k;
            a.ptr_d[g] = D_ + r0 * n;
            a.stride_a[g] = leading<typename G::StrideA>(kOp == Op::kNT ? k : n);
            a.stride_b[g] = leading<typename G::StrideB>(k);
        } else {
            a.shapes[g] = typename G::Shape(int(rows), n, k);
            a.ptr_a[g] = A_ + r0 * k;
            a.ptr_b[g] = group_block(B_, second, second_from, g, int64_t(n) * k);
            a.ptr_d[g] = D_ + r0 * ldd;
            a.stride_a[g] = leading<typename G::StrideA>(k);
            a.stride_b[g] = leading<typename G::StrideB>(kOp == Op::kNT ? k : n);
            a.stride_d[g] = leading<typename G::StrideD>(ldd);
            continue;
        }
        a.stride_d[g] = leading<typename G::StrideD>(n);
    }
}

// tn with WgradWrite::overwrite: a group with no rows gets a zero gradient block (grid: blocks x groups).
__global__ void zero_empty_groups(const int32_t* offsets, float* C, int64_t block_elems, int64_t second_from,
                                  const void* second);

// Bytes of device memory for one call's per-group arguments and CUTLASS's own workspace, served per stream
// (grouped_gemm_cutlass.cu): calls on one stream run in order, so one buffer a stream is never shared by two GEMMs
// in flight, also inside captured graphs (the buffer outlives them; it is never freed or moved once handed out).
void* stream_workspace(cudaStream_t stream, size_t bytes);
CutlassConfig resolve_config(CutlassConfig requested, int64_t rows_per_group, bool wgrad);
// Tile order of the group scheduler for a launch of an m x n product over groups of rows_per_group rows on average
// (CutlassRaster; grouped_gemm_cutlass.cu says the rule) and its swizzle (MOEKIT_CUTLASS_SWIZZLE=1|2|4|8, default 1).
bool raster_along_n(bool wgrad, int64_t m, int64_t n, int64_t rows_per_group);
int swizzle_size();

// The per-group arrays carved from `base` (256-byte aligned each); *bytes = the space they take. With a null base
// it only measures.
template <class G>
GroupArgs<G> carve_group_args(void* base, int64_t groups, size_t* bytes) {
    size_t used = 0;
    auto take = [&](size_t n) {
        void* r = base ? static_cast<char*>(base) + used : nullptr;
        used += (n + 255) & ~size_t(255);
        return r;
    };
    GroupArgs<G> a{};
    a.shapes = static_cast<typename G::Shape*>(take(groups * sizeof(typename G::Shape)));
    a.ptr_a = static_cast<const typename G::ElementAB**>(take(groups * sizeof(void*)));
    a.ptr_b = static_cast<const typename G::ElementAB**>(take(groups * sizeof(void*)));
    a.ptr_c = static_cast<const typename G::NonVoidC**>(take(groups * sizeof(void*)));
    a.ptr_d = static_cast<typename G::ElementD**>(take(groups * sizeof(void*)));
    a.stride_a = static_cast<typename G::StrideA*>(take(groups * sizeof(typename G::StrideA)));
    a.stride_b = static_cast<typename G::StrideB*>(take(groups * sizeof(typename G::StrideB)));
    a.stride_c = static_cast<typename G::StrideC*>(take(groups * sizeof(typename G::StrideC)));
    a.stride_d = static_cast<typename G::StrideD*>(take(groups * sizeof(typename G::StrideD)));
    *bytes = used;
    return a;
}

// With a Fusion (nt / nn, unswapped): its arguments `fused`, and D's rows `ldd` elements apart (else n).
template <Op kOp, class Config, Stores kStores = Stores::kPlain, class Fusion = void>
void run_grouped(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                 const int32_t* d_offsets, WgradWrite write, cudaStream_t stream, Share share = Share::kAll,
                 const typename GemmFor<kOp, Config, kStores, Fusion>::CollectiveEpilogue::FusionCallbacks::Arguments*
                     fused = nullptr,
                 int64_t ldd = 0) {
    using G = GemmFor<kOp, Config, kStores, Fusion>;
    typename G::Gemm gemm;
    const int64_t groups = s.num_groups;
    cutlass::KernelHardwareInfo hw;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&hw.device_id));
    hw.sm_count = grouped_gemm_grid_sms(Config::cluster_ctas);
    size_t args_bytes = 0;
    carve_group_args<G>(nullptr, groups, &args_bytes);
    auto make_args = [&](const GroupArgs<G>& a) {
        typename G::Gemm::Arguments r;
        r.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
        r.problem_shape = {int(groups), a.shapes, nullptr};
        r.mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
        r.epilogue.ptr_C = std::is_void_v<typename G::ElementC> ? nullptr : reinterpret_cast<decltype(r.epilogue.ptr_C)>(a.ptr_c);
        r.epilogue.dC = a.stride_c;
        r.epilogue.ptr_D = a.ptr_d;
        r.epilogue.dD = a.stride_d;
        if constexpr (std::is_void_v<Fusion>) {
            r.epilogue.thread.alpha = 1.f;
            r.epilogue.thread.beta = kOp == Op::kTN && write == WgradWrite::accumulate ? 1.f : 0.f;
        } else {
            r.epilogue.thread = fused ? *fused : decltype(r.epilogue.thread){};
        }
        r.hw_info = hw;
        // CUTLASS's M x N: a transposed wgrad's is n x m.
        constexpr bool kTnTransposed = kOp == Op::kTN && swapped<Config>();
        r.scheduler.raster_order = raster_along_n(kOp == Op::kTN, kTnTransposed ? s.n : s.k, kTnTransposed ? s.k : s.n,
                                                  groups > 0 ? s.max_rows / groups : 0)
                                       ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                       : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
        r.scheduler.max_swizzle_size = swizzle_size();
        return r;
    };
    // CUTLASS's workspace (per-SM tensor maps) depends on the SM count and the groups, not on the shapes.
    const size_t cutlass_bytes = (G::Gemm::get_workspace_size(make_args(GroupArgs<G>{})) + 255) & ~size_t(255);
    char* ws = static_cast<char*>(stream_workspace(stream, args_bytes + cutlass_bytes));
    const GroupArgs<G> a = carve_group_args<G>(ws, groups, &args_bytes);
    const typename G::Gemm::Arguments args = make_args(a);
    fill_group_args<kOp, G, swapped<Config>()><<<1, 256, 0, stream>>>(a, d_offsets, int(groups), int(s.n), int(s.k),
                                                                      A, B, C, int(s.second_from), s.second, share,
                                                                      wgrad_split(), int(ldd > 0 ? ldd : s.n));
    MOEKIT_CUDA_LAUNCH_CHECK();
    // Empty groups' blocks: zeroed for overwrite (CUTLASS would leave K = 0 accumulators unset), else untouched.
    if (kOp == Op::kTN && write == WgradWrite::overwrite && share != Share::kPingpong) {  // a split pair: its first
        const int64_t block = s.k * s.n;
        zero_empty_groups<<<dim3(unsigned(std::min<int64_t>(64, (block / 4 + 255) / 256)), unsigned(groups)), 256, 0,
                            stream>>>(d_offsets, static_cast<float*>(C), block, s.second_from, s.second);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
    cutlass::Status st = gemm.can_implement(args);
    MOEKIT_CHECK(st == cutlass::Status::kSuccess, "CUTLASS grouped GEMM cannot run ", s.to_string(), ": ",
                 cutlass::cutlassGetStatusString(st));
    st = gemm.initialize(args, ws + args_bytes, stream);
    MOEKIT_CHECK(st == cutlass::Status::kSuccess, "CUTLASS grouped GEMM initialize failed for ", s.to_string(), ": ",
                 cutlass::cutlassGetStatusString(st));
    st = gemm.run(stream);
    MOEKIT_CHECK(st == cutlass::Status::kSuccess, "CUTLASS grouped GEMM launch failed for ", s.to_string(), ": ",
                 cutlass::cutlassGetStatusString(st));
    MOEKIT_CUDA_LAUNCH_CHECK();
}

// nt / nn in a SwapAB configuration (grouped_gemm_cutlass_swap_{nt,nn}.cu: their own translation units, so the
// instantiations compile in parallel).
// `pingpong`: kSwapPingpong, else kSwapAB.
void run_swapped_nt(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                    const int32_t* d_offsets, cudaStream_t stream, bool pingpong);
void run_swapped_nn(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                    const int32_t* d_offsets, cudaStream_t stream, bool pingpong);
template <Op kOp>
void run_swapped(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                 const int32_t* d_offsets, cudaStream_t stream, bool pingpong) {
    if (pingpong)
        run_grouped<kOp, SwapABPingpong>(s, A, B, C, d_offsets, WgradWrite::overwrite, stream);
    else
        run_grouped<kOp, SwapAB>(s, A, B, C, d_offsets, WgradWrite::overwrite, stream);
}

// wgrad (tn) on ping-pong, its tile as wgrad_pingpong_tile says (or forced: kPingpongWide, kPingpongWideTransposed).
template <Stores kStores>
void run_tn_pingpong(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                     const int32_t* d_offsets, WgradWrite write, WgradPingpongTile tile, cudaStream_t stream,
                     Share share) {
    if (tile == WgradPingpongTile::kWide)
        run_grouped<Op::kTN, PingpongWide, kStores>(s, A, B, C, d_offsets, write, stream, share);
    else if (tile == WgradPingpongTile::kWideTransposed)
        run_grouped<Op::kTN, PingpongWideTransposed, kStores>(s, A, B, C, d_offsets, write, stream, share);
    else
        run_grouped<Op::kTN, Pingpong, kStores>(s, A, B, C, d_offsets, write, stream, share);
}

// wgrad (tn) in a resolved configuration, its gradient written with kStores.
template <Stores kStores>
void run_tn(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
            const int32_t* d_offsets, WgradWrite write, CutlassConfig config, cudaStream_t stream) {
    const WgradPingpongTile tile = config == CutlassConfig::kPingpongWide ? WgradPingpongTile::kWide
                                   : config == CutlassConfig::kPingpongWideTransposed
                                       ? WgradPingpongTile::kWideTransposed
                                       : wgrad_pingpong_tile(s.k, s.n);
    switch (config) {
        case CutlassConfig::kSplitBySize:
            // Same stream, one after the other: the second's argument fill waits for the first GEMM, so the two
            // share the stream's argument buffer; each launch's groups are outputs the other does not touch.
            run_grouped<Op::kTN, Cooperative, kStores>(s, A, B, C, d_offsets, write, stream, Share::kCooperative);
            return run_tn_pingpong<kStores>(s, A, B, C, d_offsets, write, tile, stream, Share::kPingpong);
        case CutlassConfig::kCooperative2x2:
            return run_grouped<Op::kTN, Cooperative2x2, kStores>(s, A, B, C, d_offsets, write, stream);
        case CutlassConfig::kPingpong:
        case CutlassConfig::kPingpongWide:
        case CutlassConfig::kPingpongWideTransposed:
            return run_tn_pingpong<kStores>(s, A, B, C, d_offsets, write, tile, stream, Share::kAll);
        case CutlassConfig::kCooperativeTall:
            return run_grouped<Op::kTN, CooperativeTall, kStores>(s, A, B, C, d_offsets, write, stream);
        default:
            return run_grouped<Op::kTN, Cooperative, kStores>(s, A, B, C, d_offsets, write, stream);
    }
}
// run_tn<Stores::kEvictFirst> (grouped_gemm_cutlass_tn_evict_first.cu: its own translation unit); which one
// runs: WgradStores (grouped_gemm_cutlass.h).
void run_tn_evict_first(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                        const int32_t* d_offsets, WgradWrite write, CutlassConfig config, cudaStream_t stream);

template <Op kOp>
void run(const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
         const int32_t* d_offsets, WgradWrite write, CutlassConfig requested, cudaStream_t stream) {
    const int64_t rows_per_group = s.num_groups > 0 ? s.max_rows / s.num_groups : 0;
    const CutlassConfig config = resolve_config(requested, rows_per_group, kOp == Op::kTN);
    if constexpr (kOp == Op::kTN) {
        const WgradStores stores = wgrad_stores();
        if (stores == WgradStores::kEvictFirst ||
            (stores == WgradStores::kAuto && config == CutlassConfig::kCooperative2x2))
            run_tn_evict_first(s, A, B, C, d_offsets, write, config, stream);
        else
            run_tn<Stores::kPlain>(s, A, B, C, d_offsets, write, config, stream);
        return;
    } else if (is_swapped_config(config)) {
        if constexpr (kOp == Op::kNT)
            run_swapped_nt(s, A, B, C, d_offsets, stream, config == CutlassConfig::kSwapPingpong);
        else
            run_swapped_nn(s, A, B, C, d_offsets, stream, config == CutlassConfig::kSwapPingpong);
        return;
    }
    if (config == CutlassConfig::kPingpong)
        run_grouped<kOp, Pingpong>(s, A, B, C, d_offsets, write, stream);
    else if (config == CutlassConfig::kPingpongWide)
        run_grouped<kOp, PingpongWide>(s, A, B, C, d_offsets, write, stream);
    else if (config == CutlassConfig::kCooperativeTall)
        run_grouped<kOp, CooperativeTall>(s, A, B, C, d_offsets, write, stream);
    else
        run_grouped<kOp, Cooperative>(s, A, B, C, d_offsets, write, stream);
}

}  // namespace moekit::cuda::cutlass_detail
