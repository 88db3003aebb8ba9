// Kernels of the device-resident training step (see train_kernels.cuh).
#include <cmath>

#include "core/hd.h"
#include "core/rng.h"
#include "cuda/cuda_check.h"
#include "cuda/train_kernels.cuh"

namespace moekit::cuda {
namespace {

constexpr int kThreads = 256;
int grid_for(int64_t n) { return int(std::min<int64_t>(ceil_div(n, kThreads), 132 * 16)); }

__global__ void begin_step_kernel(StepCounters* c) { c->current = c->completed + 1; }

__global__ void generate_kernel(float* x, int64_t n, uint64_t seed, const StepCounters* c, uint64_t fixed) {
    const uint64_t stream = c ? uint64_t(c->current) : fixed;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        x[i] = float(normal01(seed, stream, uint64_t(i)));
}

__global__ void to_bf16_kernel(const float* src, __nv_bfloat16* dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

__global__ void add_bf16_kernel(float* acc, const __nv_bfloat16* x, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        acc[i] += __bfloat162float(x[i]);
}

// Block sum of one double per thread, in a fixed tree order.
__device__ double block_sum(double v) {
    __shared__ double s[kThreads];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
        if (int(threadIdx.x) < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    return s[0];
}

__global__ void squared_error_partials_kernel(const float* a, const float* b, int64_t n, double* partials) {
    double acc = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const double d = double(a[i] - b[i]);  // the float difference, as the host loop computes it
        acc += d * d;
    }
    const double s = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void finish_mse_kernel(const double* partials, int64_t n, const double* divisor, double* out) {
    // kReduceBlocks <= 2 * kThreads partials: two block sums, the barrier keeps the shared array's reuse safe.
    const double s = block_sum(int(threadIdx.x) < kReduceBlocks ? partials[threadIdx.x] : 0.0);
    __syncthreads();
    const double s2 = block_sum(int(threadIdx.x) + kThreads < kReduceBlocks ? partials[threadIdx.x + kThreads] : 0.0);
    if (threadIdx.x == 0) out[0] = (s + s2) / double(n) / (divisor ? divisor[0] : 1.0);
}

__global__ void mse_grad_kernel(const float* pred, const float* y, int64_t n, const double* x_to_y, float* grad) {
    const double scale = 2.0 / (double(n) * x_to_y[0]);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        grad[i] = float(scale * (pred[i] - y[i]));
}

// Four elements per thread with 16-byte loads and stores (the optimizer is bandwidth-bound: 30 bytes per
// parameter). NOTE: n is a multiple of 4 and the buffers 16-byte aligned (the engine's layout pads to 64).
__global__ void adam_kernel(AdamArgs args, const StepCounters* c, float4* master, float4* m, float4* v, const float4* g,
                            __nv_bfloat162* model, int64_t n4, int32_t* nonfinite) {
    const AdamStep a = adam_step_constants(args.lr, args.beta1, args.beta2, args.eps, c->current);
    const float scale = float(args.grad_scale);  // 1 on one rank: x * 1 is x, bit for bit
    bool bad = false;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
        float4 gi = g[i];
        gi.x *= scale, gi.y *= scale, gi.z *= scale, gi.w *= scale;
        float4 mi = m[i], vi = v[i], p = master[i];
        bad |= !isfinite(gi.x) || !isfinite(gi.y) || !isfinite(gi.z) || !isfinite(gi.w);
        p.x = adam_update(a, gi.x, mi.x, vi.x, p.x), p.y = adam_update(a, gi.y, mi.y, vi.y, p.y);
        p.z = adam_update(a, gi.z, mi.z, vi.z, p.z), p.w = adam_update(a, gi.w, mi.w, vi.w, p.w);
        m[i] = mi, v[i] = vi, master[i] = p;
        model[2 * i] = __floats2bfloat162_rn(p.x, p.y);
        model[2 * i + 1] = __floats2bfloat162_rn(p.z, p.w);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(nonfinite, 1);  // a flag: order does not matter
}

__global__ void record_step_kernel(RecordRing r, StepCounters* c, const double* loss, int32_t* nonfinite) {
    const int64_t step = c->current, slot = (step - 1) % r.capacity;
    const int LE = r.num_layers * r.num_experts;
    for (int i = threadIdx.x; i < LE; i += blockDim.x)
        r.counts[slot * LE + i] = r.layer_counts[i / r.num_experts][i % r.num_experts];
    if (threadIdx.x == 0) {
        double aux = 0, z = 0;
        for (int l = 0; l < r.num_layers; ++l) {
            double v[4];
            for (int j = 0; j < 4; ++j)
                v[j] = r.router_fp64 ? static_cast<const double*>(r.layer_losses[l])[j]
                                     : double(static_cast<const float*>(r.layer_losses[l])[j]);
            aux += v[0] + v[1] + v[2];
            z += v[3];
        }
        double* s = r.scalars + slot * kRecordScalars;
        s[kRecStep] = double(step), s[kRecLoss] = loss[0], s[kRecEval] = -1.0, s[kRecAux] = aux, s[kRecZ] = z;
        s[kRecFinite] = *nonfinite ? 0.0 : 1.0;
        *nonfinite = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) c->completed = step;
}

__global__ void record_eval_kernel(RecordRing r, const StepCounters* c, const double* eval_loss) {
    const int64_t slot = (c->completed - 1) % r.capacity;
    r.scalars[slot * kRecordScalars + kRecEval] = eval_loss[0];
}

}  // namespace

void begin_step(StepCounters* counters, cudaStream_t stream) {
    begin_step_kernel<<<1, 1, 0, stream>>>(counters);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void generate_tokens(float* x, int64_t n, uint64_t seed, const StepCounters* counters, uint64_t fixed_stream,
                     cudaStream_t stream) {
    generate_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, seed, counters, fixed_stream);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void to_bf16(const float* src, __nv_bfloat16* dst, int64_t n, cudaStream_t stream) {
    to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, dst, n);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void add_bf16(float* acc, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) {
    add_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(acc, x, n);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void mean_squared_error(const float* a, const float* b, int64_t n, const double* divisor, double* partials,
                        double* out, cudaStream_t stream) {
    static_assert(kReduceBlocks <= 2 * kThreads, "finish_mse_kernel sums at most 2 * kThreads partials");
    squared_error_partials_kernel<<<kReduceBlocks, kThreads, 0, stream>>>(a, b, n, partials);
    MOEKIT_CUDA_LAUNCH_CHECK();
    finish_mse_kernel<<<1, kThreads, 0, stream>>>(partials, n, divisor, out);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void mse_grad(const float* pred, const float* y, int64_t n, const double* x_to_y, float* grad, cudaStream_t stream) {
    mse_grad_kernel<<<grid_for(n), kThreads, 0, stream>>>(pred, y, n, x_to_y, grad);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void adam_step(const AdamArgs& a, const StepCounters* counters, float* master, float* m, float* v, const float* grad,
               __nv_bfloat16* model, int64_t n, int32_t* nonfinite, cudaStream_t stream) {
    MOEKIT_CHECK(n % 4 == 0, "adam_step: ", n, " parameters, not a multiple of 4");
    const int64_t n4 = n / 4;
    adam_kernel<<<grid_for(n4), kThreads, 0, stream>>>(a, counters, reinterpret_cast<float4*>(master),
                                                      reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v),
                                                      reinterpret_cast<const float4*>(grad),
                                                      reinterpret_cast<__nv_bfloat162*>(model), n4, nonfinite);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void record_step(const RecordRing& ring, StepCounters* counters, const double* loss, int32_t* nonfinite,
                 cudaStream_t stream) {
    record_step_kernel<<<1, kThreads, 0, stream>>>(ring, counters, loss, nonfinite);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

void record_eval(const RecordRing& ring, const StepCounters* counters, const double* eval_loss, cudaStream_t stream) {
    record_eval_kernel<<<1, 1, 0, stream>>>(ring, counters, eval_loss);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

}  // namespace moekit::cuda
