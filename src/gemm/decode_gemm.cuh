// A grouped GEMM for decode: a few rows per expert, where the time is the weights' bytes.
// The catalog's "decode" schedule (cmake/catalog.py); same interface as the CUTLASS kernels.
//
// Swapped operands: the weights are mma.sync's A operand (16 weight rows per warp tile) and
// the tokens its N operand (8 per mma), so a single token wastes 7/8 of an mma, not 63/64 of
// a wgmma tile. A block owns 16 output columns of one expert, its 4 warps splitting K and
// adding their partial sums in shared memory, or 64 columns, 16 per warp over all of K
// (DecodeGemm says when each). Weight bytes are read once, straight from global memory into
// registers (16 bytes per lane per load, several loads in flight per lane). Tokens and
// scales are small and re-read from L1/L2.
//
// K order: mma.sync wants each lane to hold bytes 4q..4q+3 and 16+4q..16+4q+3 of a 32-byte
// K step (q = lane % 4). A dot product does not care about the order of K, so lane q instead
// loads bytes 16q..16q+15 of a 64-byte K step, for the weights and the tokens alike, and
// feeds them as two mma steps; the same permutation on both operands gives the same sums.
//
// Design, the rule that picks it, and the variants measured and dropped: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <type_traits>

#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace decode {

constexpr int kWarps = 4;     // per block
constexpr int kRows = 16;     // weight rows (output columns) per warp tile: one mma M
constexpr int kKBytes = 128;  // K bytes per warp step: one 128-column scale block for FP8

struct Params {
  const int32_t* problem_shapes;
  const int32_t* active_groups;  // [0]: how many groups have rows; [1..]: which
  const void* const* ptr_a;
  const int64_t* stride_a;
  const void* const* ptr_b;
  const int64_t* stride_b;
  void* const* ptr_d;
  const int64_t* stride_d;
  const float* const* ptr_sfa;
  const float* const* ptr_sfb;
  // fp8 (per tensor / per channel): group g's weight scales at sfb_base + g * (n or 1), read
  // from the kernel's parameters rather than through ptr_sfb[g] (one load fewer before them).
  const float* sfb_base;
  int64_t n;
  bool sfb_per_channel;
};

// Weights are streamed once: keep them out of L1 so the tokens stay there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The same with an L2 prefetch of the 256 bytes around the address (`.L2::256B`): for the 4-bit
// decode kernel, whose warps read a row's 256 bytes 64 at a time (docs/kernels/decode.md).
__device__ __forceinline__ uint4 load_stream_l2_256(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// c += a (16 x 32 bytes of K, row-major) * b (32 bytes of K x 8, column-major), fp32 accumulate.
template <class In>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<In, __nv_fp8_e4m3>) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (std::is_same_v<In, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<In, __half>, "decode GEMM: bf16, fp16 or e4m3 inputs");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <class Out>
__device__ __forceinline__ Out to_out(float v) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) return __float2bfloat16(v);
  else return __float2half(v);
}

// One warp's 16 output columns of group g (weight rows n0 .. n0 + 15): its pointers, and the
// weight loads of one batch. Split K (16 columns per block): the block's 4 warps share the
// columns and take K steps warp, warp + 4, ...; else (64 per block) each warp owns 16 columns
// and takes every K step.
// kBatch: the K steps whose weight loads a warp issues before using any.
template <class In_, bool kBlockScaled_, bool kSplitK_, int kBatch_>
struct WarpTile {
  using In = In_;
  static constexpr bool kBlockScaled = kBlockScaled_, kSplitK = kSplitK_;
  static constexpr int kBatch = kBatch_;
  using Weights = uint4[kBatch][2][2];  // [step][64-byte half][row r, r + 8]
  static constexpr int kStepStride = kSplitK ? kWarps : 1;

  int g, n, n0, k_steps;
  int64_t k_bytes;
  bool w_ok[2];
  const char* w_row[2];
  const float* sfb;
  // fp8 (E4M3, not block-scaled): the output is scaled by its rows' scales (from the previous
  // kernel; group_tile loads them) and its columns' (the weights' own; load_col_scales).
  static constexpr bool kScaledOutput = std::is_same_v<In, __nv_fp8_e4m3> && !kBlockScaled;

