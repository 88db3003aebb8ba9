// What bounds a write-bound wgrad (issue 10: dsv3-e256's 256 experts of ~128 rows each; issue 9: an ECHO rank's
// cold experts): every grouped wgrad backend writes dsv3-e256's fc1 gradients (30 GB fp32) at ~2.8 TB/s where
// cudaMemset fills the same bytes at ~4.5. This times, on the same bytes, the memset, and a persistent kernel that
// writes the gradients tile by tile in the wgrad kernels' order (groups in turn, row tiles fastest) with plain
// 16-byte stores, for several tile shapes, alone and with each tile also reading its reduction slabs (K rows of
// the A and B operands, bf16, as a wgrad tile loads them), and in a B-stationary order (a strip's B slab read
// once, A a tile), so the table says whether the store pattern, the loads beside it, or neither, costs the time
// (docs/perf.md: the loads beside the stores).
// usage: bench_wgrad_stores [--groups 256] [--m 4096] [--n 7168] [--rows 128] [--iters 10] [--json FILE]
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "io/atomic_file.h"
#include "lib/bench_main.h"
#include "lib/bench_util.cuh"
#include "moekit/error.h"

namespace wgrad_stores {  // named: nvcc's kernel stubs trip over a second anonymous namespace (bench_util.cuh's)

using namespace moekit::cuda::bench;

struct Shape {
    int groups, m, n, rows;
};

// Tile t of group g: rows [tm * TR, +TR), columns [tn * TC, +TC) of C[g] (m x n fp32), row tiles fastest. With
// kLoads the CTA first reads the tile's operand slabs, A_g[rows, tm*TR..] and B_g[rows, tn*TC..] (bf16), and folds
// them into one value it stores in place of the constant, so the loads cannot be dropped.
template <int TR, int TC, bool kLoads>
__global__ void __launch_bounds__(256) store_tiles(Shape s, float* C, const bf16* A, const bf16* B) {
    const int tiles_m = s.m / TR, tiles_n = s.n / TC, per_group = tiles_m * tiles_n;
    const int64_t total = int64_t(per_group) * s.groups;
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const int g = int(t / per_group), r = int(t % per_group), tm = r % tiles_m, tn = r / tiles_m;
        float v = 1.f;
        if constexpr (kLoads) {
            const bf16* a = A + int64_t(g) * s.rows * s.m + tm * TR;
            const bf16* b = B + int64_t(g) * s.rows * s.n + tn * TC;
            float acc = 0.f;
            for (int i = threadIdx.x; i < s.rows * TR / 8; i += blockDim.x) {
                const uint4 q = *reinterpret_cast<const uint4*>(a + int64_t(i / (TR / 8)) * s.m + (i % (TR / 8)) * 8);
                acc += __uint_as_float(q.x & 0x7fffff);
            }
            for (int i = threadIdx.x; i < s.rows * TC / 8; i += blockDim.x) {
                const uint4 q = *reinterpret_cast<const uint4*>(b + int64_t(i / (TC / 8)) * s.n + (i % (TC / 8)) * 8);
                acc += __uint_as_float(q.y & 0x7fffff);
            }
            v = acc;
        }
        float* c = C + int64_t(g) * s.m * s.n + int64_t(tm) * TR * s.n + int64_t(tn) * TC;
        for (int i = threadIdx.x; i < TR * TC / 4; i += blockDim.x)
            *reinterpret_cast<float4*>(c + int64_t(i / (TC / 4)) * s.n + (i % (TC / 4)) * 4) = make_float4(v, v, v, v);
    }
}

// B-stationary order: a CTA owns a column strip (group g, columns [tn * TC, +TC)) and reads its B slab once, then
// walks the row tiles reading only their A slabs: (m / TR) A slabs + one B slab a strip instead of both a tile.
template <int TR, int TC>
__global__ void __launch_bounds__(256) store_strips(Shape s, float* C, const bf16* A, const bf16* B) {
    const int tiles_m = s.m / TR, tiles_n = s.n / TC;
    const int64_t total = int64_t(tiles_n) * s.groups;
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const int g = int(t / tiles_n), tn = int(t % tiles_n);
        const bf16* b = B + int64_t(g) * s.rows * s.n + tn * TC;
        float acc_b = 0.f;
        for (int i = threadIdx.x; i < s.rows * TC / 8; i += blockDim.x) {
            const uint4 q = *reinterpret_cast<const uint4*>(b + int64_t(i / (TC / 8)) * s.n + (i % (TC / 8)) * 8);
            acc_b += __uint_as_float(q.y & 0x7fffff);
        }
        for (int tm = 0; tm < tiles_m; ++tm) {
            const bf16* a = A + int64_t(g) * s.rows * s.m + tm * TR;
            float acc = acc_b;
            for (int i = threadIdx.x; i < s.rows * TR / 8; i += blockDim.x) {
                const uint4 q = *reinterpret_cast<const uint4*>(a + int64_t(i / (TR / 8)) * s.m + (i % (TR / 8)) * 8);
                acc += __uint_as_float(q.x & 0x7fffff);
            }
            float* c = C + int64_t(g) * s.m * s.n + int64_t(tm) * TR * s.n + int64_t(tn) * TC;
            for (int i = threadIdx.x; i < TR * TC / 4; i += blockDim.x)
                *reinterpret_cast<float4*>(c + int64_t(i / (TC / 4)) * s.n + (i % (TC / 4)) * 4) =
                    make_float4(acc, acc, acc, acc);
        }
    }
}

