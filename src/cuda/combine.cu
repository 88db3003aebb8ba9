// CUDA combine (see combine.cuh): block per token, 16-byte loads, fp32 sums in ascending row order.
#include "cuda/combine.cuh"
#include "cuda/cuda_check.h"

namespace moekit::cuda {

namespace {

// 8 bf16 per 16-byte vector when H % 8 == 0 (V = uint4), else one (V = __nv_bfloat16).
template <typename V>
__device__ __forceinline__ void add_vec(float* acc, const V& v, float scale) {
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
    for (int i = 0; i < int(sizeof(V) / 2); ++i) acc[i] += __bfloat162float(e[i]) * scale;
}

template <typename V>
__global__ void combine_kernel(const int32_t* __restrict__ token_offsets, const int32_t* __restrict__ token_rows,
                               int64_t vecs, const V* __restrict__ rows, const V* __restrict__ shared_out,
                               const float* __restrict__ shared_gate, V* __restrict__ out) {
    constexpr int kPer = int(sizeof(V) / 2);
    const int64_t t = blockIdx.x;
    const int32_t lo = token_offsets[t], hi = token_offsets[t + 1];
    const float gate = shared_gate ? shared_gate[t] : 1.0f;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
        float acc[kPer] = {};
        int32_t j = lo;
        // Eight rows' loads in flight before the first add (a row at a time left the pass at ~63 % of DRAM
        // bandwidth, qwen3-30b, ncu, H200, 2026-11-27); the adds keep ascending row order (reproducible).
        for (; j + 8 <= hi; j += 8) {
            V v[8];
            for (int u = 0; u < 8; ++u) v[u] = rows[int64_t(token_rows[j + u]) * vecs + i];
            for (int u = 0; u < 8; ++u) add_vec(acc, v[u], 1.0f);
        }
        for (; j < hi; ++j) add_vec(acc, rows[int64_t(token_rows[j]) * vecs + i], 1.0f);
        if (shared_out) add_vec(acc, shared_out[t * vecs + i], gate);
        V o;
        __nv_bfloat16* oe = reinterpret_cast<__nv_bfloat16*>(&o);
        for (int k = 0; k < kPer; ++k) oe[k] = __float2bfloat16(acc[k]);
        out[t * vecs + i] = o;
    }
}

}  // namespace

template <typename R>
void combine_forward(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* rows, const __nv_bfloat16* shared_out,
                     const float* shared_gate, __nv_bfloat16* out, cudaStream_t stream) {
    if (H % 8 == 0) {
        combine_kernel<uint4><<<int(p.num_tokens), 128, 0, stream>>>(
            p.token_offsets, p.token_rows, H / 8, reinterpret_cast<const uint4*>(rows),
            reinterpret_cast<const uint4*>(shared_out), shared_gate, reinterpret_cast<uint4*>(out));
    } else {
        combine_kernel<__nv_bfloat16><<<int(p.num_tokens), 256, 0, stream>>>(p.token_offsets, p.token_rows, H, rows,
                                                                             shared_out, shared_gate, out);
    }
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void combine_backward(const RoutingPlan<R>& p, int64_t H, const __nv_bfloat16* grad_out, __nv_bfloat16* grad_rows,
                      cudaStream_t stream) {
    permute_rows(p, H, grad_out, grad_rows, stream);
}

template void combine_forward<float>(const RoutingPlan<float>&, int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                                     const float*, __nv_bfloat16*, cudaStream_t);
template void combine_forward<double>(const RoutingPlan<double>&, int64_t, const __nv_bfloat16*,
                                      const __nv_bfloat16*, const float*, __nv_bfloat16*, cudaStream_t);
template void combine_backward<float>(const RoutingPlan<float>&, int64_t, const __nv_bfloat16*, __nv_bfloat16*,
                                      cudaStream_t);
template void combine_backward<double>(const RoutingPlan<double>&, int64_t, const __nv_bfloat16*, __nv_bfloat16*,
                                       cudaStream_t);

}  // namespace moekit::cuda
