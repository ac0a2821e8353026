// A grouped GEMM for 4-bit weights at a few rows per expert (the catalog's "decode" schedule
// with INT4 or E2M1 weights): the time is the 4-bit weight bytes, read once, dequantized in
// registers. Tokens come 16-bit (W4A16) or as E4M3 with a scale per row (W4A8: the values
// widened exactly to the 16-bit type by the step that quantized them, the row's scale applied
// to the output), so the MMAs are 16-bit either way and every product is exact.
//
// Two block shapes (the catalog's tile_n): 16 output columns (weight rows) of one expert, its
// 4 warps splitting K and adding their partial sums in shared memory (for few, long tiles);
// or 64 columns, each warp 16 of them over all of K with its next weight batch requested
// before it uses the current one (for many tiles). mma.sync m16n8k16 with the weights as A
// (16 rows) and 8 tokens as its N, in the hidden dtype, fp32 accumulation.
//
// K order: lane q (= lane % 4) of a warp reads 16 contiguous bytes of each of its two weight
// rows per K step of 128 values: values 32q .. 32q + 31 of the step, one scale group (groups
// are 32 or more and K is a multiple of 32). mma t (0..7) of the step takes values
// 4t .. 4t + 3 of the lane's 32 as its k = {2q, 2q + 1, 2q + 8, 2q + 9}; the tokens are read
// in the same order, so the sums are those of the natural order.
//
// Dequantization: INT4 (two's complement nibbles) as CUTLASS converts it (the nibble put into
// a 16-bit float of value 128 + (q ^ 8), minus 136); E2M1 by a byte lookup (dequant8). Then times the
// group's scale ([K/g, N] in the hidden dtype) plus, for asymmetric INT4, its zero term (same
// layout), rounded once to the hidden dtype (one fma; without zero terms the value the
// prefill kernels' mainloop computes too). Scaling each K step's fp32 sums instead (fewer
// instructions per weight byte) measured slower (docs/kernels/decode.md).
//
// Design, the rule that picks it, and the variants measured: docs/kernels/decode.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <type_traits>

#include "gemm/decode_gemm.cuh"  // load_stream, word, mma, to_out
#include "gemm/grouped_gemm.h"
#include "launch.cuh"

namespace moe_kernels {
namespace decode_w4 {

constexpr int kWarps = 4;       // per block
constexpr int kRows = 16;       // weight rows (output columns) per warp: one mma M
constexpr int kStepK = 128;     // K values per warp step (64 bytes of each weight row)
constexpr int kBatch = 4;       // split K: the K steps whose weight loads a warp issues before using any
constexpr int kWideBatch = 2;   // 64 columns: K steps per batch, two batches in flight

struct Int4 {};
struct E2M1 {};

struct Params {
  const int32_t* problem_shapes;  // [G][3] = (M, N, K)
  const int32_t* active_groups;   // [0]: how many groups have rows; [1..]: which
  const void* const* ptr_a;
  const int64_t* stride_a;
  const void* const* ptr_b;
  const int64_t* stride_b;        // in 4-bit elements
  void* const* ptr_d;
  const int64_t* stride_d;
  const float* const* ptr_sfb;    // 16-bit scales [K / group, N] per group
  const float* const* ptr_sfa;    // E4M3 tokens: each row's scale, per group (else unused)
  const unsigned short* zero;     // 16-bit zero terms [G][K / group, N], or null
  int group;                      // scale group along K
};

using decode::load_stream;
using decode::word;

template <class T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  T2 v = __hmul2(reinterpret_cast<const T2&>(a), reinterpret_cast<const T2&>(b));
  return reinterpret_cast<uint32_t&>(v);
}

template <class T>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  T2 v = __hfma2(reinterpret_cast<const T2&>(a), reinterpret_cast<const T2&>(b), reinterpret_cast<const T2&>(c));
  return reinterpret_cast<uint32_t&>(v);
}