  // Reads only what routing wrote (shapes, pointers): callable before the wait for the
  // previous kernel (see decode_gemm_kernel).
  __device__ __forceinline__ WarpTile(const Params& p, int group) : g(group) {
    n = p.problem_shapes[3 * g + 1];
    const int k = p.problem_shapes[3 * g + 2];
    k_bytes = int64_t(k) * sizeof(In);
    k_steps = static_cast<int>((k_bytes + kKBytes - 1) / kKBytes);
    n0 = kSplitK ? blockIdx.x * kRows : (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRows;
    const int r = (threadIdx.x & 31) >> 2;
    const char* b = static_cast<const char*>(p.ptr_b[g]);
    const int64_t ldb = p.stride_b[g] * sizeof(In);
    w_ok[0] = n0 + r < n;
    w_ok[1] = n0 + r + 8 < n;
    w_row[0] = b + (n0 + r) * ldb;
    w_row[1] = b + (n0 + r + 8) * ldb;
    sfb = nullptr;
    if constexpr (kBlockScaled) sfb = p.ptr_sfb[g] + int64_t(n0 / 128) * k_steps;
  }
  // fp8: the weight scales of the columns this thread stores (group_tile: r and r + 8;
  // split K: threadIdx.x % 16), by value c / 2 (split K: [0]).
  __device__ __forceinline__ void load_col_scales(const Params& p, float (&s)[2]) const {
    const int r = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = n0 + (kSplitK ? threadIdx.x % kRows : r + 8 * j);
      s[j] = col < n ? __ldg(p.sfb_base + (p.sfb_per_channel ? g * p.n + col : g)) : 0.f;
    }
  }
  __device__ __forceinline__ bool has_columns() const { return n0 < n; }
  // Lane q's 16 bytes of half h (64 bytes) of K step s, for weight and token rows alike: the
  // byte offset into a row, and whether it lies inside K (k_bytes % 16 == 0: wholly or not).
  __device__ __forceinline__ bool k_piece(int s, int h, int64_t& off) const {
    off = int64_t(s) * kKBytes + 64 * h + 16 * (threadIdx.x & 3);
    return s < k_steps && off < k_bytes;
  }
  __device__ __forceinline__ int first_step() const { return kSplitK ? threadIdx.x >> 5 : 0; }

  // The weights of steps s0, s0 + kStepStride, ... (kBatch of them); past K: zeros.
  __device__ __forceinline__ void load_weights(int s0, Weights& w) const {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int s = s0 + i * kStepStride;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int64_t off;
        const bool in_k = k_piece(s, h, off);
#pragma unroll
        for (int j = 0; j < 2; ++j)
          w[i][h][j] = in_k && w_ok[j] ? load_stream(w_row[j] + off) : make_uint4(0, 0, 0, 0);
      }
    }
  }
};

