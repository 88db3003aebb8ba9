// Host side of the sync-free grouped GEMMs (grouped_gemm.h): argument checks, launch geometry from static bounds
// only (the real per-group row counts are read by the kernels from device offsets), kernel choice (on Hopper per
// shape between the own TMA + wgmma kernel and CUTLASS's grouped GEMM, grouped_gemm_cutlass.h; mma.sync elsewhere).
// Kernels: grouped_gemm_kernels.cuh / grouped_gemm_mma.cuh / cutlass/; tests: tests/gpu/test_grouped_gemm.cu.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/sm_share_math.h"
#include "core/tile_padding_math.h"
#include "core/wgrad_split_math.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm_tuning.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_cutlass.h"
#include "cuda/grouped_gemm_kernels.cuh"

namespace moekit::cuda {

std::string GroupedGemmShape::to_string() const {
    return str("GroupedGemmShape{groups=", num_groups, ", max_rows=", max_rows, ", n=", n, ", k=", k,
               second_from > 0 ? str(", second base from group ", second_from) : std::string(), "}");
}

namespace {

std::atomic<int> g_kernel{int(GroupedGemmKernel::kAuto)};
thread_local int t_own_kernel_only = 0;  // OwnGemmKernelScope nesting depth on this thread
thread_local int t_rule_only = 0;        // GemmRuleScope nesting depth on this thread
thread_local int t_sms_left = 0;         // GemmSmsLeftScope's SMs left to other kernels (0 = none)

GroupedGemmKernel resolve_kernel() {
    auto chosen = GroupedGemmKernel(g_kernel.load());
    if (chosen == GroupedGemmKernel::kAuto) {
        if (const char* env = std::getenv("MOEKIT_GEMM_KERNEL")) {
            if (std::strcmp(env, "mma") == 0) return GroupedGemmKernel::kMmaSync;
            if (std::strcmp(env, "wgmma") == 0) chosen = GroupedGemmKernel::kWgmma;
            if (std::strcmp(env, "tma") == 0) chosen = GroupedGemmKernel::kTma;
            if (std::strcmp(env, "cutlass") == 0) chosen = GroupedGemmKernel::kCutlass;
        }
    }
    int dev = 0, major = 0, minor = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    bool hopper = major == 9 && minor == 0;  // the wgmma kernel is built for sm_90a only
    if (chosen == GroupedGemmKernel::kWgmma || chosen == GroupedGemmKernel::kTma ||
        chosen == GroupedGemmKernel::kCutlass)
        MOEKIT_CHECK(hopper, "the wgmma grouped GEMMs need an sm_90 device, this one is sm_", major, minor);
    if (chosen == GroupedGemmKernel::kCutlass)
        MOEKIT_CHECK(cutlass_grouped_gemm_built(),
                     "the CUTLASS grouped GEMMs were not built (no CUTLASS wheel at configure time: "
                     "scripts/prepare_third_party.sh)");
    if (chosen == GroupedGemmKernel::kAuto && !(hopper && cutlass_grouped_gemm_built()))
        chosen = hopper ? GroupedGemmKernel::kTma : GroupedGemmKernel::kMmaSync;
    return chosen;  // kAuto: Hopper with CUTLASS built, chosen per call by choose_for_shape
}

int tn_hot_rows();  // set_tn_interleave's value, or MOEKIT_WGRAD_HOT_ROWS

struct Choice {
    GroupedGemmKernel kernel;
    CutlassConfig config;
};

// A measurement switch between two choices, environment variable `var` read once a call site: unset or
// `preferred_name` gives `preferred`, `other_name` gives `other`, anything else is a usage error (exit 2) naming
// both, as for MOEKIT_WGRAD_STORES (grouped_gemm_cutlass.cu).
template <typename T>
T choice_from_env(const char* var, const char* preferred_name, T preferred, const char* other_name, T other) {
    const char* env = std::getenv(var);
    if (!env || std::strcmp(env, preferred_name) == 0) return preferred;
    MOEKIT_REQUIRE(std::strcmp(env, other_name) == 0, var, "=", env, ": expected ", preferred_name, " or ",
                   other_name);
    return other;
}

// A measurement switch set from code: a setter's 1 or 0, or with -1 (the default) the environment's choice
// (`from_env`, read once by the caller).
class Switch {
public:
    void set(int on) { value_ = on; }
    bool on(bool from_env) const {
        const int v = value_.load();
        return v >= 0 ? v > 0 : from_env;
    }

private:
    std::atomic<int> value_{-1};
};

// nt / nn of small groups: the transposed product, 192 token rows a tile (kSwapAB; H200, 2026-11-27: the dsv3-e256
// layer 34.1 -> 30.6 ms, docs/perf.md); MOEKIT_SMALL_GROUP_CONFIG=tall picks the 256x128 tile for measurements.
CutlassConfig small_group_config() {
    static const CutlassConfig c = choice_from_env("MOEKIT_SMALL_GROUP_CONFIG", "swap", CutlassConfig::kSwapAB,
                                                   "tall", CutlassConfig::kCooperativeTall);
    return c;
}

// The small groups' swapped nt / nn on ping-pong (kSwapPingpong) instead of cooperative (set_swap_pingpong, else
// MOEKIT_SWAP_SCHEDULE=cooperative|pingpong). Cooperative by default: on dsv3-e256 its fc2 forward alone was 10 %
// faster on ping-pong, the layer step no different (on / off 1.001; H200, 2026-11-28).
Switch g_swap_pingpong;
bool swap_pingpong() {
    static const bool env = choice_from_env("MOEKIT_SWAP_SCHEDULE", "cooperative", false, "pingpong", true);
    return g_swap_pingpong.on(env);
}

// wgrad of small groups: CUTLASS cooperative on a 2x2 cluster (choose_for_shape); MOEKIT_SMALL_GROUP_WGRAD=coop picks
// the 1x2 cluster for measurements.
CutlassConfig small_group_wgrad_config() {
    static const CutlassConfig c = choice_from_env("MOEKIT_SMALL_GROUP_WGRAD", "2x2", CutlassConfig::kCooperative2x2,
                                                   "coop", CutlassConfig::kCooperative);
    return c;
}

// The other nt / nn on ping-pong's 128x192 tiles instead of 128x128 where those pad at most 4 % of the output
// columns (set_pingpong_wide; wide_pingpong_pays_nt, core/tile_padding_math.h, says what was measured per GEMM).
// Every such GEMM on 128x192, the n = 2048 ones (12.5 % padding) among them, made the layer 0.6-3.2 % slower (H200,
// 2026-11-28); the rule leaves those out.
Switch g_pingpong_wide;
bool pingpong_wide() {
    static const bool env = choice_from_env("MOEKIT_PINGPONG_TILE", "192", true, "128", false);
    return g_pingpong_wide.on(env);
}

// The other nt / nn where 128x192 tiles would pad more than 4 % of n (n = 2048: qwen3-30b's fc2 forward and fc1
// dgrad, dsv3-ep8's fc2 dgrad) computed transposed on ping-pong (kSwapPingpong: 128 weight rows by 192 token rows,
// n along the 128) instead of on 128x128 ping-pong: per shape where the reduction is short
// (swapped_pingpong_pays_nt, core/tile_padding_math.h, says what was measured); set_pingpong_swapped(1) or
// MOEKIT_PINGPONG_SWAPPED=1 wherever 128x192 pads, 0 nowhere.
std::atomic<int> g_pingpong_swapped{-1};
bool pingpong_swapped(const GroupedGemmShape& s) {
    static const int env = [] {
        const char* v = std::getenv("MOEKIT_PINGPONG_SWAPPED");
        if (!v) return -1;
        MOEKIT_REQUIRE(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0, "MOEKIT_PINGPONG_SWAPPED=", v,
                       ": expected 0 (never) or 1 (wherever 128x192 tiles pad over 4 %); unset: per shape");
        return v[0] == '1' ? 1 : 0;
    }();
    const int set = g_pingpong_swapped.load();
    const int mode = set >= 0 ? set : env;
    if (mode >= 0) return mode > 0 && !wide_pingpong_pays_nt(s.n);
    return swapped_pingpong_pays_nt(s.n, s.k);
}

// nt / nn of mid-sized and large groups whose reduction is longer than ping-pong pays for
// (pingpong_pays_reduction, core/tile_padding_math.h, says what was measured) on CUTLASS's cooperative 128x256
// (set_long_reduction_cooperative, else MOEKIT_LONG_K_SCHEDULE=cooperative|pingpong): on by default.
Switch g_long_k_coop;
bool long_reduction_cooperative() {
    static const bool env = choice_from_env("MOEKIT_LONG_K_SCHEDULE", "cooperative", true, "pingpong", false);
    return g_long_k_coop.on(env);
}

// The per-shape choice measured on the device (gemm_tuning.h): set_gemm_tuning, else MOEKIT_GEMM_TUNE=1|0, else on.
Switch g_gemm_tuning;

// CUTLASS's ping-pong wgrads on 128x192 tiles where those pad little (set_wgrad_wide, wgrad_pingpong_tile): on by
// default. H200, 2026-11-28, `moekit bench --variant wgrad-192` (on / off in the same rounds): qwen3-30b 0.982 and
// 0.989 (its fc2 wgrad, n = 768), dsv3-ep8 0.984 (fc1 wgrad, n = 7168), mixtral 1.000 (fc2 wgrad, n = 14336),
// dsv3-ep8 zipf 1.2 0.997. 192 along the gradient's rows instead (192x128 where m pads little) was slower per GEMM
// than 128x128 on both shapes tried (qwen3-30b fc1 1.442 vs 1.393 ms, dsv3-ep8 fc2 1.616 vs 1.487) and is not kept.
Switch g_wgrad_wide;

// Where n pads in 192-column tiles but m does not (qwen3-30b fc1, dsv3-ep8 fc2: n = 2048), the wgrad computed
// transposed on them (kPingpongWideTransposed; set_wgrad_wide_transposed): on by default. H200, 2026-11-28, `moekit
// bench --variant wgrad-192t` on / off: qwen3-30b 0.985, dsv3-ep8 0.991, mixtral 0.999 (its fc1 wgrad, m = 28672).
Switch g_wgrad_wide_t;

// The wgrad's split by group size (kSplitBySize) on or off for A/B (set_wgrad_split); unset, MOEKIT_WGRAD_SPLIT_ROWS
// and MOEKIT_WGRAD_SPLIT_LARGE decide (wgrad_split_on).
Switch g_wgrad_split;

// The wgrads of groups of >= 256 rows on the own kernel (set_wgrad_own_kernel), for A/B against CUTLASS's ping-pong.
Switch g_wgrad_own;
bool wgrad_own_kernel() {
    static const bool env = choice_from_env("MOEKIT_WGRAD_KERNEL", "cutlass", false, "tma", true);
    return g_wgrad_own.on(env);
}

// Per-shape choice among CUTLASS's configurations (and the own TMA kernel), from bench_grouped_gemm's per-GEMM
// A/B (docs/perf.md); rows per group = max_rows / G.
//  - small groups (< 256 rows, e.g. 256 experts at 4096 tokens): nt/nn CUTLASS computing Cᵀ = W·Aᵀ with 128
//    weight rows x 192 token rows a tile (small_group_config: a whole group in one tile, each weight tile read
//    once, and the weights rather than a group's ~128 rows fill the tensor-core tile's 128-row side; before it
//    the 256x128 tile, 20-25% faster than 128-row tiles, which spent half its math on padding rows);
//    tn CUTLASS cooperative 128x256 on a 2x2 cluster (both operands multicast; H200, 2026-11-27, three
//    interleaved rounds on dsv3-e256: fc1 wgrad 10.59-10.72 ms vs 10.83-11.04 on the 1x2 cluster, fc2 5.17-5.22 vs
//    5.32-5.35, the layer step no different; the 1x2 cooperative was 5% faster than ping-pong), its gradient
//    stored evict-first in L2 (WgradStores::kAuto, grouped_gemm_cutlass.h: fc1 9.40-9.55 vs 10.43-10.83 ms);
//  - nt/nn of large groups (>= 1536 rows) with a reduction at least twice the output width (mixtral fc2
//    forward, fc1 dgrad): CUTLASS cooperative 128x256 (8-10% faster);
//  - the other nt/nn with a reduction longer than 2048 (long_reduction_cooperative): CUTLASS cooperative 128x256
//    (on an H100 the ping-pong took 1.16-1.58x its time there; on an H200 within 5 % either way);
//  - the other nt/nn: CUTLASS ping-pong (each consumer warpgroup's epilogue overlaps the other's main loop). H200,
//    2026-11-27, median of three interleaved rounds against the own TMA kernel, ms: qwen3-30b fc2 forward 0.721 vs
//    0.831, fc2 dgrad 0.657 vs 0.679, fc1 forward 1.315 vs 1.329, fc1 dgrad 1.328 vs 1.409; dsv3-ep8 1.495 vs
//    1.614, 1.495 vs 1.565, 2.959 vs 2.997, 3.008 vs 3.148; mixtral fc1 forward 5.697 vs 6.007, fc2 dgrad 2.862
//    vs 3.044 (the own kernel was the choice here before); on 128x192 tiles where those pad at most 4 % of n
//    (pingpong_wide, above), else, with a reduction of at most 2048, computed transposed on ping-pong
//    (pingpong_swapped, above);
//  - wgrad (tn) of mid-sized groups (256..1535 rows): CUTLASS ping-pong (its epilogue overlaps the other
//    consumer's main loop: 10-13% faster on dsv3-ep8, equal on qwen3-30b), but its groups below 384 rows (an ECHO
//    rank's cold experts) CUTLASS cooperative, split on the device (kSplitBySize, core/wgrad_split_math.h); every
//    wgrad's ping-pong on 128x192 tiles where n pads little (g_wgrad_wide: the layer 1.6-1.8 % faster on qwen3-30b
//    and dsv3-ep8), else computed transposed on them where m does (g_wgrad_wide_t: 0.9-1.5 % more);
//  - wgrad of large groups: CUTLASS ping-pong (H200, 2026-11-26: mixtral fc2 wgrad 2.75-2.95 ms vs 3.14-3.17
//    cooperative and 3.43-3.48 own TMA). Mixtral's fc1 wgrad (28672 x 4096) took cooperative until its tiles were
//    walked along N (CutlassRaster, grouped_gemm_cutlass.cu): walking M, ping-pong re-read the gradient rows from
//    DRAM and took 8.2-9.2 ms; along N it takes 6.13-6.16 against cooperative's 6.21-6.44 (2026-11-27).
//  - the own TMA kernel's wgrad on its ping-pong schedule (set_wgrad_own_kernel) stays 3-15 % behind CUTLASS's
//    ping-pong (H200, 2026-11-28, median of 5 rounds, ms: qwen3-30b fc1 1.552 vs 1.469, fc2 0.744 vs 0.737;
//    dsv3-ep8 3.712 vs 3.259, 1.748 vs 1.585; mixtral 6.710 vs 6.015, 3.230 vs 2.990), and the layer step with it
//    read 1.014 (qwen3-30b) and 1.053 (dsv3-ep8) of the step without.
// The own TMA kernel stays the fallback (a C only 8-byte aligned, the hot/cold wgrad interleave, no CUTLASS).
Choice choose_for_shape(gemm_detail::Op op, const GroupedGemmShape& s) {
    using gemm_detail::Op;
    // Asked for the hot/cold interleave (set_tn_interleave / MOEKIT_WGRAD_HOT_ROWS): only the own kernel has it.
    if (op == Op::kTN && tn_hot_rows() > 0) return {GroupedGemmKernel::kTma, CutlassConfig::kAuto};
    const int64_t rows_per_group = s.num_groups > 0 ? s.max_rows / s.num_groups : 0;
    if (rows_per_group < kSmallGroupRows) {
        if (op == Op::kTN) return {GroupedGemmKernel::kCutlass, small_group_wgrad_config()};
        const CutlassConfig c = small_group_config();
        return {GroupedGemmKernel::kCutlass,
                c == CutlassConfig::kSwapAB && swap_pingpong() ? CutlassConfig::kSwapPingpong : c};
    }
    if (op == Op::kTN) {  // wgrad: the gradient is [k, n] (k = output rows here)
        if (wgrad_own_kernel()) return {GroupedGemmKernel::kTma, CutlassConfig::kAuto};
        if (rows_per_group < kLargeGroupRows)
            return {GroupedGemmKernel::kCutlass,
                    wgrad_split_on() ? CutlassConfig::kSplitBySize : CutlassConfig::kPingpong};
        return {GroupedGemmKernel::kCutlass, CutlassConfig::kPingpong};
    }
    const bool large_long = rows_per_group >= kLargeGroupRows && s.k >= 2 * s.n;
    if (large_long || (!pingpong_pays_reduction(s.k) && long_reduction_cooperative()))
        return {GroupedGemmKernel::kCutlass, CutlassConfig::kCooperative};
    const bool wide = pingpong_wide() && wide_pingpong_pays_nt(s.n);
    if (!wide && pingpong_swapped(s)) return {GroupedGemmKernel::kCutlass, CutlassConfig::kSwapPingpong};
    return {GroupedGemmKernel::kCutlass, wide ? CutlassConfig::kPingpongWide : CutlassConfig::kPingpong};
}

// bench_grouped_gemm's column name of a choice (the tuning's records print them).
std::string choice_name(const Choice& c) {
    if (c.kernel == GroupedGemmKernel::kTma) return "tma";
    switch (c.config) {
        case CutlassConfig::kCooperative: return "cl-coop";
        case CutlassConfig::kCooperativeTall: return "cl-tall";
        case CutlassConfig::kPingpong: return "cl-pp";
        case CutlassConfig::kSplitBySize: return "cl-split";
        case CutlassConfig::kSwapAB: return "cl-swap";
        case CutlassConfig::kCooperative2x2: return "cl-2x2";
        case CutlassConfig::kPingpongWide: return "cl-pp192";
        case CutlassConfig::kSwapPingpong: return "cl-swpp";
        case CutlassConfig::kPingpongWideTransposed: return "cl-pp192t";
        default: return "cl-auto";
    }
}

// What the measured choice (gemm_tuning.h) times for a shape: the rule's choice first, then the configurations that
// won a shape of this class on some card in docs/perf.md's tables (every one tested on every shape class by
// tests/gpu/test_grouped_gemm.cu). A wgrad's kPingpong takes wgrad_pingpong_tile's tile, so it is named by that
// tile, and the 128x128 tile is timed only where that is the rule's (elsewhere kPingpong would time a 128x192 twice).
std::vector<GemmChoice> tuning_candidates(gemm_detail::Op op, const GroupedGemmShape& s, Choice rule) {
    using gemm_detail::Op;
    const WgradPingpongTile tile = wgrad_pingpong_tile(s.k, s.n);
    if (op == Op::kTN && rule.kernel == GroupedGemmKernel::kCutlass && rule.config == CutlassConfig::kPingpong) {
        if (tile == WgradPingpongTile::kWide) rule.config = CutlassConfig::kPingpongWide;
        if (tile == WgradPingpongTile::kWideTransposed) rule.config = CutlassConfig::kPingpongWideTransposed;
    }
    std::vector<GemmChoice> out;
    auto add = [&](Choice c) {
        for (const GemmChoice& x : out)
            if (x.kernel == c.kernel && (c.kernel != GroupedGemmKernel::kCutlass || x.config == c.config)) return;
        out.push_back({c.kernel, c.config, choice_name(c)});
    };
    add(rule);
    const auto cl = [](CutlassConfig c) { return Choice{GroupedGemmKernel::kCutlass, c}; };
    const int64_t rows_per_group = s.num_groups > 0 ? s.max_rows / s.num_groups : 0;
    if (op == Op::kTN) {
        if (rows_per_group < kSmallGroupRows) {
            add(cl(CutlassConfig::kCooperative2x2));
            add(cl(CutlassConfig::kCooperative));
            return out;
        }
        if (tile == WgradPingpongTile::kSquare) add(cl(CutlassConfig::kPingpong));
        for (CutlassConfig c :
             {CutlassConfig::kPingpongWide, CutlassConfig::kPingpongWideTransposed, CutlassConfig::kCooperative})
            add(cl(c));
        if (rows_per_group < kLargeGroupRows) add(cl(CutlassConfig::kSplitBySize));
    } else if (rows_per_group < kSmallGroupRows) {
        for (CutlassConfig c : {CutlassConfig::kSwapAB, CutlassConfig::kSwapPingpong, CutlassConfig::kCooperativeTall})
            add(cl(c));
    } else {
        for (CutlassConfig c : {CutlassConfig::kCooperative, CutlassConfig::kCooperativeTall, CutlassConfig::kPingpong,
                                CutlassConfig::kPingpongWide, CutlassConfig::kSwapPingpong})
            add(cl(c));
    }
    add({GroupedGemmKernel::kTma, CutlassConfig::kAuto});
    return out;
}

template <auto kKernel>
void ensure_smem(int bytes) {
    // Once per kernel instantiation and process: raise the dynamic shared-memory limit above 48 KB.
    static std::atomic<bool> done{false};
    if (done.load()) return;
    MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    done = true;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


// cuTensorMapEncodeTiled from the driver, found at run time (no link against libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
    static EncodeTiled fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult q{};
        MOEKIT_CUDA_CHECK(
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q));
        MOEKIT_CHECK(ptr && q == cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled not found in the driver");
        return reinterpret_cast<EncodeTiled>(ptr);
    }();
    return fn;
}

// cuTensorMapEncodeTiled with what every map here shares: 128-byte swizzle (the box's contiguous dimension must be
// 128 bytes), 256-byte L2 promotion, out-of-bounds elements read as zero. dim0 x dim1 (contiguous first) name the
// tensor in the error.
CUtensorMap encode_map(CUtensorMapDataType type, int rank, const void* ptr, const cuuint64_t* gdim,
                       const cuuint64_t* gstride, const cuuint32_t* bdim, int64_t dim0, int64_t dim1) {
    CUtensorMap map;
    const cuuint32_t estride[3] = {1, 1, 1};
    CUresult r = encode_tiled()(&map, type, cuuint32_t(rank), const_cast<void*>(ptr), gdim, gstride, bdim, estride,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MOEKIT_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with code ", int(r), " (rank ", rank, ", dims ",
                 dim0, "x", dim1, ")");
    return map;
}

// Row-major tensor of `rank` dims (dims[0] contiguous), bf16 (or fp32).
CUtensorMap tensor_map(const void* ptr, int rank, const int64_t* dims, const uint32_t* box, bool fp32 = false) {
    cuuint64_t gdim[3], gstride[2];
    cuuint32_t bdim[3];
    int64_t stride = fp32 ? 4 : 2;
    for (int i = 0; i < rank; ++i) {
        gdim[i] = cuuint64_t(dims[i]);
        bdim[i] = box[i];
        if (i > 0) gstride[i - 1] = cuuint64_t(stride);
        stride *= dims[i];
    }
    return encode_map(fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, ptr, gdim,
                      gstride, bdim, dims[0], dims[1]);
}

// A row-major bf16 [rows, cols] matrix (cols % 64 == 0) as cols / 64 blocks of 64 columns: dims {64, rows,
// cols / 64}, the block stride 128 bytes, the box {64, 64, blocks}: one copy lands `blocks` [64 x 64] blocks one
// after the other, as that many 2-D boxes would (tma_wgrad_pingpong_kernel's kBlocks3d).
CUtensorMap column_blocks_map(const void* ptr, int64_t rows, int64_t cols, uint32_t blocks) {
    const cuuint64_t gdim[3] = {64, cuuint64_t(rows), cuuint64_t(cols / 64)};
    const cuuint64_t gstride[2] = {cuuint64_t(cols * 2), 128};
    const cuuint32_t bdim[3] = {64, 64, blocks};
    return encode_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, ptr, gdim, gstride, bdim, cols, rows);
}

std::atomic<int> g_cluster{0};
std::atomic<int> g_tn_hot_rows{-1};
Switch g_tn_pingpong;

bool tn_pingpong() {
    static const bool env = choice_from_env("MOEKIT_TN_SCHEDULE", "pingpong", true, "cooperative", false);
    return g_tn_pingpong.on(env);
}

std::atomic<int> g_tn_pp_buffers{-1};
int tn_pingpong_buffers() {
    const int set = g_tn_pp_buffers.load();
    if (set >= 0) return set;
    static const int env = choice_from_env("MOEKIT_TN_PP_BUFFERS", "2", 2, "4", 4);
    return env;
}

int tn_hot_rows() {
    int h = g_tn_hot_rows.load();
    if (h < 0) {
        const char* env = std::getenv("MOEKIT_WGRAD_HOT_ROWS");
        h = env ? std::max(0, std::atoi(env)) : 0;
    }
    return h;
}

}  // namespace