template <class T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  T2 v = __hsub2(reinterpret_cast<const T2&>(a), reinterpret_cast<const T2&>(b));
  return reinterpret_cast<uint32_t&>(v);
}

// Byte j of x: its low nibble to bits 0-3, its high nibble to bits 16-19, the rest zero.
__device__ __forceinline__ uint32_t spread_byte(uint32_t x, uint32_t x_shifted, int j) {
  uint32_t r;
  const uint32_t select = 0xF4F0u + 0x101u * j;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(x_shifted), "r"(select));
  return r;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t select) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(select));
  return r;
}

// Eight INT4 values (value i in bits 4i..4i+3) -> four pairs in T of q + bias (136 or 1032),
// exactly, value 2j low in out[j]: dequant8 before its subtraction.
template <class T>
__device__ __forceinline__ void int4_raw8(uint32_t x, uint32_t (&out)[4]) {
  constexpr uint32_t kMagic8 = std::is_same_v<T, __nv_bfloat16> ? 0x43084308u : 0x64086408u;
  const uint32_t xs = x >> 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // (v & 0x000F000F) ^ magic as one lop3 (0x6A = (a & b) ^ c): written as C, ptxas emits two,
    // an instruction holds only one immediate.
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(out[j]) : "r"(spread_byte(x, xs, j)), "n"(0x000F000F), "r"(kMagic8));
  }
}

// Eight 4-bit values (value i in bits 4i..4i+3) -> four pairs in T (value 2j low in out[j]).
template <class T, class W>
__device__ __forceinline__ void dequant8(uint32_t x, uint32_t (&out)[4]) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (std::is_same_v<W, Int4>) {
    // 16-bit floats whose low mantissa bits hold q ^ 8 at a fixed exponent: value base + (q +
    // 8) (int4_raw8); subtracting base + 8 leaves q exactly.
    constexpr uint32_t kBias = kBf16 ? 0x43084308u : 0x64086408u;  // 136 : 1032
    int4_raw8<T>(x, out);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = sub2<T>(out[j], kBias);
  } else {
    // E2M1 s|e1 e0|m by lookup: the bytes of the eight magnitudes' 16-bit values (0, 0.5, 1,
    // 1.5, 2, 3, 4, 6) by the low three bits, the high byte from the positive or the negative
    // table by the sign bit (prmt picks per byte), then the bytes paired into values. fp16's
    // low bytes are all zero. Exact; checked against PyTorch on the CPU (emulating prmt).
    constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;  // bf16 low bytes
    constexpr uint32_t kHi0 = kBf16 ? 0x3F3F3F00u : 0x3E3C3800u, kHi1 = kBf16 ? 0x40404040u : 0x46444240u;
    const uint32_t index = x & 0x77777777u;
    const uint32_t pick = ((x >> 1) & 0x44444444u) | 0x32103210u;  // byte i: positive i, negative i + 4
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // values 4h .. 4h + 3: prmt reads the low half of its selector
      const uint32_t i = index >> (16 * h), p = pick >> (16 * h);
      const uint32_t hi = prmt(prmt(kHi0, kHi1, i), prmt(kHi0 | 0x80808080u, kHi1 | 0x80808080u, i), p);
      if constexpr (kBf16) {
        const uint32_t lo = prmt(kLo0, kLo1, i);
        out[2 * h] = prmt(lo, hi, 0x5140u);
        out[2 * h + 1] = prmt(lo, hi, 0x7362u);
      } else {
        out[2 * h] = prmt(hi, 0u, 0x1404u);
        out[2 * h + 1] = prmt(hi, 0u, 0x3424u);
      }
    }
  }
}

