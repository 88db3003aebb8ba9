// Grouped bf16 GEMMs whose per-group row counts live in DEVICE memory only (no host sync):
// the three products an expert MLP needs, forward and backward. fp32 accumulation.
// Group g owns rows [offsets[g], offsets[g+1]) of the row-partitioned operands; rows at or past
// offsets[num_groups] (up to the static bound max_rows) are never written, and their values never reach a result
// (the TMA kernels may load them into tiles whose rows are then discarded, so they must be allocated).
// Twin/reference: per-group cuBLAS loop in the synchronous baseline; tests: tests/gpu/test_grouped_gemm.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/activation_math.h"

namespace moekit::cuda {

struct GroupedGemmShape {
    int64_t num_groups = 0;  // G (experts)
    int64_t max_rows = 0;    // static bound on offsets[G] (e.g. T*k): sizes the launch, never a count
    int64_t n = 0;           // output columns
    int64_t k = 0;           // reduction length (fixed per group for nt/nn)
    // Groups [second_from, num_groups) take their per-group operand (nt / nn: the weights B; tn: the gradient C)
    // from `second` instead, indexed from second_from (the same layout, 16-byte aligned): ECHO's spare slots, whose
    // clone weights and gradients live apart from the home experts', in the same launch as the home groups (a launch
    // of their own pays its own partial last wave: docs/perf.md). tn writes the second base's blocks fresh whatever
    // `write` says of the first's, and leaves an empty group's block unwritten (as overwrite_nonempty): a spare
    // slot's gradient is never accumulated, and nobody reads it when the slot got no rows. 0 = every group from B / C.
    int64_t second_from = 0;
    const void* second = nullptr;
    std::string to_string() const;
};

// Whether group g's per-group operand lies in the second base (GroupedGemmShape::second_from; 0 = none), and its
// block (`block` elements a group) from `first` or `second`, indexed from its base: every backend places blocks so.
__host__ __device__ inline bool in_second_base(int64_t second_from, int64_t g) {
    return second_from > 0 && g >= second_from;
}
template <typename T>
__host__ __device__ inline T* group_block(T* first, const void* second, int64_t second_from, int64_t g, int64_t block) {
    if (in_second_base(second_from, g)) return static_cast<T*>(const_cast<void*>(second)) + (g - second_from) * block;
    return first + g * block;
}

// C[r, :] = A[r, :] · B[g]ᵀ for r in group g.  A [max_rows, k], B [G, n, k] (weights [out, in]), C [max_rows, n].
// (fc1 forward: X·W1ᵀ; fc2 forward: A·W2ᵀ.)
void grouped_gemm_nt(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets /*[G+1]*/, cudaStream_t stream);

// C[r, :] = A[r, :] · B[g].  A [max_rows, k], B [G, k, n], C [max_rows, n]. (dgrad: dY·W.)
void grouped_gemm_nn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                     const int32_t* d_offsets /*[G+1]*/, cudaStream_t stream);

// How grouped_gemm_tn writes the gradient blocks C[g], and what a group with no rows gets:
// - overwrite: C[g] = A_gᵀ·B_g; an empty group's block is zeroed;
// - accumulate: C[g] += A_gᵀ·B_g; an empty group's block is left as it is;
// - overwrite_nonempty: as overwrite, but an empty group's block is left as it is (not written at all). For
//   blocks nobody reads when their group is empty: an ECHO spare slot that holds no clone this step would
//   otherwise cost a whole zeroed fp32 gradient (fc1 + fc2: 176 MiB at dsv3 sizes).
enum class WgradWrite { overwrite, accumulate, overwrite_nonempty };
inline WgradWrite wgrad_write(bool accumulate) { return accumulate ? WgradWrite::accumulate : WgradWrite::overwrite; }

// C[g] (+)= A_gᵀ · B_g with A_g = rows of A [max_rows, m] in group g and B_g the same rows of
// B [max_rows, n]; C [G, m, n] fp32 (weight gradients; reduction over the group's rows, which
// may be zero rows: see WgradWrite). (wgrad: dW = dYᵀ·X.)
// Here shape.n = n, shape.k = m (the output rows per group).
void grouped_gemm_tn(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                     const int32_t* d_offsets /*[G+1]*/, WgradWrite write, cudaStream_t stream);

