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
// K order: a thread's weight piece per row and step is decode_w4a16.cuh's (values 32q .. 32q
// + 31 of the step, q = lane % 4), and wgmma t (0..7) of the step takes its values 4t .. 4t +
// 3 as k = {2q, 2q + 1, 2q + 8, 2q + 9}: the A fragment of wgmma's register-sourced form is
// mma.sync m16n8k16's, warp w of the warpgroup holding rows 16w .. 16w + 15. The tokens are
// copied into shared memory in that order: the 4-byte pair of values 2p, 2p + 1 of the step
// (p = 16q + 2t + h) goes to k = 2q + 8h of wgmma t.
//
// Tokens in shared memory: wgmma's K-major layout without swizzle, core matrices of 8 tokens x
// 8 k (16 bytes a token), matrix (token block nb, k block kb) at (kb * kN / 8 + nb) * 128
// bytes: wgmma t reads k blocks 2t and 2t + 1 (LBO = kN / 8 * 128, SBO = 128).
//
// Measured against the mma.sync kernel, and the variants dropped: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (bypassing L1), zeros where !ok.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

// 4 bytes global -> shared, zeros where !ok (src-size 0).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }

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
    for (int id = tid; id < kN * 16; id += kThreads) {  // 16-byte chunk c of token m
      const int m = id >> 4, c = id & 15, q = c >> 2, kk = s * kStepK + 8 * c;
      const bool ok = m0 + m < x.m_rows && kk < k;
      const char* src = x.a + (ok ? (m0 + m) * x.lda + int64_t(kk) * sizeof(T) : 0);
      const uint32_t row = stage + (m >> 3) * 128 + (m & 7) * 16 + 4 * q;
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // pair 4c + e: wgmma t = 2 (c % 4) + e / 2, k block 2t + e % 2
        const int kb = 4 * (c & 3) + e;
        cp_async_4(row + kb * (kN / 8) * 128, src + 4 * e, ok);
      }
    }
  }
  cp_async_commit();
}

template <int kN>
struct Smem {
  static constexpr int kTokenBytes = kN * kStepK * 2, kWeightBytes = kColumns * kStepK / 2;
  // Per stage: tokens, weights (thread i's two 16-byte pieces at i * 16 and 2048 + i * 16), and
  // scales and zero terms [groups in the step][64 rows] (groups of 32: four per step).
  alignas(128) char tokens[kStages][kTokenBytes];
  alignas(128) char weights[kStages][kWeightBytes];
  alignas(16) unsigned short scales[kStages][4][kColumns];
  alignas(16) unsigned short zeros[kStages][4][kColumns];
};

// Step s's copies into ring stage `stage`, as one commit group (empty past the last step).
template <class T, int kN>
__device__ __forceinline__ void copy_step(const Params& p, const WeightTile<T>& t, const TokenRows<T, T>& x,
                                          int m0, int s, int n_block, Smem<kN>& sm, int stage) {
  const int tid = threadIdx.x & 127;
  if (s < t.steps) {
    // Weights: this thread's rows n_block + 16 (tid / 32) + r (+ 8), values 32q .. 32q + 31 of step s.
    const int r = (tid & 31) >> 2, q = tid & 3, kk = s * kStepK + 32 * q;
    const char* wbase = static_cast<const char*>(p.ptr_b[t.g]);
    const int64_t ldw = p.stride_b[t.g] / 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n_block + 16 * (tid >> 5) + r + 8 * h;
      const bool ok = n < t.n && kk < t.k;
      cp_async_16(smem_addr(sm.weights[stage] + h * 2048 + tid * 16), wbase + (ok ? n * ldw + kk / 2 : 0), ok);
    }
    // Scales (and zero terms): the step's groups (1, or 128 / group), 64 rows each, 16 bytes a thread.
    const int groups = t.group >= kStepK ? 1 : kStepK / t.group;
    if (tid < 8 * groups) {
      const int gi = tid >> 3, n = n_block + 8 * (tid & 7), kg = (s * kStepK) / t.group + gi;
      const bool ok = n < t.n && kg * t.group < t.k;
      const int64_t at = ok ? int64_t(kg) * t.n + n : 0;
      cp_async_16(smem_addr(&sm.scales[stage][gi][8 * (tid & 7)]), t.scale + at, ok);
      if (t.zero) cp_async_16(smem_addr(&sm.zeros[stage][gi][8 * (tid & 7)]), t.zero + at, ok);
    }
  }
  copy_tokens<T, kN>(x, m0, t.k, t.steps, s, smem_addr(sm.tokens[stage]), tid);  // commits the group
}