// Two E4M3 values (the low 16 bits of v, the first in the low byte) as a pair of T, exactly:
// fp16 by the hardware's conversion; bf16 by placing the code's exponent and mantissa in a
// bf16's lowest exponent bits and top mantissa bits (a subnormal for E4M3's subnormals) and
// multiplying by 2^120, the difference of the two biases.
template <class T>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t v) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFFu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const uint32_t spread = (v & 0xFFu) | ((v & 0xFF00u) << 8);  // bytes to bits 0-7 and 16-23
    return mul2<T>(((spread & 0x007F007Fu) << 4) | ((spread & 0x00800080u) << 8), 0x7B807B80u);
  }
}

// A lane's 32 token values from `src` (zeros where !ok) as 16-bit pairs: x[c] word j holds
// values 8c + 2j, 8c + 2j + 1: 64 bytes of T (W4A8's E4M3 values come widened to T by the
// step that quantized them, GemmKernelOps::wide_fp8_tokens).
template <class T>
__device__ __forceinline__ void load_tokens(const char* src, bool ok, uint4 (&x)[4]) {
  const uint4* v = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = ok ? __ldg(v + c) : make_uint4(0, 0, 0, 0);
}

// The weights a warp reads: 16 rows (n0 ..) of group g.
template <class T>
struct WeightTile {
  int g, n, k, n0, steps;
  bool row_ok[2];
  const char* wrow[2];
  const unsigned short* scale;  // 16-bit scales [K / group, N]
  const unsigned short* zero;   // zero terms in the same layout, or null
  int group;

  __device__ __forceinline__ WeightTile(const Params& p, int group_index, int first_row) : g(group_index) {
    n = p.problem_shapes[3 * g + 1];
    k = p.problem_shapes[3 * g + 2];
    n0 = first_row;
    steps = (k + kStepK - 1) / kStepK;
    const int r = (threadIdx.x & 31) >> 2;
    const char* wbase = static_cast<const char*>(p.ptr_b[g]);
    const int64_t ldw = p.stride_b[g] / 2;  // bytes per weight row
    row_ok[0] = n0 + r < n;
    row_ok[1] = n0 + r + 8 < n;
    wrow[0] = wbase + (n0 + r) * ldw;
    wrow[1] = wbase + (n0 + r + 8) * ldw;
    scale = reinterpret_cast<const unsigned short*>(p.ptr_sfb[g]);
    group = p.group;
    zero = p.zero ? p.zero + int64_t(g) * (k / group) * n : nullptr;
  }
  __device__ __forceinline__ bool has_rows() const { return n0 < n; }

  // The lane's weights, their scales and zero terms (broadcast to both halves) of steps s0,
  // s0 + kStride, ... (kN of them); zeros past K or N, and without zero terms.
  template <int kN, int kStride>
  __device__ __forceinline__ void load(int s0, uint4 (&w)[kN][2], uint32_t (&sc)[kN][2],
                                       uint32_t (&zr)[kN][2]) const {
    const int r = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int s = s0 + i * kStride;
      const int kk = s * kStepK + 32 * q;  // the lane's first K value of step s
      const bool in_k = s < steps && kk < k;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = in_k && row_ok[j];
        w[i][j] = ok ? decode::load_stream_l2_256(wrow[j] + kk / 2) : make_uint4(0, 0, 0, 0);
        const int64_t at = int64_t(kk / group) * n + n0 + r + 8 * j;
        const unsigned short bits = ok ? __ldg(scale + at) : 0;
        const unsigned short zbits = ok && zero ? __ldg(zero + at) : 0;
        sc[i][j] = bits * 0x10001u;
        zr[i][j] = zbits * 0x10001u;
      }
    }
  }
};

