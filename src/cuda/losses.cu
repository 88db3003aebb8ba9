// CUDA router losses (see losses.cuh). Aux scores: softmax over all E, or sigmoid/sqrtsoftplus
// renormalised over all E; aux map: plain top-k of those scores (no bias, group limit or
// dropping); padding rows zeroed. Column statistics per chunk of positions, folded in a fixed order: every
// reduction has a fixed order, so results are bitwise stable.
#include <cub/block/block_reduce.cuh>

#include <algorithm>

#include "cuda/column_runs.cuh"
#include "cuda/cuda_check.h"
#include "cuda/losses.cuh"
#include "cuda/router_warp.cuh"

namespace moekit::cuda {

using namespace detail;

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kLossThreads = 1024;  // loss_values_kernel's one block
constexpr int kLossRuns = 8;        // ColumnRuns' groups of the column statistics and the fold

// A warp's slice of the aux-score kernel's shared memory: a token's E scores and its E taken flags, 16-byte aligned.
__host__ __device__ constexpr size_t aux_scores_warp_bytes(int64_t experts, size_t score_bytes) {
    return (size_t(experts) * (score_bytes + 1) + 15) / 16 * 16;
}

// The runs' three partial sums of a column added in run order into the first group's thread; every thread of the
// block calls it (barriers), each scratch array has a slot a thread.
template <typename R>
__device__ void add_runs_in_order(const ColumnRuns& cr, R& sum, int& a, int& v, R* s_sum, int* s_a, int* s_v) {
    __syncthreads();  // the scratch is free (a previous round's readers are done)
    if (cr.active()) s_sum[threadIdx.x] = sum, s_a[threadIdx.x] = a, s_v[threadIdx.x] = v;
    __syncthreads();
    if (cr.part == 0)
        for (int q = 1; q < cr.parts; ++q) {
            const int j = cr.slot(q);
            sum += s_sum[j], a += s_a[j], v += s_v[j];
        }
}

// Warp per token: aux scores, aux map (warp_topk), log-sum-exp.
template <typename R>
__global__ void aux_scores_kernel(RouterShape s, LossTensors<R> t, bool need_aux) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int64_t tok = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
    if (tok >= s.num_tokens) return;
    const int E = int(s.num_experts), fn = int(s.score_function);
    const size_t stride = aux_scores_warp_bytes(E, sizeof(R));
    R* sc = reinterpret_cast<R*>(smem_raw + stride * warp);
    uint8_t* taken = reinterpret_cast<uint8_t*>(sc + E);
    const R* row = t.logits + tok * E;
    for (int e = lane; e < E; e += kWarp) sc[e] = row[e], taken[e] = 0;
    __syncwarp();
    const R lse = warp_logsumexp(sc, E, lane);
    if (lane == 0) t.lse[tok] = lse;
    if (!need_aux) return;
    const bool pad = t.padding_mask[tok] != 0;
    R sum = 0;
    for (int e = lane; e < E; e += kWarp) {
        sc[e] = score_of<R>(fn, sc[e], lse);
        sum += sc[e];
    }
    sum = fn == 0 ? R(1) : warp_sum(sum);
    __syncwarp();
    R* out = t.aux_scores + tok * E;
    uint8_t* map = t.aux_map + tok * E;
    for (int e = lane; e < E; e += kWarp) {
        if (fn != 0) sc[e] = sc[e] / (sum + R(1e-20));
        out[e] = pad ? R(0) : sc[e];
        map[e] = 0;
    }
    __syncwarp();
    const int pick = warp_topk(sc, taken, E, int(s.topk), lane);
    __syncwarp();  // the row's zeros are written before its picks
    if (pick >= 0 && !pad) map[pick] = 1;
}

