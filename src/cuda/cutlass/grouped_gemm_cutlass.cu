// Host side shared by the CUTLASS grouped GEMMs (grouped_gemm_cutlass.h): the tile-configuration choice, the
// per-stream argument/workspace buffers, and the zeroing of empty wgrad groups. The three products are
// instantiated in grouped_gemm_cutlass_{nt,nn,tn}.cu (one translation unit each: they compile in parallel).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/cutlass/grouped_gemm_cutlass.cuh"

namespace moekit::cuda {

bool cutlass_grouped_gemm_built() { return true; }

namespace {
std::atomic<int> g_config{int(CutlassConfig::kAuto)};
std::atomic<int> g_split_sms{-1};
}  // namespace

void set_cutlass_config(CutlassConfig config) { g_config = int(config); }
void set_wgrad_split(int side_sms) { g_split_sms = side_sms; }

namespace cutlass_detail {

CutlassConfig resolve_config(CutlassConfig requested, int64_t rows_per_group, bool wgrad) {
    if (requested == CutlassConfig::kAuto) requested = CutlassConfig(g_config.load());
    if (requested == CutlassConfig::kAuto) {
        if (const char* env = std::getenv("MOEKIT_CUTLASS_CONFIG")) {
            if (std::strcmp(env, "coop") == 0) return CutlassConfig::kCooperative;
            if (std::strcmp(env, "pingpong") == 0) return CutlassConfig::kPingpong;
            if (std::strcmp(env, "tall") == 0) return CutlassConfig::kCooperativeTall;
        }
        // The CUTLASS half of grouped_gemm.cu's per-shape choice (measured on an H100, docs/perf.md).
        if (wgrad) return rows_per_group >= kSmallGroupRows && rows_per_group < kLargeGroupRows ? CutlassConfig::kPingpong
                                                                          : CutlassConfig::kCooperative;
        return rows_per_group < kSmallGroupRows ? CutlassConfig::kCooperativeTall : CutlassConfig::kCooperative;
    }
    return requested;
}

bool raster_along_n() {
    static const bool n = [] {
        const char* env = std::getenv("MOEKIT_CUTLASS_RASTER");
        return env && std::strcmp(env, "n") == 0;
    }();
    return n;
}

int swizzle_size() {
    static const int s = [] {
        const char* env = std::getenv("MOEKIT_CUTLASS_SWIZZLE");
        const int v = env ? std::atoi(env) : 1;
        return v == 2 || v == 4 || v == 8 ? v : 1;
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

int wgrad_split_sms() {
    int v = g_split_sms.load();
    if (v < 0) {
        const char* env = std::getenv("MOEKIT_WGRAD_SPLIT_SMS");
        v = env ? std::max(0, std::atoi(env)) : 0;
    }
    return v;
}

SideStream side_stream_for(cudaStream_t stream, size_t plan_bytes) {
    static std::mutex mutex;
    static std::map<std::pair<int, cudaStream_t>, std::pair<SideStream, size_t>> sides;
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mutex);
    auto found = sides.find({dev, stream});
    if (found != sides.end() && found->second.second >= plan_bytes) return found->second.first;
    // Stream, event and allocation calls are not stream operations, but a thread capturing in global mode may not
    // make them: relax its mode for the duration.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    MOEKIT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    SideStream side{};
    cudaError_t err = cudaSuccess;
    if (found != sides.end()) {
        side = found->second.first;
    } else {
        err = cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking);
        if (err == cudaSuccess) err = cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming);
        if (err == cudaSuccess) err = cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming);
    }
    const size_t want = std::max<size_t>(plan_bytes, 1024);
    if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&side.plan), want);
    MOEKIT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    MOEKIT_CUDA_CHECK(err);
    sides[{dev, stream}] = {side, want};
    return side;
}

__global__ void split_wgrad_groups(const int32_t* offsets, int groups, int side_sms, int sm_count, uint8_t* side) {
    // Rank the groups by rows (ties by index), lay their costs out in that order, and give the side the longest
    // prefix whose cost stays within its share. One block; the costs in shared memory (int64 a group).
    extern __shared__ int64_t cost_by_rank[];
    __shared__ int64_t total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    int64_t mine = 0;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        const int64_t rows = offsets[g + 1] - offsets[g];
        const int64_t cost = rows > 0 ? max(rows, int64_t(kSplitFloorRows)) : 0;
        int rank = 0;
        for (int h = 0; h < groups; ++h) {
            const int64_t other = offsets[h + 1] - offsets[h];
            rank += other < rows || (other == rows && h < g);
        }
        cost_by_rank[rank] = cost;
        mine += cost;
    }
    atomicAdd(reinterpret_cast<unsigned long long*>(&total), static_cast<unsigned long long>(mine));
    __syncthreads();
    const int64_t budget = total * side_sms / sm_count;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        const int64_t rows = offsets[g + 1] - offsets[g];
        int rank = 0;
        for (int h = 0; h < groups; ++h) {
            const int64_t other = offsets[h + 1] - offsets[h];
            rank += other < rows || (other == rows && h < g);
        }
        int64_t through = 0;  // the cost of the groups up to and including this one in row order
        for (int j = 0; j <= rank; ++j) through += cost_by_rank[j];
        side[g] = through <= budget ? 1 : 0;
    }
}

__global__ void zero_empty_groups(const int32_t* offsets, float* C, int64_t block_elems) {
    const int g = blockIdx.y;
    if (offsets[g + 1] != offsets[g]) return;
    float4* dst = reinterpret_cast<float4*>(C + int64_t(g) * block_elems);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < block_elems / 4; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace cutlass_detail
}  // namespace moekit::cuda
