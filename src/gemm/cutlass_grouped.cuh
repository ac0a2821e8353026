// A CUTLASS 3.x ptr-array grouped GEMM for MoE, for any arch family: D_g = A_g x B_g^T with
// row-major A/D, K-major B, fp32 accumulation, no C operand (biases are applied by our own
// kernels). Shapes, pointers and strides come from device memory (GroupedGemmArgs), so
// nothing here reads the per-expert counts on the host. Each family (gemm/sm90, gemm/sm100)
// names its arch tag and schedules; the generated files instantiate one config each.
// Block-scaled schedules (Schedule::kBlockScaled, fp8_block) also read per-group scale
// pointers: A scales per row per 128 of K ([M_g, K/128], row-major), B scales per 128x128
// block ([N/128, K/128], row-major: DeepSeek's weight_scale_inv as stored). SM90's mainloop
// derives each group's scale layout from its problem shape; SM100's reads one per group from
// device memory, which write_scale_layouts fills in the workspace before each GEMM.
// FP8 (E4M3 inputs, not block-scaled) dequantizes in the epilogue: D = acc * sfa[m] * sfb[n],
// per-row input scales and per-channel (or, stride 0, per-expert) weight scales, each group's
// from its own pointer (Fp8OutputScales).
// Swap-AB schedules (Schedule::kSwapAB, for a few rows per expert) compute D_g^T = B_g x A_g^T
// instead: the weights are the wgmma's A operand (tile_n rows) and the tokens its narrow N, so a
// handful of tokens does not pad a 64-row tile; D^T is stored column-major, which is D
// row-major. The catalog's tile and cluster shapes stay those of D (tokens, output columns).
#pragma once

#include <cstdio>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"

#include "gemm/grouped_gemm.h"

namespace moe_kernels {

// Scale granularity (M, N, K) = (1, 128, 128), both scale tensors K-major, per arch family;
// swapped (SM90): (128, 1, 128), the weights' 128x128 blocks on the A side.
template <class ArchTag, bool kSwapAB = false>
struct BlockScaleConfig {
  using type = cutlass::detail::Sm90BlockwiseScaleConfig<kSwapAB ? 128 : 1, kSwapAB ? 1 : 128, 128,
                                                          cute::GMMA::Major::K, cute::GMMA::Major::K>;
  static constexpr bool kLayoutsOnDevice = false;
};
template <>
struct BlockScaleConfig<cutlass::arch::Sm100, false> {
  using type = cutlass::detail::Sm100BlockwiseScaleConfig<1, 128, 128, cute::UMMA::Major::K,
                                                           cute::UMMA::Major::K>;
  static constexpr bool kLayoutsOnDevice = true;
};

// Each group's scale layouts from its problem shape (routing writes the shapes on the device).
template <class ScaleConfig, class LayoutSFA, class LayoutSFB>
__global__ void write_scale_layouts(const int32_t* shapes, int groups, LayoutSFA* sfa,
                                    LayoutSFB* sfb) {
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
    const auto mnkl = cute::make_shape(shapes[3 * g], shapes[3 * g + 1], shapes[3 * g + 2], 1);
    sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(mnkl);
    sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(mnkl);
  }
}

// The FP8 epilogue's visitor tree: D = (weight scale) * ((row scale) * acc), in fp32, rounded
// once to ElementD. The row scales are one per row of the group's A (offsets are arbitrary, so
// scalar loads); the weight scales per output column, or one per expert where dW's N stride
// is false. Swapped, CUTLASS's M is the output columns and its N the rows.
template <class TileShape, class ElementD, bool kSwapAB>
struct Fp8OutputScales {
  template <class Stride>
  using AlongM = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float, Stride, 1>;
  template <class Stride>
  using AlongN = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float, Stride, 1>;
  using RowScale = cute::conditional_t<kSwapAB, AlongN<cute::Stride<cute::_0, cute::_1, int64_t>>,
                                       AlongM<cute::Stride<cute::_1, cute::_0, int64_t>>>;
  using WeightScale = cute::conditional_t<kSwapAB, AlongM<cute::Stride<bool, cute::_0, int64_t>>,
                                          AlongN<cute::Stride<cute::_0, bool, int64_t>>>;
  template <class Out>
  using Multiply = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, Out, float,
                                                          cutlass::FloatRoundStyle::round_to_nearest>;
  using Tree = cutlass::epilogue::fusion::Sm90EVT<
      Multiply<ElementD>, WeightScale,
      cutlass::epilogue::fusion::Sm90EVT<Multiply<float>, RowScale, cutlass::epilogue::fusion::Sm90AccFetch>>;

