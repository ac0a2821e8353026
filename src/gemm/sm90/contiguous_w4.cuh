// Our own SM90 grouped GEMM for 4-bit weights at many rows per expert: the catalog's "contig"
// schedule with INT4 or E2M1 weights. The weights are converted in shared memory into the
// operand type of an SS wgmma, so the tensor cores run at the tokens' type:
// - W4A16 (w4a16_int4, w4a16_mxfp4): bf16/fp16 tokens; each weight becomes q x scale (+ zero
//   term) rounded to the 16-bit type, as the decode and tiled kernels dequantize it; scale
//   groups of 32 or more (INT4 with or without AWQ's zero terms; MXFP4's powers of two).
// - W4A8 (w4a8_int4, w4a8_mxfp4): E4M3 tokens (one scale per row) on the FP8 tensor cores;
//   each 128-deep K block's fp32 partial sums are promoted with a scale per output column and
//   the tokens' row scales multiply the tile once before it is stored.
//   - INT4 (groups of 128): every INT4 value is an E4M3 value, so the conversion is exact; the
//     column scale is the group's 16-bit scale.
//   - MXFP4 (E2M1 with power-of-two scales per 32): per column and K block, the largest of its
//     four group scales, 2^e_max, is the column scale, and each group's values are converted
//     with their own scale's offset folded in, E4M3(v * 2^(e - e_max)) (the pre-MMA fold).
//     Exact while a column's four group exponents in a block are within 8 of each other
//     (E4M3's subnormals reach 2^-9); smaller groups' values round to E4M3 beyond that.
//
// The frame is the fp8_block kernel's (contiguous_gemm.cuh: one TMA descriptor per operand for
// all experts, tiles of 128 rows by 256 columns taken from a counter, a tile of at most 64 rows
// split by columns between the consumer warpgroups, 16-bit output through shared memory and
// TMA stores), with a K block of 128 bytes of tokens (128 E4M3 or 64 16-bit values) and:
// - B arrives packed in the fragment layout (decode_w4a16.cuh, quant4.py): TMA loads each
//   128-row weight block's eight atoms (their K block's half, or all of it for W4A8) into the
//   top of the block's 16 KB stage buffer, and warps 1-3 of the producer warpgroup expand it in
//   place to the layout wgmma reads (128-byte rows, 128-byte swizzle), a lane's packed word at a
//   time by stmatrix (convert_atom): first the atoms whose rows lie below the packed bytes, then
//   the rest read into registers, a barrier among the three warps, and written. They arrive on
//   `converted[stage]` after a proxy fence. W4A8's tokens come with each 32 columns permuted
//   (GemmKernelOps::permuted_fp8_tokens) so that the 16-bit MMAs' fragment layout is the E4M3
//   MMA's.
// - The weight scales (and zero terms) come by TMA with the stage ([K/g, N] per expert: 256
//   columns by the K block's groups).
// - Tail rows as the fp8_block kernel has them (contig::tail_rows): an expert whose rows end at
//   most kTail past a multiple of 128 multiplies them in its last full tile, as the N of a
//   swap-AB wgmma on the converted weight block, instead of a tile of its own that would
//   stream and convert the weight tile again. A partial last N tile and K block are allowed
//   (gpt-oss's 2880).
// Compiled for sm_90a; docs/kernels/contiguous-w4.md says what has run.
#pragma once

#include "gemm/decode_w4a16.cuh"  // dequant8, fma2: the 4-bit to 16-bit conversion
#include "gemm/sm90/contiguous_gemm.cuh"