// The tokens a warp multiplies (group g's rows, as many as m_rows) and where its sums go: D,
// each sum times its row's scale for E4M3 tokens.
template <class In, class T>
struct TokenRows {
  static constexpr bool kScaledRows = sizeof(In) == 1;
  const char* a;
  int64_t lda;
  int m_rows;
  T* d;
  int64_t ldd;
  const float* sfa;
  // Rows of T either way: W4A8's E4M3 values come widened (GemmKernelOps::wide_fp8_tokens).
  __device__ __forceinline__ TokenRows(const Params& p, int g)
      : a(static_cast<const char*>(p.ptr_a[g])), lda(p.stride_a[g] * int64_t(sizeof(T))),
        m_rows(p.problem_shapes[3 * g]), d(static_cast<T*>(p.ptr_d[g])), ldd(p.stride_d[g]),
        sfa(kScaledRows ? p.ptr_sfa[g] : nullptr) {}
  __device__ __forceinline__ void store(int m, int col, float v) const {
    if constexpr (kScaledRows) v *= sfa[m];
    d[int64_t(m) * ldd + col] = decode::to_out<T>(v);
  }
};

// acc += the lane's share of (weights of steps s0, s0 + kStride, ... (kN of them)) x (tokens
// m0 + 8u + r), dequantizing the weights in registers.
template <class In, class T, class W, int kTiles, int kN, int kStride>
__device__ __forceinline__ void multiply(const WeightTile<T>& t, const TokenRows<In, T>& x_rows, int m0, int s0,
                                         const uint4 (&w)[kN][2], const uint32_t (&sc)[kN][2],
                                         const uint32_t (&zr)[kN][2], float (&acc)[kTiles][4]) {
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int s = s0 + i * kStride;
    if (s >= t.steps) break;  // the same for the whole warp
    const int kk = s * kStepK + 32 * q;
    // Tokens m0 + 8u + r, values kk .. kk + 31; zeros past K or the rows.
    uint4 x[kTiles][4];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      const int m = m0 + 8 * u + r;
      const bool ok = kk < t.k && m < x_rows.m_rows;
      load_tokens<T>(x_rows.a + (ok ? m * x_rows.lda + int64_t(kk) * sizeof(T) : 0), ok, x[u]);
    }
    // Dequantize the lane's 32 values of rows r and r + 8: pair j of word c is values
    // 8c + 2j, 8c + 2j + 1.
    uint32_t wv[2][16];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t out[4];
        dequant8<T, W>(word(w[i][j], c), out);
#pragma unroll
        for (int e = 0; e < 4; ++e) wv[j][4 * c + e] = fma2<T>(out[e], sc[i][j], zr[i][j]);
      }
#pragma unroll
    for (int tt = 0; tt < 8; ++tt) {
      const uint32_t fa[4] = {wv[0][2 * tt], wv[1][2 * tt], wv[0][2 * tt + 1], wv[1][2 * tt + 1]};
#pragma unroll
      for (int u = 0; u < kTiles; ++u)
        decode::mma<T>(acc[u], fa, word(x[u][tt / 2], 2 * (tt % 2)), word(x[u][tt / 2], 2 * (tt % 2) + 1));
    }
  }
}

// One block of 16 columns: its 4 warps take K steps warp, warp + 4, ... of the tile's 16
// weight rows for all of group g's tokens, in passes of 8 * kTiles, and add their sums in
// shared memory. In: the tokens' element type; T: the MMAs' and the output's.
template <class In, class T, class W, int kTiles>
__device__ __forceinline__ void split_k_tile(const Params& p, const WeightTile<T>& t,
                                             float (&partial)[kWarps][kTiles * 8][kRows + 1]) {
  const int n = t.n, n0 = t.n0, steps = t.steps;
  const TokenRows<In, T> x_rows(p, t.g);
  const int m_rows = x_rows.m_rows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, q = lane & 3;

  for (int m0 = 0; m0 < m_rows; m0 += 8 * kTiles) {
    float acc[kTiles][4] = {};
    for (int s0 = warp; s0 < steps; s0 += kWarps * kBatch) {
      uint4 w[kBatch][2];
      uint32_t sc[kBatch][2], zr[kBatch][2];
      t.template load<kBatch, kWarps>(s0, w, sc, zr);
      multiply<In, T, W, kTiles, kBatch, kWarps>(t, x_rows, m0, s0, w, sc, zr, acc);
    }
    // c0: (row r, token 2q), c1: (r, 2q + 1), c2: (r + 8, 2q), c3: (r + 8, 2q + 1).
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      partial[warp][8 * u + 2 * q][r] = acc[u][0];
      partial[warp][8 * u + 2 * q + 1][r] = acc[u][1];
      partial[warp][8 * u + 2 * q][r + 8] = acc[u][2];
      partial[warp][8 * u + 2 * q + 1][r + 8] = acc[u][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTiles * 8 * kRows; i += kWarps * 32) {
      const int m = m0 + i / kRows, col = n0 + i % kRows;
      if (m < m_rows && col < n) {
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) v += partial[ww][i / kRows][i % kRows];
        x_rows.store(m, col, v);
      }
    }
    __syncthreads();  // `partial` is reused by the next pass
  }
}

