// The W4A8 decode GEMM on SM90's FP8 wgmma: the catalog's 64-column 4-bit decode block on 90a
// for E4M3 tokens (w4a8_int4, w4a8_mxfp4). A block is one warpgroup and 64 output columns
// (weight rows) of one expert over all of K, kN = 8, 16 or 32 tokens at a time, as in
// decode_w4_wgmma.cuh, but the tokens stay E4M3 (a scale per row, applied at the store) and
// the weights become E4M3 in registers, exactly: INT4 by a byte lookup, E2M1 by placing its
// sign, exponent and mantissa bits in E4M3's (the value times 2^-6, which the scale takes
// back). They are the A operand of register-sourced wgmma.m64nNk32.e4m3: half the MMAs of the
// 16-bit form and no multiply per weight.
//
// Per K step of 128 values cp.async copies the step's weights (4 KB), their scales and the
// tokens (kN x 128 bytes) into a ring of kStages steps in shared memory. Scales: wgmma c of the
// step (c = 0..3) covers values 32c .. 32c + 31, so a group of 32 is one wgmma (64: two; 128 or
// more: the whole step); each group's fp32 sums are multiplied by its scale and added up.
//
// Weights in the prepared layout (docs/kernels/four-bit-layout.md): the block's 4 KB per step
// in one piece, thread i's 32 bytes at 32 i, its words 2c and 2c + 1 (the 16-bit MMAs' A
// registers of the step's 16-deep blocks 2c, 2c + 1: rows r and r + 8, k 2q, 2q + 1, 2q + 8,
// 2q + 9 of each). The tokens come with each 32 columns permuted for this kernel
// (GemmKernelOps::permuted_fp8_tokens): byte 4q + i of a 32-column block holds column {2q, 2q +
// 1, 2q + 8, 2q + 9}[i], byte 16 + 4q + i the same + 16. So the E4M3 bytes of a word's row-r
// values are the A register of wgmma c for k 4q .. 4q + 3 (of block 2c; 16 + 4q .. of block
// 2c + 1), the A fragment of wgmma's register-sourced form being mma.sync m16n8k32's (warp w of
// the warpgroup holding rows 16w .. 16w + 15); a dot product does not depend on the order of K.
// The tokens are copied 16 bytes at a time, in wgmma's K-major layout without swizzle: 16-byte
// k block kb at kb x kN / 8 x 128 bytes, token block nb at + nb x 128 (LBO = kN / 8 x 128, SBO
// = 128); wgmma c reads k blocks 2c and 2c + 1.
//
// Measured against the 16-bit path (the tokens widened to 16 bits): docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "gemm/decode_w4a16.cuh"          // Params, check_args, launch_groups, prmt
#include "gemm/sm90/decode_w4_wgmma.cuh"  // cp.async, descriptors, wgmma fences
#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace decode_w4a8_wgmma {

using decode_w4::prmt;
using decode_w4_wgmma::desc;
using cp_async::smem_addr;
// The 16-bit wgmma block's shape: one warpgroup, 64 weight rows (wgmma's M), a ring of 4 steps
// of 128 K values (here four wgmma k32).
using decode_w4::kStepK;
using decode_w4_wgmma::kColumns;
using decode_w4_wgmma::kStages;
using decode_w4_wgmma::kThreads;

// Eight INT4 values (value v in bits 4v .. 4v + 3) as E4M3 bytes: values 0-3 in lo, 4-7 in hi.
// The low three bits pick a byte of the positive (0..7) and the negative (-8..-1) table, the
// sign bit picks the table (prmt per byte).
__device__ __forceinline__ void int4_to_e4m3(uint32_t x, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kP0 = 0x44403800u, kP1 = 0x4E4C4A48u;  // 0, 1, ..., 7
  constexpr uint32_t kN0 = 0xCACCCED0u, kN1 = 0xB8C0C4C8u;  // -8, -7, ..., -1
  const uint32_t index = x & 0x77777777u;
  const uint32_t pick = ((x >> 1) & 0x44444444u) | 0x32103210u;  // byte v % 4 of the positive or (+ 4) negative
  lo = prmt(prmt(kP0, kP1, index), prmt(kN0, kN1, index), pick);
  hi = prmt(prmt(kP0, kP1, index >> 16), prmt(kN0, kN1, index >> 16), pick >> 16);
}