WgradSplit wgrad_split() {
    static const WgradSplit split = [] {
        WgradSplit s;
        if (const char* env = std::getenv("MOEKIT_WGRAD_SPLIT_ROWS"))
            s.small_below = std::max<int64_t>(0, std::atoll(env));
        if (const char* env = std::getenv("MOEKIT_WGRAD_SPLIT_LARGE"))
            s.large_from = std::max<int64_t>(0, std::atoll(env));
        return s;
    }();
    return split;
}

bool wgrad_split_on() { return g_wgrad_split.on(wgrad_split().small_below > 0 || wgrad_split().large_from > 0); }

WgradPingpongTile wgrad_pingpong_tile(int64_t m, int64_t n) {
    static const bool env = choice_from_env("MOEKIT_WGRAD_TILE", "192", true, "128", false);
    static const bool env_t = choice_from_env("MOEKIT_WGRAD_TRANSPOSED", "1", true, "0", false);
    if (!g_wgrad_wide.on(env)) return WgradPingpongTile::kSquare;
    if (wide_pingpong_pads_little(n)) return WgradPingpongTile::kWide;
    if (g_wgrad_wide_t.on(env_t) && wide_pingpong_pads_little(m)) return WgradPingpongTile::kWideTransposed;
    return WgradPingpongTile::kSquare;
}

