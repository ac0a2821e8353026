// A grouped GEMM for a few to a few dozen rows per expert, shaped as vLLM's tuned Triton MoE
// decomposes decode: the catalog's "ring" schedule (cmake/catalog.py), bf16, fp16, fp8
// (per-channel or per-tensor E4M3 weights, per-row E4M3 tokens) and fp8_block (128x128 weight
// blocks, 1x128 token groups, each 128-byte partial sum scaled as it is added). Same interface
// as the other GEMM kernels.
//
// A block is 4 warps and 64 output columns (weight rows) of one expert, for kTokens of its
// rows at a time. Both operands stream through a ring of kStages K steps of kStepBytes in shared
// memory by 16-byte cp.async, the copies for step j + kStages - 1 issued while step j is
// multiplied, so the bytes in flight hold no registers (the mma.sync decode kernel,
// decode_gemm.cuh, keeps its loads in registers and so has fewer in flight per SM). Each warp
// owns 16 weight rows; tokens are mma.sync's M (16 per mma), weights its N, both read with
// ldmatrix from rows whose 16-byte chunks are XOR-swizzled by row, so the eight rows of a
// matrix hit all 32 banks. K is a byte count throughout: an mma consumes 32 bytes of K (16
// bf16/fp16 values, m16n8k16, or 32 E4M3 values, m16n8k32), whose fragments are the same bytes.
//
// The first group's weight copies are issued before the wait for the previous kernel (PDL):
// weights and routing's shapes are complete then (launch.cuh); the tokens are not.
//
// Its measurements and the default rule's use of it: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <type_traits>

#include "gemm/cp_async.cuh"
#include "gemm/decode_gemm.cuh"  // Params, mma, to_out
#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace decode_ring {

constexpr int kThreads = 128;  // 4 warps, 16 weight rows each
constexpr int kRows = 64;      // weight rows (output columns) per block

template <int kTokens, int kStepBytes>
struct Stage {
  char x[kTokens * kStepBytes];
  char w[kRows * kStepBytes];
};

// Byte offset of chunk c (16 bytes) of row r in a stage's operand.
template <int kStepBytes>
__device__ __forceinline__ uint32_t slot(int r, int c) {
  return uint32_t(r * kStepBytes + ((c ^ (r & 7)) * 16));
}

// One expert's operands as the block streams them.
struct Group {
  int g, m_rows, n, steps;
  int64_t k_bytes, ldw, ldx;
  const char* w;
  const char* x;

  template <int kStepBytes, class In>
  __device__ __forceinline__ static Group of(const decode::Params& p, int g) {
    Group t;
    t.g = g;
    t.m_rows = p.problem_shapes[3 * g];
    t.n = p.problem_shapes[3 * g + 1];
    t.k_bytes = int64_t(p.problem_shapes[3 * g + 2]) * sizeof(In);
    t.steps = static_cast<int>((t.k_bytes + kStepBytes - 1) / kStepBytes);
    t.ldw = p.stride_b[g] * int64_t(sizeof(In));
    t.ldx = p.stride_a[g] * int64_t(sizeof(In));
    t.w = static_cast<const char*>(p.ptr_b[g]);
    t.x = static_cast<const char*>(p.ptr_a[g]);
    return t;
  }
};

// Rows row0 .. row0 + kCount - 1 of K step s (of `rows` rows at `src`, ld bytes apart) into the
// operand at dst, zeros past `rows` and past K. k_bytes % 16 == 0 (check), so a chunk lies wholly
// inside K or wholly past it.
// Each thread copies the same chunk c of rows r0, r0 + kThreads / kChunks, ...: a trip count
// known when compiling, so the copies unroll with no loop and no per-chunk division.
template <int kCount, int kStepBytes>
__device__ __forceinline__ void copy_rows(uint32_t dst, const char* src, int64_t ld, int row0, int rows,
                                          int64_t k_bytes, int s) {
  constexpr int kChunks = kStepBytes / 16, kRowStride = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && (kCount * kChunks) % kThreads == 0, "whole chunks per thread");
  const int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const int64_t kb = int64_t(s) * kStepBytes + 16 * c;
  const bool k_ok = kb < k_bytes;
