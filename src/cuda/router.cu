// CUDA router forward/backward (see router.cuh). One warp per token, the row staged in shared
// memory; top-k order is value descending with ties to the lower expert index, as the CPU twin
// (src/cpu/router.cpp). Capacity: one block per expert ranks the column in shared memory. Jitter
// factors are redrawn from the device-resident seed in the backward (nothing stored).
#include <algorithm>
#include <cmath>

#include "core/bf16.h"
#include "cuda/cuda_check.h"
#include "cuda/router.cuh"
#include "core/loss_math.h"
#include "cuda/router_warp.cuh"
#include "cuda/sinkhorn.cuh"
#include "moekit/error.h"

namespace moekit::cuda {

using namespace detail;

namespace {

constexpr int kWarpsPerBlock = 4;

template <typename R>
__global__ void upcast_kernel(const __nv_bfloat16* __restrict__ src, R* __restrict__ dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = R(__bfloat162float(src[i]));
}

// Router copy of the input with Megatron's multiplicative jitter: element i = t*H + h is
// x * R(jitter_factor(seed, i, eps)), the CPU twin's draw (core/router_math.h).
template <typename R>
__global__ void upcast_jitter_kernel(const __nv_bfloat16* __restrict__ src, R* __restrict__ dst, int64_t n,
                                     const uint64_t* __restrict__ seed, double eps) {
    const uint64_t sd = *seed;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = R(__bfloat162float(src[i])) * R(jitter_factor(sd, uint64_t(i), eps));
}

// grad_input += R(g * jitter) (the CPU twin: T(acc) * jitter).
template <typename R>
__global__ void add_jittered_kernel(const R* __restrict__ src, float* __restrict__ dst, int64_t n,
                                    const uint64_t* __restrict__ seed, double eps) {
    const uint64_t sd = *seed;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] += float(src[i] * R(jitter_factor(sd, uint64_t(i), eps)));
}

// Shared memory of one warp: logits, selection scores, taken flags, group scores and flags.
template <typename R>
struct WarpSmem {
    __host__ __device__ static size_t bytes(int64_t e, int64_t g) {
        size_t b = size_t(e) * 2 * sizeof(R) + size_t(g) * sizeof(R) + size_t(e) + size_t(g);
        return (b + 15) / 16 * 16;
    }
};

// Sum of the best m entries of sel[lo, hi) in top-k order (group score, Megatron group_limited_topk).
template <typename R>
__device__ R top_m_sum(const R* sel, int lo, int hi, int m) {
    R sum = 0, prev_v = R(INFINITY);
    int prev_i = -1;
    for (int c = 0; c < m; ++c) {
        R best_v = no_value<R>();
        int best_i = INT32_MAX;
        for (int e = lo; e < hi; ++e)
            if (before(prev_v, prev_i, sel[e], e) && before(sel[e], e, best_v, best_i)) best_v = sel[e], best_i = e;
        sum += best_v;
        prev_v = best_v, prev_i = best_i;
    }
    return sum;
}

// sinkhorn != null: the selection key is the Sinkhorn matrix row (training Sinkhorn routing).
template <typename R>
__global__ void route_kernel(RouterShape s, const R* __restrict__ logits, const R* __restrict__ bias,
                             const float* __restrict__ sinkhorn, const uint8_t* __restrict__ padding,
                             int32_t* __restrict__ topk_idx, R* __restrict__ probs, uint8_t* __restrict__ map) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
    if (t >= s.num_tokens) return;
    const int E = int(s.num_experts), G = int(s.num_groups), K = int(s.topk);
    unsigned char* base = smem_raw + WarpSmem<R>::bytes(E, G) * warp;
    R* l = reinterpret_cast<R*>(base);
    R* sel = l + E;
    R* gscore = sel + E;
    uint8_t* taken = reinterpret_cast<uint8_t*>(gscore + G);
    uint8_t* gtaken = taken + E;