namespace {

int tma_cluster() {
    int c = g_cluster.load();
    if (c == 0) {
        const char* env = std::getenv("MOEKIT_GEMM_CLUSTER");
        c = env && std::strcmp(env, "2") == 0 ? 2 : 1;
    }
    return c;
}

// Whether the TMA kernel stages results in shared memory (default: bf16 as full-line stores, tn's fp32 as bulk
// tensor stores) or stores them from registers (MOEKIT_GEMM_EPILOGUE=direct: the nt/nn kernel before 2026-11-21
// 07:00, the tn kernel before 2026-11-26; kept for A/B runs).
bool tma_staged_epilogue() {
    static const bool staged = [] {
        const char* env = std::getenv("MOEKIT_GEMM_EPILOGUE");
        return !(env && std::strcmp(env, "direct") == 0);
    }();
    return staged;
}

// How many clusters of `kCluster` CTAs of this kernel fit on the device at once (cached per instantiation).
template <auto kKernel, int kCluster>
int max_clusters(int smem) {
    static std::atomic<int> cached{0};
    int n = cached.load();
    if (n > 0) return n;
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(unsigned(kCluster * grouped_gemm_sm_count()));
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kKernel, &cfg));
    MOEKIT_CHECK(n > 0, "no cluster of ", kCluster, " grouped-GEMM CTAs fits on this device");
    cached = n;
    if (std::getenv("MOEKIT_GEMM_VERBOSE"))
        std::fprintf(stderr, "grouped GEMM: %d clusters of %d CTAs fit\n", n, kCluster);
    return n;
}

