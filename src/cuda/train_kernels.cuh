// Kernels of the device-resident training step (src/cuda/train_engine.cu): data, residual stream, loss,
// Adam, records. Scalars that change per step (the step number, the loss normaliser) live in device memory
// and are read by the kernels, so one captured graph serves every iteration. Reductions run in a fixed
// order (fixed grid, per-block partials, one finishing block): replays are bitwise reproducible. Twin: the
// host loop in src/train/host_engine.cpp. Tests: tests/gpu/test_cuda_train.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/adam_math.h"

namespace moekit::cuda {

constexpr int kReduceBlocks = 264;  // partial sums of the MSE reductions (2 per SM on an H100/H200)

// Step counters on the device: completed iterations and the one being computed (1-based).
struct StepCounters {
    int64_t completed;
    int64_t current;
};

// Starts an iteration: current = completed + 1.
void begin_step(StepCounters* counters, cudaStream_t stream);

// x[i] = normal01(seed, stream_id, i) with stream_id = counters->current, or `fixed_stream` when counters is null.
void generate_tokens(float* x, int64_t n, uint64_t seed, const StepCounters* counters, uint64_t fixed_stream,
                     cudaStream_t stream);

void to_bf16(const float* src, __nv_bfloat16* dst, int64_t n, cudaStream_t stream);
void add_bf16(float* acc, const __nv_bfloat16* x, int64_t n, cudaStream_t stream);  // acc += x

// out[0] = sum((a - b)^2) / n / (divisor ? *divisor : 1), in double, fixed order. partials: [kReduceBlocks].
void mean_squared_error(const float* a, const float* b, int64_t n, const double* divisor, double* partials,
                        double* out, cudaStream_t stream);

// grad = 2 / (n * (*x_to_y)) * (pred - y): d(normalised MSE)/d pred.
void mse_grad(const float* pred, const float* y, int64_t n, const double* x_to_y, float* grad, cudaStream_t stream);

struct AdamArgs {
    double lr, beta1, beta2, eps;
    double grad_scale = 1.0;  // gradients are multiplied by it first (the EP engine's mean over micro-batches)
};
// One Adam step over the flat fp32 master weights with step t = counters->current; writes the bf16 copy
// the layers read, and sets *nonfinite when a gradient element is not finite.
void adam_step(const AdamArgs& a, const StepCounters* counters, float* master, float* m, float* v, const float* grad,
               __nv_bfloat16* model, int64_t n, int32_t* nonfinite, cudaStream_t stream);

// Where a step's record goes: slot (step - 1) % capacity of a ring the host copies at logging intervals.
struct RecordRing {
    int64_t capacity = 0;
    int num_layers = 0, num_experts = 0;
    bool router_fp64 = false;
    double* scalars = nullptr;           // [capacity, kRecordScalars]
    int32_t* counts = nullptr;           // [capacity, layers, experts]
    const int32_t* const* layer_counts = nullptr;  // [layers] device pointers to each layer's [E] counts
    const void* const* layer_losses = nullptr;     // [layers] device pointers to each layer's [4] losses (R)
};
enum RecordScalar { kRecStep, kRecLoss, kRecEval, kRecAux, kRecZ, kRecFinite, kRecordScalars };

// Writes the current step's record (loss from *loss, grads finite unless *nonfinite; resets it), then
// completed = current.
void record_step(const RecordRing& ring, StepCounters* counters, const double* loss, int32_t* nonfinite,
                 cudaStream_t stream);
// Writes *eval_loss into the record of the last completed step.
void record_eval(const RecordRing& ring, const StepCounters* counters, const double* eval_loss, cudaStream_t stream);

}  // namespace moekit::cuda
