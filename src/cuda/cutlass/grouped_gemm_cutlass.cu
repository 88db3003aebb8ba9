// Host side shared by the CUTLASS grouped GEMMs (grouped_gemm_cutlass.h): the tile-configuration choice, the
// per-stream argument/workspace buffers, and the zeroing of empty wgrad groups. The three products are
// instantiated in grouped_gemm_cutlass_{nt,nn,tn}.cu and the swapped nt / nn in grouped_gemm_cutlass_swap_{nt,nn}.cu
// (one translation unit each: they compile in parallel).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/tile_order_math.h"
#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda {

bool cutlass_grouped_gemm_built() { return true; }

namespace {
std::atomic<int> g_config{int(CutlassConfig::kAuto)};
}

void set_cutlass_config(CutlassConfig config) { g_config = int(config); }

namespace {
std::atomic<int> g_stores{-1};  // -1: not set, MOEKIT_WGRAD_STORES decides at first use
}

void set_wgrad_stores(WgradStores stores) { g_stores = int(stores); }

WgradStores wgrad_stores() {
    int s = g_stores.load();
    if (s >= 0) return WgradStores(s);
    static const WgradStores from_env = [] {
        const char* env = std::getenv("MOEKIT_WGRAD_STORES");
        if (!env || std::strcmp(env, "auto") == 0) return WgradStores::kAuto;
        if (std::strcmp(env, "plain") == 0) return WgradStores::kPlain;
        MOEKIT_REQUIRE(std::strcmp(env, "evict_first") == 0, "MOEKIT_WGRAD_STORES=", env,
                       ": expected auto, plain or evict_first");
        return WgradStores::kEvictFirst;
    }();
    return from_env;
}

namespace {
std::atomic<int> g_raster{-1};  // -1: not set, MOEKIT_CUTLASS_RASTER decides at first use
}

void set_cutlass_raster(CutlassRaster raster) { g_raster = int(raster); }

CutlassRaster cutlass_raster() {
    const int r = g_raster.load();
    if (r >= 0) return CutlassRaster(r);
    static const CutlassRaster from_env = [] {
        const char* env = std::getenv("MOEKIT_CUTLASS_RASTER");
        if (!env || std::strcmp(env, "auto") == 0) return CutlassRaster::kAuto;
        if (std::strcmp(env, "m") == 0) return CutlassRaster::kAlongM;
        MOEKIT_REQUIRE(std::strcmp(env, "n") == 0, "MOEKIT_CUTLASS_RASTER=", env, ": expected auto, m or n");
        return CutlassRaster::kAlongN;
    }();
    return from_env;
}

namespace cutlass_detail {

CutlassConfig resolve_config(CutlassConfig requested, int64_t rows_per_group, bool wgrad) {
    if (requested == CutlassConfig::kAuto) requested = CutlassConfig(g_config.load());
    if (requested == CutlassConfig::kSplitBySize && !wgrad) requested = CutlassConfig::kAuto;  // tn only
    if (is_swapped_config(requested) && wgrad) requested = CutlassConfig::kAuto;  // nt / nn only
    if (requested == CutlassConfig::kCooperative2x2 && !wgrad) requested = CutlassConfig::kCooperative;  // tn only
    if (requested == CutlassConfig::kPingpongWideTransposed && !wgrad) requested = CutlassConfig::kPingpongWide;
    if (requested == CutlassConfig::kAuto) {
        if (const char* env = std::getenv("MOEKIT_CUTLASS_CONFIG")) {
            if (std::strcmp(env, "coop") == 0) return CutlassConfig::kCooperative;
            if (std::strcmp(env, "pingpong") == 0) return CutlassConfig::kPingpong;
            if (std::strcmp(env, "pp192") == 0) return CutlassConfig::kPingpongWide;
            if (std::strcmp(env, "pp192t") == 0 && wgrad) return CutlassConfig::kPingpongWideTransposed;
            if (std::strcmp(env, "tall") == 0) return CutlassConfig::kCooperativeTall;
            if (std::strcmp(env, "split") == 0 && wgrad) return CutlassConfig::kSplitBySize;
            if (std::strcmp(env, "swap") == 0 && !wgrad) return CutlassConfig::kSwapAB;
            if (std::strcmp(env, "swap-pp") == 0 && !wgrad) return CutlassConfig::kSwapPingpong;
            if (std::strcmp(env, "coop22") == 0 && wgrad) return CutlassConfig::kCooperative2x2;
        }
        // Where CUTLASS is forced without a configuration (grouped_gemm.cu's per-shape choice always passes one):
        // by rows per group only.
        if (wgrad) {
            if (rows_per_group < kSmallGroupRows) return CutlassConfig::kCooperative;
            return wgrad_split_on() && rows_per_group < kLargeGroupRows ? CutlassConfig::kSplitBySize
                                                                        : CutlassConfig::kPingpong;
        }
        return rows_per_group < kSmallGroupRows ? CutlassConfig::kSwapAB : CutlassConfig::kCooperative;
    }
    return requested;
}

// nt / nn walk M; a wgrad walks N where core/tile_order_math.h says (why is there).
bool raster_along_n(bool wgrad, int64_t m, int64_t n, int64_t rows_per_group) {
    switch (cutlass_raster()) {
        case CutlassRaster::kAlongM:
            return false;
        case CutlassRaster::kAlongN:
            return true;
        default:
            break;
    }
    if (!wgrad) return false;
    int dev = 0, l2 = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    return wgrad_walks_along_n(m, n, rows_per_group, l2);
}

// MOEKIT_CUTLASS_SWIZZLE=1|2|4|8 (unset: 1): the group scheduler's swizzle, an A/B switch (docs/perf.md).
int swizzle_size() {
    static const int s = [] {
        const char* env = std::getenv("MOEKIT_CUTLASS_SWIZZLE");
        if (!env) return 1;
        const std::string v = env;
        MOEKIT_REQUIRE(v == "1" || v == "2" || v == "4" || v == "8", "MOEKIT_CUTLASS_SWIZZLE=", v,
                       ": expected 1, 2, 4 or 8");
        return std::stoi(v);
    }();
    return s;
}

void* stream_workspace(cudaStream_t stream, size_t bytes) {
    struct Buffer {
        void* ptr = nullptr;
        size_t bytes = 0;
    };
    static std::mutex mutex;
    static std::map<std::pair<int, cudaStream_t>, Buffer> buffers;
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mutex);
    Buffer& b = buffers[{dev, stream}];
    if (b.bytes >= bytes) return b.ptr;
    // Growing: the old buffer may still be referenced by a captured graph, so it is kept (never freed), and the
    // allocation is allowed while this thread captures (cudaMalloc is not stream-ordered).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    MOEKIT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    void* ptr = nullptr;
    const size_t want = std::max<size_t>(bytes, 2 * b.bytes);
    const cudaError_t err = cudaMalloc(&ptr, want);
    MOEKIT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    MOEKIT_CUDA_CHECK(err);
    b.ptr = ptr;
    b.bytes = want;
    return ptr;
}

__global__ void zero_empty_groups(const int32_t* offsets, float* C, int64_t block_elems, int64_t second_from,
                                  const void* second) {
    const int g = blockIdx.y;
    if (offsets[g + 1] != offsets[g] || in_second_base(second_from, g)) return;  // second base: left unwritten
    float4* dst = reinterpret_cast<float4*>(group_block(C, second, second_from, g, block_elems));
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < block_elems / 4; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace cutlass_detail
}  // namespace moekit::cuda
