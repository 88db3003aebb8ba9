// Grouped GEMMs (src/cuda/grouped_gemm.h) and their synchronous cuBLAS baseline (grouped_gemm_sync.h) against a CPU
// float64 reference on bf16-rounded random inputs: nt / nn / tn, every compute core (mma.sync; on sm_90 also wgmma
// with cp.async loads and the warp-specialised TMA + wgmma kernel, single CTAs and 2-CTA clusters, and CUTLASS's
// pointer-array grouped GEMM in both tile configurations where it was built),
// counts with zeros, one group taking all rows, sizes off the tile grid; rows past offsets[G] stay untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "core/tile_padding_math.h"
#include "core/wgrad_split_math.h"
#include "cuda/activation.cuh"
#include "cuda/cuda_check.h"
#include "cuda/gemm_tuning.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_gemm_cutlass.h"
#include "cuda/grouped_gemm_kernels.cuh"
#include "cuda/grouped_gemm_sync.h"

namespace moekit::cuda {
namespace {

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define SKIP_WITHOUT_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or 0): GPU test skipped"
int device_major() {
    int major = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    return major;
}
#define SKIP_WITHOUT_SM90() \
    SKIP_WITHOUT_GPU();     \
    if (device_major() != 9) GTEST_SKIP() << "the fused epilogues are in the sm_90 TMA kernel"

template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t len = 0;
    explicit DeviceBuffer(size_t n) : len(n) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, sizeof(T) * (n ? n : 1))); }
    explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { upload(v); }
    ~DeviceBuffer() { cudaFree(ptr); }
    // A pageable cudaMemcpy may return before its DMA lands, and a non-blocking stream does not wait for the
    // legacy stream it went on: wait here (as the engine's copy_to_device does).
    void upload(const std::vector<T>& v) {
        MOEKIT_CUDA_CHECK(cudaMemcpy(ptr, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    }
    std::vector<T> download() const {
        std::vector<T> v(len);
        MOEKIT_CUDA_CHECK(cudaMemcpy(v.data(), ptr, sizeof(T) * len, cudaMemcpyDeviceToHost));
        return v;
    }
};

using bf16 = __nv_bfloat16;
bf16 to_bf16(float f) {
    uint16_t b = float_to_bf16_bits(f);
    bf16 h;
    std::memcpy(&h, &b, 2);
    return h;
}
float from_bf16(bf16 h) {
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return bf16_bits_to_float(b);
}
uint16_t bits(bf16 h) {
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
}
uint32_t bits(float f) {  // exact: without it a float would convert to bf16 and compare rounded
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

// Random bf16 values in [-1, 1); the first `valid` elements random, the rest NaN (must never be read into results).
std::vector<bf16> random_bf16(size_t n, uint64_t seed, size_t valid) {
    Rng rng(seed);
    std::vector<bf16> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = i < valid ? to_bf16(float(2 * rng.uniform() - 1)) : to_bf16(NAN);
    return v;
}

std::vector<int32_t> offsets_of(const std::vector<int>& counts) {
    std::vector<int32_t> off(counts.size() + 1, 0);
    for (size_t g = 0; g < counts.size(); ++g) off[g + 1] = off[g] + counts[g];
    return off;
}

std::vector<int> random_counts(int G, int total, uint64_t seed, double zero_fraction) {
    Rng rng(seed);
    std::vector<double> w(G);
    double sum = 0;
    for (auto& x : w) sum += (x = rng.uniform() < zero_fraction ? 0.0 : 0.2 + rng.uniform());
    std::vector<int> c(G, 0);
    int used = 0;
    for (int g = 0; g < G; ++g) used += (c[g] = sum > 0 ? int(total * w[g] / sum) : 0);
    for (int g = 0; used < total; g = (g + 1) % G)
        if (w[g] > 0 || sum == 0) ++c[g], ++used;
    return c;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        double d = got[i] - ref[i];
        num += std::isnan(got[i]) ? 1e30 : d * d;
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

enum class Backend {
    kMma, kWgmma, kTma, kTmaPingpong, kTmaPair, kTmaPairPingpong, kCutlassCoop, kCutlassTall, kCutlassPingpong,
    kCutlassSplit, kCutlassSwap, kCutlass2x2, kCutlassPingpongWide, kCutlassSwapPingpong, kCutlassPingpongWideT,
    kAuto, kTuned, kSync
};
const char* name(Backend b) {
    return b == Backend::kMma              ? "mma.sync"
           : b == Backend::kWgmma          ? "wgmma"
           : b == Backend::kTma            ? "tma (tn: cooperative)"
           : b == Backend::kTmaPingpong    ? "tma (tn: ping-pong)"
           : b == Backend::kTmaPair        ? "tma-cluster2 (tn: cooperative)"
           : b == Backend::kTmaPairPingpong ? "tma-cluster2 (tn: ping-pong)"
           : b == Backend::kCutlassCoop    ? "cutlass-cooperative"
           : b == Backend::kCutlassTall    ? "cutlass-cooperative-256x128"
           : b == Backend::kAuto           ? "per-shape choice"
           : b == Backend::kTuned          ? "per-shape choice measured (tuned afresh)"
           : b == Backend::kCutlassPingpong ? "cutlass-pingpong"
           : b == Backend::kCutlassSplit  ? "cutlass-split-by-size"
           : b == Backend::kCutlassSwap    ? "cutlass-swap-ab (tn: its default)"
           : b == Backend::kCutlass2x2     ? "cutlass-cooperative-2x2-cluster (nt/nn: cooperative)"
           : b == Backend::kCutlassPingpongWide ? "cutlass-pingpong-128x192"
           : b == Backend::kCutlassSwapPingpong ? "cutlass-swap-ab-pingpong (tn: its default)"
           : b == Backend::kCutlassPingpongWideT ? "cutlass-pingpong-128x192-transposed (nt/nn: 128x192)"
                                           : "sync-cublas";
}

// A process-wide switch (getter, setter) put back at the end of a test, whatever the test set it to.
template <typename T>
struct RestoredAtExit {
    void (*set)(T);
    T was;
    RestoredAtExit(T (*get)(), void (*setter)(T)) : set(setter), was(get()) {}
    ~RestoredAtExit() { set(was); }
};

// own_only: the backends that take a C aligned to 8 bytes only (the own kernels; CUTLASS needs 16).
// MOEKIT_TEST_NO_CUBLAS=1 leaves out the sync baseline: its cuBLAS kernels are not moekit's, and compute-sanitizer's
// racecheck reports hazards inside them (scripts/device_suite.sh sets it for racecheck).
std::vector<Backend> backends(bool own_only = false) {
    std::vector<Backend> out{Backend::kMma};
    const char* no_cublas = std::getenv("MOEKIT_TEST_NO_CUBLAS");
    if (!own_only && !(no_cublas && std::string(no_cublas) == "1")) out.push_back(Backend::kSync);
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major == 9 && minor == 0) {
        out.push_back(Backend::kWgmma);
        out.push_back(Backend::kTma);
        out.push_back(Backend::kTmaPingpong);
        out.push_back(Backend::kTmaPair);
        out.push_back(Backend::kTmaPairPingpong);
        if (own_only) {
            out.push_back(Backend::kAuto);  // falls back to the own kernel for such a C
            return out;
        }
        if (cutlass_grouped_gemm_built()) {
            out.push_back(Backend::kCutlassCoop);
            out.push_back(Backend::kCutlassTall);
            out.push_back(Backend::kCutlassPingpong);
            out.push_back(Backend::kCutlassSplit);
            out.push_back(Backend::kCutlassSwap);
            out.push_back(Backend::kCutlass2x2);
            out.push_back(Backend::kCutlassPingpongWide);
            out.push_back(Backend::kCutlassSwapPingpong);
            out.push_back(Backend::kCutlassPingpongWideT);
            out.push_back(Backend::kAuto);
            out.push_back(Backend::kTuned);
        }
    }
    return out;
}

void select(Backend b) {
    if (b == Backend::kMma) set_grouped_gemm_kernel(GroupedGemmKernel::kMmaSync);
    if (b == Backend::kWgmma) set_grouped_gemm_kernel(GroupedGemmKernel::kWgmma);
    const bool pair = b == Backend::kTmaPair || b == Backend::kTmaPairPingpong;
    if (b == Backend::kTma || b == Backend::kTmaPingpong || pair) set_grouped_gemm_kernel(GroupedGemmKernel::kTma);
    set_grouped_gemm_cluster(pair ? 2 : 1);
    set_tn_pingpong(b == Backend::kTmaPingpong || b == Backend::kTmaPairPingpong ? 1 : 0);
    if (b == Backend::kCutlassCoop || b == Backend::kCutlassTall || b == Backend::kCutlassPingpong ||
        b == Backend::kCutlassSplit || b == Backend::kCutlassSwap || b == Backend::kCutlass2x2 ||
        b == Backend::kCutlassPingpongWide || b == Backend::kCutlassSwapPingpong ||
        b == Backend::kCutlassPingpongWideT) {
        set_grouped_gemm_kernel(GroupedGemmKernel::kCutlass);
        set_cutlass_config(b == Backend::kCutlassCoop       ? CutlassConfig::kCooperative
                           : b == Backend::kCutlassTall     ? CutlassConfig::kCooperativeTall
                           : b == Backend::kCutlassSplit   ? CutlassConfig::kSplitBySize
                           : b == Backend::kCutlassSwap    ? CutlassConfig::kSwapAB
                           : b == Backend::kCutlass2x2     ? CutlassConfig::kCooperative2x2
                           : b == Backend::kCutlassPingpongWide ? CutlassConfig::kPingpongWide
                           : b == Backend::kCutlassSwapPingpong ? CutlassConfig::kSwapPingpong
                           : b == Backend::kCutlassPingpongWideT ? CutlassConfig::kPingpongWideTransposed
                                                            : CutlassConfig::kPingpong);
    }
    // The named ping-pong and split backends on 128x128 tiles everywhere (a wgrad's ping-pong takes 128x192 where it
    // pads little by default: the auto backend covers that, kCutlassPingpongWide forces it).
    set_wgrad_wide(b == Backend::kCutlassPingpong || b == Backend::kCutlassSplit ? 0 : -1);
    if (b == Backend::kAuto || b == Backend::kTuned) set_grouped_gemm_kernel(GroupedGemmKernel::kAuto);
    // The measured choice, tuned on this call's operands: every candidate it times runs on them, and the result is
    // the kept one's (a wgrad that accumulates keeps the rule: its candidates would add into C several times). Every
    // other backend, kAuto included, is the rule's choice or a forced one: tuning off (it is on by default).
    set_gemm_tuning(b == Backend::kTuned ? 1 : 0);
    if (b == Backend::kTuned) clear_gemm_tuning();
}
void reset_backend() {
    set_grouped_gemm_kernel(GroupedGemmKernel::kAuto);
    set_grouped_gemm_cluster(0);
    set_tn_pingpong(-1);
    set_cutlass_config(CutlassConfig::kAuto);
    set_wgrad_wide(-1);
    set_gemm_tuning(-1);
}

enum class Op { kNT, kNN };

// nt / nn: C[r] = A[r]·B[g]ᵀ or A[r]·B[g]; rows past offsets[G] (up to max_rows) must keep the canary.
void check_row_gemm(Op op, const std::vector<int>& counts, int slack_rows, int n, int k, uint64_t seed) {
    const int G = int(counts.size());
    auto off = offsets_of(counts);
    const int rows = off[G], max_rows = rows + slack_rows;
    auto A = random_bf16(size_t(max_rows) * k, seed, size_t(rows) * k);
    auto B = random_bf16(size_t(G) * n * k, seed + 1, size_t(G) * n * k);
    std::vector<double> ref(size_t(rows) * n, 0.0);
    for (int g = 0; g < G; ++g)
        for (int r = off[g]; r < off[g + 1]; ++r)
            for (int j = 0; j < n; ++j) {
                double s = 0;
                for (int q = 0; q < k; ++q) {
                    double b = op == Op::kNT ? from_bf16(B[(size_t(g) * n + j) * k + q])
                                             : from_bf16(B[(size_t(g) * k + q) * n + j]);
                    s += double(from_bf16(A[size_t(r) * k + q])) * b;
                }
                ref[size_t(r) * n + j] = s;
            }
    DeviceBuffer<bf16> dA(A), dB(B);
    DeviceBuffer<int32_t> dOff(off);
    const bf16 canary = to_bf16(-12345.f);
    GroupedGemmShape shape{G, max_rows, n, k};
    for (Backend b : backends()) {
        SCOPED_TRACE(::testing::Message() << name(b) << (op == Op::kNT ? " nt" : " nn") << " G=" << G << " n=" << n
                                          << " k=" << k << " rows=" << rows << " seed=" << seed);
        select(b);
        DeviceBuffer<bf16> dC(std::vector<bf16>(size_t(max_rows) * n, canary));
        if (b == Backend::kSync)
            (op == Op::kNT ? sync_baseline::grouped_gemm_nt : sync_baseline::grouped_gemm_nn)(
                shape, dA.ptr, dB.ptr, dC.ptr, dOff.ptr, nullptr);
        else
            (op == Op::kNT ? grouped_gemm_nt : grouped_gemm_nn)(shape, dA.ptr, dB.ptr, dC.ptr, dOff.ptr, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        auto C = dC.download();
        std::vector<double> got(size_t(rows) * n);
        for (size_t i = 0; i < got.size(); ++i) got[i] = from_bf16(C[i]);
        // bf16 output rounding (2^-9 relative) dominates; fp32 accumulation adds far less.
        EXPECT_LT(rel_err(got, ref), 1e-2);
        size_t touched = 0;
        for (size_t i = size_t(rows) * n; i < C.size(); ++i) touched += bits(C[i]) != bits(canary);
        EXPECT_EQ(touched, 0u) << "elements written past offsets[G]";
    }
    reset_backend();
}

// tn: C[g] (+)= A_gᵀ·B_g in fp32 over the group's rows (zero rows: zeroed with overwrite, unchanged with
// accumulate or overwrite_nonempty). c_shift = 2: C starts 8 bytes past a 16-byte boundary (the own TMA kernel's
// register stores instead of its bulk tensor stores; only the backends that take such a C run).
void check_tn(const std::vector<int>& counts, int slack_rows, int m, int n, WgradWrite write, uint64_t seed,
              int c_shift = 0) {
    const bool accumulate = write == WgradWrite::accumulate, keep_empty = write != WgradWrite::overwrite;
    const int G = int(counts.size());
    auto off = offsets_of(counts);
    const int rows = off[G], max_rows = rows + slack_rows;
    auto A = random_bf16(size_t(max_rows) * m, seed, size_t(rows) * m);
    auto B = random_bf16(size_t(max_rows) * n, seed + 1, size_t(rows) * n);
    Rng rng(seed + 2);
    std::vector<float> C0(size_t(G) * m * n);
    for (auto& x : C0) x = float(2 * rng.uniform() - 1);
    std::vector<double> ref(C0.size());
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < m; ++i)
            for (int j = 0; j < n; ++j) {
                double s = accumulate ? C0[(size_t(g) * m + i) * n + j] : 0.0;
                for (int r = off[g]; r < off[g + 1]; ++r)
                    s += double(from_bf16(A[size_t(r) * m + i])) * from_bf16(B[size_t(r) * n + j]);
                ref[(size_t(g) * m + i) * n + j] = s;
            }
    DeviceBuffer<bf16> dA(A), dB(B);
    DeviceBuffer<int32_t> dOff(off);
    GroupedGemmShape shape{G, max_rows, n, m};
    for (Backend b : backends(c_shift != 0)) {
        SCOPED_TRACE(::testing::Message() << name(b) << " c_shift=" << c_shift << " tn G=" << G << " m=" << m
                                          << " n=" << n << " rows=" << rows << " write=" << int(write)
                                          << " seed=" << seed);
        select(b);
        std::vector<float> shifted(size_t(c_shift), 0.f);
        shifted.insert(shifted.end(), C0.begin(), C0.end());
        DeviceBuffer<float> dC(shifted);
        float* c_ptr = dC.ptr + c_shift;
        if (b == Backend::kSync)
            sync_baseline::grouped_gemm_tn(shape, dA.ptr, dB.ptr, c_ptr, dOff.ptr, write, nullptr);
        else
            grouped_gemm_tn(shape, dA.ptr, dB.ptr, c_ptr, dOff.ptr, write, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        auto all = dC.download();
        std::vector<float> C(all.begin() + c_shift, all.end());
        std::vector<double> got(C.begin(), C.end());
        // Empty groups: compared bit for bit below; the error over the others (their C0 where left unchanged).
        for (int g = 0; g < G; ++g)
            if (counts[g] == 0 && keep_empty)
                for (size_t i = size_t(g) * m * n; i < size_t(g + 1) * m * n; ++i) got[i] = ref[i] = C0[i];
        // fp32 accumulation of up to ~1e3 products of magnitude <= 1: relative error well under 1e-4.
        EXPECT_LT(rel_err(got, ref), 1e-4);
        for (int g = 0; g < G; ++g) {
            if (counts[g] != 0) continue;
            size_t bad = 0;
            for (size_t i = size_t(g) * m * n; i < size_t(g + 1) * m * n; ++i)
                bad += keep_empty ? bits(C[i]) != bits(C0[i]) : C[i] != 0.f;
            EXPECT_EQ(bad, 0u) << "empty group " << g << " not " << (keep_empty ? "left unchanged" : "zeroed");
        }
    }
    reset_backend();
}
void check_tn(const std::vector<int>& counts, int slack_rows, int m, int n, bool accumulate, uint64_t seed,
              int c_shift = 0) {
    check_tn(counts, slack_rows, m, n, wgrad_write(accumulate), seed, c_shift);
}

// GroupedGemmShape::second_from (ECHO's spare slots in the home experts' launch): groups [L, G) take B (nt, nn) or
// C (tn) from a second buffer. On every backend, against the same backend with one base holding both parts: nt / nn
// bitwise equal; tn equal on the first base under `write`, and on the second base equal to a fresh (overwrite) run
// where the group has rows and untouched where it has none; bitwise, except with accumulate, which runs the two
// parts as launches of their own (a per-shape choice may then take another kernel: fp32 rounding).
void check_second_base(const std::vector<int>& counts, int L, int n, int k, WgradWrite write, uint64_t seed) {
    const int G = int(counts.size());
    auto off = offsets_of(counts);
    const int rows = off[G], max_rows = rows + 3;
    auto A = random_bf16(size_t(max_rows) * k, seed, size_t(rows) * k);
    auto W = random_bf16(size_t(G) * n * k, seed + 1, size_t(G) * n * k);   // nt / nn weights, both parts
    auto Bt = random_bf16(size_t(max_rows) * n, seed + 2, size_t(rows) * n);  // tn: the other row operand
    Rng rng(seed + 3);
    std::vector<float> C0(size_t(G) * k * n);  // tn: gradients before the call
    for (auto& x : C0) x = float(2 * rng.uniform() - 1);
    const size_t split_w = size_t(L) * n * k;
    DeviceBuffer<bf16> dA(A), dW(W), dBt(Bt);
    DeviceBuffer<bf16> dW1(std::vector<bf16>(W.begin(), W.begin() + split_w)),
        dW2(std::vector<bf16>(W.begin() + split_w, W.end()));
    DeviceBuffer<int32_t> dOff(off);
    const GroupedGemmShape one{G, max_rows, n, k}, two{G, max_rows, n, k, L, dW2.ptr};
    for (Backend b : backends()) {
        SCOPED_TRACE(::testing::Message() << name(b) << " second base from group " << L << " of " << G << " n=" << n
                                          << " k=" << k << " write=" << int(write) << " seed=" << seed);
        select(b);
        const bool sync = b == Backend::kSync;
        for (Op op : {Op::kNT, Op::kNN}) {
            auto f = op == Op::kNT ? (sync ? sync_baseline::grouped_gemm_nt : grouped_gemm_nt)
                                   : (sync ? sync_baseline::grouped_gemm_nn : grouped_gemm_nn);
            DeviceBuffer<bf16> c1(size_t(max_rows) * n), c2(size_t(max_rows) * n);
            f(one, dA.ptr, dW.ptr, c1.ptr, dOff.ptr, nullptr);
            f(two, dA.ptr, dW1.ptr, c2.ptr, dOff.ptr, nullptr);
            MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
            const auto r1 = c1.download(), r2 = c2.download();
            size_t differ = 0;
            for (size_t i = 0; i < size_t(rows) * n; ++i) differ += bits(r1[i]) != bits(r2[i]);
            EXPECT_EQ(differ, 0u) << (op == Op::kNT ? "nt" : "nn") << ": the second base changes the result";
        }
        // tn over the same rows: C [G, k, n] with k output rows a group.
        const GroupedGemmShape tn_one{G, max_rows, n, k};
        auto tn = sync ? sync_baseline::grouped_gemm_tn : grouped_gemm_tn;
        DeviceBuffer<float> ref_acc(C0), ref_fresh(C0);
        tn(tn_one, dA.ptr, dBt.ptr, ref_acc.ptr, dOff.ptr, write, nullptr);
        tn(tn_one, dA.ptr, dBt.ptr, ref_fresh.ptr, dOff.ptr, WgradWrite::overwrite, nullptr);
        const size_t split_c = size_t(L) * k * n;
        DeviceBuffer<float> d1(std::vector<float>(C0.begin(), C0.begin() + split_c)),
            d2(std::vector<float>(C0.begin() + split_c, C0.end()));
        tn(GroupedGemmShape{G, max_rows, n, k, L, d2.ptr}, dA.ptr, dBt.ptr, d1.ptr, dOff.ptr, write, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto want_first = ref_acc.download(), want_second = ref_fresh.download();
        const auto got1 = d1.download(), got2 = d2.download();
        // |got - want| <= tol * (|want| + 1): 0 = bitwise (the sum of products of values <= 1 over <= 1200 rows).
        const float tol = write == WgradWrite::accumulate ? 1e-5f : 0.f;
        auto differs = [&](float got, float want) {
            return tol == 0.f ? bits(got) != bits(want) : !(std::fabs(got - want) <= tol * (std::fabs(want) + 1.f));
        };
        size_t bad1 = 0, bad2 = 0;
        for (size_t i = 0; i < split_c; ++i) bad1 += differs(got1[i], want_first[i]);
        for (int g = L; g < G; ++g)
            for (size_t i = 0; i < size_t(k) * n; ++i) {
                const size_t at = size_t(g - L) * k * n + i, whole = size_t(g) * k * n + i;
                bad2 += counts[g] > 0 ? differs(got2[at], want_second[whole]) : bits(got2[at]) != bits(C0[whole]);
            }
        EXPECT_EQ(bad1, 0u) << "tn: the first base's blocks differ from one base";
        EXPECT_EQ(bad2, 0u) << "tn: the second base's blocks are not fresh where filled, untouched where empty";
    }
    reset_backend();
}

}  // namespace

TEST(GroupedGemm, EmptyFirstGroupTiny) {
    SKIP_WITHOUT_GPU();
    check_row_gemm(Op::kNT, {0, 4}, 3, 64, 32, 11);
    check_row_gemm(Op::kNN, {0, 4}, 3, 64, 32, 12);
    check_tn({0, 4}, 3, 64, 32, false, 13);
}

TEST(GroupedGemm, AllRowsInOneGroup) {
    SKIP_WITHOUT_GPU();
    check_row_gemm(Op::kNT, {0, 0, 300, 0}, 0, 256, 128, 21);
    check_row_gemm(Op::kNN, {0, 0, 300, 0}, 17, 256, 128, 22);
    check_tn({0, 0, 300, 0}, 5, 128, 256, false, 23);
}

TEST(GroupedGemm, UnevenCountsWithZerosMidShape) {
    SKIP_WITHOUT_GPU();
    // G=8, H=256, F=384 (SwiGLU fc1 n = 2F = 768): fc1 forward, fc2 forward, dgrad, wgrad shapes.
    auto counts = random_counts(8, 1000, 31, 0.25);
    check_row_gemm(Op::kNT, counts, 24, 768, 256, 32);  // fc1: X·W1ᵀ
    check_row_gemm(Op::kNT, counts, 24, 256, 384, 33);  // fc2: A·W2ᵀ
    check_row_gemm(Op::kNN, counts, 24, 256, 768, 34);  // dgrad fc1: dH·W1
    check_tn(counts, 24, 768, 256, false, 35);          // wgrad fc1: dHᵀ·X
}

TEST(GroupedGemm, SizesOffTheTileGrid) {
    SKIP_WITHOUT_GPU();
    // n, k multiples of 8 but not of any tile; row counts not multiples of the row tile.
    std::vector<int> counts{1, 129, 0, 65, 7, 255};
    check_row_gemm(Op::kNT, counts, 9, 200, 72, 41);
    check_row_gemm(Op::kNN, counts, 9, 136, 264, 42);
    check_tn(counts, 9, 200, 136, false, 43);
    check_tn(counts, 9, 72, 264, true, 44);
}

TEST(GroupedGemm, LastRowTilesOfEverySize) {
    SKIP_WITHOUT_GPU();
    // Groups whose last 128-row tile holds 1..64 rows (1, 64, 129, 192, 1088, 1030), 65..127 rows (65, 127, 193,
    // 200), exactly 128 (128) or no group at all (0): every backend's row tiles cut at each group's end.
    const std::vector<int> counts{1, 64, 65, 127, 128, 129, 192, 193, 0, 1088, 1030, 200};
    check_row_gemm(Op::kNT, counts, 7, 512, 192, 301);
    check_row_gemm(Op::kNN, counts, 7, 520, 136, 302);
}

TEST(GroupedGemm, MidGroupsTransposedWhereWideTilesPad) {
    SKIP_WITHOUT_GPU();
    // Mid-sized groups (>= 256 rows a group) with n = 512, where 128x192 tiles would pad 50 % and 128-row weight tiles
    // fill the 2x1 cluster, and a short reduction: the per-shape choice computes nt / nn transposed on ping-pong
    // (swapped_pingpong_pays_nt); with k = 2304 it does not, and the long reduction takes CUTLASS's cooperative
    // 128x256 (pingpong_pays_reduction). Every backend, the choice among them, against the oracle.
    ASSERT_TRUE(swapped_pingpong_pays_nt(512, 256));
    ASSERT_FALSE(swapped_pingpong_pays_nt(512, 2304));
    ASSERT_FALSE(pingpong_pays_reduction(2304));
    const std::vector<int> counts{300, 257, 0, 412, 380, 299, 256, 341};
    check_row_gemm(Op::kNT, counts, 3, 512, 256, 311);
    check_row_gemm(Op::kNN, counts, 3, 512, 256, 312);
    check_row_gemm(Op::kNT, counts, 3, 512, 2304, 313);
    check_row_gemm(Op::kNN, counts, 3, 512, 2304, 314);
}

TEST(GroupedGemm, ManyGroupsSmallCounts) {
    SKIP_WITHOUT_GPU();
    auto counts = random_counts(64, 700, 51, 0.3);
    check_row_gemm(Op::kNT, counts, 0, 128, 64, 52);
    check_row_gemm(Op::kNN, counts, 0, 64, 128, 53);
    check_tn(counts, 0, 64, 128, true, 54);
}

TEST(GroupedGemm, MoreTilesThanMultiprocessors) {
    SKIP_WITHOUT_GPU();
    // The persistent TMA kernel runs one CTA per SM (132 on H100/H200): here nt/nn have 189 tile slots and tn 144
    // tiles, so CTAs walk several tiles and the stage ring carries over between them.
    auto counts = random_counts(16, 6000, 71, 0.2);
    check_row_gemm(Op::kNT, counts, 5, 768, 64, 72);
    check_row_gemm(Op::kNN, counts, 5, 768, 64, 73);
    check_tn(counts, 5, 384, 768, true, 74);
}

TEST(GroupedGemm, GridLeavingSmsToOtherKernels) {
    SKIP_WITHOUT_GPU();
    // Under a GemmSmsLeftScope (the layer's wgrads beside the dgrad chain, moe_layer.h set_wgrad_overlap) every
    // backend's persistent grid is smaller: 16 SMs and half the device left, more tiles than CTAs, against the CPU
    // oracle; the scope restores the whole grid when it ends.
    const int sms = grouped_gemm_sm_count();
    const auto counts = random_counts(16, 6000, 191, 0.2);
    for (const int left : {16, sms / 2}) {
        SCOPED_TRACE(std::to_string(left) + " SMs left");
        const GemmSmsLeftScope scope(left);
        EXPECT_EQ(grouped_gemm_grid_sms(2), (sms - left) / 2 * 2);
        check_row_gemm(Op::kNT, counts, 5, 768, 64, 192);
        check_row_gemm(Op::kNN, counts, 5, 768, 64, 193);
        check_tn(counts, 5, 384, 768, true, 194);
        check_tn(counts, 5, 384, 768, false, 195);
    }
    EXPECT_EQ(grouped_gemm_grid_sms(2), sms);
}

TEST(GroupedGemm, WgradPingpongManyLongJobsPerWarpgroup) {
    SKIP_WITHOUT_GPU();
    // The ping-pong wgrad (tma_wgrad_pingpong_kernel) hands a CTA's jobs to its two consumer warpgroups in turn: 400
    // groups of one 128 x 128 tile, so each warpgroup of the 132 CTAs walks one or two jobs; reductions of 0 to ~1000
    // rows, most longer than the 6-stage ring (a warpgroup that started a job before the other finished waiting on
    // the previous one would read a stage's parity a phase early); empty groups among them; every wgrad mode.
    // With two and with four staging buffers a warpgroup (set_tn_pingpong_buffers: 6 or 5 ring stages).
    const auto counts = random_counts(400, 180000, 181, 0.1);
    for (int buffers : {2, 4}) {
        SCOPED_TRACE(std::to_string(buffers) + " staging buffers a warpgroup");
        set_tn_pingpong_buffers(buffers);
        check_tn(counts, 5, 128, 128, false, 182);
        check_tn(counts, 5, 128, 128, true, 183);
        check_tn(counts, 5, 128, 128, WgradWrite::overwrite_nonempty, 184);
        // Gradient widths that are not multiples of 64 (2-D boxes, partial chunks) and a tile's last chunks skipped.
        check_tn(random_counts(30, 9000, 185, 0.2), 5, 200, 96, true, 186);
    }
    set_tn_pingpong_buffers(-1);
}

TEST(GroupedGemm, LargeGroupsLongReduction) {
    SKIP_WITHOUT_GPU();
    // >= 1536 rows per group and k >= 2n: the per-shape choice's CUTLASS-cooperative branch (nt/nn); tn its
    // large-group branch (CUTLASS ping-pong) on gradients wider and taller than wide; one group empty.
    std::vector<int> counts{1700, 0, 3000};  // max_rows / G = 1567
    check_row_gemm(Op::kNT, counts, 3, 64, 256, 91);
    check_row_gemm(Op::kNN, counts, 3, 64, 256, 92);
    check_tn(counts, 3, 64, 128, true, 93);
    check_tn(counts, 3, 256, 128, true, 94);
}

TEST(GroupedGemm, WgradGroupsSplitBySize) {
    SKIP_WITHOUT_GPU();
    // CUTLASS's kSplitBySize wgrad launches cooperative for wgrad_split()'s small (and large) groups and ping-pong
    // for the rest, each giving the other's groups no tiles: only small groups, only mid-sized ones, an ECHO rank's
    // mix (large, small and empty interleaved, sizes at the bound), with and without accumulation.
    ASSERT_EQ(wgrad_split().small_below, WgradSplit{}.small_below) << "run without MOEKIT_WGRAD_SPLIT_ROWS";
    const std::vector<int> small{40, 200, 90, 383, 256}, large{400, 410, 390, 405, 396},
        mixed{1500, 40, 0, 384, 383, 900, 0, 60, 1, 256};
    for (bool acc : {false, true}) {
        check_tn(small, 7, 192, 256, acc, 111 + acc);
        check_tn(large, 7, 192, 256, acc, 113 + acc);
        check_tn(mixed, 7, 192, 256, acc, 115 + acc);
    }
    check_tn(mixed, 7, 192, 256, WgradWrite::overwrite_nonempty, 117);
}

TEST(GroupedGemm, WgradOnWideTilesWhereTheyPadLittle) {
    SKIP_WITHOUT_GPU();
    // set_wgrad_wide(1): the per-shape choice (the auto backend) puts mid-sized groups' wgrads on 128x192 ping-pong
    // tiles where n pads little (n = 384: two tiles, one cluster), alone and as the split's ping-pong share (groups
    // of 333 rows go cooperative, the others ping-pong); n = 320 pads 20 %: 128x128. Every other backend of check_tn
    // runs beside it. With and without accumulation, one group empty, one past a 64-row step.
    // With set_wgrad_wide_transposed(1), m = 384 and n = 320 is computed transposed (the 192 along m).
    const std::vector<int> counts{700, 0, 333, 1025, 512};
    for (int split : {0, 1}) {
        SCOPED_TRACE(split ? "split by size" : "ping-pong alone");
        set_wgrad_wide(1);
        set_wgrad_wide_transposed(1);
        set_wgrad_split(split);
        for (WgradWrite w : {WgradWrite::overwrite, WgradWrite::accumulate}) {
            check_tn(counts, 5, 256, 384, w, 171 + int(w) + 4 * split);
            check_tn(counts, 5, 136, 320, w, 173 + int(w) + 4 * split);
            check_tn(counts, 5, 384, 320, w, 181 + int(w) + 4 * split);
        }
    }
    set_wgrad_wide(-1);
    set_wgrad_wide_transposed(-1);
    set_wgrad_split(-1);
}

TEST(GroupedGemm, WgradStoresPlainAndEvictFirst) {
    SKIP_WITHOUT_GPU();
    // Both ways the wgrad epilogue stores the gradient (WgradStores: CUTLASS's plain TMA stores, or marked
    // evict-first in L2; auto uses the latter on small groups only), every backend: small groups (the 2x2-cluster
    // configuration), mid-sized ones with zeros, one group taking every row; overwrite, accumulate, and
    // overwrite_nonempty.
    const RestoredAtExit<WgradStores> restore(wgrad_stores, set_wgrad_stores);
    for (WgradStores stores : {WgradStores::kPlain, WgradStores::kEvictFirst}) {
        SCOPED_TRACE(stores == WgradStores::kPlain ? "plain stores" : "evict-first stores");
        set_wgrad_stores(stores);
        check_tn(random_counts(24, 3000, 151, 0.25), 5, 256, 192, false, 152);
        check_tn({0, 0, 700, 0}, 3, 192, 256, true, 153);
        check_tn(random_counts(10, 4000, 154, 0.2), 4, 128, 264, WgradWrite::overwrite_nonempty, 155);
    }
}

TEST(GroupedGemm, EveryTileOrder) {
    SKIP_WITHOUT_GPU();
    // CUTLASS's group scheduler walking M or N (CutlassRaster; auto walks N only for a wgrad whose [rows, M]
    // operand overflows half the L2, which these shapes do not), every backend: wgrads wider than tall and taller
    // than wide, with zeros, off the tile grid, small, mid-sized and large groups; the row GEMMs too.
    const RestoredAtExit<CutlassRaster> restore(cutlass_raster, set_cutlass_raster);
    for (CutlassRaster raster : {CutlassRaster::kAlongM, CutlassRaster::kAlongN}) {
        SCOPED_TRACE(raster == CutlassRaster::kAlongM ? "along M" : "along N");
        set_cutlass_raster(raster);
        const auto mid = random_counts(12, 5000, 161, 0.25);
        check_tn(mid, 5, 776, 192, false, 162);
        check_tn(mid, 5, 192, 776, true, 163);
        check_tn({1700, 0, 3000}, 3, 1032, 256, WgradWrite::overwrite_nonempty, 164);
        check_tn({40, 200, 0, 90, 130}, 3, 320, 136, false, 165);
        check_row_gemm(Op::kNT, mid, 4, 776, 192, 166);
        check_row_gemm(Op::kNN, mid, 4, 192, 776, 167);
    }
}

TEST(GroupedGemm, SecondOperandBaseForTheLastGroups) {
    SKIP_WITHOUT_GPU();
    // ECHO's layout: L home groups, then S slot groups whose weights / gradients live in another buffer; slots with
    // and without rows, an empty home group, one slot taking most rows; every wgrad mode (accumulate: two launches).
    for (WgradWrite w : {WgradWrite::overwrite, WgradWrite::accumulate, WgradWrite::overwrite_nonempty}) {
        check_second_base({300, 0, 129, 64, 517, 0}, 4, 256, 192, w, 141);
        check_second_base({40, 70, 0, 90, 1200}, 3, 128, 136, w, 142);
        check_second_base(random_counts(12, 3000, 143, 0.2), 10, 192, 256, w, 144);
    }
}

TEST(GroupedGemm, WgradEmptyGroupsLeftUnwritten) {
    SKIP_WITHOUT_GPU();
    // overwrite_nonempty (ECHO's spare-slot gradients): the non-empty groups' blocks are overwritten as with
    // overwrite, the empty ones keep their previous bits on every backend; empty groups first, last, in runs,
    // one group taking every row, and no rows at all.
    for (const std::vector<int>& counts : std::vector<std::vector<int>>{
             {0, 300, 0}, {13, 0, 0, 700, 0, 1}, {0, 0, 0, 520, 0}, {0, 0, 0}, random_counts(9, 1200, 131, 0.4)}) {
        check_tn(counts, 3, 192, 256, WgradWrite::overwrite_nonempty, 132);
        check_tn(counts, 2, 136, 64, WgradWrite::overwrite_nonempty, 133);
    }
}

TEST(GroupedGemm, WgradGradientOffSixteenBytes) {
    SKIP_WITHOUT_GPU();
    // A C aligned to 8 bytes only (TMA stores need 16): the own kernels store tn's fp32 tiles from registers.
    std::vector<int> counts{0, 300, 17, 0, 129, 64};
    check_tn(counts, 5, 192, 264, false, 101, 2);
    check_tn(counts, 5, 192, 264, true, 102, 2);
    check_tn(counts, 5, 192, 264, WgradWrite::overwrite_nonempty, 103, 2);
}

TEST(GroupedGemm, WgradHotColdInterleave) {
    SKIP_WITHOUT_GPU();
    // tn with a few large groups among many small and some empty ones (an ECHO rank's groups) through the own
    // kernel's hot/cold interleave (set_tn_interleave) at three thresholds: every group cold, a mix, every non-empty
    // group hot; more tiles than CTAs, so CTAs walk several of each kind. (Other backends ignore the setting.)
    std::vector<int> counts;  // 40 groups: 4 of 600..900 rows, 4 empty, 32 of 1..120
    Rng rng(97);
    for (int g = 0; g < 40; ++g)
        counts.push_back(g % 10 == 3 ? 600 + int(rng.uniform() * 300) : g % 7 == 5 ? 0 : 1 + int(rng.uniform() * 120));
    for (int hot : {1 << 20, 500, 1}) {
        SCOPED_TRACE(::testing::Message() << "hot rows " << hot);
        set_tn_interleave(hot);
        check_tn(counts, 5, 256, 512, false, 98);
        check_tn(counts, 5, 384, 256, true, 99);
        check_tn(counts, 5, 256, 512, WgradWrite::overwrite_nonempty, 100);
    }
    set_tn_interleave(-1);
}

// fc2's dgrad with the gated activation's backward in its epilogue (grouped_gemm_nn_glu_backward) against the
// unfused pair grouped_gemm_nn + activation_backward on the same kernel: d gate / d up bitwise equal, rows past
// offsets[G] untouched, d prob (summed in another order) within fp32 rounding. Random counts with empty groups,
// one group taking every row, output widths off the 128- and 256-column tiles (320, 192) and on them (512, 256);
// SwiGLU and GeGLU; the own kernel (single CTAs and 2-CTA clusters) and CUTLASS's ping-pong (its epilogue visitor,
// glu_backward_visitor.cuh); probs and no probs. A kernel without the epilogue, or a shape the fusion is not wanted
// on (set_glu_backward_fusion, else per shape), launches nothing.
void check_glu_backward(const std::vector<int>& counts, int slack_rows, int n, int k, Activation act, bool with_probs,
                        uint64_t seed, int fusion_mode = 1) {
    set_glu_backward_fusion(fusion_mode);
    const int G = int(counts.size());
    const auto off = offsets_of(counts);
    const int rows = off[G], max_rows = rows + slack_rows;
    const auto dY = random_bf16(size_t(max_rows) * k, seed, size_t(max_rows) * k);
    const auto W = random_bf16(size_t(G) * k * n, seed + 1, size_t(G) * k * n);
    const auto fc1 = random_bf16(size_t(max_rows) * 2 * n, seed + 2, size_t(max_rows) * 2 * n);
    Rng rng(seed + 3);
    std::vector<float> probs(static_cast<size_t>(max_rows));
    for (auto& p : probs) p = float(rng.uniform());
    DeviceBuffer<bf16> d_dY(dY), d_W(W), d_fc1(fc1), d_dA(size_t(max_rows) * n);
    DeviceBuffer<bf16> ref(size_t(max_rows) * 2 * n), fused(size_t(max_rows) * 2 * n);
    DeviceBuffer<float> d_probs(probs), dp_ref(static_cast<size_t>(max_rows)), dp_fused(static_cast<size_t>(max_rows));
    const int64_t tiles = glu_backward_tiles(n);
    DeviceBuffer<float> partials(size_t(max_rows) * tiles);
    DeviceBuffer<int32_t> d_off(off);
    const GroupedGemmShape shape{G, max_rows, n, k};
    const float* p = with_probs ? d_probs.ptr : nullptr;
    const int32_t* num_rows = d_off.ptr + G;
    const bool wanted = glu_backward_fusion_enabled(shape);
    for (Backend b : {Backend::kTma, Backend::kTmaPair, Backend::kCutlassPingpong, Backend::kCutlassCoop}) {
        const bool cutlass = b == Backend::kCutlassPingpong || b == Backend::kCutlassCoop;
        if (cutlass && !cutlass_grouped_gemm_built()) continue;
        SCOPED_TRACE(::testing::Message() << name(b) << " G=" << G << " rows=" << rows << " n=" << n << " k=" << k
                                          << " act=" << int(act) << " probs=" << with_probs << " seed=" << seed);
        select(b);
        const std::vector<bf16> sentinel(size_t(max_rows) * 2 * n, to_bf16(7.0f));
        ref.upload(sentinel), fused.upload(sentinel);
        grouped_gemm_nn(shape, d_dY.ptr, d_W.ptr, d_dA.ptr, d_off.ptr, nullptr);
        activation_backward<float>(ActivationShape{max_rows, n, true, act}, num_rows, d_fc1.ptr, p, d_dA.ptr, ref.ptr,
                                   dp_ref.ptr, nullptr);
        const bool launched = grouped_gemm_nn_glu_backward(
            shape, d_dY.ptr, d_W.ptr, d_off.ptr, GluBackwardEpilogue{d_fc1.ptr, p, fused.ptr, partials.ptr, act},
            nullptr);
        // Forced cooperative keeps its unfused kernel; by default (-1) the per-shape choice decides.
        if (b == Backend::kCutlassCoop || !wanted) {
            EXPECT_FALSE(launched);
            MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
            auto untouched = fused.download();
            EXPECT_EQ(0, std::memcmp(untouched.data(), sentinel.data(), sizeof(bf16) * sentinel.size()));
            continue;
        }
        ASSERT_TRUE(launched);
        activation_backward_probs_from_partials(max_rows, num_rows, partials.ptr, tiles, dp_fused.ptr, nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto gr = ref.download(), gf = fused.download();
        size_t differ = 0, touched_past = 0;
        for (size_t i = 0; i < size_t(rows) * 2 * n; ++i) differ += bits(gr[i]) != bits(gf[i]);
        for (size_t i = size_t(rows) * 2 * n; i < gf.size(); ++i) touched_past += bits(gf[i]) != bits(sentinel[i]);
        EXPECT_EQ(differ, 0u) << "d gate / d up differ from the unfused pair";
        EXPECT_EQ(touched_past, 0u) << "rows past offsets[G] written";
        const auto a = dp_ref.download(), c = dp_fused.download();
        std::vector<double> want(a.begin(), a.begin() + rows), got(c.begin(), c.begin() + rows);
        if (rows > 0) EXPECT_LT(rel_err(got, want), 1e-5) << "d prob";
    }
    reset_backend();
}

TEST(GroupedGemm, GluBackwardEpilogueMatchesUnfused) {
    SKIP_WITHOUT_SM90();
    check_glu_backward(random_counts(7, 900, 111, 0.3), 9, 320, 192, Activation::silu, true, 112);
    check_glu_backward(random_counts(5, 700, 113, 0.0), 0, 512, 128, Activation::gelu, false, 114);
    check_glu_backward({0, 0, 650, 0}, 5, 320, 64, Activation::silu, true, 115);  // one group takes every row
    check_glu_backward({0, 0, 0}, 4, 256, 64, Activation::silu, true, 116);       // no rows at all
    // Several tiles a CTA (about 600 tiles of 128 x 256 on the own kernel).
    check_glu_backward(random_counts(16, 1500, 119, 0.1), 7, 768, 128, Activation::silu, true, 120);
    check_glu_backward(random_counts(6, 1500, 117, 0.2), 3, 192, 256, Activation::silu, true, 118, -1);  // default
    set_glu_backward_fusion(-1);
}

// fc1's forward with the gated activation in its epilogue (grouped_gemm_nt_glu_forward) against the unfused pair on
// the own kernel (grouped_gemm_nt + activation_forward), its epilogue on warps of its own or in the consumers:
// [gate | up] and the activation bitwise equal, rows past offsets[G] untouched. F off the 128-column tile grid (a
// tile's gate box then reads up rows, its up box rows past 2F), ECHO's second weight base, SwiGLU and GeGLU, probs and none; the own kernel alone and in 2-CTA clusters, and
// the per-shape choice (which fuses on the own kernel). Forced CUTLASS, or the fusion off, launches nothing.
void check_glu_forward(const std::vector<int>& counts, int slack_rows, int F, int k, Activation act, bool with_probs,
                       uint64_t seed, int second_from = 0, int fusion_mode = 1) {
    set_glu_forward_fusion(fusion_mode);
    const int G = int(counts.size()), n = 2 * F;
    const auto off = offsets_of(counts);
    const int rows = off[G], max_rows = rows + slack_rows;
    const int G1 = second_from > 0 ? second_from : G;
    // X's rows gathered from a token matrix (row r = token row_token[r], tokens repeating as top-k routing repeats
    // them), so the gathered launch (RowGather) has the same A; rows past offsets[G] NaN.
    const int T = rows / 3 + 1;
    const auto tokens = random_bf16(size_t(T) * k, seed + 4, size_t(T) * k);
    std::vector<int32_t> row_token(size_t(max_rows) + 1, -1);  // never read past offsets[G]
    Rng pick(seed + 5);
    auto X = random_bf16(size_t(max_rows) * k, seed, size_t(rows) * k);
    for (int r = 0; r < rows; ++r) {
        row_token[r] = int32_t(pick.below(T));
        std::memcpy(&X[size_t(r) * k], &tokens[size_t(row_token[r]) * k], sizeof(bf16) * k);
    }
    DeviceBuffer<bf16> d_tokens(tokens), gathered(size_t(max_rows) * k);
    DeviceBuffer<int32_t> d_row_token(row_token);
    const std::vector<bf16> canary_rows(size_t(max_rows) * k, to_bf16(5.0f));
    const auto W = random_bf16(size_t(G1) * n * k, seed + 1, size_t(G1) * n * k);
    const auto W2 = random_bf16(size_t(G - G1) * n * k + 1, seed + 2, size_t(G - G1) * n * k + 1);
    Rng rng(seed + 3);
    std::vector<float> probs(static_cast<size_t>(max_rows));
    for (auto& p : probs) p = float(rng.uniform());
    DeviceBuffer<bf16> d_X(X), d_W(W), d_W2(W2);
    DeviceBuffer<bf16> ref_fc1(size_t(max_rows) * n), ref_act(size_t(max_rows) * F);
    DeviceBuffer<bf16> fc1(size_t(max_rows) * n), act_out(size_t(max_rows) * F);
    DeviceBuffer<float> d_probs(probs);
    DeviceBuffer<int32_t> d_off(off);
    const GroupedGemmShape shape{G, max_rows, n, k, second_from, second_from > 0 ? d_W2.ptr : nullptr};
    const float* p = with_probs ? d_probs.ptr : nullptr;
    const std::vector<bf16> canary_fc1(size_t(max_rows) * n, to_bf16(7.0f)), canary_act(size_t(max_rows) * F,
                                                                                          to_bf16(-3.0f));
    ref_fc1.upload(canary_fc1), ref_act.upload(canary_act);
    select(Backend::kTma);
    grouped_gemm_nt(shape, d_X.ptr, d_W.ptr, ref_fc1.ptr, d_off.ptr, nullptr);
    activation_forward<float>(ActivationShape{max_rows, F, true, act}, d_off.ptr + G, ref_fc1.ptr, p, ref_act.ptr,
                              nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto want_fc1 = ref_fc1.download(), want_act = ref_act.download();
    for (Backend b : {Backend::kTma, Backend::kTmaPair, Backend::kAuto, Backend::kCutlassPingpong})
    for (const int async : {1, 0})
    for (const int gather : {0, 1}) {
        if (b == Backend::kCutlassPingpong && !cutlass_grouped_gemm_built()) continue;
        SCOPED_TRACE(::testing::Message() << name(b) << (async ? " async" : " inline") << " epilogue G=" << G
                                          << " rows=" << rows << " F=" << F << " k=" << k << " act=" << int(act)
                                          << " probs=" << with_probs << " second_from=" << second_from
                                          << (gather ? " gathered A" : "") << " seed=" << seed);
        select(b);
        set_glu_forward_async_epilogue(async);
        set_fc1_gather(1);
        fc1.upload(canary_fc1), act_out.upload(canary_act), gathered.upload(canary_rows);
        // Gathered: A is the copy's buffer, holding only the canary, so a launch that read A would differ.
        const RowGather rg{d_tokens.ptr, d_row_token.ptr, gathered.ptr};
        const bool launched = grouped_gemm_nt_glu_forward(shape, gather ? gathered.ptr : d_X.ptr, d_W.ptr, fc1.ptr,
                                                          d_off.ptr, GluForwardEpilogue{p, act_out.ptr, act}, nullptr,
                                                          gather ? &rg : nullptr);
        MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto got_fc1 = fc1.download(), got_act = act_out.download(), got_rows = gathered.download();
        if (b == Backend::kCutlassPingpong || !glu_forward_fusion_enabled(shape) ||
            (gather && !fc1_gather_enabled(shape))) {
            EXPECT_FALSE(launched);
            EXPECT_FALSE(gather && async && b == Backend::kTma && glu_forward_fusion_enabled(shape))
                << "the own kernel on single CTAs declined to gather";
            EXPECT_EQ(0, std::memcmp(got_fc1.data(), canary_fc1.data(), sizeof(bf16) * got_fc1.size()));
            EXPECT_EQ(0, std::memcmp(got_act.data(), canary_act.data(), sizeof(bf16) * got_act.size()));
            EXPECT_EQ(0, std::memcmp(got_rows.data(), canary_rows.data(), sizeof(bf16) * got_rows.size()));
            continue;
        }
        ASSERT_TRUE(launched);
        if (gather) {  // the permuted copy: X's rows up to offsets[G], the canary past them
            size_t rows_differ = 0;
            for (size_t i = 0; i < got_rows.size(); ++i)
                rows_differ += bits(got_rows[i]) != bits(i < size_t(rows) * k ? X[i] : canary_rows[i]);
            EXPECT_EQ(rows_differ, 0u) << "the gathered rows' copy differs from the permuted rows";
        }
        size_t fc1_differ = 0, act_differ = 0, nonzero = 0;
        for (size_t i = 0; i < got_fc1.size(); ++i) fc1_differ += bits(got_fc1[i]) != bits(want_fc1[i]);
        for (size_t i = 0; i < got_act.size(); ++i) {
            act_differ += bits(got_act[i]) != bits(want_act[i]);
            nonzero += i < size_t(rows) * F && from_bf16(got_act[i]) != 0.0f;
        }
        EXPECT_EQ(fc1_differ, 0u) << "[gate | up] differ from grouped_gemm_nt (or rows past offsets[G] written)";
        EXPECT_EQ(act_differ, 0u) << "the activation differs from activation_forward (or rows past offsets[G])";
        if (rows > 0) EXPECT_GT(nonzero, size_t(rows) * F / 2) << "the activation is mostly zero";
    }
    set_glu_forward_async_epilogue(-1);
    set_fc1_gather(-1);
    reset_backend();
}

TEST(GroupedGemm, GluForwardEpilogueMatchesUnfused) {
    SKIP_WITHOUT_SM90();
    check_glu_forward(random_counts(7, 900, 121, 0.3), 9, 320, 192, Activation::silu, true, 122);
    check_glu_forward(random_counts(5, 700, 123, 0.0), 0, 256, 128, Activation::gelu, false, 124);
    check_glu_forward(random_counts(6, 800, 125, 0.2), 4, 200, 64, Activation::silu, true, 126, 4);  // ECHO slots
    check_glu_forward({0, 0, 650, 0}, 5, 136, 64, Activation::silu, true, 127);  // one group takes every row
    check_glu_forward({0, 0, 0}, 4, 128, 64, Activation::silu, true, 128);       // no rows at all
    check_glu_forward(random_counts(4, 500, 129, 0.0), 3, 192, 128, Activation::silu, true, 130, 0, 0);  // off
    // A reduction off the 64-column stage (the gathered stage's chunks past k are zero-filled); several tiles a CTA.
    check_glu_forward(random_counts(6, 1100, 135, 0.1), 7, 256, 136, Activation::silu, true, 136);
    check_glu_forward(random_counts(16, 4000, 137, 0.1), 5, 384, 128, Activation::silu, true, 138);
    // By default per shape: small groups keep CUTLASS and the activation pass, mid-sized groups with a short
    // reduction fuse.
    set_glu_forward_fusion(-1);
    if (!std::getenv("MOEKIT_FUSE_GLU_FORWARD")) {
        EXPECT_FALSE(glu_forward_fusion_enabled(GroupedGemmShape{4, 500, 384, 128}));
        EXPECT_TRUE(glu_forward_fusion_enabled(GroupedGemmShape{2, 1200, 256, 128}));
        EXPECT_FALSE(glu_forward_fusion_enabled(GroupedGemmShape{2, 1200, 256, 4096}));
        set_fc1_gather(-1);
        if (!std::getenv("MOEKIT_GATHER_FC1"))  // gathering is opt-in: it measured slower
            EXPECT_FALSE(fc1_gather_enabled(GroupedGemmShape{2, 1200, 256, 128}));
    }
    check_glu_forward(random_counts(4, 500, 131, 0.0), 3, 192, 128, Activation::silu, true, 132, 0, -1);
    check_glu_forward(random_counts(2, 1200, 133, 0.0), 0, 128, 128, Activation::silu, true, 134, 0, -1);
    set_glu_forward_fusion(-1);
}

TEST(GroupedGemm, RejectsUnalignedSizes) {
    SKIP_WITHOUT_GPU();
    GroupedGemmShape shape{2, 16, 60, 64};
    DeviceBuffer<bf16> A(16 * 64), B(2 * 64 * 64), C(16 * 64);
    DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 8, 16});
    EXPECT_THROW(grouped_gemm_nt(shape, A.ptr, B.ptr, C.ptr, off.ptr, nullptr), Error);
}

TEST(GroupedGemm, SyncBaselineCountsHostSyncs) {
    SKIP_WITHOUT_GPU();
    GroupedGemmShape shape{2, 16, 64, 64};
    DeviceBuffer<bf16> A(random_bf16(16 * 64, 61, 16 * 64)), B(random_bf16(2 * 64 * 64, 62, 2 * 64 * 64));
    DeviceBuffer<bf16> C(16 * 64);
    DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 8, 16});
    int64_t before = sync_baseline::host_sync_count();
    sync_baseline::grouped_gemm_nt(shape, A.ptr, B.ptr, C.ptr, off.ptr, nullptr);
    sync_baseline::grouped_gemm_nn(shape, A.ptr, B.ptr, C.ptr, off.ptr, nullptr);
    EXPECT_EQ(sync_baseline::host_sync_count() - before, 2);
}

// Every sync-free backend captured in ONE graph (global capture mode: a host sync would fail it), then replayed
// after the device offsets changed: the replay must follow the new counts (read on the device, never baked in).
TEST(GroupedGemm, GraphReplayFollowsNewDeviceCounts) {
    SKIP_WITHOUT_GPU();
    const int G = 6, n = 192, k = 128, max_rows = 900;
    const std::vector<int> before{100, 0, 300, 7, 250, 143}, after{0, 420, 1, 0, 299, 180};
    auto A = random_bf16(size_t(max_rows) * k, 81, size_t(max_rows) * k);
    auto B = random_bf16(size_t(G) * n * k, 82, size_t(G) * n * k);
    auto D = random_bf16(size_t(max_rows) * n, 83, size_t(max_rows) * n);
    DeviceBuffer<bf16> dA(A), dB(B), dD(D);
    DeviceBuffer<int32_t> dOff(offsets_of(before));
    GroupedGemmShape row_shape{G, max_rows, n, k}, tn_shape{G, max_rows, n, k};
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (Backend b : backends()) {
        if (b == Backend::kSync) continue;
        SCOPED_TRACE(name(b));
        select(b);
        DeviceBuffer<bf16> dC(size_t(max_rows) * n), dCeager(size_t(max_rows) * n);
        DeviceBuffer<float> dW(size_t(G) * k * n), dWeager(size_t(G) * k * n);
        auto step = [&](bf16* C, float* W) {
            grouped_gemm_nt(row_shape, dA.ptr, dB.ptr, C, dOff.ptr, stream);
            grouped_gemm_tn(tn_shape, dA.ptr, dD.ptr, W, dOff.ptr, WgradWrite::overwrite, stream);
        };
        // Memsets on `stream` itself: a cudaMemset goes on the legacy stream, which `stream` (non-blocking) would
        // not wait for (it raced the replay's writes: 1 failure in 2 suite runs, H100, 2026-11-23).
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(dC.ptr, 0, sizeof(bf16) * dC.len, stream));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(dCeager.ptr, 0, sizeof(bf16) * dC.len, stream));
        dOff.upload(offsets_of(before));
        step(dC.ptr, dW.ptr);  // warm-up outside the capture (first-use set-up), with the old counts
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        step(dC.ptr, dW.ptr);
        MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        MOEKIT_CUDA_CHECK(cudaMemsetAsync(dC.ptr, 0, sizeof(bf16) * dC.len, stream));
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));  // the replay must not start before the new counts land
        dOff.upload(offsets_of(after));
        MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        step(dCeager.ptr, dWeager.ptr);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        auto C = dC.download(), Ce = dCeager.download();
        auto W = dW.download(), We = dWeager.download();
        EXPECT_EQ(0, std::memcmp(C.data(), Ce.data(), sizeof(bf16) * C.size())) << "nt replay != eager";
        EXPECT_EQ(0, std::memcmp(W.data(), We.data(), sizeof(float) * W.size())) << "tn replay != eager";
        // and the new counts were used: group 1 (0 rows before, 420 after) has a non-zero gradient now
        size_t nonzero = 0;
        for (size_t i = size_t(1) * k * n; i < size_t(2) * k * n; ++i) nonzero += W[i] != 0.f;
        EXPECT_GT(nonzero, size_t(k) * n / 2);
        MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
        MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    reset_backend();
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GroupedGemm, MeasuredChoiceTunedOnceAndNeverInACapture) {
    SKIP_WITHOUT_SM90();
    if (!cutlass_grouped_gemm_built()) GTEST_SKIP() << "the per-shape choice needs CUTLASS";
    // gemm_tuning.h's bookkeeping: a shape is tuned at its first eager launch (every candidate timed, the rule's
    // first), then looked up; a launch inside a graph capture never tunes (the capture would fail on the host's
    // wait) and takes the rule; a wgrad that accumulates never tunes. Correctness of the kept choices: the
    // kTuned backend of every test above, against the oracle.
    const int G = 8, n = 512, k = 256;
    const std::vector<int> counts{300, 257, 0, 412, 380, 299, 256, 341};
    const auto off = offsets_of(counts);
    const int max_rows = off[G];
    DeviceBuffer<bf16> dA(random_bf16(size_t(max_rows) * k, 401, size_t(max_rows) * k));
    DeviceBuffer<bf16> dB(random_bf16(size_t(G) * n * k, 402, size_t(G) * n * k));
    DeviceBuffer<bf16> dY(random_bf16(size_t(max_rows) * n, 403, size_t(max_rows) * n));
    DeviceBuffer<int32_t> dOff(off);
    DeviceBuffer<bf16> dC(size_t(max_rows) * n), dC2(size_t(max_rows) * 2 * n), dRule(size_t(max_rows) * 2 * n);
    DeviceBuffer<float> dW(size_t(G) * k * n);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    clear_gemm_tuning();
    set_gemm_tuning(1);
    const GroupedGemmShape shape{G, max_rows, n, k};
    grouped_gemm_nt(shape, dA.ptr, dB.ptr, dC.ptr, dOff.ptr, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto records = gemm_tuning_records();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].op, "nt");
    EXPECT_EQ(records[0].shape.n, n);
    EXPECT_EQ(records[0].shape.k, k);
    ASSERT_GE(records[0].names.size(), 4u) << "the rule and at least three other configurations";
    ASSERT_EQ(records[0].names.size(), records[0].ms.size());
    for (size_t i = 0; i < records[0].ms.size(); ++i)
        EXPECT_TRUE(std::isfinite(records[0].ms[i]) && records[0].ms[i] > 0) << records[0].names[i];
    EXPECT_EQ(records[0].rule, 0);
    EXPECT_GE(records[0].kept, 0);
    EXPECT_LT(records[0].kept, int(records[0].names.size()));
    grouped_gemm_nt(shape, dA.ptr, dB.ptr, dC.ptr, dOff.ptr, stream);  // looked up, not tuned again
    EXPECT_EQ(gemm_tuning_records().size(), 1u);

    // A new shape (n = 1024, k = 128: the same buffers read as another shape) first launched inside a capture: the
    // capture succeeds, nothing is tuned, the replay equals the rule's eager result bit for bit, and the shape keeps
    // the rule for good: an eager launch of it with tuning on is not tuned and computes the graph's bits.
    const GroupedGemmShape wide{G, max_rows, 2 * n, k / 2};
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    grouped_gemm_nt(wide, dA.ptr, dB.ptr, dC2.ptr, dOff.ptr, stream);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    EXPECT_EQ(gemm_tuning_records().size(), 1u) << "a launch inside a capture tuned";
    const size_t wide_bytes = sizeof(bf16) * size_t(max_rows) * 2 * n;
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto got = dC2.download();
    grouped_gemm_nt(wide, dA.ptr, dB.ptr, dRule.ptr, dOff.ptr, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(gemm_tuning_records().size(), 1u) << "a shape first launched in a capture was tuned later";
    EXPECT_EQ(0, std::memcmp(got.data(), dRule.download().data(), wide_bytes))
        << "an eager launch after the capture computed other bits than the graph";
    set_gemm_tuning(0);
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(dRule.ptr, 0, wide_bytes, stream));
    grouped_gemm_nt(wide, dA.ptr, dB.ptr, dRule.ptr, dOff.ptr, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(0, std::memcmp(got.data(), dRule.download().data(), wide_bytes))
        << "the captured launch did not take the rule";
    MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));

    // A wgrad that accumulates keeps the rule untuned; one that overwrites is tuned.
    set_gemm_tuning(1);
    const GroupedGemmShape tn{G, max_rows, n, k};
    grouped_gemm_tn(tn, dA.ptr, dY.ptr, dW.ptr, dOff.ptr, WgradWrite::accumulate, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(gemm_tuning_records().size(), 1u) << "an accumulating wgrad tuned";
    grouped_gemm_tn(tn, dA.ptr, dY.ptr, dW.ptr, dOff.ptr, WgradWrite::overwrite, stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    records = gemm_tuning_records();
    ASSERT_EQ(records.size(), 2u);
    EXPECT_EQ(records[1].op, "tn");
    set_gemm_tuning(-1);
    clear_gemm_tuning();
    EXPECT_TRUE(gemm_tuning_records().empty());
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace moekit::cuda