template <auto kKernel, int kCluster>
void launch_tma_kernel(int kSmem, int64_t jobs, const gemm_detail::Params& q, const CUtensorMap& a,
                       const CUtensorMap& b, const CUtensorMap& c, const CUtensorMap& second, cudaStream_t stream);

// The fused GLU forward's epilogue on the producer warpgroup's idle warps, overlapping the next tile's main loop
// (tma_kernel kAsyncEpi), or in the consumers after each tile (set_glu_forward_async_epilogue(0) or
// MOEKIT_GLU_FORWARD_EPILOGUE=inline, for A/B).
Switch g_glu_forward_async;
bool glu_forward_async_epilogue() {
    static const bool async = choice_from_env("MOEKIT_GLU_FORWARD_EPILOGUE", "async", true, "inline", false);
    return g_glu_forward_async.on(async);
}

template <gemm_detail::Op kOp, int kCluster>
void launch_tma(const gemm_detail::Params& p, cudaStream_t stream) {
    using gemm_detail::Op;
    CUtensorMap a, b, c, second;
    const int64_t rows = p.max_rows, n = p.n, k = p.k;
    // Groups of the first base and of the second (groups >= p.second_from): 3-D maps over each.
    const int64_t G1 = p.second_from > 0 ? p.second_from : p.G, G2 = p.G - G1;
    gemm_detail::Params q = p;
    // tn's staged epilogue stores through tensor maps over both gradient bases: both 16-byte aligned.
    const uintptr_t c_bits =
        reinterpret_cast<uintptr_t>(p.C) | (kOp == Op::kTN && G2 > 0 ? reinterpret_cast<uintptr_t>(p.second) : 0);
    q.staged_epilogue = tma_staged_epilogue() && c_bits % 16 == 0 ? 1 : 0;
    if constexpr (kOp == Op::kTN) {
        int64_t da[2] = {k, rows}, db[2] = {n, rows};
        uint32_t box[2] = {64, 64};
        a = tensor_map(p.A, 2, da, box);
        b = tensor_map(p.B, 2, db, box);
        int64_t dc[3] = {n, k, G1}, dc2[3] = {n, k, G2};
        uint32_t boxc[3] = {32, 64, 1};
        c = q.staged_epilogue && G1 > 0 ? tensor_map(p.C, 3, dc, boxc, true) : a;
        second = q.staged_epilogue && G2 > 0 ? tensor_map(p.second, 3, dc2, boxc, true) : a;
    } else {
        int64_t da[2] = {k, rows};
        uint32_t boxa[2] = {64, kCluster > 1 ? 64u : 128u};  // cluster: each CTA loads (and multicasts) one half
        a = tensor_map(p.A, 2, da, boxa);
        const bool nt = kOp == Op::kNT;
        int64_t db[3] = {nt ? k : n, nt ? n : k, G1}, db2[3] = {db[0], db[1], G2};
        // nt with the gated activation's forward: two boxes of 128 rows a stage, gate and up (Params::glu_out).
        uint32_t boxb[3] = {64, nt ? (p.glu_out ? 128u : 256u) : 64u, 1};
        b = G1 > 0 ? tensor_map(p.B, 3, db, boxb) : a;
        second = G2 > 0 ? tensor_map(p.second, 3, db2, boxb) : a;
        c = a;  // unused: bf16 results are stored without TMA
    }
    // Persistent: one CTA per SM (the kernel's shared memory allows no more) walks all tiles; with clusters, as many
    // CTA pairs as fit at once walk the pairs of n-neighbour tiles.
    const int64_t tiles_n = (p.tiles_n + kCluster - 1) / kCluster;
    const int64_t jobs = int64_t(p.tiles_m) * tiles_n * (kOp == Op::kTN ? p.G : 1);  // both bases
    q.total_tiles = int(jobs);
    q.tn_hot_rows = kOp == Op::kTN ? tn_hot_rows() : 0;
    if constexpr (kOp == Op::kTN) {
        if (q.staged_epilogue && tn_pingpong()) {  // 128 x 128 tiles, one a consumer warpgroup
            q.tiles_m = int(ceil_div(k, 128));
            q.tiles_n = int(ceil_div(n, 128));
            const int64_t tiles = int64_t(q.tiles_m) * ceil_div(q.tiles_n, kCluster) * p.G;  // pairs with clusters
            MOEKIT_CHECK(tiles < (int64_t(1) << 31), "grouped_gemm_tn: too many 128 x 128 tiles (", tiles, ")");
            q.total_tiles = int(tiles);
            using gemm_detail::pingpong_smem_bytes, gemm_detail::tma_wgrad_pingpong_kernel;
            const bool blocks3d = k % 64 == 0 && n % 64 == 0;  // two 64-column blocks a copy (kBlocks3d)
            if (blocks3d) {
                if (kCluster == 1) a = column_blocks_map(p.A, rows, k, 2);
                b = column_blocks_map(p.B, rows, n, 2);
            }
            auto launch = [&]<int kStages, int kBufs>() {
                constexpr int smem = pingpong_smem_bytes(kStages, kBufs);
                if (blocks3d)
                    launch_tma_kernel<tma_wgrad_pingpong_kernel<kStages, kBufs, kCluster, true>, kCluster>(
                        smem, q.total_tiles, q, a, b, c, second, stream);
                else
                    launch_tma_kernel<tma_wgrad_pingpong_kernel<kStages, kBufs, kCluster, false>, kCluster>(
                        smem, q.total_tiles, q, a, b, c, second, stream);
            };
            if (tn_pingpong_buffers() == 4)
                launch.template operator()<5, 4>();
            else
                launch.template operator()<6, 2>();
            return;
        }
    }
    if constexpr (kOp == Op::kNT) {
        if (q.glu_out && glu_forward_async_epilogue()) {
            launch_tma_kernel<gemm_detail::tma_kernel<kOp, kCluster, true>, kCluster>(
                gemm_detail::kTmaAsyncSmemBytes, jobs, q, a, b, c, second, stream);
            return;
        }
    }
    launch_tma_kernel<gemm_detail::tma_kernel<kOp, kCluster>, kCluster>(gemm_detail::kTmaSmemBytes, jobs, q, a, b, c,
                                                                      second, stream);
}