// The median ms of one of the kernels above on a persistent grid: as many 256-thread CTAs as fit at once.
template <typename Kernel>
double time_persistent(Kernel kernel, const Shape& s, float* C, const bf16* A, const bf16* B, cudaStream_t st,
                       int iters) {
    int per_sm = 0, sms = 0, dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
    return time_ms(
        [&] {
            kernel<<<per_sm * sms, 256, 0, st>>>(s, C, A, B);
            MOEKIT_CUDA_LAUNCH_CHECK();
        },
        st, 2, iters);
}

}  // namespace wgrad_stores

int main(int argc, char** argv) {
    using namespace wgrad_stores;
    Shape s{256, 4096, 7168, 128};
    int iters = 10;
    std::string json_path;
    return moekit::cuda::bench::bench_main("bench_wgrad_stores", [&]() -> int {
        for (int i = 1; i < argc; ++i) {
            std::string a = argv[i];
            auto value = [&]() -> std::string {
                MOEKIT_REQUIRE(i + 1 < argc, a, " needs a value");
                return argv[++i];
            };
            if (a == "--groups")
                s.groups = std::stoi(value());
            else if (a == "--m")
                s.m = std::stoi(value());
            else if (a == "--n")
                s.n = std::stoi(value());
            else if (a == "--rows")
                s.rows = std::stoi(value());
            else if (a == "--iters")
                iters = std::stoi(value());
            else if (a == "--json")
                json_path = value();
            else
                throw moekit::UsageError("unknown flag " + a);
        }
        MOEKIT_REQUIRE(s.groups > 0 && s.m > 0 && s.m % 256 == 0 && s.n > 0 && s.n % 1024 == 0 && s.rows > 0,
                       "--groups ", s.groups, " --m ", s.m, " --n ", s.n, " --rows ", s.rows,
                       ": --m must be a positive multiple of 256 (the tiles' rows), --n of 1024 (their columns), "
                       "--groups and --rows positive");
        const size_t c_elems = size_t(s.groups) * s.m * s.n;
        DevBuf<float> C(c_elems);
        DevBuf<bf16> A(size_t(s.groups) * s.rows * s.m), B(size_t(s.groups) * s.rows * s.n);
        fill_uniform(A.ptr, size_t(s.groups) * s.rows * s.m, 1.f, 1);
        fill_uniform(B.ptr, size_t(s.groups) * s.rows * s.n, 1.f, 2);
        cudaStream_t st;
        MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        const double gb = double(c_elems) * 4 / 1e9;
        nlohmann::json out{{"groups", s.groups}, {"m", s.m}, {"n", s.n}, {"rows", s.rows}, {"gradient_gb", gb}};
        std::printf("fp32 gradients: %d groups x %d x %d = %.2f GB; operand slabs of %d rows a group\n", s.groups, s.m,
                    s.n, gb, s.rows);
        auto row = [&](const std::string& what, double ms) {
            std::printf("  %-30s %9.3f ms %7.2f TB/s written\n", what.c_str(), ms, gb / ms);
            out["rows_ms"][what] = ms;
        };
        row("cudaMemsetAsync",
            time_ms([&] { MOEKIT_CUDA_CHECK(cudaMemsetAsync(C.ptr, 0, c_elems * 4, st)); }, st, 2, iters));
#define MOEKIT_TILE_ROWS(TR, TC)                                                                               \
    row("tiles " #TR "x" #TC, time_persistent(store_tiles<TR, TC, false>, s, C.ptr, A.ptr, B.ptr, st, iters)); \
    row("tiles " #TR "x" #TC " + slab loads",                                                                  \
        time_persistent(store_tiles<TR, TC, true>, s, C.ptr, A.ptr, B.ptr, st, iters));
        MOEKIT_TILE_ROWS(128, 128)
        MOEKIT_TILE_ROWS(128, 256)
        MOEKIT_TILE_ROWS(256, 128)
        MOEKIT_TILE_ROWS(64, 512)
        MOEKIT_TILE_ROWS(32, 1024)
        MOEKIT_TILE_ROWS(8, 1024)
#undef MOEKIT_TILE_ROWS
        row("strips 128x256 (B slab once)", time_persistent(store_strips<128, 256>, s, C.ptr, A.ptr, B.ptr, st, iters));
        row("strips 128x512 (B slab once)", time_persistent(store_strips<128, 512>, s, C.ptr, A.ptr, B.ptr, st, iters));
        row("strips 64x256 (B slab once)", time_persistent(store_strips<64, 256>, s, C.ptr, A.ptr, B.ptr, st, iters));
        MOEKIT_CUDA_CHECK(cudaStreamDestroy(st));
        if (!json_path.empty()) moekit::io::write_file_atomically(json_path, out.dump(1) + "\n");
        return 0;
    });
}