// Four E2M1 values, one in the low half of each byte, as E4M3 bytes of the value x 2^-6: the
// sign to bit 7, e1 e0 m to bits 4-2 (E2M1's subnormal 0.5 lands on E4M3's subnormal 2^-7).
__device__ __forceinline__ uint32_t e2m1_bytes_to_e4m3(uint32_t y) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(y << 2), "r"(0x1C1C1C1Cu), "r"((y << 4) & 0x80808080u));
  return out;  // 0xEA: (a & b) | c
}
__device__ __forceinline__ void e2m1_to_e4m3(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t xs = x >> 4;
  lo = e2m1_bytes_to_e4m3(prmt(x, xs, 0x5140u));  // values 0, 1, 2, 3
  hi = e2m1_bytes_to_e4m3(prmt(x, xs, 0x7362u));  // values 4, 5, 6, 7
}

// Eight accumulators v[i] .. v[i + 7] as "+f" asm operands.
#define MOEK_ACC8(v, i)                                                                                     \
  "+f"(v[i]), "+f"(v[i + 1]), "+f"(v[i + 2]), "+f"(v[i + 3]), "+f"(v[i + 4]), "+f"(v[i + 5]), "+f"(v[i + 6]), \
      "+f"(v[i + 7])

// d (64 x kN, fp32) = a (64 x 32, E4M3 registers) x b (32 x kN, E4M3 in shared memory) (+ d
// where accumulate).
template <int kN>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kN == 8 || kN == 16 || kN == 32, "W4A8 wgmma decode: 8, 16 or 32 tokens");
  if constexpr (kN == 8)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  else if constexpr (kN == 16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, "
                 "%12, p, 1, 1;\n}"
                 : MOEK_ACC8(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
                 "%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}"
                 : MOEK_ACC8(d, 0), MOEK_ACC8(d, 8)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#endif
}
#undef MOEK_ACC8

template <int kN>
struct Smem {
  alignas(128) uint8_t tokens[kStages][kN * kStepK];
  alignas(128) uint8_t weights[kStages][kColumns * kStepK / 2];
  alignas(16) uint16_t scales[kStages][4][kColumns];  // [group in the step][row]
};

// The E4M3 A registers of one word of the prepared layout (lo, hi: its values 0-3 and 4-7 as
// bytes): row r's four values, then row r + 8's, in the permuted order (see the top). INT4
// with the value shuffle holds row r's k 2q, 2q + 1, 2q + 8, 2q + 9 in values 0, 4, 2, 6 and row
// r + 8's in 1, 5, 3, 7; E2M1 without it in values 0, 1, 4, 5 and 2, 3, 6, 7.
template <class W>
__device__ __forceinline__ void rows_of(uint32_t lo, uint32_t hi, uint32_t& row, uint32_t& row8) {
  if constexpr (std::is_same_v<W, decode_w4::E2M1>) {
    row = prmt(lo, hi, 0x5410u);
    row8 = prmt(lo, hi, 0x7632u);
  } else {
    row = prmt(lo, hi, 0x6240u);
    row8 = prmt(lo, hi, 0x7351u);
  }
}

// One expert's operands for a block.
struct Tile {
  int m_rows, n, k, steps, group;
  const uint8_t* w;     // this thread's 32 bytes of the block's K step 0
  bool w_ok;            // its warp's 16 rows are inside N
  int64_t step_bytes;   // from one K step's atoms to the next: N / 16 KB
  const uint16_t* scale;
  const uint8_t* x;
  int64_t ldx;  // bytes per token row
};

// Step s's copies into ring stage `stage`, as one commit group (empty past the last step).
template <int kN, int kGroups>
__device__ __forceinline__ void copy_step(const Tile& t, int m0, int s, int n_block, Smem<kN>& sm, int stage) {
  const int tid = threadIdx.x;
  if (s < t.steps) {
    const uint8_t* src = t.w + (t.w_ok ? s * t.step_bytes : 0);
    cp_async::copy_16(smem_addr(sm.weights[stage] + 32 * tid), src, t.w_ok);
    cp_async::copy_16(smem_addr(sm.weights[stage] + 32 * tid + 16), src + 16, t.w_ok);
    if (tid < 8 * kGroups) {  // the step's groups, 64 rows each, 16 bytes a thread
      const int gi = tid >> 3, n = n_block + 8 * (tid & 7), kg = (s * kStepK) / t.group + gi;
      const bool ok = n < t.n && kg * t.group < t.k;
      cp_async::copy_16(smem_addr(&sm.scales[stage][gi][8 * (tid & 7)]), t.scale + (ok ? int64_t(kg) * t.n + n : 0), ok);
    }
    const uint32_t tok = smem_addr(sm.tokens[stage]);
#pragma unroll
    for (int id = tid; id < kN * 8; id += kThreads) {  // 16-byte k block c of token m
      const int m = id >> 3, c = id & 7, kk = s * kStepK + 16 * c;
      const bool ok = m0 + m < t.m_rows && kk < t.k;
      cp_async::copy_16(tok + c * (kN / 8) * 128 + (m >> 3) * 128 + (m & 7) * 16, t.x + (ok ? (m0 + m) * t.ldx + kk : 0), ok);
    }
  }
  cp_async::commit();
}

// kGroups: scale groups per K step (4: groups of 32, 2: of 64, 1: 128 or a multiple).
// 32 tokens a pass: three blocks an SM (a group's fp32 sums per scale group of the step).
template <class T, class W, int kN, int kGroups>
__global__ void __launch_bounds__(kThreads, kN >= 32 ? 3 : 4) decode_w4a8_wgmma_kernel(decode_w4::Params p) {
  __shared__ Smem<kN> sm;
  constexpr uint32_t kLbo = kN / 8 * 128, kSbo = 128;
  constexpr int kPerGroup = 4 / kGroups;  // wgmmas per group
  constexpr float kScaleMul = std::is_same_v<W, decode_w4::E2M1> ? 64.f : 1.f;
  pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int n_block = blockIdx.x * kColumns;
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const int g = p.active_groups[1 + y];
    Tile t;
    t.m_rows = p.problem_shapes[3 * g];
    t.n = p.problem_shapes[3 * g + 1];
    t.k = p.problem_shapes[3 * g + 2];
    if (n_block >= t.n) continue;  // the same for the whole block
    t.steps = (t.k + kStepK - 1) / kStepK;
    t.group = p.group;
    t.w_ok = n_block + 16 * (tid >> 5) < t.n;
    t.step_bytes = int64_t(t.n / 16) * 1024;
    t.w = static_cast<const uint8_t*>(p.ptr_b[g]) + int64_t(n_block / 16) * 1024 + 32 * tid;
    t.scale = reinterpret_cast<const uint16_t*>(p.ptr_sfb[g]);
    t.x = static_cast<const uint8_t*>(p.ptr_a[g]);
    t.ldx = p.stride_a[g];
    const float* sfa = p.ptr_sfa[g];
    T* d = static_cast<T*>(p.ptr_d[g]);
    const int64_t ldd = p.stride_d[g];
    for (int m0 = 0; m0 < t.m_rows; m0 += kN) {
      float acc[kN / 2];
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) copy_step<kN, kGroups>(t, m0, j, n_block, sm, j);
      for (int j = 0; j < t.steps; ++j) {
        const int stage = j % kStages;
        cp_async::wait<kStages - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();  // step j landed for everyone; everyone done with step j - 1's stage
        copy_step<kN, kGroups>(t, m0, j + kStages - 1, n_block, sm, (j + kStages - 1) % kStages);
        uint32_t a[4][4];  // [wgmma][register]: rows r, r + 8 of k 4q .., then of 16 + 4q ..
        const uint4 w[2] = {*reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid),
                            *reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid + 16)};
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // word 2c + h: registers 2h (row r) and 2h + 1 (row r + 8)
            const uint32_t word = decode::word(w[c >> 1], 2 * (c & 1) + h);
            uint32_t lo, hi;
            if constexpr (std::is_same_v<W, decode_w4::E2M1>) e2m1_to_e4m3(word, lo, hi);
            else int4_to_e4m3(word, lo, hi);
            rows_of<W>(lo, hi, a[c][2 * h], a[c][2 * h + 1]);
          }
        float part[kGroups][kN / 2] = {};
        const uint32_t tok = smem_addr(sm.tokens[stage]);
        decode_w4_wgmma::wgmma_fence();
