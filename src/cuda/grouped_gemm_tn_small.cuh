// Wgrad (tn) of small groups: C[g] (+)= A_gᵀ·B_g for the groups of fewer than p.tn_small_below rows (an ECHO
// rank's cold experts; every expert of dsv3-e256 at 4096 tokens). Such a group's 128x128 tile is one to four
// reduction steps and a whole 64 KiB fp32 store, so the store rate sets its time. CUTLASS's epilogues store one
// tile through a few small shared-memory buffers, one warpgroup (or two) at a time, at ~14-27 GB/s per SM (less
// than HBM's share of ~36, docs/perf.md); here several CTAs share each SM (kMinBlocks), so one CTA's stores leave
// while another's loads and mma.sync run, and a CTA's stores are whole 512-byte rows from shared memory (kStaged)
// or the fragments' 32-byte pieces straight from registers. Persistent over the groups' tiles, skipping the groups
// of >= p.tn_small_below rows (another launch's) a group at a time. Empty groups as store_pair: zeroed, or left as
// they are (keep_empty, second base). Host side: grouped_gemm.cu (tn_small_rows); tests: WgradSmallGroupsKernel.
// Included by grouped_gemm_kernels.cuh only.
#pragma once

namespace moekit::cuda::gemm_detail {

constexpr int kTnSmallStageBytes = 2 * 128 * kBK * 2;  // one ring stage: A and B, 64 k-rows x 128 each
constexpr int kTnSmallTileBytes = 128 * 128 * 4;       // the fp32 result tile, staged through the ring's memory

template <int kStages>
constexpr int tn_small_smem_bytes() {
    return (kStages * kTnSmallStageBytes > kTnSmallTileBytes ? kStages * kTnSmallStageBytes : kTnSmallTileBytes) +
           1024 /*alignment slack*/;
}

// Byte offset of the fp32 pair (row, col..col+1), col even, in the staged 128x128 result tile: 512-byte rows whose
// 8-byte pairs are XOR-swizzled by the row (pair ^ (row & 7) * 4), so the fragments' pair writes (8 rows x 4 pairs
// a half-warp) and the row reads (16 bytes a lane) are both free of bank conflicts; a pair's two halves of an
// aligned float4 stay together.
__device__ __forceinline__ uint32_t tn_small_tile_off(int row, int col) {
    return uint32_t(row) * 512u + uint32_t(((col >> 1) ^ ((row & 7) << 2)) << 3);
}

// The tile's rows from shared memory to C[g], warp w storing rows w, w + 8, ...: each lane 4 columns (16 bytes), a
// row one 512-byte line. Accumulates onto C where asked; columns past n (a partial last tile) are not stored.
__device__ __forceinline__ void tn_small_store_rows(const Params& p, const TileJob& job, uint32_t tile, float* Cg) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gn = job.n0 + lane * 4;
    if (gn >= p.n) return;
    for (int row = warp; row < 128; row += 8) {
        const int gm = job.m0 + row;
        if (gm >= p.k) break;
        float4 v;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(tile + tn_small_tile_off(row, lane * 4)));
        float* dst = Cg + int64_t(gm) * p.n + gn;
        if (p.accumulate) {
            const float4 old = *reinterpret_cast<const float4*>(dst);
            v.x += old.x, v.y += old.y, v.z += old.z, v.w += old.w;
        }
        *reinterpret_cast<float4*>(dst) = v;  // n % 8 == 0 and C 16-byte aligned (host): whole float4s
    }
}

template <int kStages, int kMinBlocks, bool kStaged>
__global__ void __launch_bounds__(256, kMinBlocks) tn_small_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int per_group = p.tiles_m * p.tiles_n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    for (int pid = blockIdx.x; pid < p.total_tiles; pid += gridDim.x) {
        const int g = pid / per_group;
        const int rows = p.offsets[g + 1] - p.offsets[g];
        if (rows >= p.tn_small_below) {  // another launch's group: on to this CTA's first tile past it
            pid += ((g + 1) * per_group - pid - 1) / int(gridDim.x) * int(gridDim.x);
            continue;
        }
        if (rows == 0 && (p.keep_empty || in_second(p, g))) continue;  // left as it is
        const TileJob job = find_job_warp<Op::kTN, 128, 128>(p, pid);
        float acc[4][4][4];
        mma_mainloop<Op::kTN, kStages>(p, job, base, acc);
        if constexpr (kStaged) {
            __syncthreads();  // every warp's last ldmatrix of the ring is done: the tile may overwrite it
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = frag_row(wm, mi, lane, h), col = frag_col(wn, ni, lane);
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(base + tn_small_tile_off(row, col)),
                                     "f"(acc[mi][ni][2 * h]), "f"(acc[mi][ni][2 * h + 1]));
                    }
            __syncthreads();
            tn_small_store_rows(p, job, base,
                                group_block(static_cast<float*>(p.C), p.second, p.second_from, g, int64_t(p.k) * p.n));
        } else {
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        store_pair<Op::kTN>(p, job, frag_row(wm, mi, lane, h), frag_col(wn, ni, lane),
                                            acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
        __syncthreads();  // the ring (or the staged tile) is read before the next job's copies land in it
    }
#endif
}

}  // namespace moekit::cuda::gemm_detail