namespace moe_kernels::sm90 {
namespace contig_w4 {

using namespace cute;
using contig::kBlockN;
using contig::kBoxBytes;
using contig::kConsumerWarps;
using contig::kHalfM;
using contig::kSchedSlots;
using contig::kThreads;
using contig::kTileM;

// The weight formats (the generated sources name them); kGroup: the W4A8 form's scale group.
struct Int4 {
  static constexpr int kGroup = 128;  // along K: one scale per K block
  using Decode = decode_w4::Int4;
};
struct E2M1 {
  static constexpr int kGroup = 32;  // four scales per K block
  using Decode = decode_w4::E2M1;
};
struct E2M1Placed {  // W4A16: 16-bit tokens (decode_w4::E2M1Placed, quant4.PLACED)
  static constexpr int kGroup = 32;
  using Decode = decode_w4::E2M1Placed;
};

constexpr int kTileN = 256, kBlocksN = kTileN / kBlockN;
constexpr int kStages = 3;
constexpr int kRowBytes = 128;  // of a K block, tokens and converted weights alike (one swizzle row)
constexpr int kConverterWarps = 3;  // warps 1-3 of the producer warpgroup
constexpr int kConvertThreads = 32 * kConverterWarps;
constexpr int kConvertBarrier = 4;  // named barrier id (1, 2: the consumer warpgroups; 3: both)
constexpr int kBlockBytes = kBlockN * kRowBytes;  // 16 KB: one converted weight block of a stage
// Registers: the CTA's 168 per thread split as 224 for the consumers (two 64x128 fp32
// accumulators, and W4A8's partial one) and 56 for the producer warpgroup: at 232/40 the W4A8
// converters spilled loop values (ptxas).
constexpr uint32_t kConsumerRegs = 224;
constexpr uint32_t kProducerRegs = (kThreads * contig::kRegsPerThread - 256 * kConsumerRegs) / 128;

// The MMA's operand type and atom for the tokens' type In.
template <class In>
struct Operand;
// TailMma: the swap-AB product of a converted weight block (the A operand, 64 rows an atom)
// and an expert's tail rows (the N), as the fp8_block kernel multiplies its tails.
template <>
struct Operand<__nv_fp8_e4m3> {
  using Element = cutlass::float_e4m3_t;
  using Mma = SM90_64x128x32_F32E4M3E4M3_SS_TN<>;
  using TailMma = SM90_64x8x32_F32E4M3E4M3_SS_TN<>;  // 8 rows: the consumers' registers hold no more
};
template <>
struct Operand<__nv_bfloat16> {
  using Element = cutlass::bfloat16_t;
  using Mma = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  using TailMma = SM90_64x16x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct Operand<__half> {
  using Element = cutlass::half_t;
  using Mma = SM90_64x128x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
  using TailMma = SM90_64x16x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};

template <class In, class W>
struct Config {
  static constexpr bool kW4A8 = sizeof(In) == 1;
  static constexpr bool kMx = kW4A8 && std::is_same_v<W, E2M1>;  // the W4A8 scale fold
  using Element = typename Operand<In>::Element;
  using TiledMma = decltype(make_tiled_mma(typename Operand<In>::Mma{}));
  using TailMma = decltype(make_tiled_mma(typename Operand<In>::TailMma{}));
  static constexpr int kTail = kW4A8 ? 8 : contig::kTail;  // tail rows at most (TailMma's N)
  static constexpr int kTileK = kRowBytes / sizeof(In);  // K values per block: 128 or 64
  static constexpr int kPackedRowBytes = kTileK / 2;      // 64 or 32
  static constexpr int kPackedBytes = kBlockN * kPackedRowBytes;  // at the top of the block
  static constexpr int kPackedAtomBytes = 16 * kPackedRowBytes;    // 16 rows of the fragment layout
  // Scale rows per K block at most: W4A8's fixed group; W4A16's groups of 32 or more.
  static constexpr int kScaleRows = kW4A8 ? kTileK / W::kGroup : kTileK / 32;
  static constexpr int kStageBytesA = kTileM * kRowBytes, kStageBytesB = kTileN * kRowBytes;
  static constexpr int kOutBytes = 2 * (2 * kTileN / 128) * kBoxBytes;  // 16-bit rows, per warpgroup
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kHalfM>, Int<kTileK>, Int<2 * kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kTileK>, Int<kBlocksN * kStages>>{}));
  using SmemLayoutTail = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                Shape<Int<kTail>, Int<kTileK>, Int<kStages>>{}));
  struct alignas(1024) SharedStorage {
    alignas(1024) uint8_t a[kStages * kStageBytesA];
    alignas(1024) uint8_t b[kStages * kStageBytesB];  // each block: packed at its top, then converted
    alignas(1024) uint8_t a_tail[kStages * kTail * kRowBytes];  // the tail rows, if the tile has them
    alignas(1024) uint8_t out[kOutBytes];
    alignas(128) uint16_t scale[kStages][kScaleRows][kTileN];  // the tile's columns' weight scales
    // W4A16 INT4's zero terms, in the scales' layout (W4A8 takes none: a token of room)
    alignas(128) uint16_t zero[kW4A8 ? 1 : kStages][kW4A8 ? 1 : kScaleRows][kW4A8 ? 8 : kTileN];
    float column_scale[kMx ? kStages : 1][kTileN];  // W4A8 MXFP4: each column's 2^e_max
    uint2 e4m3_of[kMx ? 16 : 1];  // W4A8 MXFP4: E4M3 codes of the eight E2M1 magnitudes times 2^-d
    uint64_t full[kStages];       // TMA bytes landed
    uint64_t converted[kStages];  // the converter warps wrote the stage's weights
    uint64_t empty[kStages];      // consumers done with the stage (one arrive per consumer warp)
    int32_t tile[kSchedSlots];
    uint64_t tile_full[kSchedSlots];
    uint64_t tile_empty[kSchedSlots];  // every consumer and converter warp read it
    // then int32 tile_start[E + 1] and offsets[E + 1], as in the fp8_block kernel
  };
};

struct Params {
  contig::Params base;  // tma_a, tma_tail, tma_d, d, offsets, tile_counter, num_experts, n, k, max_tail
  CUtensorMap tma_w;      // weights in the fragment layout, 5D (encode_fragments), box 8 atoms of a K block
  CUtensorMap tma_scale;  // weight scales [E, K / g, N] 16-bit, box 256 x (the K block's groups) x 1
  CUtensorMap tma_zero;   // W4A16 INT4's zero terms, the same (has_zero)
  const float* row_scale;  // W4A8: [rows], each token row's E4M3 scale
  int64_t rows;
  int group, scale_rows;  // scale group along K; scale rows a K block's box brings
  int slices;             // K slices of 128 per expert (K padded)
  bool has_zero;
};