#pragma unroll
        for (int c = 0; c < 4; ++c)
          wgmma_e4m3<kN>(part[c / kPerGroup], a[c], desc(tok + 2 * c * kLbo, kLbo, kSbo), c % kPerGroup);
        decode_w4_wgmma::wgmma_commit_wait();
#pragma unroll
        for (int gi = 0; gi < kGroups; ++gi) {
          decode_w4_wgmma::fence_acc<kN>(part[gi]);
          const float s0 = float(reinterpret_cast<const T&>(sm.scales[stage][gi][row0])) * kScaleMul;
          const float s1 = float(reinterpret_cast<const T&>(sm.scales[stage][gi][row0 + 8])) * kScaleMul;
#pragma unroll
          for (int i = 0; i < kN / 2; ++i) acc[i] += part[gi][i] * ((i >> 1) & 1 ? s1 : s0);
        }
      }
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const int m = m0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n_block + row0 + 8 * ((i >> 1) & 1);
        if (m < t.m_rows && col < t.n) d[int64_t(m) * ldd + col] = decode::to_out<T>(acc[i] * sfa[m]);
      }
      cp_async::wait<0>();
      __syncthreads();  // the ring is reused by the next pass
    }
  }
}

}  // namespace decode_w4a8_wgmma

// In: E4M3 (the tokens, not widened); T: the scales' and the output's type (bf16, fp16); W: the
// 4-bit format; kTokens: the catalog's tile_m (8, 16 or 32); 64 columns per block.
template <class In, class T, class W, int kTokens>
struct DecodeW4A8Wgmma {
  static_assert(std::is_same_v<In, __nv_fp8_e4m3>, "W4A8 wgmma decode: E4M3 tokens");
  static size_t workspace_size(int, int) { return 0; }

