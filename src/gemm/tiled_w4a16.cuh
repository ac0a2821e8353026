// A grouped 4-bit-weight GEMM for many rows per expert (the catalog's "tiled" schedule): INT4 or
// E2M1 weights with 16-bit group scales of any group of 32 or more (MXFP4's 32, which
// CUTLASS's mixed-input mainloop cannot take) and optional INT4 zero terms, dequantized in
// registers once per block tile and reused for all of its tokens. Tokens are 16-bit (W4A16)
// or E4M3 with a scale per row (W4A8: widened exactly, the row's scale applied to the output).
//
// A block owns kRows = 128 weight rows (output columns) of one expert and walks the expert's
// tokens in tiles of kTokens; its 8 warps each take 16 of the weight rows (one mma.sync M, one
// atom of the fragment layout, decode_w4a16.cuh) and all kTokens tokens (kTokens / 8 mmas of
// N = 8). K advances 64 values per stage through a 3-stage cp.async ring in shared memory: each
// lane's half of its atom's 32 bytes (words 0-3 or 4-7: the A registers of the stage's four
// 16-deep K blocks), the token rows (128 bytes each; 64 for E4M3) and the stage's scales (and
// zero terms). The tokens' B registers come by ldmatrix from rows whose 16-byte chunks are
// swizzled (chunk c of row m at c ^ (m % 8)), in the natural K order.
//
// Compiled, not yet run on a GPU; design and status: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include "gemm/decode_gemm.cuh"   // mma, to_out
#include "gemm/decode_w4a16.cuh"  // dequant8, fma2, Int4, E2M1
#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace tiled_w4 {

constexpr int kWarps = 8;
constexpr int kRows = 16 * kWarps;  // weight rows per block
constexpr int kStageK = 64;         // K values per stage
constexpr int kStages = 3;
constexpr int kMaxScaleRows = kStageK / 32;  // scale groups a stage spans, at most

using decode_w4::Params;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// 16-byte chunks of a token row per stage: 8 (16-bit tokens) or 4 (E4M3).
template <class In>
constexpr int kChunks = kStageK * int(sizeof(In)) / 16;

// E4M3 tokens of the stage being computed, widened once to the 16-bit layout (8 chunks a row,
// swizzled as 16-bit tokens are), so that the 8 warps do not each widen every token.
template <int kTokens>
struct Widened {
  uint4 tokens[kTokens][8];
};
template <class In, int kTokens>
using WidenedFor = Widened<sizeof(In) == 1 ? kTokens : 1>;  // 16-bit tokens need none

template <class In, int kTokens>
struct Stage {
  uint4 weights[kWarps][32];                 // per warp's atom, each lane's 16 bytes of the stage
  uint4 tokens[kTokens][kChunks<In>];        // the stage's bytes of each token row, chunks swizzled
  unsigned short scale[kMaxScaleRows][kRows];
  unsigned short zero[kMaxScaleRows][kRows];
};

// 16-bit tokens: chunk c (of 8) of token row m lives at chunk c ^ (m % 8), so that ldmatrix's
// eight rows at one chunk hit eight different bank groups (E4M3 rows are only widened).
template <class In>
__device__ __forceinline__ int swizzle(int m, int c) { return kChunks<In> == 8 ? c ^ (m & 7) : c; }
__device__ __forceinline__ int swizzle16(int m, int c) { return c ^ (m & 7); }

