// SM90 mixed-input grouped GEMM (W4A16): D_g = X_g x dequant(W_g)^T with INT4 weights [N, K]
// and one 16-bit scale per group of `weight_group` along K, converted to the activations' type
// in registers by CUTLASS's ptr-array RS mainloop. The converted operand must be the wgmma's A,
// so the weights are A and the tokens B, as in the swap-AB schedules (src/gemm/cutlass_grouped.cuh):
// D^T is stored column-major, which is D row-major.
// The weights are read as prepare_weights stores them, in the fragment layout
// (python/moe_kernels/quant4.py): per expert, K zero-padded to Kpad (a multiple of 128) and
// tiled into 1 KB atoms of 16 rows x 128 k, atom (n/16, k/128) at byte 1024 (n/16 + N/16 k/128).
// To CUTLASS that is a CuTe layout for A instead of a stride (its example 69's shuffled form):
// tile_to_shape(atom, (N, Kpad, 1)) with the atom of compute_memory_reordering_atom over 8 MMA
// K blocks and INT4's value shuffle: a thread's values of one MMA K block are one 32-bit word in
// the order CUTLASS's INT4 conversion takes, and a tile of 128 rows x 128 k is 8 KB in one piece
// for its TMA. (The mainloop reads shared memory one K block at a time, so a warp's 32-bit
// loads are 32 bytes apart: 8-way bank conflicts.) The atom spans 128 of K, hence K tiles of
// 128; the mainloop loads one scale per K tile, so scale groups of 128 or more (smaller ones run
// on the decode, tiled and contiguous kernels). The scales are [K/g, N] per expert (N
// contiguous, as AWQ and GPTQ store them). Each group's scale stride and weight layout are
// written into the workspace before each GEMM. No zero points: CUTLASS 4.2's ptr-array form of
// this mainloop with zero terms (ConvertAndScaleWithZero) never copies or updates the scales'
// TMA descriptor and raised an illegal instruction on the H200; asymmetric INT4 runs on the
// decode and tiled kernels.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "gemm/cutlass_grouped.cuh"
#include "gemm/grouped_gemm.h"

namespace moe_kernels::sm90 {

namespace fragment {

// CUTLASS 4.2's cutlass::compute_memory_reordering_atom (tools/util/include/cutlass/util/
// mixed_dtype_utils.hpp), unchanged: that header also includes curand, which the CUDA this
// project builds with need not have. The layout of (m, k) -> offset over the 16 x 16 k A
// operand of one warp's wgmma (ElementMma: the MMA's type), repeated atom_layout times, that
// puts each thread's values next to each other, permuted within by val_layout.
template <class ElementMma, class AtomLayout = cute::Layout<cute::_1>, class ValLayout = cute::Layout<cute::_1>>
constexpr auto memory_reordering_atom(AtomLayout atom_layout = {}, ValLayout val_layout = {}) {
  using namespace cute;

  static_assert(is_static_v<ValLayout>, "ValLayout must be static");
  static_assert(is_static_v<AtomLayout>, "AtomLayout must be static");

  using MmaAtom = decltype(SM90::GMMA::rs_op_selector<ElementMma, ElementMma, float, Shape<_64, _16, _32>>());
  using MmaTraits = MMA_Traits<MmaAtom>;
  auto mk_shape_mma = select<0, 2>(typename MmaTraits::Shape_MNK{});
  auto tv_layout_mma = typename MmaTraits::ALayout{};
  static_assert(size<1>(tv_layout_mma) % size(val_layout) == 0, "Value layout must evenly divide the MMA value layout");

  auto tv_tiler_warp = make_shape(Int<32>{}, size<1>(tv_layout_mma));
  auto mk_shape_warp = shape_div(mk_shape_mma, size(typename MmaTraits::ThrID{}) / Int<32>{});
  auto tv_layout_mma_warp = make_layout_like(composition(tv_layout_mma, tv_tiler_warp));
  auto mk_layout_mma_warp = right_inverse(tv_layout_mma_warp).with_shape(mk_shape_warp);

  auto mk_layout_mma_trgt = blocked_product(mk_layout_mma_warp, atom_layout);

  auto val_to_offset = logical_product(val_layout, size<1>(tv_layout_mma) / size(val_layout) * size(atom_layout));
  auto thr_to_offset = make_layout(size<0>(tv_layout_mma_warp));
  auto tv_to_offset = select<1, 0>(logical_product(val_to_offset, thr_to_offset));
  auto layout_atom = composition(tv_to_offset, mk_layout_mma_trgt);

  return layout_atom;
}

// The fragment layout's atom: 16 rows x 128 k (8 MMA K blocks), INT4's value shuffle (register
// a_i in nibbles i and i + 4 of its word, the order CUTLASS's INT4 conversion takes).
using AtomBlocks = cute::Layout<cute::Shape<cute::_1, cute::_8>>;  // 8 MMA K blocks
using ValueShuffle = cute::Layout<cute::Shape<cute::_2, cute::_4>, cute::Stride<cute::_4, cute::_1>>;
template <class ElementMma>
using Atom = decltype(memory_reordering_atom<ElementMma, AtomBlocks, ValueShuffle>());
constexpr int kAtomRows = 16;
constexpr int kAtomK = 128;

// One expert's weights: (n, k, 1) -> element offset, atoms repeated over (N, Kpad), rows first.
template <class ElementMma>
using WeightLayout = decltype(cute::tile_to_shape(Atom<ElementMma>{}, cute::make_shape(int{}, int{}, cute::_1{})));

template <class ElementMma>
CUTE_HOST_DEVICE WeightLayout<ElementMma> weight_layout(int n, int kpad) {
  return cute::tile_to_shape(Atom<ElementMma>{}, cute::make_shape(n, kpad, cute::_1{}));
}

inline int64_t padded_k(int64_t k) { return (k + kAtomK - 1) / kAtomK * kAtomK; }

}  // namespace fragment

// Each group's scale stride, (1, N, N * K/g) (the packed [K/g, N] layout), and weight layout.
template <class StrideScale, class ElementMma>
__global__ void write_group_layouts(StrideScale* strides, fragment::WeightLayout<ElementMma>* layouts, int groups,
                                    int64_t n, int64_t scale_k, int kpad) {
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
    StrideScale s{};
    cute::get<1>(s) = n;
    cute::get<2>(s) = n * scale_k;
    strides[g] = s;
    layouts[g] = fragment::weight_layout<ElementMma>(static_cast<int>(n), kpad);
  }
}