  static typename Tree::Arguments arguments(const float** sfa, const float** sfb, bool per_channel) {
    typename WeightScale::Arguments w{sfb, 0.f, {}};
    if constexpr (kSwapAB) cute::get<0>(w.dCol) = per_channel;
    else cute::get<1>(w.dRow) = per_channel;
    return {w, {{sfa, 0.f, {}}, {}, {}}, {}};
  }
};

// The routing kernels write one int64 leading dimension per group and three int32 per problem
// shape; a CUTLASS grouped kernel's types must have exactly that layout.
template <class Kernel, class ProblemShape>
constexpr bool routing_layouts_match() {
  return sizeof(typename Kernel::InternalStrideA) == sizeof(int64_t) &&
         sizeof(typename Kernel::InternalStrideB) == sizeof(int64_t) &&
         sizeof(typename Kernel::InternalStrideD) == sizeof(int64_t) &&
         sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t);
}

// A grouped GEMM's arguments with only the common part filled: the groups' shapes live on the
// device (no host sync, graph-safe) and the SM count is the device's.
template <class Gemm, class ProblemShape>
typename Gemm::Arguments grouped_arguments(const GroupedGemmArgs& a, int32_t* shapes) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {a.num_groups, reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(shapes),
                        nullptr};
  args.hw_info.device_id = a.device;
  args.hw_info.sm_count = a.sm_count;
  return args;
}

// Everything of a GroupedGemmArgs that make_arguments reads (the stream aside), and N and K:
// equal keys make equal CUTLASS arguments, hence equal kernel parameters. No padding, so memcmp compares.
struct ParamsKey {
  const void* p[11];
  int64_t v[7];
  bool operator==(const ParamsKey& o) const { return memcmp(this, &o, sizeof(*this)) == 0; }
};
static_assert(sizeof(ParamsKey) == 11 * sizeof(void*) + 7 * sizeof(int64_t), "ParamsKey has padding");

inline ParamsKey params_key(const GroupedGemmArgs& a) {
  ParamsKey k;
  const void* p[11] = {a.workspace, a.problem_shapes, a.problem_shapes_t, a.ptr_a, a.stride_a, a.ptr_b,
                       a.stride_b, a.ptr_d, a.stride_d, a.ptr_sfa, a.ptr_sfb};
  const int64_t v[7] = {a.num_groups, a.sfb_per_channel, a.weight_group, a.device, a.sm_count, a.n, a.k};
  memcpy(k.p, p, sizeof(p));
  memcpy(k.v, v, sizeof(v));
  return k;
}

// Initializes a CUTLASS device GEMM on `workspace` and launches it: MOEK_OK, or why not.
// Initializing encodes the TMA descriptors on the host (each through a driver entry point
// looked up per call) and sets the kernel's shared-memory attribute; a forward's arguments
// depend only on its workspace address and host-side values (ParamsKey), so the parameters
// of the last few argument sets are kept per GEMM type and reused, as a serving loop calls
// with the same workspace every time. Only the workspace initialization runs again.
template <class Gemm>
int launch_cutlass(const typename Gemm::Arguments& args, const ParamsKey& key, void* workspace,
                   cudaStream_t stream, char* err, size_t errlen) {
  using Params = typename Gemm::Params;
  struct Entry {
    ParamsKey key;
    Params params;
  };
  constexpr int kEntries = 4;
  static std::mutex mu;
  static Entry entries[kEntries];
  static int filled = 0, next = 0;
  Params params;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < filled && !cached; ++i)
      if (entries[i].key == key) {
        params = entries[i].params;
        cached = true;
      }
  }
  cutlass::Status st;
  if (cached) {
    st = Gemm::GemmKernel::initialize_workspace(args, workspace, stream);
  } else {
    Gemm gemm;
    st = gemm.initialize(args, workspace, stream);
    if (st == cutlass::Status::kSuccess) {
      params = gemm.params();
      std::lock_guard<std::mutex> lock(mu);
      entries[next] = Entry{key, params};
      next = (next + 1) % kEntries;
      filled = filled < kEntries ? filled + 1 : kEntries;
    }
  }
  if (st != cutlass::Status::kSuccess) {
    snprintf(err, errlen, "CUTLASS initialize failed: %s", cutlassGetStatusString(st));
    return MOEK_CUDA_ERROR;
  }
  st = Gemm::run(params, stream);
  if (st != cutlass::Status::kSuccess) {
    snprintf(err, errlen, "CUTLASS run failed: %s (%s)", cutlassGetStatusString(st),
             cudaGetErrorString(cudaGetLastError()));
    return MOEK_CUDA_ERROR;
  }
  return MOEK_OK;
}