#pragma unroll
  for (int i = 0; i < kCount * kChunks / kThreads; ++i) {
    const int r = r0 + i * kRowStride;
    const bool ok = k_ok && row0 + r < rows;
    cp_async::copy_16(dst + slot<kStepBytes>(r, c), src + (ok ? (row0 + r) * ld + kb : 0), ok);
  }
}

// Step s's weight rows n0 .. n0 + 63 into ring stage s % kStages (nothing past the last step).
template <int kTokens, int kStepBytes, int kStages>
__device__ __forceinline__ void copy_weights(const Group& t, int n0, int s, Stage<kTokens, kStepBytes>* ring) {
  if (s < t.steps)
    copy_rows<kRows, kStepBytes>(cp_async::smem_addr(ring[s % kStages].w), t.w, t.ldw, n0, t.n, t.k_bytes, s);
}

// Step s's token rows m0 .. m0 + kTokens - 1, then the commit that closes the step's group of
// copies (an empty group past the last step keeps the count).
template <int kTokens, int kStepBytes, int kStages>
__device__ __forceinline__ void copy_tokens(const Group& t, int m0, int s, Stage<kTokens, kStepBytes>* ring) {
  if (s < t.steps)
    copy_rows<kTokens, kStepBytes>(cp_async::smem_addr(ring[s % kStages].x), t.x, t.ldx, m0, t.m_rows, t.k_bytes, s);
  cp_async::commit();
}

// Grid: (N / 64 weight blocks, active groups, capped at 65535); a block walks its expert's rows
// kTokens at a time, re-streaming its 64 weight rows for each pass.
// kBlockScaled (fp8_block): token scales [M, K / 128] (ptr_sfa[g]), weight scales
// [N / 128, K / 128] (ptr_sfb[g]); a 64-row block lies in one 128-row weight block.
template <class In, class Out, bool kBlockScaled, int kTokens, int kStepBytes, int kStages>
__global__ void __launch_bounds__(kThreads) ring_kernel(decode::Params p) {
  constexpr int kTiles = kTokens / 16;  // mma M tiles
  constexpr bool kScaledOutput = std::is_same_v<In, __nv_fp8_e4m3> && !kBlockScaled;
  constexpr int kBlocksPerStep = kStepBytes / 128;  // fp8_block: scale blocks per K step
  using StageT = Stage<kTokens, kStepBytes>;
  extern __shared__ __align__(128) char smem[];
  StageT* ring = reinterpret_cast<StageT*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mat = lane >> 3, r8 = lane & 7;
  const int n0 = blockIdx.x * kRows;
  const int active = p.active_groups[0];
  bool preloaded = false;
  if (int(blockIdx.y) < active) {
    const Group t = Group::of<kStepBytes, In>(p, p.active_groups[1 + blockIdx.y]);
    if (n0 < t.n && t.m_rows > 0) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) copy_weights<kTokens, kStepBytes, kStages>(t, n0, s, ring);
      preloaded = true;
    }
  }
  pdl_begin();
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const Group t = Group::of<kStepBytes, In>(p, p.active_groups[1 + y]);
    if (n0 >= t.n) continue;  // N is the same for every group: the whole block skips
    const float* sfa = kScaledOutput || kBlockScaled ? p.ptr_sfa[t.g] : nullptr;
    const int k_blocks = static_cast<int>((t.k_bytes + 127) / 128);
    const float* sfb = kBlockScaled ? p.ptr_sfb[t.g] + int64_t(n0 / 128) * k_blocks : nullptr;
    for (int m0 = 0; m0 < t.m_rows; m0 += kTokens) {
      // The first kStages - 1 steps; preloaded weights join the first step's group.
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (!preloaded) copy_weights<kTokens, kStepBytes, kStages>(t, n0, s, ring);
        copy_tokens<kTokens, kStepBytes, kStages>(t, m0, s, ring);
      }
      preloaded = false;
      float acc[kTiles][2][4] = {};
      for (int j = 0; j < t.steps; ++j) {
        // fp8_block: step j's scales, [block][tile][token lane / 4, + 8], requested before the
        // wait for its operands so that they arrive with them (zeros past M and past K).
        float sa[kBlockScaled ? kBlocksPerStep : 1][kTiles][2], sw[kBlockScaled ? kBlocksPerStep : 1];
        if constexpr (kBlockScaled) {
#pragma unroll
          for (int b = 0; b < kBlocksPerStep; ++b) {
            const int kb = j * kBlocksPerStep + b;
            sw[b] = kb < k_blocks ? __ldg(sfb + kb) : 0.f;
#pragma unroll
            for (int u = 0; u < kTiles; ++u)
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int m = m0 + 16 * u + (lane >> 2) + 8 * half;
                sa[b][u][half] = kb < k_blocks && m < t.m_rows ? __ldg(sfa + int64_t(m) * k_blocks + kb) : 0.f;
              }
          }
        }
        cp_async::wait<kStages - 2>();
        __syncthreads();  // step j landed for every thread; every thread is done with step j - 1
        copy_weights<kTokens, kStepBytes, kStages>(t, n0, j + kStages - 1, ring);
        copy_tokens<kTokens, kStepBytes, kStages>(t, m0, j + kStages - 1, ring);
        const uint32_t xs = cp_async::smem_addr(ring[j % kStages].x), ws = cp_async::smem_addr(ring[j % kStages].w);
        float part[kTiles][2][4] = {};  // fp8_block: one 128-byte scale block's sums
