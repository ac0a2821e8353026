// SM100 (B200) grouped GEMM schedules: tcgen05 MMA with the tile computed by one CTA (1sm)
// or by a CTA pair (2sm, cluster M a multiple of 2). Compiled and disassembled here; no
// SM100 GPU has run them yet.
#pragma once

#include "gemm/cutlass_grouped.cuh"

namespace moe_kernels::sm100 {

using OneSm = Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100,
                       cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>;
using TwoSm = Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100,
                       cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm>;
// fp8_block: scales per 1x128 of A and 128x128 of B applied in the mainloop.
using OneSmBlockwise = Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedBlockwise1SmSm100,
                                cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm, true>;
using TwoSmBlockwise = Schedule<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedBlockwise2SmSm100,
                                cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm, true>;

template <class A, class B, class D, int TM, int TN, int TK, int CM, int CN, class Schedule>
using GroupedGemm = CutlassGroupedGemm<cutlass::arch::Sm100, A, B, D, TM, TN, TK, CM, CN, Schedule>;

}  // namespace moe_kernels::sm100
