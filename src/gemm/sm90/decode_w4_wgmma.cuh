// The 4-bit decode GEMM on SM90's register-sourced wgmma: the catalog's 64-column "decode"
// block on 90a. A block is one warpgroup and 64 output columns (weight rows) of one expert over
// all of K, for kN = 8 or 16 tokens at a time. Per K step of 128 values its 128 threads copy,
// with cp.async into a ring of kStages steps in shared memory, the step's weights (each
// thread the two 16-byte pieces it will dequantize), their scales (and zero terms) and the
// tokens; the copies for step j + kStages - 1 are issued while step j is multiplied, so the
// loads in flight hold no registers. A thread dequantizes its weights in registers as
// decode_w4a16.cuh does and they are wgmma's A operand (m64nNk16); the tokens are its B
// operand, read from shared memory once per block (the mma.sync kernel's warps each re-read
// them from L1/L2, 2-4 KB beside every 1 KB of weights).
//
// Weights in the fragment layout (decode_w4a16.cuh, quant4.py): a block's 64 rows of a K step
// are four atoms in one 4 KB piece, thread i's 32 bytes at 32 i (warp w the rows 16w .. 16w + 15),
// word j its A registers of wgmma j of the step: the A fragment of wgmma's register-sourced form
// is mma.sync m16n8k16's. So the tokens keep their natural K order.
//
// Tokens in shared memory: wgmma's K-major layout without swizzle, core matrices of 8 tokens x
// 8 k (16 bytes a token), matrix (token block nb, k block kb) at (kb * kN / 8 + nb) * 128
// bytes: wgmma j reads k blocks 2j and 2j + 1 (LBO = kN / 8 * 128, SBO = 128).
//
// Measured against the mma.sync kernel, and the variants dropped: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "gemm/cp_async.cuh"
#include "gemm/decode_w4a16.cuh"  // Params, WeightTile, TokenRows, dequant8, check_args, launch_groups
#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace decode_w4_wgmma {

using decode_w4::kStepK;
using decode_w4::Params;
using decode_w4::TokenRows;
using decode_w4::WeightTile;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kColumns = 64;   // weight rows per block: wgmma's M
constexpr int kStages = 4;     // K steps in the shared-memory ring

using cp_async::smem_addr;

// Shared-memory descriptor, K-major without swizzle (byte offsets in units of 16).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