// One block: 64 weight rows (n_block ..) of group g for all of its tokens, kN at a time.
template <class In, class T, class W, int kN>
__device__ __forceinline__ void block_tile(const Params& p, const WeightTile<T>& t, int n_block, Smem<kN>& sm) {
  constexpr uint32_t kLbo = kN / 8 * 128, kSbo = 128;
  const TokenRows<In, T> out_rows(p, t.g);
  const TokenRows<T, T> x_rows(p, t.g);
  const int tid = threadIdx.x & 127, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int steps = t.steps;
  const int gi = t.group >= kStepK ? 0 : (32 * q) / t.group;  // this lane's scale group within a step

  for (int m0 = 0; m0 < x_rows.m_rows; m0 += kN) {
    float acc[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) copy_step<T, kN>(p, t, x_rows, m0, j, n_block, sm, j);
    for (int j = 0; j < steps; ++j) {
      const int stage = j % kStages;
      cp_async_wait<kStages - 2>();
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();  // step j landed for everyone; everyone done with step j - 1's stage
      copy_step<T, kN>(p, t, x_rows, m0, j + kStages - 1, n_block, sm, (j + kStages - 1) % kStages);
      uint32_t wv[2][16];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 w = *reinterpret_cast<const uint4*>(sm.weights[stage] + h * 2048 + tid * 16);
        const uint32_t sc = sm.scales[stage][gi][row0 + 8 * h] * 0x10001u;
        const uint32_t zr = t.zero ? sm.zeros[stage][gi][row0 + 8 * h] * 0x10001u : 0u;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          uint32_t o[4];
          decode_w4::dequant8<T, W>(decode::word(w, c), o);
#pragma unroll
          for (int e = 0; e < 4; ++e) wv[h][4 * c + e] = decode_w4::fma2<T>(o[e], sc, zr);
        }
      }
      const uint32_t tok = smem_addr(sm.tokens[stage]);
      fence_acc<kN>(acc);
      wgmma_fence();
#pragma unroll
      for (int tt = 0; tt < 8; ++tt) {
        const uint32_t a[4] = {wv[0][2 * tt], wv[1][2 * tt], wv[0][2 * tt + 1], wv[1][2 * tt + 1]};
        wgmma<T, kN>(acc, a, desc(tok + 2 * tt * kLbo, kLbo, kSbo));
      }
      wgmma_commit_wait();
      fence_acc<kN>(acc);
    }
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int m = m0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n_block + row0 + 8 * ((i >> 1) & 1);
      if (m < x_rows.m_rows && col < t.n) out_rows.store(m, col, acc[i]);
    }
    cp_async_wait<0>();
    __syncthreads();
  }
}

template <class In, class T, class W, int kN>
__global__ void __launch_bounds__(kThreads, 4) decode_w4_wgmma_kernel(Params p) {
  __shared__ Smem<kN> sm;
  pdl_begin();
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    // (The tile's rows, shapes and scale pointers; its weights are copied by copy_step.)
    const WeightTile<T> t(p, p.active_groups[1 + y], blockIdx.x * kColumns + 16 * ((threadIdx.x >> 5) & 3));
    block_tile<In, T, W, kN>(p, t, blockIdx.x * kColumns, sm);
  }
}

}  // namespace decode_w4_wgmma

// In: the tokens' element type (T, or E4M3 for W4A8, whose inputs come widened); T: the
// MMAs' and the output's; kTokens: the catalog's tile_m (8 or 16); 64 columns per block.
template <class In, class T, class W, int kTokens>
struct DecodeW4Wgmma {
  static size_t workspace_size(int, int) { return 0; }

  // The scales come 8 columns (16 bytes) at a time and a step's 128 values in whole groups.
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = decode_w4::check_args<In>(a, "4-bit wgmma decode GEMM", 8, err, errlen)) return st;
    if (a.weight_group % decode_w4::kStepK && decode_w4::kStepK % a.weight_group) {
      snprintf(err, errlen, "4-bit wgmma decode GEMM: scale group %d neither divides nor is a multiple of 128",
               a.weight_group);
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    using namespace decode_w4_wgmma;
    return decode_w4::launch_groups(decode_w4_wgmma_kernel<In, T, W, kTokens>, a, kColumns, kThreads,
                                    "4-bit wgmma decode GEMM", err, errlen);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size, static_cast<int>(sizeof(decode_w4_wgmma::Smem<kTokens>)), false,
      sizeof(In) == 1};
};

}  // namespace moe_kernels