// ElementQ: cutlass::int4b_t. Schedule: a Schedule of gemm/sm90/grouped_gemm.cuh (its
// mainloop and epilogue tags). TileM: tokens per tile (CUTLASS's N), TileN: weight rows per
// tile (CUTLASS's M), TileK: 128, the fragment layout's atom.
template <class ElementAct, class ElementQ, class ElementD, int TileM, int TileN, int TileK, int ClusterM,
          int ClusterN, class Schedule>
struct MixedGroupedGemm {
  static_assert(TileK == fragment::kAtomK, "the fragment layout's atoms span 128 of K: K tiles of 128");
  static_assert(TileN % fragment::kAtomRows == 0, "whole 16-row atoms per tile");
  using ElementScale = ElementAct;
  using Weights = cute::tuple<ElementQ, ElementScale>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::Int<TileN>, cute::Int<TileM>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterN>, cute::Int<ClusterM>, cute::_1>;
  using LayoutW = fragment::WeightLayout<ElementAct>;  // weights [N, Kpad] in the fragment layout: the A operand
  using LayoutX = cutlass::layout::ColumnMajor;  // activations [M, K], K-major: the B operand
  using LayoutD = cutlass::layout::ColumnMajor;  // D^T [N, M]: the bytes of D [M, N] row-major
  static constexpr int kAlignW = 128 / cutlass::sizeof_bits<ElementQ>::value;
  static constexpr int kAlignX = 128 / cutlass::sizeof_bits<ElementAct>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD,
      LayoutD*, kAlignD, typename Schedule::Epilogue>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Weights, LayoutW*,
      kAlignW, ElementAct, LayoutX*, kAlignX, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideX = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using StrideScale = typename CollectiveMainloop::StrideScale;
  static_assert(cute::is_same_v<typename Kernel::InternalStrideA, LayoutW>, "weights read through their layout");
  // Routing writes one int64 leading dimension per group (B, D) and three int32 per problem
  // shape; the weights' layouts are ours (the workspace), routing's stride_b is not read.
  static_assert(sizeof(StrideX) == sizeof(int64_t) && sizeof(StrideD) == sizeof(int64_t) &&
                    sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t),
                "stride or problem shape layout changed");

  // Bytes at the workspace's start for the per-group scale strides and weight layouts, each
  // array 256-aligned.
  static size_t scale_stride_bytes(int num_groups) {
    return (size_t(num_groups) * sizeof(StrideScale) + 255) / 256 * 256;
  }
  static size_t stride_bytes(int num_groups) {
    return scale_stride_bytes(num_groups) + (size_t(num_groups) * sizeof(LayoutW) + 255) / 256 * 256;
  }

  // The problem shapes (routing's problem_shapes_t) carry the real K: A's layout does not depend
  // on the problem's K (CUTLASS takes a layout operand as given), the K tile count ceil(K/128)
  // is Kpad/128 either way, and B's TMA zero-fills past the real K (a Kpad there would read the
  // next token's row).
  static typename Gemm::Arguments make_arguments(const GroupedGemmArgs& a) {
    auto args = grouped_arguments<Gemm, ProblemShape>(a, a.problem_shapes_t);
    char* ws = static_cast<char*>(a.workspace);
    args.mainloop.ptr_A = reinterpret_cast<const ElementQ**>(a.ptr_b);
    args.mainloop.dA = reinterpret_cast<LayoutW*>(ws ? ws + scale_stride_bytes(a.num_groups) : nullptr);
    args.mainloop.ptr_B = reinterpret_cast<const ElementAct**>(a.ptr_a);
    args.mainloop.dB = reinterpret_cast<StrideX*>(a.stride_a);
    args.mainloop.ptr_S = reinterpret_cast<const ElementScale**>(a.ptr_sfb);
    args.mainloop.dS = reinterpret_cast<const StrideScale*>(ws);
    args.mainloop.chunk_size = a.weight_group;
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(a.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(a.stride_d);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    // Consecutive tiles along the tokens, so that the CTAs running at once share a weight tile.
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = Raster::AlongN;
    return args;
  }

  static size_t workspace_size(int num_groups, int sm_count) {
    GroupedGemmArgs a{};
    a.num_groups = num_groups;
    a.sm_count = sm_count;
    a.weight_group = TileK;
    return stride_bytes(num_groups) + Gemm::get_workspace_size(make_arguments(a));
  }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (a.zero_base) {
      snprintf(err, errlen, "4-bit GEMM: this kernel takes no zero points (asymmetric INT4 runs on the decode and "
               "tiled kernels)");
      return MOEK_UNSUPPORTED;
    }
    // The weights' layout: whole 16-row atoms, K padded to Kpad = K rounded up to 128 (what
    // prepare_weights stores and routing's per-expert pointers step by), offsets in 32 bits.
    const int64_t kpad = fragment::padded_k(a.k);
    if (a.k <= 0 || a.n <= 0 || a.n % fragment::kAtomRows || a.n * kpad > INT32_MAX) {
      snprintf(err, errlen, "4-bit GEMM: N=%lld, K=%lld: the fragment layout takes N a multiple of %d and "
               "N x Kpad (K rounded up to %d) below 2^31", (long long)a.n, (long long)a.k, fragment::kAtomRows,
               fragment::kAtomK);
      return MOEK_INVALID_ARGUMENT;
    }
    if (a.weight_group <= 0 || a.k % a.weight_group) {
      snprintf(err, errlen, "4-bit GEMM: K=%lld is not a multiple of the scale group %d", (long long)a.k,
               a.weight_group);
      return MOEK_INVALID_ARGUMENT;
    }
    // The mainloop loads one scale per K tile: a smaller group would take its first group's
    // scale for the whole tile. CUTLASS's can_implement cannot see K here (the problem shapes
    // live on the device), so the rule is checked on the host. A group that is a multiple of
    // 128 dividing K also makes K a multiple of 128 (Kpad = K).
    if (a.weight_group % TileK) {
      snprintf(err, errlen, "4-bit GEMM: scale group %d is not a multiple of the tile's K (%d, the fragment "
               "layout's atom); this kernel takes groups of %d or more", a.weight_group, TileK, TileK);
      return MOEK_UNSUPPORTED;
    }
    const cutlass::Status st = Gemm::can_implement(make_arguments(a));
    if (st != cutlass::Status::kSuccess) {
      snprintf(err, errlen, "CUTLASS can_implement failed: %s (scale group %d, tile K %d: the group must "
               "be a multiple of the tile's K)", cutlassGetStatusString(st), a.weight_group, TileK);
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    char* ws = static_cast<char*>(a.workspace);
    write_group_layouts<StrideScale, ElementAct><<<(a.num_groups + 127) / 128, 128, 0, a.stream>>>(
        reinterpret_cast<StrideScale*>(ws), reinterpret_cast<LayoutW*>(ws + scale_stride_bytes(a.num_groups)),
        a.num_groups, a.n, a.k / a.weight_group, static_cast<int>(fragment::padded_k(a.k)));
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      snprintf(err, errlen, "scale strides and weight layouts launch: %s", cudaGetErrorString(e));
      return MOEK_CUDA_ERROR;
    }
    return launch_cutlass<Gemm>(make_arguments(a), params_key(a), ws + stride_bytes(a.num_groups), a.stream, err,
                                errlen);
  }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, Kernel::SharedStorageSize, false};
};

}  // namespace moe_kernels::sm90