// A family's schedule: its CUTLASS mainloop and epilogue tags, whether the mainloop applies
// block scales (fp8_block) and whether A and B trade places (see the top). The families
// (gemm/sm90, gemm/sm100) name theirs.
template <class MainloopTag, class EpilogueTag, bool kBlock = false, bool kSwap = false>
struct Schedule {
  using Mainloop = MainloopTag;
  using Epilogue = EpilogueTag;
  static constexpr bool kBlockScaled = kBlock;
  static constexpr bool kSwapAB = kSwap;
};

// Schedule: one of the families' Schedule instances (gemm/sm90, gemm/sm100).
template <class ArchTag, class ElementA, class ElementB, class ElementD, int TileM, int TileN,
          int TileK, int ClusterM, int ClusterN, class Schedule>
struct CutlassGroupedGemm {
  static constexpr bool kSwapAB = Schedule::kSwapAB;
  static_assert(!kSwapAB || std::is_same_v<ElementA, ElementB>, "swap-AB: one input type");
  static_assert(!kSwapAB || std::is_same_v<ArchTag, cutlass::arch::Sm90>, "swap-AB: SM90 schedules");
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  // CUTLASS's M and N: the weights' rows first when swapped.
  using TileShape = cute::Shape<cute::Int<kSwapAB ? TileN : TileM>, cute::Int<kSwapAB ? TileM : TileN>,
                                cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<kSwapAB ? ClusterN : ClusterM>,
                                   cute::Int<kSwapAB ? ClusterM : ClusterN>, cute::_1>;
  // Both inputs K-major whichever is A: activations [M, K] and weights [N, K].
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  // D [M, N] row-major; swapped, CUTLASS's D^T [N, M] column-major (the same bytes).
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr bool kBlockScaled = Schedule::kBlockScaled;
  using ScaleConfig = typename BlockScaleConfig<ArchTag, kSwapAB>::type;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr bool kLayoutsOnDevice = kBlockScaled && BlockScaleConfig<ArchTag>::kLayoutsOnDevice;
  // write_scale_layouts stores them as plain values, the SFB array right after the SFA one.
  static_assert(!kLayoutsOnDevice || (std::is_trivially_copyable_v<LayoutSFA> &&
                                      std::is_trivially_copyable_v<LayoutSFB> &&
                                      sizeof(LayoutSFA) % alignof(LayoutSFB) == 0),
                "scale layouts: plain values packed back to back");
  using StrideArgA = cute::conditional_t<kBlockScaled, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using StrideArgB = cute::conditional_t<kBlockScaled, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  // FP8 with per-row and per-channel (or per-tensor) scales: applied by the epilogue.
  static constexpr bool kScaledOutput =
      std::is_same_v<ElementA, cutlass::float_e4m3_t> && !kBlockScaled;
  using OutputScales = Fp8OutputScales<TileShape, ElementD, kSwapAB>;
  using Fusion = cute::conditional_t<kScaledOutput, typename OutputScales::Tree,
                                     cutlass::epilogue::fusion::LinearCombination<ElementD, float>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, typename Schedule::Epilogue,
      Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, ElementA, StrideArgA, kAlignA, ElementB, StrideArgB,
      kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(routing_layouts_match<Kernel, ProblemShape>(), "stride or problem shape layout changed");

