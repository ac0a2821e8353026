// SM90 mixed-input grouped GEMM (W4A16): D_g = X_g x dequant(W_g)^T with 4-bit weights
// [N, K] (INT4, two per byte, K-major) and one 16-bit scale per group of `weight_group`
// along K, converted to the activations' type in registers by CUTLASS's ptr-array RS
// mainloop. The converted operand must be the wgmma's A, so the weights are A and the tokens
// B, as in the swap-AB schedules (src/gemm/cutlass_grouped.cuh): D^T is stored column-major,
// which is D row-major. The scales are [K/g, N] per expert (N contiguous, as AWQ and GPTQ store them);
// their per-group strides are written into the workspace before each GEMM. No zero points:
// CUTLASS 4.2's ptr-array form of this mainloop with zero terms (ConvertAndScaleWithZero) never
// copies or updates the scales' TMA descriptor and raised an illegal instruction on the H200;
// asymmetric INT4 runs on the decode and tiled kernels.
#pragma once

#include <cstdio>

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

// Each group's scale stride: (1, N, N * K/g), the packed [K/g, N] layout.
template <class StrideScale>
__global__ void write_scale_strides(StrideScale* strides, int groups, int64_t n, int64_t scale_k) {
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
    StrideScale s{};
    cute::get<1>(s) = n;
    cute::get<2>(s) = n * scale_k;
    strides[g] = s;
  }
}

// ElementQ: cutlass::int4b_t. Schedule: a Schedule of
// gemm/sm90/grouped_gemm.cuh (its mainloop and epilogue tags). TileM: tokens per tile
// (CUTLASS's N), TileN: weight rows per tile (CUTLASS's M).
template <class ElementAct, class ElementQ, class ElementD, int TileM, int TileN, int TileK, int ClusterM,
          int ClusterN, class Schedule>
struct MixedGroupedGemm {
  using ElementScale = ElementAct;
  using Weights = cute::tuple<ElementQ, ElementScale>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::Int<TileN>, cute::Int<TileM>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterN>, cute::Int<ClusterM>, cute::_1>;
  using LayoutW = cutlass::layout::RowMajor;     // weights [N, K], K-major: the A operand
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
  using StrideW = typename Kernel::InternalStrideA;
  using StrideX = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using StrideScale = typename CollectiveMainloop::StrideScale;
  static_assert(routing_layouts_match<Kernel, ProblemShape>(), "stride or problem shape layout changed");

  // Bytes at the workspace's start for the per-group scale strides, 256-aligned.
  static size_t stride_bytes(int num_groups) {
    return (size_t(num_groups) * sizeof(StrideScale) + 255) / 256 * 256;
  }

  static typename Gemm::Arguments make_arguments(const GroupedGemmArgs& a) {
    auto args = grouped_arguments<Gemm, ProblemShape>(a, a.problem_shapes_t);
    args.mainloop.ptr_A = reinterpret_cast<const ElementQ**>(a.ptr_b);
    args.mainloop.dA = reinterpret_cast<StrideW*>(a.stride_b);
    args.mainloop.ptr_B = reinterpret_cast<const ElementAct**>(a.ptr_a);
    args.mainloop.dB = reinterpret_cast<StrideX*>(a.stride_a);
    args.mainloop.ptr_S = reinterpret_cast<const ElementScale**>(a.ptr_sfb);
    args.mainloop.dS = reinterpret_cast<const StrideScale*>(a.workspace);
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
    if (a.weight_group <= 0 || a.k % a.weight_group) {
      snprintf(err, errlen, "4-bit GEMM: K=%lld is not a multiple of the scale group %d", (long long)a.k,
               a.weight_group);
      return MOEK_INVALID_ARGUMENT;
    }
    // The mainloop loads one scale per K tile: a smaller group would take its first group's
    // scale for the whole tile. CUTLASS's can_implement cannot see K here (the problem shapes
    // live on the device), so the rule is checked on the host.
    if (a.weight_group % TileK) {
      snprintf(err, errlen, "4-bit GEMM: scale group %d is not a multiple of the tile's K (%d); this "
               "kernel takes groups of %d or more", a.weight_group, TileK, TileK);
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
    write_scale_strides<<<(a.num_groups + 127) / 128, 128, 0, a.stream>>>(
        reinterpret_cast<StrideScale*>(a.workspace), a.num_groups, a.n, a.k / a.weight_group);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      snprintf(err, errlen, "scale strides launch: %s", cudaGetErrorString(e));
      return MOEK_CUDA_ERROR;
    }
    return launch_cutlass<Gemm>(make_arguments(a), params_key(a),
                                static_cast<char*>(a.workspace) + stride_bytes(a.num_groups), a.stream, err, errlen);
  }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, Kernel::SharedStorageSize, false};
};

}  // namespace moe_kernels::sm90
