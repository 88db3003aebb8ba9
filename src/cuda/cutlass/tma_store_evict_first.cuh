// A CuTe TMA store that marks the lines it writes evict-first in L2, for the wgrad epilogue: the fp32 gradient a
// wgrad writes is not read again in the step, while the operand tiles it would push out of L2 are (each token row
// of a group serves every output tile of that group). Plugged into CUTLASS's pointer-array TMA epilogue as its
// shared-to-global copy (grouped_gemm_cutlass.cuh, WithStoreOp); the traits mirror CuTe's SM90_TMA_STORE ones
// (a descriptor, or for grouped GEMMs a pointer to the per-group descriptor) and differ only in the instruction.
#pragma once
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

#include <cstdint>

namespace moekit::cuda::cutlass_detail {

struct TmaStoreEvictFirst {
    static constexpr uint64_t kPolicy = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);
    CUTE_DEVICE static void copy(void const* desc, void const* smem, int32_t const& c0, int32_t const& c1) {
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3}], [%1], %4;"
                     :
                     : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1),
                       "l"(kPolicy)
                     : "memory");
    }
    CUTE_DEVICE static void copy(void const* desc, void const* smem, int32_t const& c0, int32_t const& c1,
                                 int32_t const& c2) {
        asm volatile(
            "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;"
            :
            : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2),
              "l"(kPolicy)
            : "memory");
    }
    CUTE_DEVICE static void copy(void const* desc, void const* smem, int32_t const& c0, int32_t const& c1,
                                 int32_t const& c2, int32_t const& c3) {
        asm volatile(
            "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4, %5}], [%1], %6;"
            :
            : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2),
              "r"(c3), "l"(kPolicy)
            : "memory");
    }
    CUTE_DEVICE static void copy(void const* desc, void const* smem, int32_t const& c0, int32_t const& c1,
                                 int32_t const& c2, int32_t const& c3, int32_t const& c4) {
        asm volatile(
            "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4, %5, %6}], [%1], "
            "%7;"
            :
            : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2),
              "r"(c3), "r"(c4), "l"(kPolicy)
            : "memory");
    }
};
// The grouped-GEMM form: the descriptor is the group's, updated in global memory by the epilogue.
struct TmaStoreEvictFirstPtr : TmaStoreEvictFirst {};

}  // namespace moekit::cuda::cutlass_detail

namespace cute {

template <class Op, class TS, class SLayout, class TD, class DLayout>
CUTE_HOST_DEVICE void moekit_tma_store_unpack(void const* desc, Tensor<TS, SLayout> const& src,
                                              Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TS>::value, "a TMA store reads shared memory");
    auto coord = dst.data().coord_;
    detail::explode_tuple(detail::CallCOPY<Op>{}, make_tuple(desc, raw_pointer_cast(src.data())), seq<0, 1>{}, coord,
                          tuple_seq<decltype(coord)>{});
}

template <class NumBitsPerTMA>
struct Copy_Traits<moekit::cuda::cutlass_detail::TmaStoreEvictFirstPtr, NumBitsPerTMA> {
    using ThrID = Layout<_1>;
    using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
    using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
    using RefLayout = SrcLayout;
    TmaDescriptor const* tma_desc_;

    template <class TS, class SLayout, class TD, class DLayout>
    CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                       Tensor<TD, DLayout>& dst) {
        moekit_tma_store_unpack<moekit::cuda::cutlass_detail::TmaStoreEvictFirstPtr>(traits.tma_desc_, src, dst);
    }
};

template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<moekit::cuda::cutlass_detail::TmaStoreEvictFirst, NumBitsPerTMA, AuxParams_> {
    using ThrID = Layout<_1>;
    using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
    using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
    using RefLayout = SrcLayout;
    TmaDescriptor tma_desc_;
    using AuxParams = AuxParams_;
    AuxParams aux_params_;

    CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

    template <class GShape>
    CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
        return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
    }

    // The grouped epilogue stores through the group's descriptor.
    CUTE_HOST_DEVICE constexpr Copy_Traits<moekit::cuda::cutlass_detail::TmaStoreEvictFirstPtr, NumBitsPerTMA> with(
        TmaDescriptor const* desc) const {
        return {desc};
    }

    template <class TS, class SLayout, class TD, class DLayout>
    CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                       Tensor<TD, DLayout>& dst) {
        moekit_tma_store_unpack<moekit::cuda::cutlass_detail::TmaStoreEvictFirst>(&traits.tma_desc_, src, dst);
    }
};

}  // namespace cute
