// SM90 (H100/H200) grouped GEMM schedules: TMA warp-specialized wgmma kernels, ping-pong
// (two consumer warpgroups on alternate tiles) or cooperative (both on one tile).
#pragma once

#include "gemm/cutlass_grouped.cuh"

namespace moe_kernels::sm90 {

using PingpongEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using CooperativeEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

using Pingpong = Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, PingpongEpilogue>;
using Cooperative =
    Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative, CooperativeEpilogue>;
// FP8 only (cmake/catalog.py MAINLOOPS): no promotion of partial sums to fp32 ...
using PingpongFastAccum =
    Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, PingpongEpilogue>;
using CooperativeFastAccum = Schedule<
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum, CooperativeEpilogue>;
// ... or scales per 128 of K applied to the fp32 partial sums (fp8_block).
using PingpongBlockwise = Schedule<
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise, PingpongEpilogue, true>;
using CooperativeBlockwise = Schedule<
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, CooperativeEpilogue, true>;

// Swap-AB (few rows per expert; src/gemm/cutlass_grouped.cuh): the same mainloops with the
// weights as the wgmma's A operand.
template <class S>
using SwapAB = Schedule<typename S::Mainloop, typename S::Epilogue, S::kBlockScaled, true>;
using CooperativeSwapABBlockwise = SwapAB<CooperativeBlockwise>;  // the catalog's coop_swapab rows

template <class A, class B, class D, int TM, int TN, int TK, int CM, int CN, class Schedule>
using GroupedGemm = CutlassGroupedGemm<cutlass::arch::Sm90, A, B, D, TM, TN, TK, CM, CN, Schedule>;

}  // namespace moe_kernels::sm90