// One persistent launch of a tma_kernel instantiation: a CTA per SM, or as many clusters as fit.
template <auto kKernel, int kCluster>
void launch_tma_kernel(int kSmem, int64_t jobs, const gemm_detail::Params& q, const CUtensorMap& a,
                       const CUtensorMap& b, const CUtensorMap& c, const CUtensorMap& second, cudaStream_t stream) {
    ensure_smem<kKernel>(kSmem);
    if constexpr (kCluster == 1) {
        const int64_t ctas = std::min<int64_t>(jobs, grouped_gemm_grid_sms(1));
        kKernel<<<unsigned(ctas), 384, kSmem, stream>>>(q, a, b, c, second);
    } else {
        const int64_t clusters = std::min<int64_t>(
            {jobs, int64_t(max_clusters<kKernel, kCluster>(kSmem)), int64_t(grouped_gemm_grid_sms(kCluster) / kCluster)});
        cudaLaunchConfig_t cfg{};
        cudaLaunchAttribute attr{};
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = kCluster;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.gridDim = dim3(unsigned(clusters * kCluster));
        cfg.blockDim = dim3(384);
        cfg.dynamicSmemBytes = kSmem;
        cfg.stream = stream;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kKernel, q, a, b, c, second));
    }
}

// Whether a gated activation pass rides in its GEMM's epilogue: fc1's forward (set_glu_forward_fusion, else
// MOEKIT_FUSE_GLU_FORWARD=0|1, else per shape) and fc2's dgrad (set_glu_backward_fusion, MOEKIT_FUSE_GLU_BACKWARD).
// Both run on the own TMA kernel (fc2's dgrad also on CUTLASS's ping-pong, as an epilogue visitor, where CUTLASS is
// forced: that made the step 1.22 of unfused), so a fusion trades CUTLASS's faster main loop for the pass it saves.
// Forward, per shape (glu_fusion_pays): the epilogue on warps of its own, overlapping the next tile's main loop, on
// where the reduction is short (H <= 2048) and groups are mid-sized (256..1535 rows), where the own kernel's main
// loop is within 1-2 % of CUTLASS's. moekit bench --variant glu-forward, the step's graph on / off in the same rounds
// (H200, 2026-11-27): qwen3-30b (H 2048) 1.007 / 0.977; dsv3-ep8 (H 7168) 1.005, mixtral (H 4096, 2000-row groups)
// 1.013, dsv3-e256 (128-row groups) 1.028.
// Backward, nowhere by default: in the consumers' epilogue the step read 0.995 on qwen3-30b and 1.013 on dsv3-ep8
// (--variant glu-backward, same call). On warps of its own (measured, taken out: docs/perf.md) the epilogue has twice
// the forward's elements a tile plus the gate / up loads; three warps took 1.2 ms for a dgrad whose main loop takes
// 0.74 (qwen3-30b, ncu), and the step read 1.017 / 1.006.
enum class GluFusion { kNever, kAlways, kPerShape };
std::atomic<int> g_glu_fusion[2] = {-1, -1};  // [backward]
GluFusion glu_fusion_from_env(const char* var) {
    // Unset: per shape; 0 / 1: never / always.
    return std::getenv(var) ? choice_from_env(var, "0", GluFusion::kNever, "1", GluFusion::kAlways)
                            : GluFusion::kPerShape;
}
GluFusion glu_fusion_mode(bool backward) {
    const int set = g_glu_fusion[backward].load();
    if (set >= 0) return set > 0 ? GluFusion::kAlways : GluFusion::kNever;
    static const GluFusion forward_env = glu_fusion_from_env("MOEKIT_FUSE_GLU_FORWARD");
    static const GluFusion backward_env = glu_fusion_from_env("MOEKIT_FUSE_GLU_BACKWARD");
    return backward ? backward_env : forward_env;
}
bool glu_fusion_pays(bool backward, const GroupedGemmShape& s) {
    if (backward) return false;
    const int64_t rows_per_group = s.num_groups > 0 ? s.max_rows / s.num_groups : 0;
    return s.k <= 2048 && rows_per_group >= kSmallGroupRows && rows_per_group < kLargeGroupRows;
}
bool glu_fusion_wanted(bool backward, const GroupedGemmShape& s) {
    const GluFusion mode = glu_fusion_mode(backward);
    return mode == GluFusion::kAlways || (mode == GluFusion::kPerShape && glu_fusion_pays(backward, s));
}