// The warp's sums over its K steps for tokens m0 .. m0 + 8 * kTiles - 1 of the group:
// acc[u] = c0..c3 of mma tile u. kBlockScaled: fp8_block, A scales [M, K/128] and B scales
// [N/128, K/128] applied to each 128-column partial sum; else raw fp32 sums (fp8's per-row
// and per-channel scales are applied to the output: group_tile). `w` holds the first batch
// of weights when `preloaded`. `after_first_loads()` runs once, right after the first token
// loads are issued (or at the end, for a warp with no K steps): loads it issues wait behind
// the ones the first mma needs, not ahead of them (issue is in order).
template <class Tile, int kTiles, class AfterFirstLoads>
__device__ __forceinline__ void warp_sums(const Tile& t, const char* a, int64_t lda,
                                          const float* sfa, int m0, int m_rows,
                                          typename Tile::Weights& w, bool preloaded,
                                          float (&acc)[kTiles][4],
                                          AfterFirstLoads&& after_first_loads) {
  using In = typename Tile::In;
  constexpr bool kBlockScaled = Tile::kBlockScaled;
  constexpr int kStride = Tile::kStepStride, kBatch = Tile::kBatch;
  constexpr int kXSteps = 2;
  static_assert(kBatch % kXSteps == 0, "decode GEMM: batches of whole token-load pairs");
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
  bool first = true;
  for (int s0 = t.first_step(); s0 < t.k_steps; s0 += kStride * kBatch) {
    if (!preloaded) t.load_weights(s0, w);
    preloaded = false;
    // Token loads two steps at a time (in flight together; more would cost registers).
#pragma unroll
    for (int i0 = 0; i0 < kBatch; i0 += kXSteps) {
      if (s0 + i0 * kStride >= t.k_steps) break;  // the same for the whole warp
      uint4 x[kXSteps][2][kTiles];  // [step][half][token tile]: token m0 + 8u + r
#pragma unroll
      for (int j = 0; j < kXSteps; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int64_t off;
          const bool in_k = t.k_piece(s0 + (i0 + j) * kStride, h, off);
#pragma unroll
          for (int u = 0; u < kTiles; ++u) {
            const int m = m0 + 8 * u + r;
            x[j][h][u] = in_k && m < m_rows
                             ? __ldg(reinterpret_cast<const uint4*>(a + m * lda + off))
                             : make_uint4(0, 0, 0, 0);
          }
        }
      if (first) {
        after_first_loads();
        first = false;
      }
#pragma unroll
      for (int j = 0; j < kXSteps; ++j) {
        const int i = i0 + j, s = s0 + i * kStride;
        if (s >= t.k_steps) break;  // the same for the whole warp
        float part[kTiles][4] = {};
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const uint32_t wa[4] = {word(w[i][h][0], 2 * v), word(w[i][h][1], 2 * v),
                                    word(w[i][h][0], 2 * v + 1), word(w[i][h][1], 2 * v + 1)};
#pragma unroll
            for (int u = 0; u < kTiles; ++u)
              mma<In>(kBlockScaled ? part[u] : acc[u], wa, word(x[j][h][u], 2 * v),
                      word(x[j][h][u], 2 * v + 1));
          }
        if constexpr (kBlockScaled) {
          const float ws = t.sfb[s];
#pragma unroll
          for (int u = 0; u < kTiles; ++u) {
            // c0/c2 are token 2q of the tile, c1/c3 token 2q + 1 (rows r and r + 8).
            const int m = m0 + 8 * u + 2 * q;
            const float s0a = m < m_rows ? sfa[int64_t(m) * t.k_steps + s] * ws : 0.f;
            const float s1a = m + 1 < m_rows ? sfa[int64_t(m + 1) * t.k_steps + s] * ws : 0.f;
            acc[u][0] += part[u][0] * s0a;
            acc[u][1] += part[u][1] * s1a;
            acc[u][2] += part[u][2] * s0a;
            acc[u][3] += part[u][3] * s1a;
          }
        }
      }
    }
  }
  if (first) after_first_loads();
}