// Eight 4-bit codes (value i in bits 4i..4i+3, bit 3 its sign) as eight E4M3 bytes (value i
// in byte i): a byte lookup among `pos` (the codes of the values with bit 3 clear, by the low
// three bits) and `neg` (those with it set), then one per byte by bit 3. prmt reads four
// selectors from the low half of its selector register, so values 4-7 go through it shifted.
__device__ __forceinline__ uint2 lookup8(uint32_t x, uint2 pos, uint2 neg) {
  const uint32_t index = x & 0x77777777u;
  // Per value: byte i of the first candidates (selector i) or of the second ones (i + 4).
  const uint32_t pick = ((x >> 1) & 0x44444444u) | 0x32103210u;
  uint2 r;
  uint32_t a, b;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(pos.x), "r"(pos.y), "r"(index));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(b) : "r"(neg.x), "r"(neg.y), "r"(index));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r.x) : "r"(a), "r"(b), "r"(pick));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(pos.x), "r"(pos.y), "r"(index >> 16));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(b) : "r"(neg.x), "r"(neg.y), "r"(index >> 16));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r.y) : "r"(a), "r"(b), "r"(pick >> 16));
  return r;
}

// Four E2M1 codes of one row of a word as its E4M3 bytes, in code order: `spread` puts the row's
// codes in the low nibbles of four bytes (from x and xs = x >> 4), `gather` its magnitudes (from
// xm = x & 0x77777777) in the low half as the lookup's selectors, the magnitude comes from
// `table` (the codes of 0, 0.5, .. 6 at the row's scale offset) and the sign from bit 3. The
// same bytes as lookup8's negative table (the positive one with bit 7 set), for half its prmts.
__device__ __forceinline__ uint32_t e2m1_row_to_e4m3(uint32_t x, uint32_t xs, uint32_t xm, uint2 table,
                                                     uint32_t spread, uint32_t gather) {
  const uint32_t codes = __byte_perm(x, xs, spread);
  const uint32_t magnitude = __byte_perm(table.x, table.y, __byte_perm(xm, 0u, gather));
  return magnitude | ((codes << 4) & 0x80808080u);
}

// INT4 (two's complement): 0..7, then -8..-1 by the low three bits. Exact.
constexpr uint2 kInt4Pos = {0x44403800u, 0x4E4C4A48u};  // 0, 1, 2, 3 | 4, 5, 6, 7
constexpr uint2 kInt4Neg = {0xCACCCED0u, 0xB8C0C4C8u};  // -8, -7, -6, -5 | -4, -3, -2, -1
// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^-d in E4M3 (round to nearest even), d =
// 0..15: exact up to d = 8, all zeros from 13 (computed with PyTorch's float8_e4m3fn).
__device__ __forceinline__ uint2 e2m1_to_e4m3(int d) {
  constexpr uint32_t kTable[16][2] = {
      {0x3c383000u, 0x4c484440u}, {0x34302800u, 0x44403c38u}, {0x2c282000u, 0x3c383430u},
      {0x24201800u, 0x34302c28u}, {0x1c181000u, 0x2c282420u}, {0x14100800u, 0x24201c18u},
      {0x0c080400u, 0x1c181410u}, {0x06040200u, 0x14100c08u}, {0x03020100u, 0x0c080604u},
      {0x02010000u, 0x06040302u}, {0x01000000u, 0x03020201u}, {0x00000000u, 0x02010100u},
      {0x00000000u, 0x01000000u}, {0x00000000u, 0x00000000u}, {0x00000000u, 0x00000000u},
      {0x00000000u, 0x00000000u}};
  return make_uint2(kTable[d][0], kTable[d][1]);
}

// A 16-bit scale as a float.
template <class Out>
__device__ __forceinline__ float scale_value(uint16_t v) {
  if constexpr (std::is_same_v<Out, __half>) return __half2float(__ushort_as_half(v));
  else return __uint_as_float(uint32_t(v) << 16);
}

// W4A8 MXFP4, once a stage before its blocks are converted: each column's largest group scale
// in the K block, 2^e_max, goes to column_scale, and each of its group scales is replaced in
// place by the group's exponent offset d = e_max - e (15: a zero scale, whose values are zeros),
// so a unit's conversion needs one table index instead of the row's shuffles.
template <class Out, class Smem>
__device__ __forceinline__ void fold_scales(Smem& smem, int stage, int t) {
  constexpr int kGroups = kRowBytes / 32;  // E4M3 K values per block over MXFP4's group
  for (int col = t; col < kTileN; col += kConvertThreads) {
    float s[kGroups];
    float s_max = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      s[g] = scale_value<Out>(smem.scale[stage][g][col]);
      s_max = fmaxf(s_max, s[g]);
    }
    // Powers of two (positive): exponents from the bits (2^-127, a float subnormal, has field 0).
    const int e_max = int(__float_as_uint(s_max) >> 23);
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
      smem.scale[stage][g][col] = s[g] > 0.f ? uint16_t(min(e_max - int(__float_as_uint(s[g]) >> 23), 15)) : 15;
    smem.column_scale[stage][col] = s_max;
  }
}