#pragma unroll
        for (int ks = 0; ks < kStepBytes / 32; ++ks) {
          uint32_t b[4];  // weight rows 16w + 0-7 (bytes 0-15, 16-31 of the slice), then 16w + 8-15
          cp_async::ldmatrix_x4(b, ws + slot<kStepBytes>(16 * warp + r8 + 8 * (mat >> 1), 2 * ks + (mat & 1)));
#pragma unroll
          for (int u = 0; u < kTiles; ++u) {
            uint32_t a[4];  // tokens 16u + 0-7, + 8-15 (bytes 0-15), then the same (bytes 16-31)
            cp_async::ldmatrix_x4(a, xs + slot<kStepBytes>(16 * u + r8 + 8 * (mat & 1), 2 * ks + (mat >> 1)));
            decode::mma<In>(kBlockScaled ? part[u][0] : acc[u][0], a, b[0], b[1]);
            decode::mma<In>(kBlockScaled ? part[u][1] : acc[u][1], a, b[2], b[3]);
          }
          if constexpr (kBlockScaled) {
            if (ks % 4 == 3) {  // the end of a 128-byte block: scale its sums into acc
              const int blk = ks / 4;
#pragma unroll
              for (int u = 0; u < kTiles; ++u)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                  for (int i = 0; i < 4; ++i) {
                    acc[u][h][i] += part[u][h][i] * (sa[blk][u][i >> 1] * sw[blk]);
                    part[u][h][i] = 0.f;
                  }
            }
          }
        }
      }
      // acc[u][h][i]: token 16u + lane / 4 (+ 8 for i >= 2), columns 16w + 8h + 2 (lane % 4) + i % 2.
      Out* d = static_cast<Out*>(p.ptr_d[t.g]);
      const int64_t ldd = p.stride_d[t.g];
      float col_scale[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int col = n0 + 16 * warp + 8 * h + 2 * (lane & 3) + i;
          col_scale[h][i] = !kScaledOutput || col >= t.n ? 1.f
                            : __ldg(p.sfb_base + (p.sfb_per_channel ? t.g * p.n + col : t.g));
        }