// Block per (chunk of loss_chunk_positions(S) sequence positions, sequence b) of kColumnThreads: the chunk's
// partial column sums, a column's positions in ColumnRuns (coalesced across the experts of a row); and a thread a
// position: its valid-token count and z-loss sum. loss_values_kernel folds the chunks, so every sum has a fixed order.
constexpr int kColumnThreads = 512;
template <typename R>
__global__ void __launch_bounds__(kColumnThreads)
    column_stats_kernel(RouterShape s, LossTensors<R> t, bool need_aux) {
    __shared__ R part_sum[kColumnThreads];
    __shared__ int part_aux[kColumnThreads], part_valid[kColumnThreads];
    const int64_t E = s.num_experts, B = s.micro_batch_size, c = blockIdx.x, b = blockIdx.y, C = gridDim.x;
    const int64_t chunk = loss_chunk_positions(s.seq_length), i0 = c * chunk, i1 = min(s.seq_length, i0 + chunk);
    const int64_t slot = (c * B + b) * E;
    const ColumnRuns cr(E, kColumnThreads, i1 - i0, kLossRuns);
    for (int64_t e0 = 0; e0 < E; e0 += cr.width) {
        const int64_t e = e0 + cr.lane;
        R sum = 0;
        int acount = 0, vcount = 0;
        if (cr.active() && e < E) {
#pragma unroll 8
            for (int64_t i = i0 + cr.lo; i < i0 + cr.hi; ++i) {
                const int64_t tok = i * B + b;
                if (need_aux) {
                    sum += t.aux_scores[tok * E + e];
                    acount += t.aux_map[tok * E + e];
                }
                vcount += t.padding_mask[tok] == 0 && t.routing_map[tok * E + e];
            }
        }
        add_runs_in_order(cr, sum, acount, vcount, part_sum, part_aux, part_valid);
        if (cr.part == 0 && e < E) {
            t.chunk_scores[slot + e] = sum;
            t.chunk_counts[slot + e] = acount;
            t.chunk_counts[C * B * E + slot + e] = vcount;
        }
    }
    const int64_t i = i0 + threadIdx.x, tok = i * B + b;
    const bool valid = i < i1 && t.padding_mask[tok] == 0;
    const R z = valid ? t.lse[tok] * t.lse[tok] : R(0);
    using ReduceR = cub::BlockReduce<R, kColumnThreads>;
    using ReduceI = cub::BlockReduce<int, kColumnThreads>;
    __shared__ typename ReduceR::TempStorage temp_r;
    __shared__ typename ReduceI::TempStorage temp_i;
    const R z_sum = ReduceR(temp_r).Sum(z);
    const int n_valid = ReduceI(temp_i).Sum(int(valid));
    if (threadIdx.x == 0) {
        t.chunk_scores[C * B * E + c * B + b] = z_sum;
        t.chunk_counts[2 * C * B * E + c * B + b] = n_valid;
    }
}