// Atom a (16 rows) of a 128-row weight block b: this lane's packed bytes of the K block (v[0];
// W4A8 also v[1]: 32 bytes, the whole atom row of its 128 K values), converted to the MMA's type
// and stored by stmatrix at their places in the block's swizzled rows. Matrix i of an x4 store:
// rows 8 (i % 2) .. + 7 of the atom, 16-byte chunk 2c + i / 2, lanes 8i .. 8i + 7 addressing its rows.
// - W4A16: K block of 64 = four 16-deep blocks j, word j of v[0] their A registers (the fragment
//   layout), so a converted word is a whole x4 store (chunks 2j, 2j + 1).
// - W4A8: K block of 128 = four 32-deep blocks c, words 2c and 2c + 1; the tokens come with each
//   32-value block's bytes permuted (slot 4t + i of a row = value {2t, 2t + 1, 2t + 8, 2t + 9}[i],
//   and 16 + the same, written so by the step that quantized them: GemmKernelOps::
//   permuted_fp8_tokens), which makes a converted word pair the E4M3 A registers of a k32 block.
template <class In, class Out, class W, class Smem>
__device__ __forceinline__ void convert_atom(uint8_t* block, Smem& smem, const Params& p, int stage, int b, int a,
                                             const uint4 (&v)[2], int lane) {
  using C = Config<In, W>;
  const int g = lane >> 2, col = b * kBlockN + 16 * a + g;  // this lane's columns: col, col + 8
  const int row = 16 * a + 8 * ((lane >> 3) & 1) + (lane & 7);  // the row this lane addresses
  const uint32_t base = cast_smem_ptr_to_uint(block) + row * kRowBytes;
  auto store = [&](int chunk, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    const uint32_t addr = base + ((chunk ^ (row % 8)) * 16);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3) : "memory");
  };
  if constexpr (C::kW4A8) {
    uint2 pos = kInt4Pos, neg = kInt4Neg, pos8 = kInt4Pos;  // MXFP4: per row and group (below)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (C::kMx) {  // group c's tables for each row's offset from its column's largest scale
        pos = smem.e4m3_of[smem.scale[stage][c][col]];  // fold_scales left the offsets there
        pos8 = smem.e4m3_of[smem.scale[stage][c][col + 8]];
      }
      uint32_t r[4];  // a0, a1 of word 2c; a0, a1 of word 2c + 1 (a0: row g, a1: row g + 8)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t x = decode::word(v[c >> 1], 2 * (c & 1) + h);
        if constexpr (C::kMx) {  // E2M1 without the shuffle: nibbles 0, 1, 4, 5 row g; 2, 3, 6, 7 row g + 8
          const uint32_t xs = x >> 4, xm = x & 0x77777777u;
          r[2 * h] = e2m1_row_to_e4m3(x, xs, xm, pos, 0x6240u, 0x0020u);
          r[2 * h + 1] = e2m1_row_to_e4m3(x, xs, xm, pos8, 0x7351u, 0x0031u);
        } else {  // INT4 with the shuffle: nibbles 0, 4, 2, 6 row g; 1, 5, 3, 7 row g + 8
          const uint2 e = lookup8(x, pos, neg);
          r[2 * h] = __byte_perm(e.x, e.y, 0x6240);
          r[2 * h + 1] = __byte_perm(e.x, e.y, 0x7351);
        }
      }
      store(2 * c + (lane >> 4), r[0], r[1], r[2], r[3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int srow = p.group < 64 ? j >> 1 : 0;  // K block j's scale row in the stage (K blocks of 64)
      const uint32_t s_lo = smem.scale[stage][srow][col] * 0x10001u, s_hi = smem.scale[stage][srow][col + 8] * 0x10001u;
      const uint32_t z_lo = p.has_zero ? smem.zero[stage][srow][col] * 0x10001u : 0u;
      const uint32_t z_hi = p.has_zero ? smem.zero[stage][srow][col + 8] * 0x10001u : 0u;
      uint32_t o[4];
      decode_w4::fragment<In, typename W::Decode>(decode::word(v[0], j), o);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = decode_w4::fma2<In>(o[e], e & 1 ? s_hi : s_lo, e & 1 ? z_hi : z_lo);
      store(2 * j + (lane >> 4), o[0], o[1], o[2], o[3]);
    }
  }
}

// One 128-row weight block of a stage (block b of the tile's columns), packed at its top (lane l
// of atom a at kPackedAtomBytes a + 16 l; W4A8: its 32 bytes at + 32 l), expanded in place: the
// atoms whose rows lie below the packed bytes first, then the others' packed bytes read into
// registers, a barrier among the converter warps (their writes overwrite packed bytes), and
// written. Converter warp w takes atoms w, w + 3, w + 6.
template <class In, class Out, class W, class Smem>
__device__ __forceinline__ void convert_block(uint8_t* block, Smem& smem, const Params& p, int stage, int b, int t) {
  using C = Config<In, W>;
  constexpr int kAtoms = kBlockN / 16, kLow = (kBlockBytes - C::kPackedBytes) / (16 * kRowBytes);
  const uint8_t* packed = block + kBlockBytes - C::kPackedBytes;
  const int w = t >> 5, lane = t & 31;
  auto read = [&](int a, uint4 (&v)[2]) {
    const uint8_t* src = packed + a * C::kPackedAtomBytes + (C::kW4A8 ? 32 : 16) * lane;
    v[0] = *reinterpret_cast<const uint4*>(src);
    v[1] = C::kW4A8 ? *reinterpret_cast<const uint4*>(src + 16) : make_uint4(0, 0, 0, 0);
  };
#pragma unroll
  for (int a = w; a < kLow; a += kConverterWarps) {
    uint4 v[2];
    read(a, v);
    convert_atom<In, Out, W>(block, smem, p, stage, b, a, v, lane);
  }
  constexpr int kHigh = (kAtoms - kLow + kConverterWarps - 1) / kConverterWarps;  // high atoms per warp, at most
  uint4 v[kHigh][2];
#pragma unroll
  for (int i = 0; i < kHigh; ++i)
    if (kLow + w + i * kConverterWarps < kAtoms) read(kLow + w + i * kConverterWarps, v[i]);
  asm volatile("bar.sync %0, %1;" ::"n"(kConvertBarrier), "n"(kConvertThreads) : "memory");
#pragma unroll
  for (int i = 0; i < kHigh; ++i)
    if (kLow + w + i * kConverterWarps < kAtoms)
      convert_atom<In, Out, W>(block, smem, p, stage, b, kLow + w + i * kConverterWarps, v[i], lane);
}