  // Bytes at the workspace's start for the per-group scale layouts (SM100 fp8_block), 256-aligned.
  static size_t layout_bytes(int num_groups) {
    if constexpr (!kLayoutsOnDevice) return 0;
    return (size_t(num_groups) * (sizeof(LayoutSFA) + sizeof(LayoutSFB)) + 255) / 256 * 256;
  }
  static LayoutSFA* layouts_sfa(const GroupedGemmArgs& a) { return reinterpret_cast<LayoutSFA*>(a.workspace); }
  static LayoutSFB* layouts_sfb(const GroupedGemmArgs& a) {
    return reinterpret_cast<LayoutSFB*>(static_cast<char*>(a.workspace) + sizeof(LayoutSFA) * a.num_groups);
  }

  static typename Gemm::Arguments make_arguments(const GroupedGemmArgs& a) {
    auto args = grouped_arguments<Gemm, ProblemShape>(a, kSwapAB ? a.problem_shapes_t : a.problem_shapes);
    args.mainloop.ptr_A = reinterpret_cast<const ElementA**>(kSwapAB ? a.ptr_b : a.ptr_a);
    args.mainloop.dA = reinterpret_cast<StrideA*>(kSwapAB ? a.stride_b : a.stride_a);
    args.mainloop.ptr_B = reinterpret_cast<const ElementB**>(kSwapAB ? a.ptr_a : a.ptr_b);
    args.mainloop.dB = reinterpret_cast<StrideB*>(kSwapAB ? a.stride_a : a.stride_b);
    if constexpr (kBlockScaled) {
      // Per-group scale pointers; the layouts are derived from each group's shape by SM90's
      // mainloop, or read from the workspace on SM100 (see run).
      args.mainloop.ptr_SFA = kSwapAB ? a.ptr_sfb : a.ptr_sfa;
      args.mainloop.ptr_SFB = kSwapAB ? a.ptr_sfa : a.ptr_sfb;
      if constexpr (kLayoutsOnDevice) {
        args.mainloop.layout_SFA = layouts_sfa(a);
        args.mainloop.layout_SFB = layouts_sfb(a);
      }
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(a.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(a.stride_d);
    // Consecutive tiles along CUTLASS's N, so that the CTAs running at once share a weight
    // tile (from L2) rather than each reading another from DRAM: the default (along M) is
    // that already when the tokens are M; swapped, the tokens are N.
    if constexpr (kSwapAB) {
      using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
      args.scheduler.raster_order = Raster::AlongN;
    }
    if constexpr (kScaledOutput) {
      args.epilogue.thread = OutputScales::arguments(a.ptr_sfa, a.ptr_sfb, a.sfb_per_channel);
    } else {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
    }
    return args;
  }

  static size_t workspace_size(int num_groups, int sm_count) {
    GroupedGemmArgs a{};
    a.num_groups = num_groups;
    a.sm_count = sm_count;
    return layout_bytes(num_groups) + Gemm::get_workspace_size(make_arguments(a));
  }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    const cutlass::Status st = Gemm::can_implement(make_arguments(a));
    if (st != cutlass::Status::kSuccess) {
      snprintf(err, errlen, "CUTLASS can_implement failed: %s", cutlassGetStatusString(st));
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    const auto args = make_arguments(a);
    if constexpr (kLayoutsOnDevice) {
      write_scale_layouts<ScaleConfig><<<(a.num_groups + 127) / 128, 128, 0, a.stream>>>(
          a.problem_shapes, a.num_groups, layouts_sfa(a), layouts_sfb(a));
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
        snprintf(err, errlen, "scale layouts launch: %s", cudaGetErrorString(e));
        return MOEK_CUDA_ERROR;
      }
    }
    return launch_cutlass<Gemm>(args, params_key(a), static_cast<char*>(a.workspace) + layout_bytes(a.num_groups),
                                a.stream, err, errlen);
  }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, Kernel::SharedStorageSize, false};
};

}  // namespace moe_kernels