template <typename R>
__device__ R block_sum(R v, R* red) {
    __syncthreads();
    red[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    return red[0];
}

// One block: loss values, per-(b, e) gradient coefficients, tracker updates.
template <typename R>
__global__ void __launch_bounds__(kLossThreads)
    loss_values_kernel(RouterShape s, LossShape ls, LossTensors<R> t) {
    __shared__ R red[kLossThreads];
    const int64_t E = s.num_experts, B = s.micro_batch_size, C = loss_chunks(s.seq_length);
    const R k = R(s.topk), scale = R(ls.backward_scale);
    // Fold column_stats_kernel's chunks, each (b, e) in ColumnRuns of chunks.
    {
        __shared__ int fold_aux[kLossThreads], fold_valid[kLossThreads];
        const int64_t BE = B * E;
        const ColumnRuns cr(BE, kLossThreads, C, kLossRuns);
        for (int64_t be0 = 0; be0 < BE; be0 += cr.width) {
            const int64_t be = be0 + cr.lane;
            R sum = 0;
            int acount = 0, vcount = 0;
            if (cr.active() && be < BE)
#pragma unroll 4
                for (int64_t c = cr.lo; c < cr.hi; ++c) {
                    sum += t.chunk_scores[c * BE + be];
                    acount += t.chunk_counts[c * BE + be];
                    vcount += t.chunk_counts[C * BE + c * BE + be];
                }
            add_runs_in_order(cr, sum, acount, vcount, red, fold_aux, fold_valid);
            if (cr.part == 0 && be < BE) t.score_sums[be] = sum, t.aux_counts[be] = acount, t.valid_counts[be] = vcount;
        }
    }
    R nv = 0, z = 0;
    for (int64_t cb = threadIdx.x; cb < C * B; cb += blockDim.x)
        nv += R(t.chunk_counts[2 * C * B * E + cb]), z += t.chunk_scores[C * B * E + cb];
    const R n_valid = block_sum(nv, red);  // block_sum's barriers also publish the folded sums to the block
    const R z_sum = block_sum(z, red);
    const R n_div = max(n_valid, R(1));
    // Megatron switch_load_balancing_loss_func: coeff * E / (k * T_tot^2) * sum_i P_i * tokens_i.
    const R aux_c = R(ls.aux_coeff) * R(E) / (k * n_div * n_div);
    const R seq_tokens = max(n_valid / R(B), R(1));
    const R seq_c = R(ls.seq_aux_coeff) * R(E) / (k * seq_tokens * seq_tokens * R(B));
    const R glob_c = R(ls.global_aux_coeff) * R(E) / (k * n_div * n_div);
    int32_t steps = 0;
    if (ls.global_aux_coeff != 0) steps = *t.ga_steps + 1;
    __syncthreads();
    R aux = 0, seq = 0, glob = 0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        R p_tot = 0;
        int64_t c_tot = 0, v_tot = 0;
        for (int64_t b = 0; b < B; ++b) {
            const R p = t.score_sums[b * E + e];
            const int64_t c = t.aux_counts[b * E + e];
            p_tot += p, c_tot += c, v_tot += t.valid_counts[b * E + e];
            seq += p * R(c);
        }
        aux += p_tot * R(c_tot);
        R avg = 0;
        if (ls.global_aux_coeff != 0) {
            t.global_tokens_per_expert[e] += double(c_tot);
            avg = R(t.global_tokens_per_expert[e] / double(steps));
            glob += p_tot * avg;
        }
        if (t.local_tokens_per_expert) t.local_tokens_per_expert[e] += double(v_tot);
        for (int64_t b = 0; b < B; ++b)
            t.grad_coeff[b * E + e] = scale * (aux_c * R(c_tot) + seq_c * R(t.aux_counts[b * E + e]) + glob_c * avg);
    }
    aux = block_sum(aux, red);
    seq = block_sum(seq, red);
    glob = block_sum(glob, red);
    if (threadIdx.x == 0) {
        t.losses[kAuxLoss] = aux_c * aux;
        t.losses[kSeqAuxLoss] = seq_c * seq;
        t.losses[kGlobalAuxLoss] = glob_c * glob;
        t.losses[kZLoss] = R(ls.z_coeff) * z_sum / n_div;
        t.z_grad_coeff[0] = scale * R(ls.z_coeff) / n_div;
        if (ls.global_aux_coeff != 0) *t.ga_steps = steps;
    }
}