    R* prow = probs + t * E;
    uint8_t* mrow = map + t * E;
    if (padding[t]) {  // padding tokens are not routed (zero map and probs), as the CPU twin
        for (int e = lane; e < E; e += kWarp) prow[e] = 0, mrow[e] = 0;
        if (lane < K) topk_idx[t * K + lane] = -1;
        return;
    }
    const R* row = logits + t * E;
    for (int e = lane; e < E; e += kWarp) l[e] = row[e], taken[e] = 0;
    for (int g = lane; g < G; g += kWarp) gtaken[g] = 0;
    __syncwarp();
    const int fn = int(s.score_function);
    const bool softmax_post = fn == 0 && !s.pre_softmax;
    const R lse = warp_logsumexp(l, E, lane);
    // Value each expert would contribute (before normalisation) and its selection key.
    for (int e = lane; e < E; e += kWarp) {
        const R v = softmax_post ? l[e] : score_of<R>(fn, l[e], lse);
        // Sinkhorn never adds the expert bias (its counts are still kept, as the CPU twin).
        sel[e] = sinkhorn ? R(sinkhorn[t * E + e]) : v + (s.has_expert_bias && !s.sinkhorn ? bias[e] : R(0));
    }
    __syncwarp();
    if (G > 0) {
        const int per_group = E / G, m = K / int(s.group_topk);
        for (int g = lane; g < G; g += kWarp) gscore[g] = top_m_sum(sel, g * per_group, (g + 1) * per_group, m);
        __syncwarp();
        for (int c = 0; c < s.group_topk; ++c) warp_take_best(gscore, gtaken, G, lane);
        // Experts of dropped groups are taken out (not set to -inf): a NaN score of a kept group must
        // still win over them, as on the CPU (allowed entries first); the kept groups hold >= k experts.
        for (int e = lane; e < E; e += kWarp)
            if (!gtaken[e / per_group]) taken[e] = 1;
        __syncwarp();
    }
    // Top-k: lane j keeps the j-th pick (k <= 32, checked in validate()).
    const int my_idx = warp_topk(sel, taken, E, K, lane);
    R v = 0;
    if (lane < K) v = softmax_post ? l[my_idx] : score_of<R>(fn, l[my_idx], lse);
    R p = v;
    if (softmax_post) {
        const R m = warp_max(lane < K ? v : neg_inf<R>());
        const R ex = lane < K ? exp(v - m) : R(0);
        p = ex / warp_sum(ex);
    } else if (fn != 0 && K > 1) {
        p = v / (warp_sum(lane < K ? v : R(0)) + R(1e-20));
    }
    p *= R(s.scaling_factor);
    for (int e = lane; e < E; e += kWarp) prow[e] = 0, mrow[e] = 0;
    __syncwarp();
    if (lane < K) {
        prow[my_idx] = p;
        mrow[my_idx] = 1;
        topk_idx[t * K + lane] = my_idx;
    }
}

// One block per expert: among the valid tokens keep the first `capacity` of the column in the
// order (key descending, token ascending), key = prob (policy probs) or map bit (policy position);
// capacity = get_capacity(valid tokens * k, E, cf) is computed here, on the device.
template <typename R>
__global__ void capacity_kernel(RouterShape s, const uint8_t* __restrict__ padding, R* __restrict__ probs,
                                uint8_t* __restrict__ map) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int num_valid;
    const int64_t T = s.num_tokens, E = s.num_experts, e = blockIdx.x;
    R* key = reinterpret_cast<R*>(smem_raw);
    uint8_t* valid = reinterpret_cast<uint8_t*>(key + T);
    if (threadIdx.x == 0) num_valid = 0;
    __syncthreads();
    int my_valid = 0;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        key[t] = s.drop_policy == DropPolicy::probs ? probs[t * E + e] : R(map[t * E + e]);
        valid[t] = padding[t] == 0;
        my_valid += valid[t];
    }
    atomicAdd(&num_valid, my_valid);  // integer: order-independent
    __syncthreads();
    const int64_t capacity = capacity_of(int64_t(num_valid) * s.topk, E, s.capacity_factor, 0);
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        if (!valid[t]) continue;
        bool keep = true;
        if (capacity <= num_valid) {
            const R k = key[t];
            int64_t rank = 0;
            for (int64_t u = 0; u < T && rank < capacity; ++u)
                rank += valid[u] && value_ranks_before(key[u], u, k, t);  // NaN last, as the CPU twin
            keep = rank < capacity;
        }
        const uint8_t routed = map[t * E + e];
        const uint8_t m = s.pad_to_capacity ? uint8_t(keep) : uint8_t(routed && keep);
        map[t * E + e] = m;
        if (!m) probs[t * E + e] = 0;
    }
}