// All passes (kTiles * 8 tokens each) of one group over the tile's weights, and the stores;
// fp8 (E4M3, not block-scaled) stores acc * (row m's scale) * (column's weight scale).
// Split K: the warps' sums are added in shared memory (`partial`), then stored by the block;
// else each lane stores its own sums: c0 (row r, token 2q), c1 (r, 2q + 1), c2 (r + 8, 2q),
// c3 (r + 8, 2q + 1) of each mma tile.
template <class Out, class Tile, int kTiles>
__device__ __forceinline__ void group_tile(const Params& p, const Tile& t,
                                           typename Tile::Weights& w, bool preloaded,
                                           float (&partial)[Tile::kSplitK ? kWarps : 1][kTiles * 8][kRows + 1]) {
  using In = typename Tile::In;
  constexpr bool kBlockScaled = Tile::kBlockScaled, kSplitK = Tile::kSplitK;
  const int g = t.g, n = t.n, n0 = t.n0;
  const int m_rows = p.problem_shapes[3 * g];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, q = lane & 3;
  const char* a = static_cast<const char*>(p.ptr_a[g]);
  const int64_t lda = p.stride_a[g] * sizeof(In);
  constexpr bool kScaledOutput = Tile::kScaledOutput;
  const float* sfa = kBlockScaled || kScaledOutput ? p.ptr_sfa[g] : nullptr;
  Out* d = static_cast<Out*>(p.ptr_d[g]);
  const int64_t ldd = p.stride_d[g];
  // This thread's output value (u, c) of the pass from m0: its row and column. Split K: element
  // threadIdx.x + 128 u of the block's 8 kTiles x 16 sums (c = 0 only); else the lane's own
  // accumulator c of mma tile u.
  static_assert(8 * kRows == kWarps * 32, "decode GEMM: one split-K sum per thread per tile");
  auto coord = [&](int m0, int u, int c, int& m, int& col) {
    if constexpr (kSplitK) {
      const int i = threadIdx.x + u * kWarps * 32;
      m = m0 + i / kRows;
      col = n0 + i % kRows;
    } else {
      m = m0 + 8 * u + 2 * q + (c & 1);
      col = n0 + r + 8 * (c >> 1);
    }
  };

  for (int m0 = 0; m0 < m_rows; m0 += kTiles * 8) {
    // fp8: the scales of the values this thread stores, used only at the stores and loaded
    // after the pass's first token loads (warp_sums), so that neither they nor their addresses
    // hold up the weight and token loads (the other placements measured slower:
    // docs/kernels/decode.md). Value (u, c): row scale [u][c % 2] (split K: [u][0]), column
    // scale [c / 2] (split K: [0]).
    float row_scale[kTiles][kSplitK ? 1 : 2], col_scale[2];
    auto load_scales = [&] {
      if constexpr (kScaledOutput) {
#pragma unroll
        for (int u = 0; u < kTiles; ++u)
#pragma unroll
          for (int c = 0; c < (kSplitK ? 1 : 2); ++c) {
            int m, col;
            coord(m0, u, c, m, col);
            row_scale[u][c] = m < m_rows ? __ldg(sfa + m) : 0.f;
          }
        t.load_col_scales(p, col_scale);
      }
    };
    float acc[kTiles][4] = {};
    warp_sums<Tile, kTiles>(t, a, lda, kBlockScaled ? sfa : nullptr, m0, m_rows, w, preloaded, acc,
                            load_scales);
    preloaded = false;
    auto store = [&](int u, int c, int m, int col, float v) {
      if constexpr (kScaledOutput) v *= row_scale[u][kSplitK ? 0 : c & 1] * col_scale[kSplitK ? 0 : c >> 1];
      d[int64_t(m) * ldd + col] = to_out<Out>(v);
    };
    if constexpr (kSplitK) {
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        partial[warp][8 * u + 2 * q][r] = acc[u][0];
        partial[warp][8 * u + 2 * q + 1][r] = acc[u][1];
        partial[warp][8 * u + 2 * q][r + 8] = acc[u][2];
        partial[warp][8 * u + 2 * q + 1][r + 8] = acc[u][3];
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        int m, col;
        coord(m0, u, 0, m, col);
        if (m < m_rows && col < n) {
          float v = 0.f;
#pragma unroll
          for (int ww = 0; ww < kWarps; ++ww) v += partial[ww][m - m0][col - n0];
          store(u, 0, m, col, v);
        }
      }
      __syncthreads();  // `partial` is reused by the next pass
    } else {
#pragma unroll
      for (int u = 0; u < kTiles; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          int m, col;
          coord(m0, u, c, m, col);
          if (m < m_rows && col < n) store(u, c, m, col, acc[u][c]);
        }
    }
  }
}

// Before the wait for the previous kernel (PDL), a warp reads the active-group list, its
// group's shapes and pointers and issues its first batch of weight loads: all written by
// routing, two or more launches back, so complete and visible once this grid runs (launch.cuh).
// The weight stream thus starts while the previous kernel (expand or activation) finishes.
// kMinBlocks > 0: at most 65536 / (128 * kMinBlocks) registers per thread, so that more
// blocks, and more weight loads, are in flight per SM (DecodeGemm::run says when).
template <class In, class Out, bool kBlockScaled, bool kSplitK, int kTiles, int kBatch, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) decode_gemm_kernel(Params p) {
  using Tile = WarpTile<In, kBlockScaled, kSplitK, kBatch>;
  __shared__ float partial[kSplitK ? kWarps : 1][kTiles * 8][kRows + 1];
  const int active = p.active_groups[0];
  typename Tile::Weights w;
  bool preloaded = false;
  if (int(blockIdx.y) < active) {
    const Tile first(p, p.active_groups[1 + blockIdx.y]);
    if (first.has_columns()) {
      first.load_weights(first.first_step(), w);
      preloaded = true;
    }
  }
  pdl_begin();
  for (int y = blockIdx.y; y < active; y += gridDim.y) {  // gridDim.y is capped at 65535
    const Tile t(p, p.active_groups[1 + y]);
    // Split K: the same for the whole block (it syncs); else per warp.
    if (t.has_columns())
      group_tile<Out, Tile, kTiles>(p, t, w, preloaded, partial);
    preloaded = false;
  }
}

}  // namespace decode