// One warp of a 64-column block: its 16 weight rows over all of K for all of group g's
// tokens, in passes of 8 * kTiles. Weight batches of kWideBatch steps alternate between two
// register sets: the next batch is requested before the current one is multiplied, so a
// warp always has loads in flight. No shared memory, no block barrier.
template <class In, class T, class W, int kTiles>
__device__ __forceinline__ void wide_tile(const Params& p, const WeightTile<T>& t) {
  constexpr int kB = kWideBatch;
  const int n = t.n, n0 = t.n0, steps = t.steps;
  const TokenRows<In, T> x_rows(p, t.g);
  const int m_rows = x_rows.m_rows;
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;

  for (int m0 = 0; m0 < m_rows; m0 += 8 * kTiles) {
    float acc[kTiles][4] = {};
    uint4 wa[kB][2], wb[kB][2];
    uint32_t sa[kB][2], za[kB][2], sb[kB][2], zb[kB][2];
    t.template load<kB, 1>(0, wa, sa, za);
    for (int s0 = 0; s0 < steps; s0 += 2 * kB) {
      if (s0 + kB < steps) t.template load<kB, 1>(s0 + kB, wb, sb, zb);
      multiply<In, T, W, kTiles, kB, 1>(t, x_rows, m0, s0, wa, sa, za, acc);
      if (s0 + kB >= steps) break;
      if (s0 + 2 * kB < steps) t.template load<kB, 1>(s0 + 2 * kB, wa, sa, za);
      multiply<In, T, W, kTiles, kB, 1>(t, x_rows, m0, s0 + kB, wb, sb, zb, acc);
    }
    // c0: (row r, token 2q), c1: (r, 2q + 1), c2: (r + 8, 2q), c3: (r + 8, 2q + 1).
#pragma unroll
    for (int u = 0; u < kTiles; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + 8 * u + 2 * q + (e & 1), col = n0 + r + 8 * (e >> 1);
        if (m < m_rows && col < n) x_rows.store(m, col, acc[u][e]);
      }
  }
}

// kColumns: output columns per block, 16 (split K) or 64 (a warp per 16).
template <class In, class T, class W, int kTiles, int kColumns>
__global__ void __launch_bounds__(kWarps * 32) decode_w4a16_kernel(Params p) {
  static_assert(kColumns == kRows || kColumns == kRows * kWarps, "4-bit decode: 16 or 64 columns per block");
  constexpr bool kSplitK = kColumns == kRows;
  __shared__ float partial[kSplitK ? kWarps : 1][kSplitK ? kTiles * 8 : 1][kRows + 1];
  // Unlike the 16-bit/FP8 decode kernel, no weights are requested before the wait for the
  // previous kernel: that, and batches of 8 K steps, measured slower (docs/kernels/decode.md).
  pdl_begin();
  const int active = p.active_groups[0];
  const int first_row = blockIdx.x * kColumns + (kSplitK ? 0 : kRows * (threadIdx.x >> 5));
  for (int y = blockIdx.y; y < active; y += gridDim.y) {  // gridDim.y is capped at 65535
    const WeightTile<T> t(p, p.active_groups[1 + y], first_row);
    if constexpr (kSplitK) {
      if (t.has_rows())  // the same for the whole block (it syncs)
        split_k_tile<In, T, W, kTiles>(p, t, partial);
    } else if (t.has_rows()) {  // per warp
      wide_tile<In, T, W, kTiles>(p, t);
    }
  }
}