template <typename R>
__global__ void route_backward_kernel(RouterShape s, const R* __restrict__ logits, const uint8_t* __restrict__ padding,
                                      const int32_t* __restrict__ topk_idx, const R* __restrict__ grad_probs,
                                      R* __restrict__ grad_logits) {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
    if (t >= s.num_tokens) return;
    const int E = int(s.num_experts), K = int(s.topk), fn = int(s.score_function);
    const R* row = logits + t * E;
    R* grow = grad_logits + t * E;
    if (padding[t]) {
        for (int e = lane; e < E; e += kWarp) grow[e] = 0;
        return;
    }
    const bool softmax_post = fn == 0 && !s.pre_softmax;
    R lse = 0;
    if (fn == 0) {
        R m = neg_inf<R>();
        for (int e = lane; e < E; e += kWarp) m = max(m, row[e]);
        m = warp_max(m);
        R sum = 0;
        for (int e = lane; e < E; e += kWarp) sum += exp(row[e] - m);
        lse = m + log(warp_sum(sum));
    }
    const int idx = lane < K ? topk_idx[t * K + lane] : 0;
    // g = d loss / d (normalised, unscaled) prob of pick `lane`.
    const R g = lane < K ? grad_probs[t * E + idx] * R(s.scaling_factor) : R(0);
    const R l = lane < K ? row[idx] : R(0);
    for (int e = lane; e < E; e += kWarp) grow[e] = 0;
    __syncwarp();
    if (softmax_post) {
        const R m = warp_max(lane < K ? l : neg_inf<R>());
        const R ex = lane < K ? exp(l - m) : R(0);
        const R p = ex / warp_sum(ex);
        const R gp = warp_sum(g * p);
        if (lane < K) grow[idx] = p * (g - gp);
    } else if (fn == 0) {
        // pre-softmax: probs are the softmax scores themselves; dl = s (ds - <ds, s>).
        const R sv = lane < K ? exp(l - lse) : R(0);
        const R gs = warp_sum(g * sv);
        for (int e = lane; e < E; e += kWarp) grow[e] = -exp(row[e] - lse) * gs;
        __syncwarp();
        if (lane < K) grow[idx] += sv * g;
    } else {
        const R v = lane < K ? score_of<R>(fn, l, R(0)) : R(0);
        R dv = g;
        if (K > 1) {
            const R denom = warp_sum(v) + R(1e-20);
            dv = g / denom - warp_sum(g * v) / (denom * denom);
        }
        if (lane < K) grow[idx] = dv * score_grad<R>(fn, l);
    }
}

template <typename R>
__global__ void add_to_float_kernel(const R* __restrict__ src, float* __restrict__ dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] += float(src[i]);
}
template <typename R>
__global__ void copy_to_float_kernel(const R* __restrict__ src, float* __restrict__ dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = float(src[i]);
}

int grid_for(int64_t n, int block = 256) { return int(std::min<int64_t>(ceil_div(n, block), 4096)); }

// Row-major C[m, n] = op(A) · op(B) through column-major cuBLAS (C^T = op(B)^T op(A)^T).
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
    const float alpha = 1.0f;
    MOEKIT_CUBLAS_CHECK(cublasSgemm(h, tb, ta, n, m, k, &alpha, B, ldb, A, lda, &beta, C, ldc));
}
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const double* A, int lda,
          const double* B, int ldb, double beta, double* C, int ldc) {
    const double alpha = 1.0;
    MOEKIT_CUBLAS_CHECK(cublasDgemm(h, tb, ta, n, m, k, &alpha, B, ldb, A, lda, &beta, C, ldc));
}

