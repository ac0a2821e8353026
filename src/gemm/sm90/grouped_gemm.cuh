// SM90 (H100/H200) grouped GEMM schedules: TMA warp-specialized wgmma kernels, ping-pong
// (two consumer warpgroups on alternate tiles) or cooperative (both on one tile).
#pragma once

#include "gemm/cutlass_grouped.cuh"

namespace moe_kernels::sm90 {

struct Pingpong {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
struct Cooperative {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

template <class A, class B, class D, int TM, int TN, int TK, int CM, int CN, class Schedule>
using GroupedGemm = CutlassGroupedGemm<cutlass::arch::Sm90, A, B, D, TM, TN, TK, CM, CN, Schedule>;

}  // namespace moe_kernels::sm90