// fc2's dgrad with the gated activation's backward in its epilogue (one pass over the rows fewer): computes dA =
// A · B[g] as grouped_gemm_nn would, rounds it to bf16, and writes instead grad_fc1[r] = [d gate | d up]
// ([max_rows, 2n]) of fc1_out[r] = [gate | up] with d a = dA * probs[r] (probs null = 1), bitwise what
// activation_backward makes of the stored dA, and dp_partials[r * glu_backward_tiles(n) + t] = the sum over the t-th
// kGluBackwardTileColumns columns of act(gate) * up * dA (null: skipped; activation_backward_probs_from_partials
// sums them). Runs on the own TMA kernel (in its consumers' staged epilogue), or where CUTLASS is forced on its
// ping-pong configuration (an epilogue visitor).
// Returns false having launched nothing where it does not run: then the caller runs grouped_gemm_nn +
// activation_backward.
struct GluBackwardEpilogue {
    const __nv_bfloat16* fc1_out;
    const float* probs;
    __nv_bfloat16* grad_fc1;
    float* dp_partials;
    Activation act;
};
constexpr int64_t kGluBackwardTileColumns = 128;
int64_t glu_backward_tiles(int64_t n);  // ceil(n / kGluBackwardTileColumns)
// 1 = fuse on every shape, 0 = never; -1 (default) = MOEKIT_FUSE_GLU_BACKWARD=0|1, else on the shapes where it
// measured faster (grouped_gemm.cu).
void set_glu_backward_fusion(int on);
bool glu_backward_fusion_enabled(const GroupedGemmShape& shape);  // whether a launch of this shape would fuse now
bool grouped_gemm_nn_glu_backward(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                                  const int32_t* d_offsets, const GluBackwardEpilogue& epilogue, cudaStream_t stream);

// fc1's forward with the gated activation in its epilogue (one pass over the rows fewer): C = [gate | up] =
// A · B[g]ᵀ ([max_rows, n], n = 2F) exactly as grouped_gemm_nt writes it, and act_out[r] = act(gate) * up *
// probs[r] ([max_rows, F]; probs null = 1), bitwise what activation_forward<float> makes of the stored C. Runs on the
// own TMA kernel (its tiles take gate columns f .. f+127 and up columns F+f .. together); needs F % 8 == 0. Returns
// false having launched nothing where it does not run (not sm_90, another kernel forced, fusion off for this shape):
// then the caller runs grouped_gemm_nt + activation_forward.
struct GluForwardEpilogue {
    const float* probs;
    __nv_bfloat16* act_out;
    Activation act;
};
// 1 = fuse on every shape, 0 = never; -1 (default) = MOEKIT_FUSE_GLU_FORWARD=0|1, else on the shapes where it
// measured faster (grouped_gemm.cu: short reductions, mid-sized groups).
void set_glu_forward_fusion(int on);
bool glu_forward_fusion_enabled(const GroupedGemmShape& shape);  // whether a launch of this shape would fuse now
// Where the fused forward's epilogue runs: 1 = on three warps of its own, overlapping the next tile's main loop (3
// stages); 0 = in the consumer warpgroups after each tile (4 stages); -1 (default) = MOEKIT_GLU_FORWARD_EPILOGUE=
// async|inline, else async.
void set_glu_forward_async_epilogue(int on);
// With a RowGather, A's rows are gathered from the unpermuted tokens inside the kernel's loads instead of read from
// A (one pass over the rows fewer: the permute): row r is tokens[row_token[r]] ([T, shape.k] bf16, 16-byte
// aligned) for r < offsets[G], and those rows are written to `rows` ([max_rows, k]; rows past offsets[G] untouched),
// the permuted copy fc1's wgrad reads. A must still be a valid [max_rows, k] allocation (it may be `rows`). Only
// where fc1_gather_enabled(shape) (the own kernel on single CTAs, its epilogue on warps of its own) and tokens and
// rows are 16-byte aligned: elsewhere returns false having launched nothing.
struct RowGather {
    const __nv_bfloat16* tokens;
    const int32_t* row_token;
    __nv_bfloat16* rows;
};
// 1 = gather wherever the fused forward runs on single CTAs, 0 = never; -1 (default) = MOEKIT_GATHER_FC1=0|1, else
// 0 (measured slower than the permute pass it saves: grouped_gemm.cu).
void set_fc1_gather(int on);
bool fc1_gather_enabled(const GroupedGemmShape& shape);  // whether grouped_gemm_nt_glu_forward would gather now
bool grouped_gemm_nt_glu_forward(const GroupedGemmShape& shape, const __nv_bfloat16* A, const __nv_bfloat16* B,
                                 __nv_bfloat16* C, const int32_t* d_offsets, const GluForwardEpilogue& epilogue,
                                 cudaStream_t stream, const RowGather* gather = nullptr);

// wgrads (grouped_gemm_tn) of groups of >= 256 rows under the per-shape choice: 1 = the own TMA kernel (its
// ping-pong schedule, set_tn_pingpong), 0 = CUTLASS's ping-pong; -1 (default) = MOEKIT_WGRAD_KERNEL=cutlass|tma, else
// CUTLASS (grouped_gemm.cu's choose_for_shape says what each measured).
void set_wgrad_own_kernel(int on);

// nt / nn that the per-shape choice gives CUTLASS's ping-pong: 1 = on its 128x192 tiles (kPingpongWide) where
// those pad at most 4 % of the output columns (wide_pingpong_pays_nt, core/tile_padding_math.h), else 128x128;
// 0 = 128x128 always; -1 (default) = MOEKIT_PINGPONG_TILE=192|128, else 192.
void set_pingpong_wide(int on);

