// The second grouped-GEMM backend: CUTLASS's SM90 pointer-array grouped GEMM (TMA + wgmma, warp-specialised,
// persistent) with the per-group shapes and pointers written ON THE DEVICE from the offsets, so it stays
// sync-free and graph-capturable like the own kernels. Same contracts as grouped_gemm.h (it is reached through
// grouped_gemm_nt/nn/tn when the kCutlass kernel is chosen). Built only where the CUTLASS headers were found at
// configure time (the pinned nvidia-cutlass wheel, scripts/prepare_third_party.sh): cutlass_grouped_gemm_built().
// Implementation: src/cuda/cutlass/; tests: tests/gpu/test_grouped_gemm.cu (every backend against the CPU oracle).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/wgrad_split_math.h"
#include "cuda/grouped_gemm.h"

namespace moekit::cuda {

bool cutlass_grouped_gemm_built();

// Tile configurations, chosen per call from the mean rows per group (or forced: set_cutlass_config, or
// MOEKIT_CUTLASS_CONFIG=coop|tall|pingpong|pp192|pp192t|split|swap|swap-pp|coop22).
//   kCooperative:     128x256x64 tiles, two consumer warpgroups on one tile, 1x2 cluster (row tile multicast).
//   kCooperativeTall: 256x128x64 tiles, 1x2 cluster (a whole small group in one row tile: weights read once).
//   kPingpong:        128x128x64 tiles, two consumer warpgroups alternating tiles (epilogue hidden), 1x2 cluster.
//   kSplitBySize (tn only; nt/nn take kAuto's choice): cooperative and ping-pong are both launched, one after the
//                     other; on the device each takes its share of the groups by size (core/wgrad_split_math.h:
//                     cooperative for wgrad_split()'s small groups, as an ECHO rank's cold experts, and large ones)
//                     and gives the others no tiles.
//   kSwapAB (nt/nn only; tn takes kAuto's choice): the transposed product Cᵀ = W·Aᵀ, 128 weight rows by 192
//                     token rows a tile, cooperative, 2x1 cluster (the token tile multicast): the weights, not the
//                     few token rows of a small group, fill the tensor-core tile's 128-row side.
//   kCooperative2x2 (tn only; nt/nn take kCooperative): kCooperative on a 2x2 cluster, both operands multicast.
//   kSwapPingpong (nt/nn only; tn takes kAuto's choice): kSwapAB's product and tile on ping-pong: each consumer
//                     warpgroup owns a whole 128x192 tile, its epilogue under the other's main loop (a small group's
//                     tile is a short reduction against a 48 KB epilogue that kSwapAB does not overlap).
//   kPingpongWide:    ping-pong on 128x192x64 tiles, 1x2 cluster: 1.1-1.2x the math per byte loaded of
//                     kPingpong's tile, each warpgroup's epilogue still under the other's main loop (192
//                     accumulators a thread). A wgrad's ping-pong (kPingpong, kSplitBySize's ping-pong share) takes
//                     it where wgrad_pingpong_tile says.
//   kPingpongWideTransposed (tn only; nt/nn take kPingpongWide): the wgrad computed transposed, Cᵀ = Bᵀ·A, on
//                     kPingpongWide's tiles: their 192 columns along the gradient's m.
enum class CutlassConfig {
    kAuto,
    kCooperative,
    kCooperativeTall,
    kPingpong,
    kSplitBySize,
    kSwapAB,
    kCooperative2x2,
    kPingpongWide,
    kSwapPingpong,
    kPingpongWideTransposed
};
// The configurations that compute an nt / nn transposed (Cᵀ = W·Aᵀ: weights along the tile's rows).
constexpr bool is_swapped_config(CutlassConfig c) {
    return c == CutlassConfig::kSwapAB || c == CutlassConfig::kSwapPingpong;
}
// The mean rows per group at which the per-shape choice (grouped_gemm.cu) and kAuto here change configuration:
// below kSmallGroupRows a 256-row tile holds a whole group; from kLargeGroupRows on, wgrad is plain ping-pong (no
// split by size) and nt / nn with a long reduction cooperative.
constexpr int64_t kSmallGroupRows = 256, kLargeGroupRows = 1536;
void set_cutlass_config(CutlassConfig config);
// How the wgrad (tn) epilogue writes its fp32 gradient: CUTLASS's plain TMA stores, or the same marked evict-first
// in L2 (src/cuda/cutlass/tma_store_evict_first.cuh), or kAuto: evict-first for the small groups' 2x2-cluster
// configuration only. There the gradient (e.g. dsv3-e256's 30 GB fp32) streams past operand slabs that every output
// tile of a group re-reads, and evict-first keeps them in L2 (H200, 2026-11-27: fc1 wgrad 10.43 -> 9.55 ms, DRAM
// reads under ncu 2.2 -> 0.8 GB); on mid-sized and large groups it was a wash or slower (docs/perf.md).
// Default from MOEKIT_WGRAD_STORES=auto|plain|evict_first (unset: auto).
enum class WgradStores { kAuto, kPlain, kEvictFirst };
void set_wgrad_stores(WgradStores stores);
WgradStores wgrad_stores();
// The group scheduler's tile order: kAuto walks M (nt / nn: a group's rows), except for a wgrad whose mean group's
// [rows, M] operand is the wider and overflows half the L2, which walks N (grouped_gemm_cutlass.cu says why);
// kAlongM / kAlongN force one for every launch (A/B measurements). Default from MOEKIT_CUTLASS_RASTER=auto|m|n
// (unset: auto).
enum class CutlassRaster { kAuto, kAlongM, kAlongN };
void set_cutlass_raster(CutlassRaster raster);
CutlassRaster cutlass_raster();
// Which wgrad groups kSplitBySize gives to the cooperative launch: WgradSplit's defaults, or
// MOEKIT_WGRAD_SPLIT_ROWS (small_below) and MOEKIT_WGRAD_SPLIT_LARGE (large_from); with both 0 the split is off
// (wgrad of mid-sized groups all ping-pong, as before 2026-11-26).
WgradSplit wgrad_split();
bool wgrad_split_on();
// The tile a wgrad's ping-pong launch (kPingpong, kSplitBySize's ping-pong share) takes for an [m, n] gradient:
// 128x192 where those pad at most 2 % of n (core/tile_padding_math.h), else the transposed product on them where they
// pad at most 2 % of m, else 128x128; with the switches on (set_wgrad_wide, set_wgrad_wide_transposed, grouped_gemm.h).
enum class WgradPingpongTile { kSquare, kWide, kWideTransposed };
WgradPingpongTile wgrad_pingpong_tile(int64_t m, int64_t n);

void cutlass_grouped_gemm_nt(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                             __nv_bfloat16* C, const int32_t* d_offsets, cudaStream_t stream,
                             CutlassConfig config = CutlassConfig::kAuto);
void cutlass_grouped_gemm_nn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                             __nv_bfloat16* C, const int32_t* d_offsets, cudaStream_t stream,
                             CutlassConfig config = CutlassConfig::kAuto);
// grouped_gemm_nn_glu_backward's contract on the ping-pong configuration (128x128 tiles: a d(prob) partial per
// 128 columns), its epilogue hidden under the other warpgroup's main loop. Runs where `config` is the per-shape
// choice of an unswapped one (the fusion is worth a switch to ping-pong), or kAuto with CUTLASS forced and
// ping-pong resolved (a forced other configuration keeps its unfused kernel); returns whether it ran.
bool cutlass_grouped_gemm_nn_glu_backward(const GroupedGemmShape& shape, const __nv_bfloat16* A,
                                          const __nv_bfloat16* B, const int32_t* d_offsets,
                                          const GluBackwardEpilogue& epilogue, cudaStream_t stream,
                                          CutlassConfig config);
void cutlass_grouped_gemm_tn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                             const int32_t* d_offsets, WgradWrite write, cudaStream_t stream,
                             CutlassConfig config = CutlassConfig::kAuto);

}  // namespace moekit::cuda