// fc1's A rows gathered from the tokens inside the fused forward's loads (RowGather): set_fc1_gather, else
// MOEKIT_GATHER_FC1=0|1, else off: it measured slower than the permute pass it saves (qwen3-30b's step 1.026-1.033
// of the permuted one, --variant gather-fc1, H200, 2026-11-27; docs/perf.md). The own kernel on single CTAs with
// the epilogue on warps of its own only (a cluster multicasts TMA boxes of A).
Switch g_fc1_gather;
bool fc1_gather_wanted(const GroupedGemmShape& s) {
    static const bool env = choice_from_env("MOEKIT_GATHER_FC1", "0", false, "1", true);
    const bool on = g_fc1_gather.on(env);
    const GroupedGemmKernel k = resolve_kernel();
    return on && glu_fusion_wanted(false, s) && (k == GroupedGemmKernel::kAuto || k == GroupedGemmKernel::kTma) &&
           tma_cluster() != 2 && glu_forward_async_epilogue();
}

// The launch of a resolved kernel (and CUTLASS configuration) on checked arguments: the tail of launch(), and what
// the measured choice times for each candidate.
template <gemm_detail::Op kOp>
void run_kernel(const char* name, GroupedGemmKernel kernel, CutlassConfig config, gemm_detail::Params p,
                const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
                const int32_t* d_offsets, WgradWrite write, cudaStream_t stream) {
    using namespace gemm_detail;
    if (kernel == GroupedGemmKernel::kCutlass) {
        MOEKIT_CHECK(reinterpret_cast<uintptr_t>(C) % 16 == 0, name, ": the CUTLASS kernels need C 16-byte aligned");
        if constexpr (kOp == Op::kNT)
            cutlass_grouped_gemm_nt(s, A, B, static_cast<__nv_bfloat16*>(C), d_offsets, stream, config);
        else if constexpr (kOp == Op::kNN)
            cutlass_grouped_gemm_nn(s, A, B, static_cast<__nv_bfloat16*>(C), d_offsets, stream, config);
        else
            cutlass_grouped_gemm_tn(s, A, B, static_cast<float*>(C), d_offsets, write, stream, config);
        return;
    }
    bool wgmma = kernel == GroupedGemmKernel::kWgmma || kernel == GroupedGemmKernel::kTma;
    const int BM = 128, BN = wgmma ? 256 : 128;
    p.tiles_n = int(ceil_div(s.n, BN));
    // NT/NN: every group may end with a partial tile, hence the +G over the dense bound.
    p.tiles_m = int(kOp == Op::kTN ? ceil_div(s.k, BM) : ceil_div(s.max_rows, BM) + s.num_groups);
    int64_t grid = int64_t(p.tiles_m) * p.tiles_n * (kOp == Op::kTN ? s.num_groups : 1);
    MOEKIT_CHECK(grid < (int64_t(1) << 31), name, ": too many tiles for ", s.to_string());
    if (kernel == GroupedGemmKernel::kTma) {
        if (tma_cluster() == 2)
            launch_tma<kOp, 2>(p, stream);
        else
            launch_tma<kOp, 1>(p, stream);
    } else if (wgmma) {
        constexpr int kSmem = smem_bytes<kOp, 128, 256, 4>();
        ensure_smem<wgmma_kernel<kOp>>(kSmem);
        wgmma_kernel<kOp><<<unsigned(grid), 256, kSmem, stream>>>(p);
    } else {
        constexpr int kSmem = smem_bytes<kOp, 128, 128, 4>();
        ensure_smem<mma_kernel<kOp>>(kSmem);
        mma_kernel<kOp><<<unsigned(grid), 256, kSmem, stream>>>(p);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
}

// What an untuned shape's launch does with the tuning: time candidates now (the host waits on its stream), keep the
// rule for good (inside a graph capture: a later eager launch must compute what the graph does, bit for bit), or
// take the rule this once (a tn that accumulates: its candidates would add into the gradient several times; a
// partial grid, GemmSmsLeftScope: it would measure another machine).
enum class TuningNow { tune, keep_rule, rule_once };
TuningNow tuning_now(bool tn, WgradWrite write, cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    // The legacy stream cannot be asked while a blocking stream captures (cudaErrorStreamCaptureImplicit): then no.
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return TuningNow::rule_once;
    }
    if (status != cudaStreamCaptureStatusNone) return TuningNow::keep_rule;
    return (tn && write != WgradWrite::overwrite) || t_sms_left > 0 ? TuningNow::rule_once : TuningNow::tune;
}

