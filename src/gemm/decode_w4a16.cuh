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
// Weights in the fragment layout (python/moe_kernels/quant4.py, which prepare_weights makes once
// at load): per expert, atoms of 16 rows x 128 K values (1 KB), atom (row block a, K step s) at
// byte 1024 (a + N / 16 s), K padded to 128 with zeros. Lane 4g + t of the warp that owns an
// atom reads its 32 bytes (two 16-byte loads; the warp's 1 KB in one piece): word j holds the
// m16n8k16 A registers of the step's 16-deep K block j (rows g and g + 8, k 16j + 2t, + 1 and
// 16j + 2t + 8, + 9), so the converted word is the MMA operand as it is, in the natural K order;
// the tokens' B registers are their 4-byte pairs at the same k.
//
// Dequantization: INT4 (two's complement nibbles, register a_i in nibbles i and i + 4 of its word:
// CUTLASS's value shuffle) as CUTLASS converts it (the nibble put into a 16-bit float of value
// 128 + (q ^ 8), minus 136); E2M1 for W4A16 from the placed layout by masks and shifts
// (E2M1Placed, below), for W4A8 (a_i in nibbles 2i and 2i + 1) by a byte lookup (dequant8). Then times the
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
// E2M1 for 16-bit tensor cores (w4a16_mxfp4): each word's eight codes stored bit by bit
// (quant4.PLACED_BITS) where a mask, or a shift or rotate and a mask, puts register r's pair in
// bf16's sign, lowest two exponent bits and top mantissa bit: the E2M1 value times 2^-126
// exactly (0.5 as a bf16 subnormal), or for fp16, moved by two more instructions, times 2^-14.
// The scales come times 2^126 or 2^14 (quant4.mxfp4_scales).
struct E2M1Placed {};

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

// One word of the fragment layout (the A registers of one 16-deep K block, see above) -> the
// four registers in T, unscaled: INT4 with the value shuffle (a_i from nibbles i and i + 4),
// E2M1 without it (a_i from nibbles 2i and 2i + 1, dequant8's pairs), placed E2M1 by masks and
// shifts (times 2^-126: register r's code pair from bits [m, e0, e1, s] of quant4.PLACED_BITS,
// registers 0-2 the word masked, shifted left by 4 and rotated left by 10, register 3 the word
// shifted left by 6 (m, e0, s) and right by 2 (e1); fp16: e1, e0, m three bits up, times 2^-14).
template <class T, class W>
__device__ __forceinline__ void fragment(uint32_t x, uint32_t (&a)[4]) {
  if constexpr (std::is_same_v<W, E2M1Placed>) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "placed E2M1: 16-bit registers");
    a[0] = x & 0x81C081C0u;
    a[1] = (x << 4) & 0x81C081C0u;
    a[2] = __funnelshift_l(x, x, 10) & 0x81C081C0u;
    a[3] = ((x << 6) & 0x80C080C0u) | ((x >> 2) & 0x01000100u);
    if constexpr (std::is_same_v<T, __half>) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = ((a[i] << 3) | a[i]) & 0x8E008E00u;
    }
  } else if constexpr (std::is_same_v<W, Int4>) {
    constexpr uint32_t kMagic8 = std::is_same_v<T, __nv_bfloat16> ? 0x43084308u : 0x64086408u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t raw;  // (nibbles i, i + 4 at bits 0-3, 16-19) ^ (magic | 8): base + (q + 8)
      asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(raw) : "r"(x >> (4 * i)), "n"(0x000F000F), "r"(kMagic8));
      a[i] = sub2<T>(raw, kMagic8);
    }
  } else {
    dequant8<T, W>(x, a);
  }
}

// A lane's scales (and zero terms) of one K step: per slot, row r in the low half and r + 8 in
// the high half. kSlots: the scale groups of a step, 1 (groups of 128 or more), 2 (64) or 4
// (32); K block j of the step is in slot j * kSlots / 8, known when the kernel is compiled. kZero:
// with INT4 zero terms. The kernel is built for each, so that registers are held only for what
// the weights have.
template <int kSlots, bool kZero>
struct StepScales {
  static_assert(kSlots == 1 || kSlots == 2 || kSlots == 4, "one, two or four scale groups a step");
  uint32_t s[kSlots];
  uint32_t z[kZero ? kSlots : 1];
};

// The pair of 16-bit values in the low (h = 0) or high half of v, in both halves.
__device__ __forceinline__ uint32_t both_halves(uint32_t v, int h) { return prmt(v, 0u, h ? 0x3232u : 0x1010u); }

// The weights a warp reads: the atom of rows n0 .. n0 + 15 of group g (n0 a multiple of 16).
template <class T>
struct WeightTile {
  int g, n, k, n0, steps;
  bool rows_ok;
  const char* atom;              // this lane's 32 bytes of K step 0
  int64_t step_bytes;            // from one K step's atom to the next: N / 16 KB
  const unsigned short* scale;  // 16-bit scales [K / group, N]
  const unsigned short* zero;   // zero terms in the same layout, or null
  int group;
  int steps_per_row;             // groups of 128 or more: K steps per scale row (else 0)