// What the 4-bit decode and tiled GEMMs share on the host: the argument check (scale groups of
// 32 or more dividing K; N a multiple of n_multiple) and the launch over (N / rows) x groups.
template <class In>
inline int check_args(const GroupedGemmArgs& a, const char* what, int n_multiple, char* err, size_t errlen) {
  if (a.n <= 0 || a.max_active_groups <= 0 || !a.active_groups || !a.ptr_sfb ||
      (sizeof(In) == 1 && !a.ptr_sfa)) {
    snprintf(err, errlen, "%s: needs N, the active-group list, the weight scales (and the E4M3 tokens' row "
             "scales)", what);
    return MOEK_INVALID_ARGUMENT;
  }
  if (a.weight_group < 32 || a.weight_group % 32 || a.k % 32 || a.k % a.weight_group || a.n % n_multiple) {
    snprintf(err, errlen, "%s: scale group %d and K=%lld must be multiples of 32 (the group dividing K), "
             "N=%lld a multiple of %d", what, a.weight_group, (long long)a.k, (long long)a.n, n_multiple);
    return MOEK_UNSUPPORTED;
  }
  return MOEK_OK;
}

// Grid: (N / rows_per_block) x groups x token_splits (blockIdx.z: which of an expert's token
// tiles a block takes, for kernels that split them).
template <class Kernel>
inline int launch_groups(Kernel kernel, const GroupedGemmArgs& a, int rows_per_block, int threads,
                         const char* what, char* err, size_t errlen, int token_splits = 1) {
  const Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                 a.stride_d, a.ptr_sfb, a.ptr_sfa, static_cast<const unsigned short*>(a.zero_base),
                 a.weight_group};
  const dim3 grid(static_cast<unsigned>((a.n + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>(a.max_active_groups < 65535 ? a.max_active_groups : 65535),
                  static_cast<unsigned>(token_splits));
  const cudaError_t e = launch(kernel, grid, threads, 0, a.stream, p);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "%s launch: %s", what, cudaGetErrorString(e));
    return MOEK_CUDA_ERROR;
  }
  return MOEK_OK;
}

}  // namespace decode_w4

// In: the tokens' element type (T, or E4M3 for W4A8); T: the MMAs' and the output's (bf16,
// fp16). kTokens: the catalog's tile_m (tokens per pass, a multiple of 8); kColumns: its
// tile_n, output columns per block (16: split K; 64: a warp per 16 columns).
template <class In, class T, class W, int kTokens, int kColumns>
struct DecodeW4A16 {
  static_assert(kTokens % 8 == 0, "W4A16 decode GEMM: tokens per pass in multiples of 8");
  static constexpr int kTiles = kTokens / 8;
  static constexpr bool kSplitK = kColumns == decode_w4::kRows;

  static size_t workspace_size(int, int) { return 0; }

  // Each lane's 32 values along K share one scale; K in whole 32-value pieces (16 bytes).
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    return decode_w4::check_args<In>(a, "4-bit decode GEMM", 1, err, errlen);
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    using namespace decode_w4;
    return launch_groups(decode_w4a16_kernel<In, T, W, kTiles, kColumns>,
                         a, kColumns, kWarps * 32, "4-bit decode GEMM", err, errlen);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size,
      static_cast<int>(sizeof(float) * (kSplitK ? decode_w4::kWarps * kTiles * 8 : 1) * (decode_w4::kRows + 1)),
      false, sizeof(In) == 1};
};

}  // namespace moe_kernels