// Row-major C[m, n] fp32 (= or +=, beta) = op(A) · op(B) with bf16 A and B on tensor cores (fp32 accumulation).
void gemm_bf16(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
               const __nv_bfloat16* A, int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc) {
    const float alpha = 1.0f;
    MOEKIT_CUBLAS_CHECK(cublasGemmEx(h, tb, ta, n, m, k, &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C,
                                     CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The tensor-core gating linear's backward operands in one launch: grad logits [T, E] fp32 -> [T, 3E] bf16, row t =
// hi | mid | lo of its E values (core/bf16.h split_to_bf16x3), and W [E, H] -> [W; W; W] [3E, H] (three device
// copies before: three graph nodes). Four experts a thread where E % 4 == 0 and the rows are aligned for it,
// 16-byte copies of W where aligned.
__device__ __forceinline__ uint32_t pack_bf16_pair(uint16_t lo, uint16_t hi) {
    return uint32_t(lo) | uint32_t(hi) << 16;
}

__global__ void split_bf16x3_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int64_t T,
                                    int64_t E, bool quads, const __nv_bfloat16* __restrict__ w,
                                    __nv_bfloat16* __restrict__ w3, int64_t EH, bool vec_w) {
    const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
    if (quads) {
        const int64_t per_row = E / 4;
        for (int64_t i = first; i < T * per_row; i += step) {
            const int64_t t = i / per_row, e = (i - t * per_row) * 4;
            const float4 v = reinterpret_cast<const float4*>(src)[i];
            const Bf16x3 a = split_to_bf16x3(v.x), b = split_to_bf16x3(v.y), c = split_to_bf16x3(v.z),
                         d = split_to_bf16x3(v.w);
            __nv_bfloat16* row = dst + t * 3 * E + e;
            *reinterpret_cast<uint2*>(row) = make_uint2(pack_bf16_pair(a.hi, b.hi), pack_bf16_pair(c.hi, d.hi));
            *reinterpret_cast<uint2*>(row + E) =
                make_uint2(pack_bf16_pair(a.mid, b.mid), pack_bf16_pair(c.mid, d.mid));
            *reinterpret_cast<uint2*>(row + 2 * E) =
                make_uint2(pack_bf16_pair(a.lo, b.lo), pack_bf16_pair(c.lo, d.lo));
        }
    } else {
        for (int64_t i = first; i < T * E; i += step) {
            const int64_t t = i / E, e = i - t * E;
            const Bf16x3 p = split_to_bf16x3(src[i]);
            __nv_bfloat16* row = dst + t * 3 * E + e;
            row[0] = __nv_bfloat16_raw{p.hi}, row[E] = __nv_bfloat16_raw{p.mid}, row[2 * E] = __nv_bfloat16_raw{p.lo};
        }
    }
    if (vec_w) {
        const int64_t n = EH / 8;
        for (int64_t i = first; i < n; i += step) {
            const uint4 v = reinterpret_cast<const uint4*>(w)[i];
            uint4* out = reinterpret_cast<uint4*>(w3);
            out[i] = v, out[n + i] = v, out[2 * n + i] = v;
        }
    } else {
        for (int64_t i = first; i < EH; i += step) w3[i] = w3[EH + i] = w3[2 * EH + i] = w[i];
    }
}

// dW [E, H] (= or +=) the sum of grad_weight3's three [E, H] parts, (hi + mid) + lo.
__global__ void sum_three_parts_kernel(const float* __restrict__ parts, float* __restrict__ dst, int64_t n,
                                       bool accumulate) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float v = (parts[i] + parts[n + i]) + parts[2 * n + i];
        dst[i] = accumulate ? dst[i] + v : v;
    }
}