// The four 8x8 16-bit matrices at the rows lanes 8i .. 8i + 7 point to, as mma.sync's operands.
__device__ __forceinline__ void ldmatrix_x4(const void* row, uint32_t (&r)[4]) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// One block: the tile's kRows weight rows of group g, for all of the group's tokens. In: the
// tokens' element type; T: the MMAs' and the output's.
template <class In, class T, class W, int kTokens>
__device__ __forceinline__ void group_tile(const Params& p, int g, Stage<In, kTokens> (&stages)[kStages],
                                           WidenedFor<In, kTokens>& wide) {
  const int m_rows = p.problem_shapes[3 * g];
  const int n = p.problem_shapes[3 * g + 1];
  const int k = p.problem_shapes[3 * g + 2];
  const int n0 = blockIdx.x * kRows;
  const int group = p.group;
  const int scale_k = k / group;
  const int k_stages = (k + kStageK - 1) / kStageK;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, r = lane >> 2, q = lane & 3;
  // This lane's 32 bytes of its warp's atom at K step 0 (of 128), and the step from one to the next.
  const char* watom = static_cast<const char*>(p.ptr_b[g]) + int64_t(n0 / 16 + warp) * 1024 + 32 * lane;
  const int64_t step_bytes = int64_t(n / 16) * 1024;
  const char* abase = static_cast<const char*>(p.ptr_a[g]);
  const int64_t lda = p.stride_a[g] * int64_t(sizeof(In));
  constexpr int kC = kChunks<In>, kPerChunk = 16 / int(sizeof(In));  // chunks per row, values per chunk
  constexpr int kTokenCopies = (kTokens * kC + kWarps * 32 - 1) / (kWarps * 32);  // token chunks per thread, at most
  constexpr bool kScaledRows = sizeof(In) == 1;
  const float* sfa = kScaledRows ? p.ptr_sfa[g] : nullptr;
  const unsigned short* scale = reinterpret_cast<const unsigned short*>(p.ptr_sfb[g]);
  const unsigned short* zero = p.zero ? p.zero + int64_t(g) * scale_k * n : nullptr;
  T* d = static_cast<T*>(p.ptr_d[g]);
  const int64_t ldd = p.stride_d[g];

  // Token tiles blockIdx.z, blockIdx.z + gridDim.z, ... (the launch splits an expert's tokens
  // over gridDim.z blocks where its weight tiles alone would leave SMs idle).
  for (int m0 = blockIdx.z * kTokens; m0 < m_rows; m0 += gridDim.z * kTokens) {
    // Stage s's loads: every thread copies 16-byte chunks (zeros past K, N or the rows).
    auto load = [&](int s) {
      Stage<In, kTokens>& st = stages[s % kStages];
      const int k0 = s * kStageK;
      {  // weights: each lane its 16 bytes of the stage (half s % 2 of K step s / 2)
        const bool ok = s < k_stages && n0 + 16 * warp < n;
        cp_async16(&st.weights[warp][lane], ok ? watom + (s / 2) * step_bytes + 16 * (s % 2) : watom, ok);
      }
#pragma unroll
      for (int j = 0; j < kTokenCopies; ++j) {  // tokens: kTokens rows x kC chunks, a fixed count per thread
        const int i = tid + j * kWarps * 32;
        if (kTokens * kC % (kWarps * 32) != 0 && i >= kTokens * kC) break;
        const int m = i / kC, c = i % kC;
        const bool ok = s < k_stages && m0 + m < m_rows && k0 + kPerChunk * c < k;
        cp_async16(&st.tokens[m][swizzle<In>(m, c)],
                   ok ? abase + (m0 + m) * lda + int64_t(k0 + kPerChunk * c) * sizeof(In) : abase, ok);
      }
      if (tid < 2 * kMaxScaleRows * (kRows / 8)) {  // scales, then zero terms: kRows / 8 chunks per row
        const bool is_zero = tid >= kMaxScaleRows * (kRows / 8);
        const int i = is_zero ? tid - kMaxScaleRows * (kRows / 8) : tid;
        const int j = i / (kRows / 8), c = i % (kRows / 8);
        const int srow = k0 / group + j;
        const unsigned short* src = is_zero ? zero : scale;
        const bool ok = s < k_stages && src && srow < scale_k && (k0 + j * 32) < k && n0 + 8 * c < n &&
                        (j == 0 || group == 32);
        cp_async16(is_zero ? &st.zero[j][8 * c] : &st.scale[j][8 * c],
                   ok ? src + int64_t(srow) * n + n0 + 8 * c : scale, ok);
      }
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      load(s);
      cp_async_commit();
    }

    float acc[kTokens / 8][4] = {};
    const int row0 = 16 * warp + r;  // this lane's weight rows: row0 and row0 + 8 of the tile
    for (int s = 0; s < k_stages; ++s) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // stage s landed for every thread; stage s - 1's buffer is free
      load(s + kStages - 1);
      cp_async_commit();
      const Stage<In, kTokens>& st = stages[s % kStages];
      if constexpr (kScaledRows) {  // E4M3 chunk c (values 16c ..) -> 16-bit chunks 2c, 2c + 1
#pragma unroll
        for (int j = 0; j < kTokenCopies; ++j) {
          const int i = tid + j * kWarps * 32;
          if (kTokens * kC % (kWarps * 32) != 0 && i >= kTokens * kC) break;
          const int m = i / kC, c = i % kC;
          const uint4 raw = st.tokens[m][swizzle<In>(m, c)];
          uint4 lo, hi;
          lo.x = decode_w4::e4m3x2_to<T>(raw.x);
          lo.y = decode_w4::e4m3x2_to<T>(raw.x >> 16);
          lo.z = decode_w4::e4m3x2_to<T>(raw.y);
          lo.w = decode_w4::e4m3x2_to<T>(raw.y >> 16);
          hi.x = decode_w4::e4m3x2_to<T>(raw.z);
          hi.y = decode_w4::e4m3x2_to<T>(raw.z >> 16);
          hi.z = decode_w4::e4m3x2_to<T>(raw.w);
          hi.w = decode_w4::e4m3x2_to<T>(raw.w >> 16);
          wide.tokens[m][swizzle16(m, 2 * c)] = lo;
          wide.tokens[m][swizzle16(m, 2 * c + 1)] = hi;
        }
        __syncthreads();  // the widened stage is complete before any warp reads it
      }
      // The A registers of the stage's four K blocks (rows row0, row0 + 8), dequantized and scaled.
      const uint4 wq = st.weights[warp][lane];
      uint32_t av[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int srow = group == 32 ? j >> 1 : 0;  // K block j's scale row in the stage
        const uint32_t s_lo = uint32_t(st.scale[srow][row0]) * 0x10001u, s_hi = uint32_t(st.scale[srow][row0 + 8]) * 0x10001u;
        const uint32_t z_lo = zero ? uint32_t(st.zero[srow][row0]) * 0x10001u : 0u;
        const uint32_t z_hi = zero ? uint32_t(st.zero[srow][row0 + 8]) * 0x10001u : 0u;
        decode_w4::fragment<T, W>(decode::word(wq, j), av[j]);
#pragma unroll
        for (int e = 0; e < 4; ++e)  // a1, a3: row0 + 8
          av[j][e] = decode_w4::fma2<T>(av[j][e], e & 1 ? s_hi : s_lo, e & 1 ? z_hi : z_lo);
      }
#pragma unroll
      for (int u = 0; u < kTokens / 8; ++u) {
        const int m = 8 * u + (lane & 7);  // the row this lane points ldmatrix at
        const uint4* row16;
        if constexpr (kScaledRows) row16 = wide.tokens[m];
        else row16 = st.tokens[m];
#pragma unroll
        for (int jj = 0; jj < 4; jj += 2) {  // K blocks jj, jj + 1: chunks 2jj .. 2jj + 3
          uint32_t b[4];
          ldmatrix_x4(row16 + swizzle16(m, 2 * jj + (lane >> 3)), b);
          decode::mma<T>(acc[u], av[jj], b[0], b[1]);
          decode::mma<T>(acc[u], av[jj + 1], b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is reused by the next token tile
    // c0: (weight row r, token 2q), c1: (r, 2q + 1), c2: (r + 8, 2q), c3: (r + 8, 2q + 1).
#pragma unroll
    for (int u = 0; u < kTokens / 8; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + 8 * u + 2 * q + (e & 1);
        const int col = n0 + row0 + 8 * (e >> 1);
        if (m < m_rows && col < n)
          d[int64_t(m) * ldd + col] = decode::to_out<T>(kScaledRows ? acc[u][e] * sfa[m] : acc[u][e]);
      }
    }
  }
}

template <class In, class T, class W, int kTokens>
__global__ void __launch_bounds__(kWarps * 32) tiled_w4a16_kernel(Params p) {
  __shared__ __align__(16) Stage<In, kTokens> stages[kStages];
  __shared__ __align__(16) WidenedFor<In, kTokens> wide;
  pdl_begin();
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const int g = p.active_groups[1 + y];
    if (int(blockIdx.x) * kRows < p.problem_shapes[3 * g + 1])  // the same for the whole block
      group_tile<In, T, W, kTokens>(p, g, stages, wide);
  }
}

}  // namespace tiled_w4