// wgrads (tn) that take CUTLASS's ping-pong (alone or as kSplitBySize's ping-pong share): 1 = on 128x192 tiles
// (kPingpongWide) where those pad at most 2 % of the gradient's n columns (core/tile_padding_math.h), 0 = 128x128;
// -1 (default) = MOEKIT_WGRAD_TILE=192|128, else 192.
void set_wgrad_wide(int on);

// With set_wgrad_wide on: a wgrad whose n pads in 128x192 tiles but whose m does not computed transposed on them
// (kPingpongWideTransposed); 1 = on, 0 = off, -1 (default) = MOEKIT_WGRAD_TRANSPOSED=1|0, else 1.
void set_wgrad_wide_transposed(int on);

// wgrads of mid-sized groups: 1 = split by group size between CUTLASS's cooperative and ping-pong launches
// (kSplitBySize), 0 = ping-pong alone; -1 (default) = by MOEKIT_WGRAD_SPLIT_ROWS / MOEKIT_WGRAD_SPLIT_LARGE, split
// unless both are 0 (wgrad_split_on, grouped_gemm_cutlass.h).
void set_wgrad_split(int on);

// nt / nn of small groups (computed transposed, kSwapAB): 1 = on CUTLASS's ping-pong schedule (kSwapPingpong), 0 =
// cooperative; -1 (default) = MOEKIT_SWAP_SCHEDULE=cooperative|pingpong, else cooperative.
void set_swap_pingpong(int on);

// nt / nn of mid-sized groups whose 128x192 tiles would pad more than 4 % of n: computed transposed on CUTLASS's
// ping-pong (kSwapPingpong) instead of on 128x128 tiles. 1 = always, 0 = never; -1 (default) =
// MOEKIT_PINGPONG_SWAPPED=0|1, else per shape: where the reduction is short (swapped_pingpong_pays_nt,
// core/tile_padding_math.h).
void set_pingpong_swapped(int on);

// nt / nn of mid-sized and large groups whose reduction is longer than 2048 (pingpong_pays_reduction,
// core/tile_padding_math.h): 1 = CUTLASS's cooperative 128x256, 0 = the ping-pong rules above as for a short one;
// -1 (default) = MOEKIT_LONG_K_SCHEDULE=cooperative|pingpong, else cooperative.
void set_long_reduction_cooperative(int on);

// Multiprocessors of the current device (cached per device): the size of every backend's persistent grid, unless
// a GemmSmsLeftScope lives on the launching thread.
int grouped_gemm_sm_count();

// While a GemmSmsLeftScope(n) lives on a thread, the persistent grouped GEMMs it launches leave n SMs to kernels
// running beside them (their grid: core/sm_share_math.h grid_sms_leaving); 0 = the whole device. The layer's wgrad
// on a stream of its own takes it, so that the dgrad chain's memory passes get SMs while it runs (moe_layer.cu).
class GemmSmsLeftScope {
public:
    explicit GemmSmsLeftScope(int sms_left);
    ~GemmSmsLeftScope();
    GemmSmsLeftScope(const GemmSmsLeftScope&) = delete;
    GemmSmsLeftScope& operator=(const GemmSmsLeftScope&) = delete;

private:
    int previous_;
};
// The SMs a persistent grid of `cluster`-CTA clusters launched from this thread takes now.
int grouped_gemm_grid_sms(int cluster);

// Several EP ranks on one GPU (virtual ranks) spin in device barriers while a peer still runs its GEMMs. CUTLASS's
// kernels hold a whole SM per CTA (their register budget), so they cannot be scheduled beside the spinning blocks
// and the step waits for the barrier's time-out (seen on an H100: EP=8 budgeted/ECHO tests). While an
// OwnGemmKernelScope(true) lives on a thread, the per-shape choice there keeps to the own TMA kernel, which shares
// an SM with a spinning block. A kernel forced with MOEKIT_GEMM_KERNEL is not overridden.
class OwnGemmKernelScope {
public:
    explicit OwnGemmKernelScope(bool on);
    ~OwnGemmKernelScope();
    OwnGemmKernelScope(const OwnGemmKernelScope&) = delete;
    OwnGemmKernelScope& operator=(const OwnGemmKernelScope&) = delete;

private:
    bool on_;
};

// While a GemmRuleScope(true) lives on a thread, the per-shape choice there is the rule's alone (choose_for_shape):
// nothing is tuned and no measured choice is taken (gemm_tuning.h), so every process computes the same bits for the
// same inputs. A layer with --deterministic-mode takes it (moe_layer.cu), and so do moekit train's layers.
class GemmRuleScope {
public:
    explicit GemmRuleScope(bool on);
    ~GemmRuleScope();
    GemmRuleScope(const GemmRuleScope&) = delete;
    GemmRuleScope& operator=(const GemmRuleScope&) = delete;

private:
    bool on_;
};

}  // namespace moekit::cuda