// kTokens, kColumns: the catalog's tile_m and tile_n (cmake/catalog.py "decode" rows). 16
// columns per block: split K over its warps (for few, long tiles: more blocks to fill the
// SMs); 64: a warp per 16 columns over all of K (for many tiles: no block-wide sum).
template <class In, class Out, bool kBlockScaled, int kTokens, int kColumns>
struct DecodeGemm {
  static_assert(kTokens % 8 == 0, "decode GEMM: tokens per pass in multiples of 8");
  static_assert(kColumns == decode::kRows || kColumns == decode::kRows * decode::kWarps,
                "decode GEMM: 16 (split K) or 64 (a warp each) output columns per block");
  static constexpr int kTiles = kTokens / 8;
  static constexpr bool kSplitK = kColumns == decode::kRows;
  static constexpr int64_t kDenseMaxKBytes = 4096;
  static constexpr int kWholeSteps = 6;

  static size_t workspace_size(int, int) { return 0; }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (a.n <= 0 || a.max_active_groups <= 0 || !a.active_groups) {
      snprintf(err, errlen, "decode GEMM: needs N, the active-group list and its bound");
      return MOEK_INVALID_ARGUMENT;
    }
    if (std::is_same_v<In, __nv_fp8_e4m3> && !kBlockScaled && (!a.ptr_sfa || !a.sfb_base)) {
      snprintf(err, errlen, "decode GEMM (fp8): needs the row scales and the weight scales");
      return MOEK_INVALID_ARGUMENT;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    decode::Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b,
                     a.stride_b, a.ptr_d, a.stride_d, a.ptr_sfa, a.ptr_sfb, a.sfb_base, a.n,
                     a.sfb_per_channel};
    const dim3 grid(static_cast<unsigned>((a.n + kColumns - 1) / kColumns),
                    static_cast<unsigned>(a.max_active_groups < 65535 ? a.max_active_groups
                                                                      : 65535));
    // 8-token split-K tiles over short K (at most 4 KB: 8 K steps per warp): six blocks per
    // SM (80 registers, no spills) instead of five, so a one-token GEMM1 of Qwen3-30B-A3B
    // (768 blocks) is one wave. Long K keeps the default, whose registers pay there
    // (measurements: docs/kernels/decode.md).
    const int64_t k_bytes = a.k * int64_t(sizeof(In));
    auto* kernel = decode::decode_gemm_kernel<In, Out, kBlockScaled, kSplitK, kTiles, 2, 0>;
    if constexpr (kSplitK && kTiles == 1)
      if (k_bytes <= kDenseMaxKBytes)
        kernel = decode::decode_gemm_kernel<In, Out, kBlockScaled, kSplitK, kTiles, 2, 6>;
    // 64-column tiles over short K (a warp's K in at most kWholeSteps steps: fp8 K <= 768,
    // 16-bit K <= 384): each warp requests all its weights before the PDL wait, if the whole
    // grid is resident at once (214 registers: two blocks per SM); with two waves it is slower
    // (docs/kernels/decode.md).
    if constexpr (!kSplitK) {
      auto* whole = decode::decode_gemm_kernel<In, Out, kBlockScaled, kSplitK, kTiles, kWholeSteps, 0>;
      static const int per_sm = [whole] {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, whole, decode::kWarps * 32, 0) == cudaSuccess)
          return n;
        cudaGetLastError();  // not sticky: clear it, and never pick the whole-K kernel
        return 0;
      }();
      const int64_t steps = (k_bytes + decode::kKBytes - 1) / decode::kKBytes;
      if (steps > 2 && steps <= kWholeSteps &&
          int64_t(grid.x) * grid.y <= int64_t(per_sm) * a.sm_count)
        kernel = whole;
    }
    const cudaError_t e = launch(kernel, grid, decode::kWarps * 32, 0, a.stream, p);
    if (e != cudaSuccess) {
      snprintf(err, errlen, "decode GEMM launch: %s", cudaGetErrorString(e));
      return MOEK_CUDA_ERROR;
    }
    return MOEK_OK;
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size,
      static_cast<int>(sizeof(float) * (kSplitK ? decode::kWarps : 1) * kTiles * 8 * (decode::kRows + 1)),
      false};
};

}  // namespace moe_kernels