  __device__ __forceinline__ WeightTile(const Params& p, int group_index, int first_row) : g(group_index) {
    n = p.problem_shapes[3 * g + 1];
    k = p.problem_shapes[3 * g + 2];
    n0 = first_row;
    steps = (k + kStepK - 1) / kStepK;
    rows_ok = n0 < n;
    step_bytes = int64_t(n / 16) * 1024;
    atom = static_cast<const char*>(p.ptr_b[g]) + int64_t(n0 / 16) * 1024 + 32 * (threadIdx.x & 31);
    scale = reinterpret_cast<const unsigned short*>(p.ptr_sfb[g]);
    group = p.group;
    steps_per_row = group >= kStepK ? group / kStepK : 0;
    zero = p.zero ? p.zero + int64_t(g) * (k / group) * n : nullptr;
  }
  __device__ __forceinline__ bool has_rows() const { return rows_ok; }

  // The lane's weights of steps s0, s0 + kStride, ... (kN of them), and their scales and zero
  // terms per slot; zeros past K or N.
  template <int kN, int kStride, int kSlots, bool kZero>
  __device__ __forceinline__ void load(int s0, uint4 (&w)[kN][2], StepScales<kSlots, kZero> (&sc)[kN]) const {
    const int r = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int s = s0 + i * kStride;
      const bool ok = s < steps && rows_ok;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w[i][h] = ok ? decode::load_stream_l2_256(atom + s * step_bytes + 16 * h) : make_uint4(0, 0, 0, 0);
      // The step's first scale row, with no division by the runtime group on the common paths
      // (a division per slot was a seventh of the split-K kernel's instructions for MXFP4).
      const int row0 = kSlots > 1 ? s * kSlots : steps_per_row == 1 ? s : s / steps_per_row;
#pragma unroll
      for (int c = 0; c < kSlots; ++c) {
        const int kk = s * kStepK + c * (kStepK / kSlots);  // the slot's first K value
        const bool in = ok && kk < k;
        const int64_t at = int64_t(row0 + c) * n + n0 + r;
        sc[i].s[c] = in ? uint32_t(__ldg(scale + at)) | (uint32_t(__ldg(scale + at + 8)) << 16) : 0u;
        if constexpr (kZero) sc[i].z[c] = in ? uint32_t(__ldg(zero + at)) | (uint32_t(__ldg(zero + at + 8)) << 16) : 0u;
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
template <class In, class T, class W, int kTiles, int kN, int kStride, int kSlots, bool kZero>
__device__ __forceinline__ void multiply(const WeightTile<T>& t, const TokenRows<In, T>& x_rows, int m0, int s0,
                                         const uint4 (&w)[kN][2], const StepScales<kSlots, kZero> (&sc)[kN],
                                         float (&acc)[kTiles][4]) {
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int s = s0 + i * kStride;
    if (s >= t.steps) break;  // the same for the whole warp
    // Tokens m0 + 8u + r: the pairs at k 16j + 2q and 16j + 2q + 8 of the step (B registers
    // of K block j); zeros past K (whole 32-value pieces) or the rows.
    uint32_t x[kTiles][8][2];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      const int m = m0 + 8 * u + r;
      const char* row = x_rows.a + (m < x_rows.m_rows ? m * x_rows.lda : 0) + int64_t(s * kStepK + 2 * q) * sizeof(T);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool ok = m < x_rows.m_rows && s * kStepK + 16 * j < t.k;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          x[u][j][h] = ok ? __ldg(reinterpret_cast<const uint32_t*>(row + (16 * j + 8 * h) * sizeof(T))) : 0u;
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = j * kSlots / 8;  // j is unrolled: the slot is a register, not a select
      const uint32_t sv = sc[i].s[c], zv = kZero ? sc[i].z[c] : 0u;
      const uint32_t s_lo = both_halves(sv, 0), s_hi = both_halves(sv, 1);
      const uint32_t z_lo = kZero ? both_halves(zv, 0) : 0u, z_hi = kZero ? both_halves(zv, 1) : 0u;
      uint32_t a[4];
      fragment<T, W>(word(w[i][j >> 2], j & 3), a);
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = fma2<T>(a[e], e & 1 ? s_hi : s_lo, e & 1 ? z_hi : z_lo);  // a1, a3: row r + 8
#pragma unroll
      for (int u = 0; u < kTiles; ++u) decode::mma<T>(acc[u], a, x[u][j][0], x[u][j][1]);
    }
  }
}

// One block of 16 columns: its 4 warps take K steps warp, warp + 4, ... of the tile's 16
// weight rows for all of group g's tokens, in passes of 8 * kTiles, and add their sums in
// shared memory. In: the tokens' element type; T: the MMAs' and the output's.
template <class In, class T, class W, int kTiles, int kSlots, bool kZero>
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
      StepScales<kSlots, kZero> sc[kBatch];
      t.template load<kBatch, kWarps>(s0, w, sc);
      multiply<In, T, W, kTiles, kBatch, kWarps>(t, x_rows, m0, s0, w, sc, acc);
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
template <class In, class T, class W, int kTiles, int kSlots, bool kZero>
__device__ __forceinline__ void wide_tile(const Params& p, const WeightTile<T>& t) {
  constexpr int kB = kWideBatch;
  const int n = t.n, n0 = t.n0, steps = t.steps;
  const TokenRows<In, T> x_rows(p, t.g);
  const int m_rows = x_rows.m_rows;
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;

  for (int m0 = 0; m0 < m_rows; m0 += 8 * kTiles) {
    float acc[kTiles][4] = {};
    uint4 wa[kB][2], wb[kB][2];
    StepScales<kSlots, kZero> sa[kB], sb[kB];
    t.template load<kB, 1>(0, wa, sa);
    for (int s0 = 0; s0 < steps; s0 += 2 * kB) {
      if (s0 + kB < steps) t.template load<kB, 1>(s0 + kB, wb, sb);
      multiply<In, T, W, kTiles, kB, 1>(t, x_rows, m0, s0, wa, sa, acc);
      if (s0 + kB >= steps) break;
      if (s0 + 2 * kB < steps) t.template load<kB, 1>(s0 + 2 * kB, wa, sa);
      multiply<In, T, W, kTiles, kB, 1>(t, x_rows, m0, s0 + kB, wb, sb, acc);
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

// kColumns: output columns per block, 16 (split K) or 64 (a warp per 16); kSlots, kZero: StepScales.
template <class In, class T, class W, int kTiles, int kColumns, int kSlots, bool kZero>
__global__ void __launch_bounds__(kWarps * 32, kColumns == kRows ? 4 : 3) decode_w4a16_kernel(Params p) {
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
        split_k_tile<In, T, W, kTiles, kSlots, kZero>(p, t, partial);
    } else if (t.has_rows()) {  // per warp
      wide_tile<In, T, W, kTiles, kSlots, kZero>(p, t);
    }
  }
}

// What the 4-bit decode and tiled GEMMs share on the host: the argument check (scale groups of
// 32 or 64, or a multiple of 128, dividing K; K a multiple of 32; N of 16, whole atoms of the
// fragment layout, and of n_multiple) and the launch over (N / rows) x groups.
template <class In>
inline int check_args(const GroupedGemmArgs& a, const char* what, int n_multiple, char* err, size_t errlen) {
  if (a.n <= 0 || a.max_active_groups <= 0 || !a.active_groups || !a.ptr_sfb ||
      (sizeof(In) == 1 && !a.ptr_sfa)) {
    snprintf(err, errlen, "%s: needs N, the active-group list, the weight scales (and the E4M3 tokens' row "
             "scales)", what);
    return MOEK_INVALID_ARGUMENT;
  }
  const bool group_ok = a.weight_group == 32 || a.weight_group == 64 || (a.weight_group > 0 && a.weight_group % 128 == 0);
  if (!group_ok || a.k % 32 || a.k % a.weight_group || a.n % 16 || a.n % n_multiple) {
    snprintf(err, errlen, "%s: scale group %d must be 32, 64 or a multiple of 128 dividing K=%lld (a multiple of "
             "32), N=%lld a multiple of %d", what, a.weight_group, (long long)a.k, (long long)a.n,
             n_multiple > 16 ? n_multiple : 16);
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
  static constexpr bool kInt4 = std::is_same_v<W, decode_w4::Int4>;  // zero terms are INT4's only

  static size_t workspace_size(int, int) { return 0; }

  // Whole atoms of the fragment layout (N % 16) and scale groups a step holds whole or is inside.
  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    return decode_w4::check_args<In>(a, "4-bit decode GEMM", 1, err, errlen);
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    if (int st = check(a, err, errlen)) return st;
    // Scale groups per K step (check_args: groups of 32, 64 or a multiple of 128).
    if (a.weight_group == 32) return launch_slots<4>(a, err, errlen);
    if (a.weight_group == 64) return launch_slots<2>(a, err, errlen);
    return launch_slots<1>(a, err, errlen);
  }

  template <int kSlots>
  static int launch_slots(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace decode_w4;
    constexpr int kThreads = kWarps * 32;
    const char* what = "4-bit decode GEMM";
    return a.zero_base ? launch_groups(decode_w4a16_kernel<In, T, W, kTiles, kColumns, kSlots, kInt4>, a, kColumns,
                                       kThreads, what, err, errlen)
                       : launch_groups(decode_w4a16_kernel<In, T, W, kTiles, kColumns, kSlots, false>, a, kColumns,
                                       kThreads, what, err, errlen);
  }

  static constexpr GemmKernelOps kOps{
      &run, &check, &workspace_size,
      static_cast<int>(sizeof(float) * (kSplitK ? decode_w4::kWarps * kTiles * 8 : 1) * (decode_w4::kRows + 1)),
      false, sizeof(In) == 1};
};

}  // namespace moe_kernels