// Warp per valid token: dl += d/dl of sum_e coeff[b, e] * aux_score[t, e] + z-loss term.
template <typename R>
__global__ void losses_backward_kernel(RouterShape s, LossShape ls, LossTensors<R> t, R* grad_logits) {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int64_t tok = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
    if (tok >= s.num_tokens || t.padding_mask[tok]) return;
    const int E = int(s.num_experts), fn = int(s.score_function);
    const int64_t b = tok % s.micro_batch_size;
    const R* row = t.logits + tok * E;
    R* grow = grad_logits + tok * E;
    const R lse = t.lse[tok];
    const R zc = ls.z_coeff != 0 ? t.z_grad_coeff[0] * R(2) * lse : R(0);
    const bool aux = ls.need_aux();
    const R* coeff = t.grad_coeff + b * E;
    // <ds, s> over the row (s = the aux scores, ds = coeff).
    R dot = 0, fsum = 0;
    for (int e = lane; e < E; e += kWarp) {
        if (aux) dot += coeff[e] * t.aux_scores[tok * E + e];
        if (fn != 0) fsum += score_of<R>(fn, row[e], lse);
    }
    dot = warp_sum(dot);
    fsum = fn != 0 ? warp_sum(fsum) + R(1e-20) : R(1);
    for (int e = lane; e < E; e += kWarp) {
        const R soft = exp(row[e] - lse);
        R g = zc * soft;
        if (aux) {
            const R ds = coeff[e];
            if (fn == 0) {
                g += soft * (ds - dot);
            } else {
                g += (ds - dot) / fsum * score_grad<R>(fn, row[e]);
            }
        }
        grow[e] += g;
    }
}

}  // namespace

LossShape LossShape::from_config(const MoeConfig& c) {
    LossShape l;
    l.aux_coeff = c.aux_loss_coeff("aux_loss");
    l.seq_aux_coeff = c.aux_loss_coeff("seq_aux_loss");
    l.global_aux_coeff = c.aux_loss_coeff("global_aux_loss");
    l.z_coeff = c.moe_z_loss_coeff.value_or(0.0);
    l.backward_scale = c.moe_loss_backward_scale;
    return l;
}

size_t aux_scores_smem_bytes(int64_t num_experts, bool fp64) {
    return aux_scores_warp_bytes(num_experts, fp64 ? sizeof(double) : sizeof(float)) * kWarpsPerBlock;
}

template <typename R>
void losses_forward(const RouterShape& s, const LossShape& ls, const LossTensors<R>& t, cudaStream_t stream) {
    const int64_t E = s.num_experts;
    const size_t smem = aux_scores_smem_bytes(E, std::is_same_v<R, double>);
    if (smem > 48 * 1024)
        MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&aux_scores_kernel<R>),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    aux_scores_kernel<R><<<int(ceil_div(s.num_tokens, kWarpsPerBlock)), kWarpsPerBlock * kWarp, smem, stream>>>(
        s, t, ls.need_aux());
    MOEKIT_CUDA_LAUNCH_CHECK();
    MOEKIT_CHECK(t.chunk_scores && t.chunk_counts, "losses_forward: no chunk scratch (loss_chunk_*_elems)");
    column_stats_kernel<R><<<dim3(unsigned(loss_chunks(s.seq_length)), unsigned(s.micro_batch_size)),
                             kColumnThreads, 0, stream>>>(s, t, ls.need_aux());
    MOEKIT_CUDA_LAUNCH_CHECK();
    loss_values_kernel<R><<<1, kLossThreads, 0, stream>>>(s, ls, t);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template <typename R>
void losses_backward(const RouterShape& s, const LossShape& ls, const LossTensors<R>& t, R* grad_logits,
                     cudaStream_t stream) {
    if (!ls.any()) return;
    losses_backward_kernel<R><<<int(ceil_div(s.num_tokens, kWarpsPerBlock)), kWarpsPerBlock * kWarp, 0, stream>>>(
        s, ls, t, grad_logits);
    MOEKIT_CUDA_LAUNCH_CHECK();
}

template void losses_forward<float>(const RouterShape&, const LossShape&, const LossTensors<float>&, cudaStream_t);
template void losses_forward<double>(const RouterShape&, const LossShape&, const LossTensors<double>&, cudaStream_t);
template void losses_backward<float>(const RouterShape&, const LossShape&, const LossTensors<float>&, float*,
                                     cudaStream_t);
template void losses_backward<double>(const RouterShape&, const LossShape&, const LossTensors<double>&, double*,
                                      cudaStream_t);

}  // namespace moekit::cuda