// In: the tokens' element type (T, or E4M3 for W4A8); T: the MMAs' and the output's (bf16,
// fp16). kTokens: the catalog's tile_m (tokens per tile, a multiple of 8); 128 output columns
// per block.
template <class In, class T, class W, int kTokens>
struct TiledW4A16 {
  static_assert(kTokens % 8 == 0 && kTokens <= 64, "W4A16 tiled GEMM: 8 to 64 tokens per tile, in 8s");

  static size_t workspace_size(int, int) { return 0; }

  // Whole atoms of the fragment layout; a K block of 16 is inside one scale group.
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    return decode_w4::check_args<In>(a, "4-bit tiled GEMM", 16, err, errlen);
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    // Few experts with many rows each (few weight tiles): split each expert's token tiles over
    // more blocks, so that about kBlocksPerSm blocks per SM are launched, as many as the mean
    // rows per expert have tiles. Blocks whose split holds no tile of their expert exit.
    constexpr int64_t kBlocksPerSm = 4;
    const int64_t groups = a.max_active_groups > 0 ? a.max_active_groups : 1;
    const int64_t weight_blocks = (a.n + tiled_w4::kRows - 1) / tiled_w4::kRows * groups;
    const int64_t tiles = (a.rows / groups + kTokens - 1) / kTokens;
    const int64_t want = (kBlocksPerSm * a.sm_count + weight_blocks - 1) / weight_blocks;
    const int splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({tiles, want, 65535})));
    return decode_w4::launch_groups(tiled_w4::tiled_w4a16_kernel<In, T, W, kTokens>, a, tiled_w4::kRows,
                                    tiled_w4::kWarps * 32, "4-bit tiled GEMM", err, errlen, splits);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size,
      static_cast<int>(sizeof(tiled_w4::Stage<In, kTokens>) * tiled_w4::kStages +
                       (sizeof(In) == 1 ? sizeof(tiled_w4::WidenedFor<In, kTokens>) : 0)),
      false};
};

}  // namespace moe_kernels