// With `glu` (nn only) / `glu_fwd` (nt only): the fused dgrad + gated-activation backward / fc1 forward + activation,
// launched where glu_fusion_wanted and the kernel allowed has that epilogue (the own TMA kernel; for the backward also
// CUTLASS's ping-pong where CUTLASS is forced); returns whether it was launched (nothing is done otherwise).
template <gemm_detail::Op kOp>
bool launch(const char* name, const GroupedGemmShape& s, const __nv_bfloat16* A, const __nv_bfloat16* B, void* C,
            const int32_t* d_offsets, WgradWrite write, cudaStream_t stream,
            const GluBackwardEpilogue* glu = nullptr, const GluForwardEpilogue* glu_fwd = nullptr,
            const RowGather* gather = nullptr) {
    using namespace gemm_detail;
    MOEKIT_CHECK(s.num_groups >= 0 && s.max_rows >= 0 && s.n >= 0 && s.k >= 0, name, ": negative size in ",
                 s.to_string());
    MOEKIT_CHECK(s.n % 8 == 0 && s.k % 8 == 0, name, ": n and k must be multiples of 8 (16-byte row loads), got ",
                 s.to_string());
    MOEKIT_CHECK(s.n < (int64_t(1) << 30) && s.k < (int64_t(1) << 30) && s.max_rows < (int64_t(1) << 30), name,
                 ": sizes beyond 2^30 in ", s.to_string());
    if ((glu && !glu_fusion_wanted(true, s)) || (glu_fwd && !glu_fusion_wanted(false, s))) return false;
    if (gather && !fc1_gather_wanted(s)) return false;
    // Nothing to compute: with `glu` the caller's unfused path handles it (its activation pass still runs).
    if (s.num_groups == 0 || s.n == 0) return false;
    if (kOp != Op::kTN && (s.max_rows == 0 || s.k == 0)) return false;
    if (kOp == Op::kTN && s.k == 0) return false;
    MOEKIT_CHECK(A && B && (C || glu) && d_offsets, name, ": null pointer");
    MOEKIT_CHECK((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B)) % 16 == 0, name,
                 ": A and B must be 16-byte aligned");
    MOEKIT_CHECK(reinterpret_cast<uintptr_t>(C) % 8 == 0, name, ": C must be 8-byte aligned");
    MOEKIT_CHECK(s.second_from >= 0 && s.second_from <= s.num_groups && (s.second_from == 0 || s.second), name,
                 ": the second operand base needs 0 < second_from <= groups and a pointer, got ", s.to_string());
    MOEKIT_CHECK(s.second_from == 0 || reinterpret_cast<uintptr_t>(s.second) % 16 == 0, name,
                 ": the second operand base must be 16-byte aligned");
    MOEKIT_CHECK(!(glu && s.second_from > 0), name, ": no second operand base with the fused activation backward");
    if (kOp == Op::kTN && s.second_from > 0 && write == WgradWrite::accumulate) {
        // The first base accumulates, the second is written fresh: CUTLASS has one beta a launch, so two launches
        // (the second base's groups as a GEMM of their own, over their rows' offsets).
        GroupedGemmShape first = s, rest = s;
        first.num_groups = s.second_from, first.second_from = 0, first.second = nullptr;
        rest.num_groups = s.num_groups - s.second_from, rest.second_from = 0, rest.second = nullptr;
        launch<kOp>(name, first, A, B, C, d_offsets, write, stream);
        launch<kOp>(name, rest, A, B, const_cast<void*>(s.second), d_offsets + s.second_from,
                    WgradWrite::overwrite_nonempty, stream);
        return true;
    }

    Params p{};
    p.A = A;
    p.B = B;
    p.C = C;
    p.offsets = d_offsets;
    p.G = int(s.num_groups);
    p.max_rows = int(s.max_rows);
    p.n = int(s.n);
    p.k = int(s.k);
    p.second_from = int(s.second_from);
    p.second = const_cast<void*>(s.second);
    p.accumulate = write == WgradWrite::accumulate ? 1 : 0;
    p.keep_empty = write != WgradWrite::overwrite ? 1 : 0;

    const GroupedGemmKernel resolved = resolve_kernel();
    GroupedGemmKernel kernel = resolved;
    CutlassConfig config = CutlassConfig::kAuto;
    if (kernel == GroupedGemmKernel::kAuto && t_own_kernel_only > 0) kernel = GroupedGemmKernel::kTma;
    if (kernel == GroupedGemmKernel::kAuto) {
        Choice c = choose_for_shape(kOp, s);
        // The plain product's choice measured on this device where tuning is on (gemm_tuning.h); the fused epilogues,
        // ECHO's second base, the hot / cold interleave and a GemmRuleScope keep the rule.
        const bool plain = !glu && !glu_fwd && s.second_from == 0 && reinterpret_cast<uintptr_t>(C) % 16 == 0 &&
                           !(kOp == Op::kTN && tn_hot_rows() > 0);
        if (plain && t_rule_only == 0 && gemm_tuning_enabled()) {
            const char* op = kOp == Op::kNT ? "nt" : kOp == Op::kNN ? "nn" : "tn";
            GemmChoice m{};
            if (gemm_tuning_detail::lookup(op, s, &m)) {
                c = {m.kernel, m.config};
            } else if (const TuningNow now = tuning_now(kOp == Op::kTN, write, stream); now == TuningNow::keep_rule) {
                gemm_tuning_detail::keep(op, s, tuning_candidates(kOp, s, c).front());
            } else if (now == TuningNow::tune) {
                m = gemm_tuning_detail::tune(
                    op, s, tuning_candidates(kOp, s, c),
                    [&](const GemmChoice& x) {
                        run_kernel<kOp>(name, x.kernel, x.config, p, s, A, B, C, d_offsets, write, stream);
                    },
                    stream);
                c = {m.kernel, m.config};
            }
        }
        kernel = c.kernel, config = c.config;
        // CUTLASS's TMA stores need a 16-byte aligned C; the own kernel takes any 8-byte aligned one.
        if (reinterpret_cast<uintptr_t>(C) % 16 != 0) kernel = GroupedGemmKernel::kTma;
    }
    if (glu) {
        MOEKIT_CHECK(glu->fc1_out && glu->grad_fc1, name, ": null activation input or gradient");
        MOEKIT_CHECK((reinterpret_cast<uintptr_t>(glu->fc1_out) | reinterpret_cast<uintptr_t>(glu->grad_fc1)) % 16 == 0,
                     name, ": the activation input and gradient must be 16-byte aligned");
        // CUTLASS's visitor where CUTLASS is forced; else the own TMA kernel, whether chosen per shape or forced.
        if (resolved == GroupedGemmKernel::kCutlass) {
            if constexpr (kOp == Op::kNN)
                return cutlass_grouped_gemm_nn_glu_backward(s, A, B, d_offsets, *glu, stream, config);
            return false;
        }
        if (!(resolved == GroupedGemmKernel::kAuto || resolved == GroupedGemmKernel::kTma) || !tma_staged_epilogue())
            return false;
        kernel = GroupedGemmKernel::kTma;
        p.glu_in = glu->fc1_out;
        p.glu_probs = glu->probs;
        p.glu_grad = glu->grad_fc1;
        p.glu_dp = glu->dp_partials;
        p.glu_act = int(glu->act);
    }
    if (glu_fwd) {
        // The own TMA kernel, whether chosen per shape or forced; any other kernel forced has no such epilogue.
        if (s.n % 16 != 0 || !(resolved == GroupedGemmKernel::kAuto || resolved == GroupedGemmKernel::kTma))
            return false;
        MOEKIT_CHECK(glu_fwd->act_out, name, ": null activation output");
        MOEKIT_CHECK((reinterpret_cast<uintptr_t>(C) | reinterpret_cast<uintptr_t>(glu_fwd->act_out)) % 16 == 0, name,
                     ": the fc1 output and the activation output must be 16-byte aligned");
        kernel = GroupedGemmKernel::kTma;
        p.glu_out = glu_fwd->act_out;
        p.glu_probs = glu_fwd->probs;
        p.glu_act = int(glu_fwd->act);
        if (gather) {
            MOEKIT_CHECK(gather->tokens && gather->row_token && gather->rows, name, ": null gather operand");
            // 16-byte row pieces: elsewhere decline (the caller permutes the rows as before).
            if ((reinterpret_cast<uintptr_t>(gather->tokens) | reinterpret_cast<uintptr_t>(gather->rows)) % 16 != 0)
                return false;
            p.gather_tokens = gather->tokens;
            p.gather_row_token = gather->row_token;
            p.gather_copy = gather->rows;
        }
    }
    run_kernel<kOp>(name, kernel, config, p, s, A, B, C, d_offsets, write, stream);
    return true;
}

}  // namespace