template <class In, class Out, class W>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const __grid_constant__ Params p) {
  using C = Config<In, W>;
  using SharedStorage = typename C::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem_raw + sizeof(SharedStorage));
  int32_t* offsets = tile_start + p.base.num_experts + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.converted[s], kConverterWarps);
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kSchedSlots; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.tile_full[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.tile_empty[s], kConsumerWarps + kConverterWarps);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(&p.base.tma_a);
    if (p.base.max_tail > 0) cute::prefetch_tma_descriptor(&p.base.tma_tail);
    cute::prefetch_tma_descriptor(&p.tma_w);
    cute::prefetch_tma_descriptor(&p.tma_scale);
    if (p.has_zero) cute::prefetch_tma_descriptor(&p.tma_zero);
    cute::prefetch_tma_descriptor(&p.base.tma_d);
  }
  pdl_begin();  // the offsets and A (and its row scales) come from the previous kernels

  const int E = p.base.num_experts;
  contig::load_tile_starts(p.base.offsets, E, p.base.max_tail, offsets, tile_start);
  // The last N tile and K block may be partial (gpt-oss: N = 5760 and 2880, K = 2880): the loads
  // past K read zeros, the weight rows past N are the next expert's (computed, never stored),
  // their scales zeros.
  const int n_tiles = (p.base.n + kTileN - 1) / kTileN, k_blocks = (p.base.k + C::kTileK - 1) / C::kTileK;
  const int num_tiles = tile_start[E] * n_tiles;

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp == 0) {  // the loader
      int stage = 0, phase = 0;
      contig::TileSlots slots;
      const int scale_bytes = p.scale_rows * kTileN * int(sizeof(uint16_t));
      for (;;) {
        const int t = contig::take_tile(smem, p.base.tile_counter, slots);
        if (t >= num_tiles) break;
        const contig::Tile tile = contig::tile_at(t, tile_start, offsets, E, n_tiles);
        const int halves = tile.rows > kHalfM ? 2 : 1;
        const bool tail = contig::tail_rows(tile, p.base.max_tail) > 0;
        for (int kb = 0; kb < k_blocks; ++kb) {
          cutlass::arch::ClusterBarrier::wait(&smem.empty[stage], phase ^ 1);
          if (lane == 0) {
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
                &smem.full[stage], halves * (C::kStageBytesA / 2) + (tail ? C::kTail * kRowBytes : 0) +
                                       kBlocksN * C::kPackedBytes + (p.has_zero ? 2 : 1) * scale_bytes);
            const auto hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
            for (int h = 0; h < halves; ++h)
              SM90_TMA_LOAD_2D::copy(&p.base.tma_a, &smem.full[stage], hint,
                                     smem.a + stage * C::kStageBytesA + h * (C::kStageBytesA / 2), kb * kRowBytes,
                                     tile.row0 + h * kHalfM);
            if (tail)
              SM90_TMA_LOAD_2D::copy(&p.base.tma_tail, &smem.full[stage], hint,
                                     smem.a_tail + stage * C::kTail * kRowBytes, kb * kRowBytes, tile.row0 + kTileM);
#pragma unroll
            for (int b = 0; b < kBlocksN; ++b)  // 8 atoms of the fragment layout: K slice kb (W4A8) or half of kb / 2
              SM90_TMA_LOAD_5D::copy(&p.tma_w, &smem.full[stage], hint,
                                     smem.b + stage * C::kStageBytesB + (b + 1) * kBlockBytes - C::kPackedBytes, 0,
                                     C::kW4A8 ? 0 : kb & 1, 0, (tile.n * kTileN + b * kBlockN) / 16,
                                     tile.expert * p.slices + (C::kW4A8 ? kb : kb >> 1));
            const int scale_row = kb * C::kTileK / p.group;
            SM90_TMA_LOAD_3D::copy(&p.tma_scale, &smem.full[stage], hint, &smem.scale[stage][0][0], tile.n * kTileN,
                                   scale_row, tile.expert);
            if constexpr (!C::kW4A8)
              if (p.has_zero)
                SM90_TMA_LOAD_3D::copy(&p.tma_zero, &smem.full[stage], hint, &smem.zero[stage][0][0],
                                       tile.n * kTileN, scale_row, tile.expert);
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
      return;
    }
    // The converters: every stage of every tile, in the order the loader fills them.
    const int t = threadIdx.x - 32;
    if constexpr (C::kMx) {
#pragma unroll
      for (int d = 0; d < 16; ++d)  // constant indices: the table stays in the instructions
        if (t == d) smem.e4m3_of[d] = e2m1_to_e4m3(d);
      asm volatile("bar.sync %0, %1;" ::"n"(kConvertBarrier), "n"(kConvertThreads) : "memory");
    }
    int kseq = 0;
    contig::TileSlots slots;
    for (;;) {
      const int tile = contig::read_tile(smem, slots);
      if (tile >= num_tiles) break;
      for (int kb = 0; kb < k_blocks; ++kb, ++kseq) {
        const int stage = kseq % kStages;
        cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], (kseq / kStages) & 1);
        if constexpr (C::kMx) {
          fold_scales<Out>(smem, stage, t);
          asm volatile("bar.sync %0, %1;" ::"n"(kConvertBarrier), "n"(kConvertThreads) : "memory");
        }
#pragma unroll
        for (int b = 0; b < kBlocksN; ++b)
          convert_block<In, Out, W>(smem.b + stage * C::kStageBytesB + b * kBlockBytes, smem, p, stage, b, t);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the wgmmas
        __syncwarp();
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.converted[stage]);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int half = wg - 1;
  typename C::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<typename C::Element*>(smem.a)), typename C::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<typename C::Element*>(smem.b)), typename C::SmemLayoutB{});
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kHalfM>, Int<kTileN>>{});
  Tensor part = partition_fragment_C(mma, Shape<Int<kHalfM>, Int<kBlockN>>{});  // W4A8: one block's K block
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kHalfM>, Int<kBlockN>>{}));
  const int my_row = get<0>(coord(0));
  // Value i of a 64 x 128 accumulator is column 8 * (i / 4) + 2q + (i & 1), row my_row + 8 *
  // ((i >> 1) & 1) (wgmma's layout): the thread's columns come in 16 pairs.
  const int q = lane & 3;
  static_assert(decltype(size(part))::value == 64, "64x128 fp32 accumulator: 64 values per thread");
  // The tail rows: weight block `half` (two 64-row A operands) x kTail rows of A (the N).
  typename C::TailMma tmma;
  auto tthr = tmma.get_thread_slice(threadIdx.x % 128);
  Tensor tTrA = tthr.make_fragment_A(tthr.partition_A(sB));  // (MMA, 2, k steps, kBlocksN * kStages)
  Tensor tTrB = tthr.make_fragment_B(tthr.partition_B(
      make_tensor(make_smem_ptr(reinterpret_cast<typename C::Element*>(smem.a_tail)), typename C::SmemLayoutTail{})));
  Tensor acc_t = partition_fragment_C(tmma, Shape<Int<kBlockN>, Int<C::kTail>>{});
  // (weight row within the block, tail row) of each of its values
  Tensor coord_t = tthr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<C::kTail>>{}));

  int kseq = 0;
  contig::TileSlots slots;
  for (;;) {
    const int t = contig::read_tile(smem, slots);
    if (t >= num_tiles) break;
    const contig::Tile tile = contig::tile_at(t, tile_start, offsets, E, n_tiles);
    const int tile_rows = min(tile.rows, kTileM);
    const bool split = tile_rows <= kHalfM;
    const int a_half = split ? 0 : half, b_first = split ? half : 0, blocks = split ? 1 : kBlocksN;
    const int tail = contig::tail_rows(tile, p.base.max_tail);  // never with a split tile
    clear(acc);
    clear(acc_t);
    if constexpr (C::kW4A8) {
      for (int kb = 0; kb < k_blocks; ++kb, ++kseq) {
        const int stage = kseq % kStages, phase = (kseq / kStages) & 1;
        cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], phase);
        cutlass::arch::ClusterBarrier::wait(&smem.converted[stage], phase);
        // Each 128-column block's K block into `part`, promoted into acc with its columns' scales.
#pragma unroll
        for (int b = 0; b < kBlocksN; ++b) {
          if (b >= blocks) break;
          warpgroup_fence_operand(part);
          warpgroup_arrive();
          mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
          for (int k = 0; k < size<2>(tCrA); ++k) {
            cute::gemm(mma, tCrA(_, _, k, 2 * stage + a_half), tCrB(_, _, k, kBlocksN * stage + b_first + b), part);
            mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_wait<0>();
          warpgroup_fence_operand(part);
          const int col = (b_first + b) * kBlockN + 2 * q;
#pragma unroll
          for (int j = 0; j < 16; ++j) {  // columns 8j + 2q, 8j + 2q + 1
            float2 s;
            if constexpr (C::kMx) s = *reinterpret_cast<const float2*>(&smem.column_scale[stage][col + 8 * j]);
            else s = contig::unpack2<Out>(*reinterpret_cast<const uint32_t*>(&smem.scale[stage][0][col + 8 * j]));
#pragma unroll
            for (int e = 0; e < 4; ++e) acc(4 * j + e, 0, b) += part(4 * j + e) * ((e & 1) ? s.y : s.x);
          }
        }
        if (tail) {  // weight block `half` x the tail rows, promoted with the block's column scales
          Tensor part_t = partition_fragment_C(tmma, Shape<Int<kBlockN>, Int<C::kTail>>{});
          warpgroup_fence_operand(part_t);
          warpgroup_arrive();
          tmma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
          for (int k = 0; k < size<2>(tTrA); ++k) {
            cute::gemm(tmma, tTrA(_, _, k, kBlocksN * stage + half), tTrB(_, _, k, stage), part_t);
            tmma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_wait<0>();
          warpgroup_fence_operand(part_t);
#pragma unroll
          for (int i = 0; i < size(part_t); ++i) {
            const int col = half * kBlockN + get<0>(coord_t(i));
            float s;
            if constexpr (C::kMx) s = smem.column_scale[stage][col];
            else s = scale_value<Out>(smem.scale[stage][0][col]);
            acc_t(i) += part_t(i) * s;
          }
        }
        __syncwarp();  // the stage's operands and scales are read
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[stage]);
      }
      // The tokens' row scales (rows past the buffer, whose outputs are not stored, read the last).
      const int64_t first = tile.row0 + a_half * kHalfM + my_row;
      const float r0 = p.row_scale[min(first, p.rows - 1)], r1 = p.row_scale[min(first + 8, p.rows - 1)];
#pragma unroll
      for (int b = 0; b < kBlocksN; ++b)
#pragma unroll
        for (int i = 0; i < size(part); ++i) acc(i, 0, b) *= (i & 2) ? r1 : r0;
      if (tail)
#pragma unroll
        for (int i = 0; i < size(acc_t); ++i)
          acc_t(i) *= p.row_scale[min(int64_t(tile.row0) + kTileM + get<1>(coord_t(i)), p.rows - 1)];
    } else {
      // Straight into acc (block b's 64 values at 64b), `nb` blocks a K block, the same wgmmas
      // on every path between arrive and commit; a stage is released once the next one's
      // wgmmas are issued and its own have completed.
      // With tail rows (full tiles only) the tail's wgmmas join each K block's batch, into acc_t.
      auto k_loop = [&](auto nb, auto with_tail) {
        for (int kb = 0; kb < k_blocks; ++kb, ++kseq) {
          const int stage = kseq % kStages, phase = (kseq / kStages) & 1;
          cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], phase);
          cutlass::arch::ClusterBarrier::wait(&smem.converted[stage], phase);
          warpgroup_fence_operand(acc);
          if constexpr (decltype(with_tail)::value) warpgroup_fence_operand(acc_t);
          warpgroup_arrive();
#pragma unroll
          for (int b = 0; b < decltype(nb)::value; ++b) {
            Tensor acc_b = make_tensor(acc.data() + 64 * b, part.layout());
#pragma unroll
            for (int k = 0; k < size<2>(tCrA); ++k)
              cute::gemm(mma, tCrA(_, _, k, 2 * stage + a_half), tCrB(_, _, k, kBlocksN * stage + b_first + b), acc_b);
          }
          if constexpr (decltype(with_tail)::value)
#pragma unroll
            for (int k = 0; k < size<2>(tTrA); ++k)
              cute::gemm(tmma, tTrA(_, _, k, kBlocksN * stage + half), tTrB(_, _, k, stage), acc_t);
          warpgroup_commit_batch();
          warpgroup_wait<1>();  // the previous K block's wgmmas are done: release its stage
          warpgroup_fence_operand(acc);
          if constexpr (decltype(with_tail)::value) warpgroup_fence_operand(acc_t);
          if (kb > 0) {
            __syncwarp();
            if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[(kseq + kStages - 1) % kStages]);
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        if constexpr (decltype(with_tail)::value) warpgroup_fence_operand(acc_t);
        __syncwarp();
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[(kseq + kStages - 1) % kStages]);
      };
      mma.accumulate_ = GMMA::ScaleOut::One;
      tmma.accumulate_ = GMMA::ScaleOut::One;
      if (split) k_loop(Int<1>{}, false_type{});
      else if (tail) k_loop(Int<kBlocksN>{}, true_type{});
      else k_loop(Int<kBlocksN>{}, false_type{});
    }
    if (tail) {  // a few scattered rows: straight from the registers (columns past N not stored)
      const int col0 = tile.n * kTileN + half * kBlockN;
      Out* d = static_cast<Out*>(p.base.d) + (int64_t(tile.row0) + kTileM) * p.base.n + col0;
#pragma unroll
      for (int i = 0; i < size(acc_t); ++i)
        if (get<1>(coord_t(i)) < tail && col0 + get<0>(coord_t(i)) < p.base.n)
          d[get<1>(coord_t(i)) * int64_t(p.base.n) + get<0>(coord_t(i))] = Vec8<Out>::from_float(acc_t(i));
    }
    const int rows = split ? tile_rows : tile_rows - half * kHalfM;
    const int64_t row0 = tile.row0 + (split ? 0 : half * kHalfM);
    uint8_t* out = smem.out + half * (C::kOutBytes / 2);
    contig::store_out<Out>(p.base, acc, out, row0, tile.n * kTileN + b_first * kBlockN, rows, my_row, lane, blocks);
  }
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The weight scales (or zero terms) [E, K / g, N] 16-bit in boxes of 256 columns x box_rows rows
// of one expert: 3D, so that a partial last K block reads zeros past the expert's rows, not the
// next one's.
inline bool encode_scales3d(CUtensorMap* map, const void* base, int64_t experts, int64_t rows, int64_t n,
                            int box_rows) {
  auto fn = contig::encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[3] = {cuuint64_t(n), cuuint64_t(rows), cuuint64_t(experts)};
  const cuuint64_t strides[2] = {cuuint64_t(n) * 2, cuuint64_t(rows) * cuuint64_t(n) * 2};
  const cuuint32_t box[3] = {cuuint32_t(kTileN), cuuint32_t(box_rows), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// 4-bit weights in the fragment layout (quant4.py) [E, S, N / 16, 1024] bytes as 5D (16 bytes,
// half, lane, atom, expert x slice): the 16 bytes of a lane's atom row for K values 64h ..
// 64h + 63 of a slice, lane l's at 32 l + 16 h. Box: 8 atoms (128 rows), all 32 lanes, one half
// (K blocks of 64) or both (128); atoms past N read zeros.
inline bool encode_fragments(CUtensorMap* map, const void* base, int64_t experts, int64_t slices, int64_t n,
                             int halves) {
  auto fn = contig::encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[5] = {16, 2, 32, cuuint64_t(n / 16), cuuint64_t(experts * slices)};
  const cuuint64_t strides[4] = {16, 32, 1024, cuuint64_t(n / 16) * 1024};
  const cuuint32_t box[5] = {16, cuuint32_t(halves), 32, cuuint32_t(kBlockN / 16), 1};
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace contig_w4

// In: the tokens' type (__nv_fp8_e4m3 for W4A8, else Out); Out: the output's and the weight
// scales' type, __nv_bfloat16 or __half; W: contig_w4::Int4 or contig_w4::E2M1.
template <class In, class Out, class W>
struct ContiguousW4 {
  static_assert(sizeof(In) == 1 || std::is_same_v<In, Out>, "contiguous 4-bit GEMM: W4A16 tokens are the output type");
  using Cfg = contig_w4::Config<In, W>;
  using Storage = typename Cfg::SharedStorage;
  static constexpr const char* kWhat = Cfg::kW4A8 ? "contiguous W4A8 GEMM" : "contiguous W4A16 GEMM";

  static size_t smem_bytes(int num_experts) {
    return sizeof(Storage) + sizeof(int32_t) * 2 * (size_t(num_experts) + 1);
  }

  static int registers() { return contig::kernel_registers<contig_w4::gemm_kernel<In, Out, W>>(); }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace contig_w4;
    if (!a.offsets || !a.tile_counter || !a.sfb_base || (Cfg::kW4A8 && !a.sfa_base)) {
      snprintf(err, errlen, "%s: needs the experts' row offsets, a tile counter and the weight scales (W4A8: "
               "and the tokens' row scales)", kWhat);
      return MOEK_INVALID_ARGUMENT;
    }
    if (a.act_out || (a.zero_base && (Cfg::kW4A8 || !std::is_same_v<W, Int4>))) {
      snprintf(err, errlen, "%s: applies no activation and takes zero points only with 16-bit tokens and "
               "INT4 weights", kWhat);
      return MOEK_UNSUPPORTED;
    }
    // W4A8: one scale per K block (INT4) or the four MXFP4 groups the fold expects; W4A16: any
    // group of 32 or more that a K block's groups tile. Rows of 16 bytes for TMA: the packed
    // weights' K / 2, the scales' and the output's N x 2.
    const int g = a.weight_group;
    const bool group_ok = Cfg::kW4A8 ? g == W::kGroup
                                     : g >= 32 && g % 32 == 0 && (g % Cfg::kTileK == 0 || Cfg::kTileK % g == 0);
    if (!group_ok || a.k % g || a.k % 32 || a.n % 16) {
      snprintf(err, errlen, "%s: takes scale groups of %s dividing K, K a multiple of 32 and N of 16; got group "
               "%d, K=%lld, N=%lld", kWhat, Cfg::kW4A8 ? (W::kGroup == 128 ? "128" : "32") : "32, 64, 128, ...",
               g, (long long)a.k, (long long)a.n);
      return MOEK_UNSUPPORTED;
    }
    if (int st = contig::check_smem(kWhat, a, smem_bytes(a.num_groups), err, errlen)) return st;
    if (registers() < contig::kRegsPerThread) {
      snprintf(err, errlen, "%s: built with %d registers per thread, its warpgroups need %d", kWhat, registers(),
               contig::kRegsPerThread);
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace contig_w4;
    if (int st = check(a, err, errlen)) return st;
    if (a.rows == 0) return MOEK_OK;
    Params p{};
    p.group = a.weight_group;
    p.scale_rows = Cfg::kTileK > p.group ? Cfg::kTileK / p.group : 1;
    p.has_zero = a.zero_base != nullptr;
    p.slices = static_cast<int>((a.k + 127) / 128);
    const int64_t scale_rows_total = a.k / p.group;
    if (!contig::encode(&p.base.tma_a, a.a_base, a.rows, a.k * int64_t(sizeof(In)), kHalfM) ||
        !contig::encode(&p.base.tma_tail, a.a_base, a.rows, a.k * int64_t(sizeof(In)), Cfg::kTail) ||
        !contig::encode(&p.base.tma_d, a.d_base, a.rows, 2 * a.n, kHalfM) ||
        !encode_fragments(&p.tma_w, a.b_base, a.num_groups, p.slices, a.n, Cfg::kW4A8 ? 2 : 1) ||
        !encode_scales3d(&p.tma_scale, a.sfb_base, a.num_groups, scale_rows_total, a.n, p.scale_rows) ||
        (p.has_zero && !encode_scales3d(&p.tma_zero, a.zero_base, a.num_groups, scale_rows_total, a.n, p.scale_rows))) {
      snprintf(err, errlen, "%s: cuTensorMapEncodeTiled failed", kWhat);
      return MOEK_CUDA_ERROR;
    }
    p.base.d = a.d_base;
    p.base.offsets = a.offsets;
    p.base.tile_counter = a.tile_counter;
    p.base.num_experts = a.num_groups;
    p.base.n = static_cast<int>(a.n);
    p.base.k = static_cast<int>(a.k);
    p.row_scale = a.sfa_base;
    p.rows = a.rows;
    p.base.max_tail = std::min(contig::max_tail(), Cfg::kTail);
    return contig::launch_persistent(kWhat, gemm_kernel<In, Out, W>, p, smem_bytes(a.num_groups),
                                     (a.n + kTileN - 1) / kTileN, a, err, errlen);
  }

  static size_t workspace_size(int, int) { return 0; }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, int(sizeof(Storage)), false, false, Cfg::kW4A8};
};

}  // namespace moe_kernels::sm90