template <int kN>
__device__ __forceinline__ void fence_acc(float (&acc)[kN / 2]) {
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// acc (64 x kN, fp32) += a (64 x 16, registers) x b (16 x kN, shared memory).
template <class T, int kN>
__device__ __forceinline__ void wgmma(float (&acc)[kN / 2], const uint32_t (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kN == 8 || kN == 16, "4-bit wgmma decode: 8 or 16 tokens");
  if constexpr (kN == 8) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                   "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]),
                     "+f"(acc[6]), "+f"(acc[7])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                   "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]),
                     "+f"(acc[6]), "+f"(acc[7])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit_wait() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

// Tokens m0 .. m0 + kN - 1 of K step s into stage `stage` (see the layout above), by the 128
// threads of one warpgroup (tid = thread in it); one commit group per call, empty past the last step.
template <class T, int kN>
__device__ __forceinline__ void copy_tokens(const TokenRows<T, T>& x, int m0, int k, int steps, int s,
                                            uint32_t stage, int tid) {
  if (s < steps) {
#pragma unroll
    for (int id = tid; id < kN * 16; id += kThreads) {  // 16-byte chunk c (values 8c ..) of token m
      const int m = id >> 4, c = id & 15, kk = s * kStepK + 8 * c;
      const bool ok = m0 + m < x.m_rows && kk < k;
      cp_async::copy_16(stage + (c * (kN / 8) + (m >> 3)) * 128 + (m & 7) * 16,
                  x.a + (ok ? (m0 + m) * x.lda + int64_t(kk) * sizeof(T) : 0), ok);
    }
  }
  cp_async::commit();
}

template <int kN>
struct Smem {
  static constexpr int kTokenBytes = kN * kStepK * 2, kWeightBytes = kColumns * kStepK / 2;
  // Per stage: tokens, weights (thread i's 32 bytes at 32 i), and scales and zero terms [groups
  // in the step][64 rows] (groups of 32: four per step).
  alignas(128) char tokens[kStages][kTokenBytes];
  alignas(128) char weights[kStages][kWeightBytes];
  alignas(16) unsigned short scales[kStages][4][kColumns];
  alignas(16) unsigned short zeros[kStages][4][kColumns];
};

// Step s's copies into ring stage `stage`, as one commit group (empty past the last step).
// kSlots: the scale groups of a step (4: groups of 32, 2: 64, 1: 128 or more); kZero: INT4 zero terms.
template <class T, int kN, int kSlots, bool kZero>
__device__ __forceinline__ void copy_step(const Params& p, const WeightTile<T>& t, const TokenRows<T, T>& x,
                                          int m0, int s, int n_block, Smem<kN>& sm, int stage) {
  const int tid = threadIdx.x & 127;
  if (s < t.steps) {
    // Weights: this thread's 32 bytes of its warp's atom (WeightTile::atom).
    const char* src = t.atom + (t.rows_ok ? s * t.step_bytes : 0);
    cp_async::copy_16(smem_addr(sm.weights[stage] + 32 * tid), src, t.rows_ok);
    cp_async::copy_16(smem_addr(sm.weights[stage] + 32 * tid + 16), src + 16, t.rows_ok);
    // Scales (and zero terms): the step's kSlots groups, 64 rows each, 16 bytes a thread; the
    // group's row without a division by the runtime group on the common paths.
    if (tid < 8 * kSlots) {
      const int gi = tid >> 3, n = n_block + 8 * (tid & 7);
      const int kg = kSlots > 1 ? s * kSlots + gi : t.steps_per_row == 1 ? s : s / t.steps_per_row;
      const bool ok = n < t.n && kg * t.group < t.k;
      const int64_t at = ok ? int64_t(kg) * t.n + n : 0;
      cp_async::copy_16(smem_addr(&sm.scales[stage][gi][8 * (tid & 7)]), t.scale + at, ok);
      if constexpr (kZero) cp_async::copy_16(smem_addr(&sm.zeros[stage][gi][8 * (tid & 7)]), t.zero + at, ok);
    }
  }
  copy_tokens<T, kN>(x, m0, t.k, t.steps, s, smem_addr(sm.tokens[stage]), tid);  // commits the group
}

// Thread tid's A registers of ring stage `stage` (rows row0 and row0 + 8 of its warp, the step's
// eight 16-deep K blocks): its 32 bytes dequantized and scaled (plus zero terms), one scale pair
// per slot (K block j in slot j * kSlots / 8), each in both halves of a register.
template <class T, class W, int kN, int kSlots, bool kZero>
__device__ __forceinline__ void dequantize_step(const Smem<kN>& sm, int stage, int tid, int row0,
                                                uint32_t (&av)[8][4]) {
  const uint4 w[2] = {*reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid),
                      *reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid + 16)};
  uint32_t s_lo[kSlots], s_hi[kSlots], z_lo[kSlots], z_hi[kSlots];
#pragma unroll
  for (int c = 0; c < kSlots; ++c) {
    s_lo[c] = sm.scales[stage][c][row0] * 0x10001u;
    s_hi[c] = sm.scales[stage][c][row0 + 8] * 0x10001u;
    z_lo[c] = kZero ? sm.zeros[stage][c][row0] * 0x10001u : 0u;
    z_hi[c] = kZero ? sm.zeros[stage][c][row0 + 8] * 0x10001u : 0u;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = j * kSlots / 8;
    decode_w4::fragment<T, W>(decode::word(w[j >> 2], j & 3), av[j]);
#pragma unroll
    for (int e = 0; e < 4; ++e)  // a1, a3: row + 8
      av[j][e] = decode_w4::fma2<T>(av[j][e], e & 1 ? s_hi[c] : s_lo[c], e & 1 ? z_hi[c] : z_lo[c]);
  }
}