#ifndef MOEKIT_WITH_CUTLASS
// Built without the CUTLASS headers: resolve_kernel refuses kCutlass before any of these is reached.
bool cutlass_grouped_gemm_built() { return false; }
void set_cutlass_config(CutlassConfig) {}
void set_wgrad_stores(WgradStores) {}
void set_cutlass_raster(CutlassRaster) {}
CutlassRaster cutlass_raster() { return CutlassRaster::kAuto; }
WgradStores wgrad_stores() { return WgradStores::kAuto; }
void cutlass_grouped_gemm_nt(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                             const int32_t*, cudaStream_t, CutlassConfig) {
    MOEKIT_CHECK(false, "CUTLASS grouped GEMMs not built");
}
void cutlass_grouped_gemm_nn(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                             const int32_t*, cudaStream_t, CutlassConfig) {
    MOEKIT_CHECK(false, "CUTLASS grouped GEMMs not built");
}
void cutlass_grouped_gemm_tn(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*, float*,
                             const int32_t*, WgradWrite, cudaStream_t, CutlassConfig) {
    MOEKIT_CHECK(false, "CUTLASS grouped GEMMs not built");
}
bool cutlass_grouped_gemm_nn_glu_backward(const GroupedGemmShape&, const __nv_bfloat16*, const __nv_bfloat16*,
                                          const int32_t*, const GluBackwardEpilogue&, cudaStream_t, CutlassConfig) {
    MOEKIT_CHECK(false, "CUTLASS grouped GEMMs not built");
    return false;
}
#endif

OwnGemmKernelScope::OwnGemmKernelScope(bool on) : on_(on) {
    if (on_) ++t_own_kernel_only;
}
OwnGemmKernelScope::~OwnGemmKernelScope() {
    if (on_) --t_own_kernel_only;
}
GemmRuleScope::GemmRuleScope(bool on) : on_(on) {
    if (on_) ++t_rule_only;
}
GemmRuleScope::~GemmRuleScope() {
    if (on_) --t_rule_only;
}

GemmSmsLeftScope::GemmSmsLeftScope(int sms_left) : previous_(t_sms_left) { t_sms_left = sms_left; }
GemmSmsLeftScope::~GemmSmsLeftScope() { t_sms_left = previous_; }
int grouped_gemm_grid_sms(int cluster) { return grid_sms_leaving(grouped_gemm_sm_count(), t_sms_left, cluster); }

int grouped_gemm_sm_count() {
    static std::atomic<int> cached[64] = {};
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    int n = dev < 64 ? cached[dev].load() : 0;
    if (n == 0) {
        MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
        if (dev < 64) cached[dev] = n;
    }
    return n;
}

void set_grouped_gemm_kernel(GroupedGemmKernel kernel) { g_kernel = int(kernel); }
void set_grouped_gemm_cluster(int size) { g_cluster = size; }
void set_tn_interleave(int hot_rows) { g_tn_hot_rows = hot_rows; }
void set_tn_pingpong(int on) { g_tn_pingpong.set(on); }
void set_tn_pingpong_buffers(int buffers) {
    MOEKIT_CHECK(buffers == -1 || buffers == 2 || buffers == 4, "set_tn_pingpong_buffers(", buffers,
                 "): 2, 4 or -1 (MOEKIT_TN_PP_BUFFERS)");
    g_tn_pp_buffers = buffers;
}
void set_wgrad_own_kernel(int on) { g_wgrad_own.set(on); }
void set_pingpong_wide(int on) { g_pingpong_wide.set(on); }
void set_wgrad_wide(int on) { g_wgrad_wide.set(on); }
void set_wgrad_wide_transposed(int on) { g_wgrad_wide_t.set(on); }
void set_wgrad_split(int on) { g_wgrad_split.set(on); }
void set_swap_pingpong(int on) { g_swap_pingpong.set(on); }
void set_pingpong_swapped(int on) { g_pingpong_swapped = on; }
void set_long_reduction_cooperative(int on) { g_long_k_coop.set(on); }
void set_gemm_tuning(int on) { g_gemm_tuning.set(on); }
bool gemm_tuning_enabled() {
    static const bool env = choice_from_env("MOEKIT_GEMM_TUNE", "1", true, "0", false);
    return g_gemm_tuning.on(env);
}
void set_glu_backward_fusion(int on) { g_glu_fusion[1] = on; }
void set_glu_forward_fusion(int on) { g_glu_fusion[0] = on; }
void set_glu_forward_async_epilogue(int on) { g_glu_forward_async.set(on); }
bool glu_forward_fusion_enabled(const GroupedGemmShape& shape) { return glu_fusion_wanted(false, shape); }
void set_fc1_gather(int on) { g_fc1_gather.set(on); }
bool fc1_gather_enabled(const GroupedGemmShape& shape) { return fc1_gather_wanted(shape) && shape.n % 16 == 0; }
bool glu_backward_fusion_enabled(const GroupedGemmShape& shape) { return glu_fusion_wanted(true, shape); }
GroupedGemmKernel grouped_gemm_kernel() { return resolve_kernel(); }
const char* grouped_gemm_kernel_name(GroupedGemmKernel kernel) {
    switch (kernel) {
        case GroupedGemmKernel::kTma: return "tma+wgmma";
        case GroupedGemmKernel::kWgmma: return "cp.async+wgmma";
        case GroupedGemmKernel::kCutlass: return "cutlass";
        case GroupedGemmKernel::kMmaSync: return "mma.sync";
        default: return "per shape: cutlass configurations (tma+wgmma fallback)";
    }
}

void grouped_gemm_nt(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream) {
    launch<gemm_detail::Op::kNT>("grouped_gemm_nt", shape, A, B, C, d_offsets, WgradWrite::overwrite, stream);
}

void grouped_gemm_nn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets, cudaStream_t stream) {
    launch<gemm_detail::Op::kNN>("grouped_gemm_nn", shape, A, B, C, d_offsets, WgradWrite::overwrite, stream);
}

void grouped_gemm_tn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                     const int32_t* d_offsets, WgradWrite write, cudaStream_t stream) {
    launch<gemm_detail::Op::kTN>("grouped_gemm_tn", shape, A, B, C, d_offsets, write, stream);
}

int64_t glu_backward_tiles(int64_t n) { return ceil_div(n, kGluBackwardTileColumns); }

bool grouped_gemm_nn_glu_backward(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                                  const int32_t* d_offsets, const GluBackwardEpilogue& epilogue, cudaStream_t stream) {
    return launch<gemm_detail::Op::kNN>("grouped_gemm_nn_glu_backward", shape, A, B, nullptr, d_offsets,
                                        WgradWrite::overwrite, stream, &epilogue);
}

bool grouped_gemm_nt_glu_forward(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                                 __nv_bfloat16* C, const int32_t* d_offsets, const GluForwardEpilogue& epilogue,
                                 cudaStream_t stream, const RowGather* gather) {
    return launch<gemm_detail::Op::kNT>("grouped_gemm_nt_glu_forward", shape, A, B, C, d_offsets,
                                        WgradWrite::overwrite, stream, nullptr, &epilogue, gather);
}

}  // namespace moekit::cuda