template <typename R>
void set_smem(const void* kernel, size_t bytes) {
    if (bytes > 48 * 1024)
        MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace

size_t route_smem_bytes(const RouterShape& s, bool fp64) {
    const size_t warp = fp64 ? WarpSmem<double>::bytes(s.num_experts, s.num_groups)
                             : WarpSmem<float>::bytes(s.num_experts, s.num_groups);
    return warp * kWarpsPerBlock;
}

RouterShape RouterShape::from_config(const MoeConfig& c, int64_t seq_length, int64_t micro_batch_size) {
    RouterShape s;
    s.seq_length = seq_length;
    s.micro_batch_size = micro_batch_size;
    s.num_tokens = seq_length * micro_batch_size;
    s.num_experts = c.num_experts();
    s.hidden = c.hidden_size;
    s.topk = c.moe_router_topk;
    const std::string& fn = c.moe_router_score_function;
    s.score_function = fn == "sigmoid" ? ScoreFunction::sigmoid
                       : fn == "sqrtsoftplus" ? ScoreFunction::sqrtsoftplus
                                              : ScoreFunction::softmax;
    s.pre_softmax = c.moe_router_pre_softmax;
    s.num_groups = c.moe_router_num_groups.value_or(0);
    s.group_topk = c.moe_router_group_topk.value_or(0);
    if (s.num_groups == 0) s.group_topk = 0;
    s.has_expert_bias = c.moe_router_enable_expert_bias;
    s.scaling_factor = c.moe_router_topk_scaling_factor.value_or(1.0);
    s.jitter_eps = c.moe_input_jitter_eps.value_or(0.0);
    const auto& types = c.moe_router_load_balancing_type;
    s.sinkhorn = std::find(types.begin(), types.end(), "sinkhorn") != types.end();
    if (s.sinkhorn) {  // probs = sigmoid (k = 1) or full softmax at the picks (cpu::sinkhorn_activation)
        s.score_function = s.topk == 1 ? ScoreFunction::sigmoid : ScoreFunction::softmax;
        s.pre_softmax = true;
        s.num_groups = 0, s.group_topk = 0, s.scaling_factor = 1.0;
    }
    if (c.moe_expert_capacity_factor && *c.moe_expert_capacity_factor >= 0) {
        s.capacity_factor = *c.moe_expert_capacity_factor;
        s.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
        s.drop_policy = c.moe_token_drop_policy == "position" ? DropPolicy::position : DropPolicy::probs;
    }
    return s;
}

int64_t RouterShape::max_rows() const {
    if (!dropless() && pad_to_capacity)
        return num_experts * std::min(capacity_of(num_tokens * topk, num_experts, capacity_factor, 0), num_tokens);
    return num_tokens * topk;
}

std::string RouterShape::to_string() const {
    return str("RouterShape{T=", num_tokens, " (S=", seq_length, " B=", micro_batch_size, ") E=", num_experts,
               " H=", hidden, " k=", topk, " score=", int(score_function), pre_softmax ? " pre" : "",
               " groups=", num_groups, "/", group_topk, has_expert_bias ? " bias" : "", " scale=", scaling_factor,
               " cf=", capacity_factor, pad_to_capacity ? " pad" : "", jitter_eps > 0 ? " jitter" : "",
               sinkhorn ? " sinkhorn" : "", "}");
}

void RouterShape::validate() const {
    MOEKIT_CHECK(num_tokens > 0 && num_tokens == seq_length * micro_batch_size, to_string());
    MOEKIT_CHECK(num_experts > 0 && hidden > 0 && topk >= 1 && topk <= num_experts, to_string());
    MOEKIT_REQUIRE(topk <= 32, "--moe-router-topk=", topk, ": --device cuda supports top-k up to 32");
    MOEKIT_CHECK(num_groups == 0 || (num_experts % num_groups == 0 && group_topk >= 1 && group_topk <= num_groups),
                 to_string());
    MOEKIT_CHECK(num_tokens * num_experts < (int64_t(1) << 31), "router tensors over 2^31 elements: ", to_string());
}

template <typename R>
void upcast_inputs_and_gemm(const RouterShape& s, const RouterTensors<R>& t, cublasHandle_t cublas,
                            cudaStream_t stream) {
    const int64_t T = s.num_tokens, E = s.num_experts, H = s.hidden;
    if (s.jitter_eps > 0) {
        MOEKIT_CHECK(t.jitter_seed, "router: --moe-input-jitter-eps needs the device jitter seed");
        upcast_jitter_kernel<R><<<grid_for(T * H), 256, 0, stream>>>(t.hidden, t.hidden_r, T * H, t.jitter_seed,
                                                                      s.jitter_eps);
    } else {
        upcast_kernel<R><<<grid_for(T * H), 256, 0, stream>>>(t.hidden, t.hidden_r, T * H);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
    upcast_kernel<R><<<grid_for(E * H), 256, 0, stream>>>(t.weight, t.weight_r, E * H);
    MOEKIT_CUDA_LAUNCH_CHECK();
    // logits [T, E] = x [T, H] · Wᵀ
    gemm(cublas, CUBLAS_OP_N, CUBLAS_OP_T, int(T), int(E), int(H), t.hidden_r, int(H), t.weight_r, int(H), R(0),
         t.logits, int(E));
}

template <typename R>
void route_after_logits(const RouterShape& s, const RouterTensors<R>& t, cudaStream_t stream, bool training) {
    const int64_t T = s.num_tokens, E = s.num_experts;
    const bool sinkhorn = s.sinkhorn && training;
    if (sinkhorn) {
        MOEKIT_CHECK(t.sinkhorn && t.sinkhorn_d0, "router: Sinkhorn routing needs its [T, E] and [T] buffers");
        sinkhorn_forward<R>(T, E, t.logits, t.padding_mask, t.sinkhorn, t.sinkhorn_d0, stream);
    }
    const size_t smem = route_smem_bytes(s, std::is_same_v<R, double>);
    set_smem<R>(reinterpret_cast<const void*>(&route_kernel<R>), smem);
    route_kernel<R><<<int(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * kWarp, smem, stream>>>(
        s, t.logits, t.expert_bias, sinkhorn ? t.sinkhorn : nullptr, t.padding_mask, t.topk_idx, t.probs,
        t.routing_map);
    MOEKIT_CUDA_LAUNCH_CHECK();
    if (!s.dropless()) {
        const size_t csmem = size_t(T) * (sizeof(R) + 1);
        MOEKIT_REQUIRE(csmem <= 200 * 1024, "--moe-expert-capacity-factor on --device cuda: ", T,
                       " tokens exceed the capacity kernel's shared-memory column (", 200 * 1024 / (sizeof(R) + 1), ")");
        set_smem<R>(reinterpret_cast<const void*>(&capacity_kernel<R>), csmem);
        capacity_kernel<R><<<int(E), 256, csmem, stream>>>(s, t.padding_mask, t.probs, t.routing_map);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
}

template <typename R>
void router_forward(const RouterShape& s, const RouterTensors<R>& t, cublasHandle_t cublas, cudaStream_t stream,
                    bool training) {
    MOEKIT_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    if constexpr (sizeof(R) == sizeof(float)) {
        if (s.linear_on_tensor_cores(false)) {
            // logits [T, E] = x [T, H] · Wᵀ: bf16 operands as they are (exact products), fp32 sums; no upcast copies.
            const int T = int(s.num_tokens), E = int(s.num_experts), H = int(s.hidden);
            gemm_bf16(cublas, CUBLAS_OP_N, CUBLAS_OP_T, T, E, H, t.hidden, H, t.weight, H, 0.0f, t.logits, E);
            route_after_logits(s, t, stream, training);
            return;
        }
    }
    upcast_inputs_and_gemm(s, t, cublas, stream);
    route_after_logits(s, t, stream, training);
}

template <typename R>
void router_backward_probs(const RouterShape& s, const RouterTensors<R>& t, const R* grad_probs, R* grad_logits,
                           cudaStream_t stream) {
    route_backward_kernel<R><<<int(ceil_div(s.num_tokens, kWarpsPerBlock)), kWarpsPerBlock * kWarp, 0, stream>>>(
        s, t.logits, t.padding_mask, t.topk_idx, grad_probs, grad_logits);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void router_backward_linear(const RouterShape& s, const RouterTensors<R>& t, const R* grad_logits, float* grad_weight,
                            float* grad_input, R* scratch, cublasHandle_t cublas, cudaStream_t stream,
                            bool accumulate) {
    const int T = int(s.num_tokens), E = int(s.num_experts), H = int(s.hidden);
    const float beta_w = accumulate ? 1.0f : 0.0f;
    // R = double: dW [E, H] = dLᵀ · x_R is an R-typed product that must land in a buffer the GEMM does not
    // read (scratch may alias t.hidden_r, and a GEMM whose output overlaps its input is undefined: its CTAs
    // read and write in no set order). It goes into t.weight_r, is copied (or added, into a main grad) to
    // grad_weight, and W_R is upcast again for dX (E * H elements, cheap).
    auto weight_grad_via_weight_r = [&] {
        gemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, H, T, grad_logits, E, t.hidden_r, H, R(0), t.weight_r, H);
        if (accumulate) {
            add_to_float_kernel<R><<<grid_for(int64_t(E) * H), 256, 0, stream>>>(t.weight_r, grad_weight,
                                                                                 int64_t(E) * H);
        } else {
            copy_to_float_kernel<R><<<grid_for(int64_t(E) * H), 256, 0, stream>>>(t.weight_r, grad_weight,
                                                                                  int64_t(E) * H);
        }
        MOEKIT_CUDA_LAUNCH_CHECK();
        upcast_kernel<R><<<grid_for(int64_t(E) * H), 256, 0, stream>>>(t.weight, t.weight_r, int64_t(E) * H);
        MOEKIT_CUDA_LAUNCH_CHECK();
    };
    MOEKIT_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    if constexpr (sizeof(R) == sizeof(float)) {
        if (s.linear_on_tensor_cores(false)) {
            // dL = hi + mid + lo exactly (bf16 parts, [T, 3E]), so both products run on bf16 tensor cores with
            // exact products and fp32 sums. dX [T, H] += [hi|mid|lo] [T, 3E] · [W; W; W] [3E, H] (one GEMM, dX read
            // and written once); dW3 [3E, H] = [hi|mid|lo]ᵀ · x (x read once), then dW (+)= the three parts' sum.
            MOEKIT_CHECK(t.grad_logits_split && t.weight3 && t.grad_weight3,
                         "router: the tensor-core gating linear needs its split, weight3 and grad_weight3 buffers");
            const int64_t EH = int64_t(E) * H;
            const auto aligned = [](const void* ptr, int bytes) {
                return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
            };
            const bool quads = E % 4 == 0 && aligned(grad_logits, 16) && aligned(t.grad_logits_split, 8);
            const bool vec_w = EH % 8 == 0 && aligned(t.weight, 16) && aligned(t.weight3, 16);
            split_bf16x3_kernel<<<grid_for(std::max(int64_t(T) * E / (quads ? 4 : 1), vec_w ? EH / 8 : EH)), 256, 0,
                                  stream>>>(grad_logits, t.grad_logits_split, T, E, quads, t.weight, t.weight3, EH,
                                            vec_w);
            MOEKIT_CUDA_LAUNCH_CHECK();
            gemm_bf16(cublas, CUBLAS_OP_T, CUBLAS_OP_N, 3 * E, H, T, t.grad_logits_split, 3 * E, t.hidden, H, 0.0f,
                      t.grad_weight3, H);
            sum_three_parts_kernel<<<grid_for(EH), 256, 0, stream>>>(t.grad_weight3, grad_weight, EH, accumulate);
            MOEKIT_CUDA_LAUNCH_CHECK();
            gemm_bf16(cublas, CUBLAS_OP_N, CUBLAS_OP_N, T, H, 3 * E, t.grad_logits_split, 3 * E, t.weight3, H, 1.0f,
                      grad_input, H);
            return;
        }
    }
    if (s.jitter_eps > 0) {
        // dX += (dL · W) * jitter: the product goes through scratch (written after dW has read x_R).
        if constexpr (sizeof(R) == sizeof(float)) {
            gemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, H, T, grad_logits, E, t.hidden_r, H, beta_w, grad_weight, H);
        } else {
            weight_grad_via_weight_r();
        }
        gemm(cublas, CUBLAS_OP_N, CUBLAS_OP_N, T, H, E, grad_logits, E, t.weight_r, H, R(0), scratch, H);
        add_jittered_kernel<R><<<grid_for(int64_t(T) * H), 256, 0, stream>>>(scratch, grad_input, int64_t(T) * H,
                                                                            t.jitter_seed, s.jitter_eps);
        MOEKIT_CUDA_LAUNCH_CHECK();
    } else if constexpr (sizeof(R) == sizeof(float)) {
        // dW [E, H] = dLᵀ [E, T] · x [T, H]; dX [T, H] += dL [T, E] · W [E, H].
        gemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, H, T, grad_logits, E, t.hidden_r, H, beta_w, grad_weight, H);
        gemm(cublas, CUBLAS_OP_N, CUBLAS_OP_N, T, H, E, grad_logits, E, t.weight_r, H, 1.0f, grad_input, H);
    } else {
        weight_grad_via_weight_r();
        gemm(cublas, CUBLAS_OP_N, CUBLAS_OP_N, T, H, E, grad_logits, E, t.weight_r, H, R(0), scratch, H);
        add_to_float_kernel<R><<<grid_for(int64_t(T) * H), 256, 0, stream>>>(scratch, grad_input, int64_t(T) * H);
        MOEKIT_CUDA_LAUNCH_CHECK();
    }
}

#define MOEKIT_INSTANTIATE_ROUTER(R)                                                                              \
    template void router_forward<R>(const RouterShape&, const RouterTensors<R>&, cublasHandle_t, cudaStream_t,    \
                                    bool);                                                                         \
    template void router_backward_probs<R>(const RouterShape&, const RouterTensors<R>&, const R*, R*,             \
                                           cudaStream_t);                                                         \
    template void router_backward_linear<R>(const RouterShape&, const RouterTensors<R>&, const R*, float*, float*, \
                                            R*, cublasHandle_t, cudaStream_t, bool);
MOEKIT_INSTANTIATE_ROUTER(float)
MOEKIT_INSTANTIATE_ROUTER(double)

}  // namespace moekit::cuda