// One block: 64 weight rows (n_block ..) of group g for all of its tokens, kN at a time.
template <class In, class T, class W, int kN, int kSlots, bool kZero>
__device__ __forceinline__ void block_tile(const Params& p, const WeightTile<T>& t, int n_block, Smem<kN>& sm) {
  constexpr uint32_t kLbo = kN / 8 * 128, kSbo = 128;
  const TokenRows<In, T> out_rows(p, t.g);
  const TokenRows<T, T> x_rows(p, t.g);
  const int tid = threadIdx.x & 127, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int steps = t.steps;

  for (int m0 = 0; m0 < x_rows.m_rows; m0 += kN) {
    float acc[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) copy_step<T, kN, kSlots, kZero>(p, t, x_rows, m0, j, n_block, sm, j);
    for (int j = 0; j < steps; ++j) {
      const int stage = j % kStages;
      cp_async::wait<kStages - 2>();
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();  // step j landed for everyone; everyone done with step j - 1's stage
      copy_step<T, kN, kSlots, kZero>(p, t, x_rows, m0, j + kStages - 1, n_block, sm, (j + kStages - 1) % kStages);
      uint32_t av[8][4];
      dequantize_step<T, W, kN, kSlots, kZero>(sm, stage, tid, row0, av);
      // K blocks 2j, 2j + 1 of the tokens: the stage's descriptor plus a constant (addresses in
      // units of 16 bytes stay inside the 14-bit field: shared memory is under 256 KB).
      const uint64_t tok = desc(smem_addr(sm.tokens[stage]), kLbo, kSbo);
      fence_acc<kN>(acc);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 8; ++j) wgmma<T, kN>(acc, av[j], tok + 2 * j * kLbo / 16);
      wgmma_commit_wait();
      fence_acc<kN>(acc);
    }
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int m = m0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n_block + row0 + 8 * ((i >> 1) & 1);
      if (m < x_rows.m_rows && col < t.n) out_rows.store(m, col, acc[i]);
    }
    cp_async::wait<0>();
    __syncthreads();
  }
}

template <class In, class T, class W, int kN, int kSlots, bool kZero>
__global__ void __launch_bounds__(kThreads, 4) decode_w4_wgmma_kernel(Params p) {
  __shared__ Smem<kN> sm;
  pdl_begin();
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    // (The tile's rows, shapes and scale pointers; its weights are copied by copy_step.)
    const WeightTile<T> t(p, p.active_groups[1 + y], blockIdx.x * kColumns + 16 * ((threadIdx.x >> 5) & 3));
    block_tile<In, T, W, kN, kSlots, kZero>(p, t, blockIdx.x * kColumns, sm);
  }
}

}  // namespace decode_w4_wgmma

// In: the tokens' element type (T, or E4M3 for W4A8, whose inputs come widened); T: the
// MMAs' and the output's; kTokens: the catalog's tile_m (8 or 16); 64 columns per block.
template <class In, class T, class W, int kTokens>
struct DecodeW4Wgmma {
  static constexpr bool kInt4 = std::is_same_v<W, decode_w4::Int4>;  // zero terms are INT4's only

  static size_t workspace_size(int, int) { return 0; }

  // The scales come 8 columns (16 bytes) at a time, a step's 128 values in whole groups; MXFP4
  // (E2M1) weights in groups of 32 without zero terms, the one form built for them.
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = decode_w4::check_args<In>(a, "4-bit wgmma decode GEMM", 16, err, errlen)) return st;
    if (!kInt4 && (a.weight_group != 32 || a.zero_base)) {
      snprintf(err, errlen, "4-bit wgmma decode GEMM: MXFP4 weights take scale groups of 32 and no zero terms "
               "(group %d%s)", a.weight_group, a.zero_base ? ", zero terms given" : "");
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  // Built per scale groups a step and zero terms, so that the kernel's loop holds no runtime
  // group arithmetic.
  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    if constexpr (!kInt4) {
      return launch<4, false>(a, err, errlen);
    } else {
      if (a.weight_group == 32) return a.zero_base ? launch<4, true>(a, err, errlen) : launch<4, false>(a, err, errlen);
      if (a.weight_group == 64) return a.zero_base ? launch<2, true>(a, err, errlen) : launch<2, false>(a, err, errlen);
      return a.zero_base ? launch<1, true>(a, err, errlen) : launch<1, false>(a, err, errlen);
    }
  }

  template <int kSlots, bool kZero>
  static int launch(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace decode_w4_wgmma;
    return decode_w4::launch_groups(decode_w4_wgmma_kernel<In, T, W, kTokens, kSlots, kZero>, a, kColumns, kThreads,
                                    "4-bit wgmma decode GEMM", err, errlen);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size, static_cast<int>(sizeof(decode_w4_wgmma::Smem<kTokens>)), false,
      sizeof(In) == 1};
};

}  // namespace moe_kernels