  // Scale groups of 32, 64, or a multiple of 128 (the wgmmas of a step split into whole
  // groups); the scales come 8 columns (16 bytes) at a time; no zero terms (W4A8 has none).
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = decode_w4::check_args<In>(a, "W4A8 wgmma decode GEMM", 16, err, errlen)) return st;
    if (a.weight_group != 32 && a.weight_group != 64 && a.weight_group % decode_w4a8_wgmma::kStepK) {
      snprintf(err, errlen, "W4A8 wgmma decode GEMM: scale group %d is not 32, 64 or a multiple of 128",
               a.weight_group);
      return MOEK_UNSUPPORTED;
    }
    if (a.zero_base) {
      snprintf(err, errlen, "W4A8 wgmma decode GEMM: takes no zero terms");
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    using namespace decode_w4a8_wgmma;
    constexpr const char* kWhat = "W4A8 wgmma decode GEMM";
    if (a.weight_group == 32)
      return decode_w4::launch_groups(decode_w4a8_wgmma_kernel<T, W, kTokens, 4>, a, kColumns, kThreads, kWhat, err,
                                      errlen);
    if (a.weight_group == 64)
      return decode_w4::launch_groups(decode_w4a8_wgmma_kernel<T, W, kTokens, 2>, a, kColumns, kThreads, kWhat, err,
                                      errlen);
    return decode_w4::launch_groups(decode_w4a8_wgmma_kernel<T, W, kTokens, 1>, a, kColumns, kThreads, kWhat, err,
                                    errlen);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size, static_cast<int>(sizeof(decode_w4a8_wgmma::Smem<kTokens>)), false, false,
      true};
};

}  // namespace moe_kernels