#pragma unroll
      for (int u = 0; u < kTiles; ++u)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int m = m0 + 16 * u + (lane >> 2) + 8 * half;
          if (m >= t.m_rows) continue;
          const float row_scale = kScaledOutput ? __ldg(sfa + m) : 1.f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = n0 + 16 * warp + 8 * h + 2 * (lane & 3);
            const float v0 = acc[u][h][2 * half] * row_scale * col_scale[h][0];
            const float v1 = acc[u][h][2 * half + 1] * row_scale * col_scale[h][1];
            Out* at = d + int64_t(m) * ldd + col;
            if (col + 1 < t.n) {  // N and ldd even (16-byte rows): a 4-byte store
              if constexpr (std::is_same_v<Out, __nv_bfloat16>) *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(v0, v1);
              else *reinterpret_cast<__half2*>(at) = __floats2half2_rn(v0, v1);
            } else if (col < t.n) {
              *at = decode::to_out<Out>(v0);
            }
          }
        }
      cp_async::wait<0>();
      __syncthreads();  // the ring is refilled by the next pass or group
    }
  }
}

}  // namespace decode_ring

// kBlockScaled: fp8_block (the catalog's "blockwise" mainloop). kTokens, kStepBytes: the
// catalog's tile_m and tile_k (in bytes: tile_k times the element size).
template <class In, class Out, bool kBlockScaled, int kTokens, int kStepBytes>
struct DecodeRing {
  static_assert(kTokens % 16 == 0, "ring decode GEMM: tokens per pass in multiples of 16 (mma M)");
  static_assert(kStepBytes % 128 == 0, "ring decode GEMM: K steps of whole 8-chunk swizzle rows");
  static_assert(!kBlockScaled || std::is_same_v<In, __nv_fp8_e4m3>, "ring decode GEMM: block scales are E4M3's");
  static constexpr int kStages = 4;
  static constexpr int kSmem = kStages * int(sizeof(decode_ring::Stage<kTokens, kStepBytes>));

  static size_t workspace_size(int, int) { return 0; }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (a.n <= 0 || a.max_active_groups <= 0 || !a.active_groups) {
      snprintf(err, errlen, "ring decode GEMM: needs N, the active-group list and its bound");
      return MOEK_INVALID_ARGUMENT;
    }
    if ((a.k * int64_t(sizeof(In))) % 16 || (a.n % 2)) {
      snprintf(err, errlen, "ring decode GEMM: K (%lld) must fill whole 16-byte chunks and N (%lld) be even",
               static_cast<long long>(a.k), static_cast<long long>(a.n));
      return MOEK_INVALID_ARGUMENT;
    }
    if (std::is_same_v<In, __nv_fp8_e4m3> && !kBlockScaled && (!a.ptr_sfa || !a.sfb_base)) {
      snprintf(err, errlen, "ring decode GEMM (fp8): needs the row scales and the weight scales");
      return MOEK_INVALID_ARGUMENT;
    }
    if (kBlockScaled && (!a.ptr_sfa || !a.ptr_sfb)) {
      snprintf(err, errlen, "ring decode GEMM (fp8_block): needs the token and weight block scales");
      return MOEK_INVALID_ARGUMENT;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    auto* kernel = decode_ring::ring_kernel<In, Out, kBlockScaled, kTokens, kStepBytes, kStages>;
    if (cudaError_t e = allow_smem(reinterpret_cast<const void*>(kernel), a.device, kSmem); e != cudaSuccess) {
      snprintf(err, errlen, "ring decode GEMM: %s", cudaGetErrorString(e));
      return MOEK_CUDA_ERROR;
    }
    decode::Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                     a.stride_d, a.ptr_sfa, a.ptr_sfb, a.sfb_base, a.n, a.sfb_per_channel};
    const dim3 grid(static_cast<unsigned>((a.n + decode_ring::kRows - 1) / decode_ring::kRows),
                    static_cast<unsigned>(a.max_active_groups < 65535 ? a.max_active_groups : 65535));
    if (cudaError_t e = launch(kernel, grid, dim3(decode_ring::kThreads), kSmem, a.stream, p); e != cudaSuccess) {
      snprintf(err, errlen, "ring decode GEMM launch: %s", cudaGetErrorString(e));
      return MOEK_CUDA_ERROR;
    }
    return MOEK_OK;
  }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, kSmem, false};
};

}  // namespace moe_kernels
