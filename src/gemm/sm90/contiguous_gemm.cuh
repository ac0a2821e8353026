// Our own SM90 grouped GEMM for fp8_block (DeepSeek-style block scales) at many rows per expert:
// the catalog's "contig" schedule. Same interface as the CUTLASS kernels (GroupedGemmArgs).
//
// Why not CUTLASS's ptr-array kernel: the routing leaves every expert's rows contiguous in one
// [rows, K] buffer and the weights are one [E, N, K] tensor, so two TMA descriptors cover all
// groups and no per-group descriptor is rewritten on the device; an expert's last M tile, when
// its rows fit in 64, loads only those 64 rows of A and is split by columns between the two
// consumer warpgroups, so a tile with a few tail rows costs half a tile, not a whole one; and
// the tile is 256 columns wide (two weight-scale blocks), which reads 25% fewer bytes from L2
// per FLOP than 128 (CUTLASS 4.2's blockwise mainloop keeps a second fp32 accumulator and does
// not build it).
//
// Persistent: one CTA per SM; tiles are ordered by expert, then N tile, then M tile, and each
// CTA takes the next one from a counter in global memory when its loader is done with the
// last. So the tiles in flight are always about consecutive ones, which share their weight
// tile (the M tiles of one N tile) and their A rows (the expert's N tiles) in L2, however
// long each tile takes. With a fixed stride instead (blockIdx.x, +gridDim.x, ...), the CTAs
// drift apart (half tiles are short) and re-read their operands from DRAM.
// Warp specialization: warp 0 loads (one lane issues the TMA loads of A, B and, every 4 K
// blocks, of their scales; scale_at), warpgroups 1 and 2 each
// compute 64 rows of the 128-row tile with wgmma (64x128x32 per 128 columns, fp32), promoting
// each 128-deep K block's partial sums with scale(row) * scale(weight block) into their
// accumulators. Both epilogues go through shared memory and leave by TMA stores, so the
// warpgroups are back at their wgmmas while the tile is written out.
// A is loaded in 64-row halves, only those with rows of the tile's expert in them; a half may
// still reach into the next expert's rows (or past the buffer: zeros): those rows are computed
// and never stored, and their scales are the expert's last row's. A tile of at most 64 rows
// (an expert's last or only one) is split by columns: warpgroup h multiplies those rows by
// weight block h, so the wgmmas of one warpgroup still run while the other promotes (with one
// warpgroup doing both blocks, the tensor cores idle through its promotions). But an expert's
// last rows up to 16 past a full tile get no tile of their own: that tile multiplies them too
// (tail_rows), so they cost no second stream of the weight tile.
// GEMM1 with a gated activation: the two 128-row weight blocks of a tile are
// gate block n and up block n (I rows further), so the epilogue holds both halves of 128
// intermediate columns and writes what the activation kernel would: act(gate, up) of the
// outputs rounded to the output type (bf16 or fp16, as the unfused path stores them) plus bias,
// quantized to E4M3 per row per 128 columns. That saves
// GEMM1's 16-bit output (4I bytes per row), its reread and a launch.
// Measurements and the variants tried: docs/kernels/contiguous-fp8-block.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cute/tensor.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "act.cuh"
#include "dispatch.cuh"
#include "gemm/grouped_gemm.h"
#include "launch.cuh"
#include "vec.cuh"

namespace moe_kernels::sm90 {
namespace contig {

constexpr int kTileM = 128, kTileK = 128;  // K: one 128-byte swizzle row, one scale block
constexpr int kBlockN = 128;               // columns per weight-scale block and per wgmma
constexpr int kHalfM = 64;                 // rows per consumer warpgroup
constexpr int kThreads = 384;              // producer + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr int kSchedSlots = 2;             // tiles taken ahead by the loader
constexpr int kBoxBytes = kHalfM * 128;    // one TMA store box: 64 rows x 128 bytes
constexpr int kTail = 16;                  // rows past a full tile that ride along (tail_rows)
constexpr int kSfaRows = 128 + kTail;      // row scales per K block: the tile's and its tail's
constexpr int kSetBlocks = 4;              // K blocks per scale set (scale_at)
constexpr int kSfbPitch = 32;              // floats per weight block's set: TMA writes 128-byte aligned
// Registers per thread after setmaxnreg: the consumers take what the producer warpgroup gives
// back, within the CTA's allocation (128 * 40 + 256 * 232 = 128 * 24 + 256 * 240 = 384 * 168);
// asking for more than the CTA holds blocks forever, so run() checks the kernel was built with
// 168. Without scale sets the fused kernel's consumers take 240 (with 232 they spill four
// accumulators in every K block; the loader spills instead, off the tensor path), the unfused
// one's 232 (240 measured slower for it).
constexpr int kRegsPerThread = 168;

using namespace cute;
using Element = cutlass::float_e4m3_t;
using TiledMma = decltype(make_tiled_mma(SM90_64x128x32_F32E4M3E4M3_SS_TN<>{}));
using TailMma = decltype(make_tiled_mma(SM90_64x16x32_F32E4M3E4M3_SS_TN<>{}));  // weights x tail rows

// kFused: GEMM1 with the activation in its epilogue (E4M3 out: one box per warpgroup, 4
// stages); otherwise the 16-bit output tile's 64 KB buffer takes a stage's room.
template <int kTileN, bool kFused>
struct Config {
  static constexpr int kBlocksN = kTileN / kBlockN;
  static constexpr int kStageBytesA = kTileM * kTileK, kStageBytesB = kTileN * kTileK;
  // x 48 KB; the unfused kernel's 64 KB output buffer takes the fourth stage's room (3 stages
  // measured close to 4).
  static constexpr int kStages = kFused ? 4 : 3;
  static constexpr int kBoxesPerHalf = kFused ? 1 : 2 * kTileN / 128;  // E4M3 or 16-bit rows
  static constexpr int kOutBytes = 2 * kBoxesPerHalf * kBoxBytes;
  static constexpr uint32_t kConsumerRegs = kFused ? 240 : 232;  // see kRegsPerThread
  static constexpr uint32_t kProducerRegs = (kThreads * kRegsPerThread - 256 * kConsumerRegs) / 128;
  // With scale sets (no per-lane scale copies) both kernels' consumers take 240: at 232 the
  // unfused one spilled an accumulator in every K block (ptxas); its loader spills instead.
  // GEMM2 at 232 measured slower.
  static constexpr uint32_t kConsumerRegsSets = 240;
  static constexpr uint32_t kProducerRegsSets = (kThreads * kRegsPerThread - 256 * kConsumerRegsSets) / 128;
  // A stage of A (or B) is 128 rows x 128 bytes with the 128-byte swizzle, i.e. blocks of 64
  // (128) rows back to back: A is indexed as (64, 128, 2 * kStages), half h of stage s at
  // 2s + h; B as (128, 128, kBlocksN * kStages), block b of stage s at kBlocksN * s + b.
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kHalfM>, Int<kTileK>, Int<2 * kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kTileK>, Int<kBlocksN * kStages>>{}));
  using SmemLayoutTail = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                Shape<Int<kTail>, Int<kTileK>, Int<kStages>>{}));
  struct alignas(1024) SharedStorage {
    alignas(1024) Element a[kStages * kStageBytesA];
    alignas(1024) Element b[kStages * kStageBytesB];
    alignas(1024) Element a_tail[kStages * kTail * kTileK];  // the tail rows, if the tile has them
    alignas(1024) uint8_t out[kOutBytes];  // per warpgroup: kBoxesPerHalf TMA boxes
    // The scales, as scale_at finds them: two sets of [row][kSetBlocks] (loaded by TMA), or
    // [stage][row] (copied by the loader's lanes).
    alignas(128) float sfa[std::max(2 * kSetBlocks, kStages) * kSfaRows];
    alignas(128) float sfb[std::max(2 * kSfbPitch, kStages) * kBlocksN];
    float tail_amax[4][kTail];  // fused: warpgroup 0's warps' amax per tail row
    uint64_t full[kStages];   // TMA bytes landed (and, without sets, the 32 loader lanes' scale copies)
    uint64_t empty[kStages];  // consumers done with the stage (one arrive per consumer warp)
    int32_t tile[kSchedSlots];           // tiles taken by the loader, for the consumers
    uint64_t tile_full[kSchedSlots];     // the loader wrote tile[i]
    uint64_t tile_empty[kSchedSlots];    // every consumer warp read it
    // then, dynamically sized: int32 tile_start[E + 1] (prefix sums of M tiles per expert) and
    // int32 offsets[E + 1] (the experts' row offsets)
  };
};

struct Params {
  CUtensorMap tma_a;  // A [rows, K] e4m3, box 64 x 128
  CUtensorMap tma_tail;  // the same, box kTail x 128
  CUtensorMap tma_b;  // B [E * N, K] e4m3, box 128 x 128
  CUtensorMap tma_d;    // D [rows, N] 16-bit as bytes, box 64 x 128 bytes (unfused)
  CUtensorMap tma_act;  // act_out [rows, inter] E4M3, box 64 x 128 (fused)
  const float* sfa;   // [rows, K / 128]
  const float* sfb;   // [E, N / 128, K / 128]
  CUtensorMap tma_sfa, tma_sfa_tail, tma_sfb;  // the same, boxes of kSetBlocks x 128, kTail, 1 rows (kSets)
  void* d;            // [rows, N], the output type (bf16 or fp16)
  const int32_t* offsets;  // [E + 1] row offsets of the experts
  int32_t* tile_counter;   // next tile to take; zero at launch
  int num_experts, n, k;
  // The fused activation (act_out != NULL: GEMM1, 256 columns, n = 2 * inter).
  uint8_t* act_out;                // E4M3 [rows, inter]
  float* act_scale;                // [rows, inter / 128]
  const void* act_bias;            // [E, n] of the output type, or NULL
  int activation, inter;
  float act_alpha, act_limit;
  int max_tail;  // kTail, or fewer by MOE_KERNELS_CONTIG_TAIL (0: none; for A/B runs)
};

__device__ __forceinline__ int upper_bound(const int32_t* v, int n, int x) {
  int lo = 0, hi = n;  // first i with v[i] > x
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (v[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

struct Tile {
  int expert, n, row0, rows;  // rows of this expert from row0 (may exceed the tile)
};

// An expert whose rows end at most kTail past a multiple of 128 (and past 128) has no M tile of
// its own for them: its last full tile also multiplies them, as the N of a swap-AB wgmma
// (weights x rows, 64 x kTail x 32) on the weight block already in shared memory, instead of a
// tile of 64 rows that streams the weight tile again for a few (common at ~128 rows per
// expert).
__device__ __forceinline__ int m_tiles_of(int rows, int max_tail) {
  return rows <= kTileM ? (rows > 0) : (rows - max_tail + kTileM - 1) / kTileM;
}
__device__ __forceinline__ int tail_rows(const Tile& tile, int max_tail) {  // 0, or rows past the tile's 128
  return tile.rows > kTileM && tile.rows <= kTileM + max_tail ? tile.rows - kTileM : 0;
}

// Where K block kb's scales are in shared memory (the kseq-th K block the CTA takes, over its
// tiles): row r's at sfa[a + r * stride], weight block b's at sfb[b_ + b * b_stride]. With scale
// sets, one TMA box per operand brings kSetBlocks K blocks' scales for all rows of the tile
// into one of two sets, with the stage of the set's first K block; a set is reloaded 2 *
// kSetBlocks K blocks later, when the stage's empty barrier says the consumers are past it.
// Without (K / 128 not a multiple of 4: the boxes need 16-byte rows), each stage's lanes copy
// 4 bytes per row. Those copies (128 requests per K block, each row's 4 bytes K/32 bytes apart)
// cost more than the sets do.
struct ScaleAt {
  int a, b, stride, b_stride;
};
template <int kStages, int kBlocksN, bool kSets>
__device__ __forceinline__ ScaleAt scale_at(int stage, int kseq) {
  // The reload at K block s0 + 2 * kSetBlocks waits for the consumers to be done with K block
  // s0 + 2 * kSetBlocks - kStages, which must be past the set's last one, s0 + kSetBlocks - 1.
  static_assert(kStages <= kSetBlocks + 1, "a scale set would be reloaded while still in use");
  if constexpr (kSets) {
    const int set = (kseq / kSetBlocks) & 1, j = kseq % kSetBlocks;
    return {set * kSetBlocks * kSfaRows + j, set * kSfbPitch * kBlocksN + j, kSetBlocks, kSfbPitch};
  }
  return {stage * kSfaRows, stage * kBlocksN, 1, 1};
}

// Tile t in expert-major, then N, then M order.
__device__ __forceinline__ Tile tile_at(int t, const int32_t* tile_start, const int32_t* offsets,
                                        int num_experts, int n_tiles) {
  const int e = upper_bound(tile_start, num_experts + 1, t / n_tiles) - 1;  // non-empty expert
  const int m_tiles = tile_start[e + 1] - tile_start[e];
  const int j = t - tile_start[e] * n_tiles;
  Tile tile;
  tile.expert = e;
  tile.n = j / m_tiles;
  tile.row0 = offsets[e] + (j % m_tiles) * kTileM;
  tile.rows = offsets[e + 1] - tile.row0;
  return tile;
}

// Every thread of the CTA (kThreads): the experts' row offsets [E + 1] into shared memory, and each
// expert's first M tile (tile_start[e], prefix sums of m_tiles_of, warp 0 scanning 32 experts
// at a time). Syncs the CTA.
__device__ __forceinline__ void load_tile_starts(const int32_t* gmem_offsets, int E, int max_tail,
                                                 int32_t* offsets, int32_t* tile_start) {
  for (int i = threadIdx.x; i <= E; i += kThreads) offsets[i] = gmem_offsets[i];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  if (threadIdx.x / 32 == 0) {
    int carry = 0;
    if (lane == 0) tile_start[0] = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      int v = e < E ? m_tiles_of(offsets[e + 1] - offsets[e], max_tail) : 0;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
      }
      if (e < E) tile_start[e + 1] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
}

// The tile schedule's slots in shared memory (Smem's tile, tile_full, tile_empty): the loader
// warp takes the next tile from the counter and passes it on (a number past the last tells the
// other warps to stop); every other warp reads the tiles in the same order.
struct TileSlots {
  int slot = 0, phase = 0;
  __device__ __forceinline__ void next() {
    if (++slot == kSchedSlots) { slot = 0; phase ^= 1; }
  }
};
template <class Smem>
__device__ __forceinline__ int take_tile(Smem& smem, int32_t* counter, TileSlots& s) {
  const int lane = threadIdx.x % 32;
  int t = 0;
  if (lane == 0) t = atomicAdd(counter, 1);
  t = __shfl_sync(0xffffffffu, t, 0);
  cutlass::arch::ClusterBarrier::wait(&smem.tile_empty[s.slot], s.phase ^ 1);
  if (lane == 0) {
    smem.tile[s.slot] = t;
    cutlass::arch::ClusterBarrier::arrive(&smem.tile_full[s.slot]);
  }
  s.next();
  return t;
}
template <class Smem>
__device__ __forceinline__ int read_tile(Smem& smem, TileSlots& s) {
  cutlass::arch::ClusterBarrier::wait(&smem.tile_full[s.slot], s.phase);
  const int t = smem.tile[s.slot];
  __syncwarp();
  if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.tile_empty[s.slot]);
  s.next();
  return t;
}

// Registers per thread a kernel was built with (0 if the runtime cannot say), asked once.
template <auto kKernel>
int kernel_registers() {
  static const int regs = [] {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kKernel) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return fa.numRegs;
  }();
  return regs;
}

// First weight row (within the expert) of 128-row block b of N tile n: consecutive blocks, or
// with the activation fused, gate block n and up block n.
template <int kTileN>
__device__ __forceinline__ int block_row(const Params& p, int n, int b) {
  return p.act_out ? n * kBlockN + b * p.inter : n * kTileN + b * kBlockN;
}

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(cast_smem_ptr_to_uint(smem)),
               "l"(gmem) : "memory");
}

// The output type's conversions: two floats rounded into one register (one F2FP in either
// type), one float rounded, and a packed pair back to floats.
template <class Out>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<Out, __half>) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
template <class Out>
__device__ __forceinline__ float round_to(float x) {
  return Vec8<Out>::to_float(Vec8<Out>::from_float(x));
}
template <class Out>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<Out, __half>) return __half22float2(*reinterpret_cast<const __half2*>(&v));
  else return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));  // exact
}

// One warpgroup's barrier (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int half) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + half) : "memory");
}

// Both epilogues write this warpgroup's 64 rows of the tile into its out buffer in shared
// memory, laid out as TMA's 128-byte swizzle wants it: boxes of 64 rows x 128 bytes, 16-byte
// piece c of a row at c ^ row % 8 (which also puts the 8 rows a warp writes at once in
// different banks). Then one thread stores the boxes with TMA while the warpgroup goes back to
// its wgmmas. A half with fewer rows (an expert's last tile: the rows past its end are the next
// expert's) is copied row by row from the buffer instead.

__device__ __forceinline__ uint32_t swizzled(int box, int row, int byte) {  // offset in out
  return box * kBoxBytes + row * 128 + (((byte / 16) ^ (row % 8)) * 16) + byte % 16;
}

// Before writing the buffer: the last tile's TMA stores have read it.
__device__ __forceinline__ void out_acquire(int half) {
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  warpgroup_sync(half);
}

// The buffer's first `boxes` boxes to map (rows from row0, bytes from x0), or its first `rows`
// rows' first `row_bytes` bytes (TMA clips the boxes at the tensor's edge itself).
__device__ __forceinline__ void out_release(const CUtensorMap* map, const uint8_t* out, uint8_t* gmem,
                                            int64_t ld, int x0, int64_t row0, int rows, int half,
                                            int boxes, int64_t row_bytes = INT64_MAX) {
  if (rows >= kHalfM) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the TMA stores
    warpgroup_sync(half);
    if (threadIdx.x % 128 == 0) {
      for (int box = 0; box < boxes; ++box)
        SM90_TMA_STORE_2D::copy(map, out + box * kBoxBytes, x0 + 128 * box, int(row0));
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    return;
  }
  warpgroup_sync(half);
  const int pieces = 8 * boxes;  // 16-byte pieces per row
  for (int i = threadIdx.x % 128; i < rows * pieces; i += 128) {
    const int r = i / pieces, c = i % pieces;
    if (16 * c < row_bytes)
      *reinterpret_cast<uint4*>(gmem + r * ld + 16 * c) =
          *reinterpret_cast<const uint4*>(out + swizzled(c / 8, r, 16 * (c % 8)));
  }
}

// The 16-bit epilogue for the accumulator's first `blocks` blocks of 128 columns: each thread's
// pairs are already the fragments stmatrix takes (2 boxes of 64 columns per block).
template <class Out, class Acc>
__device__ __forceinline__ void store_out(const Params& p, const Acc& acc, uint8_t* out, int64_t row0,
                                           int col0, int rows, int my_row, int lane, int blocks) {
  const int half = threadIdx.x / 128 - 1;
  out_acquire(half);
  const int m = lane / 8, row = my_row - lane / 4 + 8 * (m & 1) + (lane & 7);
  const uint32_t base = cast_smem_ptr_to_uint(out);
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if (b >= blocks) break;
#pragma unroll
    for (int j = 0; j < 16; j += 2) {  // pieces j, j + 1 of 8 columns, rows my_row and + 8
      const uint32_t r0 = pack2<Out>(acc(4 * j, 0, b), acc(4 * j + 1, 0, b));
      const uint32_t r1 = pack2<Out>(acc(4 * j + 2, 0, b), acc(4 * j + 3, 0, b));
      const uint32_t r2 = pack2<Out>(acc(4 * j + 4, 0, b), acc(4 * j + 5, 0, b));
      const uint32_t r3 = pack2<Out>(acc(4 * j + 6, 0, b), acc(4 * j + 7, 0, b));
      const int piece = 16 * b + j + m / 2;  // of 32 in the row
      const uint32_t addr = base + swizzled(piece / 8, row, 16 * (piece % 8));
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                   "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
    }
  }
  out_release(&p.tma_d, out, reinterpret_cast<uint8_t*>(static_cast<Out*>(p.d) + row0 * p.n + col0), 2 * int64_t(p.n),
                 2 * col0, row0, rows, half, 2 * blocks, 2 * (int64_t(p.n) - col0));
}

// The fused activation's epilogue for this warpgroup's rows row0 + [0, rows): acc(i, 0, 0)
// holds gate columns, acc(i, 0, 1) the up columns of the same intermediate columns. Its
// output, 128 E4M3 bytes per row, is one box; each thread writes its byte pairs.
template <int kAct, class Out, class Acc>
__device__ __forceinline__ void store_activation(const Params& p, const Acc& acc, const Tile& tile,
                                                 uint8_t* out, int64_t row0, int rows, int my_row,
                                                 int lane) {
  const int q = lane & 3, half = threadIdx.x / 128 - 1;
  const int64_t col0 = int64_t(tile.n) * kBlockN;  // the tile's first intermediate column
  const Out* bias = p.act_bias ? static_cast<const Out*>(p.act_bias) + int64_t(tile.expert) * p.n + col0 : nullptr;
  out_acquire(half);
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const int r = my_row + 8 * rs;
    float v[32];  // columns 8 * (j / 2) + 2q + j % 2
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int i = 4 * (j / 2) + 2 * rs + j % 2, col = 8 * (j / 2) + 2 * q + j % 2;
      // GEMM1's output is 16-bit: round as the unfused path stores it.
      float g = round_to<Out>(acc(i, 0, 0));
      float u = round_to<Out>(acc(i, 0, 1));
      if (bias) {
        g += Vec8<Out>::to_float(bias[col]);
        u += Vec8<Out>::to_float(bias[p.inter + col]);
      }
      v[j] = activate<kAct>(g, u, p.act_alpha, p.act_limit);
      amax = fmaxf(amax, fabsf(v[j]));
    }
    // The row's 128 columns are spread over the 4 lanes of the quad.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float scale = fp8_scale(amax), inv = __frcp_rn(scale);
#pragma unroll
    for (int piece = 0; piece < 16; ++piece)  // 8 columns each; this lane's 2 bytes of it
      *reinterpret_cast<uint16_t*>(out + swizzled(0, r, 8 * piece + 2 * q)) =
          static_cast<uint16_t>(to_fp8x2(v[2 * piece], v[2 * piece + 1], inv));
    if (q == 0 && r < rows) p.act_scale[(row0 + r) * int64_t(p.inter / kBlockN) + tile.n] = scale;
  }
  out_release(&p.tma_act, out, p.act_out + row0 * p.inter + col0, p.inter, int(col0), row0, rows,
              half, 1);
}

// A split tile with the activation fused: warpgroup 1's block (the up columns) goes to
// warpgroup 0's acc(i, 0, 1), rounded to the output type as store_activation rounds it anyway,
// through warpgroup 1's box of the out buffer, in two rounds of 8 KB.
template <class Out, class Acc>
__device__ __forceinline__ void hand_over_up(Acc& acc, uint8_t* box, int half) {
  uint32_t* x = reinterpret_cast<uint32_t*>(box);
  const int t = threadIdx.x % 128;
  if (half == 1) out_acquire(1);  // its last TMA stores have read warpgroup 1's box
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (half == 1) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        x[j * 128 + t] = pack2<Out>(acc(32 * r + 2 * j, 0, 0), acc(32 * r + 2 * j + 1, 0, 0));
    }
    asm volatile("bar.sync 3, 256;" ::: "memory");  // both consumer warpgroups
    if (half == 0) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 v = unpack2<Out>(x[j * 128 + t]);
        acc(32 * r + 2 * j, 0, 1) = v.x;
        acc(32 * r + 2 * j + 1, 0, 1) = v.y;
      }
    }
    asm volatile("bar.sync 3, 256;" ::: "memory");  // read before warpgroup 1 writes there again
  }
}

// The fused activation for a tile's tail rows (tail_rows): warpgroup 0 holds their gate
// columns, warpgroup 1 the up columns, as (weight row, tail row) values. Warpgroup 1 hands its
// values over through its box of the out buffer; warpgroup 0 applies the activation as
// store_activation does, takes each row's amax over its 128 columns (across its four warps
// through smem.tail_amax), and writes the E4M3 bytes and scales straight from the registers.
template <int kAct, class Out, class Acc, class Coord, class Smem>
__device__ __forceinline__ void store_tail_activation(const Params& p, const Acc& acc, const Coord& coord,
                                                      const Tile& tile, int tail, Smem& smem) {
  constexpr int kN = decltype(size(acc))::value;
  float* x = reinterpret_cast<float*>(smem.out + kBoxBytes);
  const int t = threadIdx.x % 128, half = threadIdx.x / 128 - 1, lane = t % 32;
  static_assert(kN * 128 * sizeof(float) <= kBoxBytes, "the tail's up values fit warpgroup 1's box");
  if (half == 1) {
    out_acquire(1);  // its last TMA stores have read warpgroup 1's box
#pragma unroll
    for (int i = 0; i < kN; ++i) x[i * 128 + t] = acc(i);
  }
  asm volatile("bar.sync 3, 256;" ::: "memory");  // both consumer warpgroups
  float v[kN];
  if (half == 0) {
    const int64_t col0 = int64_t(tile.n) * kBlockN;  // the tile's first intermediate column
    const Out* bias = p.act_bias ? static_cast<const Out*>(p.act_bias) + int64_t(tile.expert) * p.n + col0 : nullptr;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int col = get<0>(coord(i));
      float g = round_to<Out>(acc(i));
      float u = round_to<Out>(x[i * 128 + t]);
      if (bias) {
        g += Vec8<Out>::to_float(bias[col]);
        u += Vec8<Out>::to_float(bias[p.inter + col]);
      }
      v[i] = activate<kAct>(g, u, p.act_alpha, p.act_limit);
    }
  }
  asm volatile("bar.sync 3, 256;" ::: "memory");  // read before warpgroup 1 writes there again
  if (half == 1) return;
  // Value i of the 64 x 16 fragments is tail row 2q + (i & 1) + 8 * ((i >> 2) & 1) (q = lane % 4;
  // wgmma's accumulator layout): four rows per thread, slot (i & 1) + 2 * ((i >> 2) & 1); the
  // other lanes with the same q hold the same rows.
  static_assert(kN == 2 * 8 && kTail == 16, "two 64 x 16 accumulators");
  const int q = lane & 3;
  auto slot = [](int i) { return (i & 1) + 2 * ((i >> 2) & 1); };       // of value i
  auto row = [q](int r) { return 2 * q + (r & 1) + 8 * (r >> 1); };     // tail row of slot r
  float m[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kN; ++i) m[slot(i)] = fmaxf(m[slot(i)], fabsf(v[i]));
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int d = 4; d < 32; d *= 2) m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], d));
    if (lane < 4) smem.tail_amax[t / 32][row(r)] = m[r];
  }
  warpgroup_sync(0);
  float scale[4], inv[4];  // (one reciprocal per row, not per value)
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = row(r);
    scale[r] = fp8_scale(fmaxf(fmaxf(smem.tail_amax[0][j], smem.tail_amax[1][j]),
                               fmaxf(smem.tail_amax[2][j], smem.tail_amax[3][j])));
    inv[r] = __frcp_rn(scale[r]);
  }
  const int64_t row0 = tile.row0 + kTileM;
  uint8_t* out = p.act_out + row0 * p.inter + int64_t(tile.n) * kBlockN;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (row(slot(i)) < tail)
      out[row(slot(i)) * int64_t(p.inter) + get<0>(coord(i))] =
          static_cast<uint8_t>(to_fp8x2(v[i], 0.f, inv[slot(i)]) & 0xff);
  }
  if (t < 4) {  // warp 0's first quad: the scales of its four rows
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (row(r) < tail) p.act_scale[(row0 + row(r)) * int64_t(p.inter / kBlockN) + tile.n] = scale[r];
  }
}

template <int kTileN, bool kFused, bool kSets, class Out>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const __grid_constant__ Params p) {
  using C = Config<kTileN, kFused>;
  constexpr int kStages = C::kStages, kBlocksN = C::kBlocksN;
  using SharedStorage = typename C::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem_raw + sizeof(SharedStorage));
  int32_t* offsets = tile_start + p.num_experts + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], kSets ? 1 : 1 + 32);
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kSchedSlots; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.tile_full[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.tile_empty[s], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(&p.tma_a);
    cute::prefetch_tma_descriptor(&p.tma_tail);
    cute::prefetch_tma_descriptor(&p.tma_b);
    if constexpr (kSets) {
      cute::prefetch_tma_descriptor(&p.tma_sfa);
      cute::prefetch_tma_descriptor(&p.tma_sfb);
    }
    cute::prefetch_tma_descriptor(kFused ? &p.tma_act : &p.tma_d);
  }
  pdl_begin();  // the offsets, A and its scales come from the previous kernels

  const int E = p.num_experts;
  load_tile_starts(p.offsets, E, p.max_tail, offsets, tile_start);
  const int n_tiles = p.act_out ? p.inter / kBlockN : p.n / kTileN, k_blocks = p.k / kTileK;
  const int num_tiles = tile_start[E] * n_tiles;

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kSets ? C::kProducerRegsSets : C::kProducerRegs>();
    if (warp != 0) return;
    int stage = 0, phase = 0, kseq = 0;
    TileSlots slots;
    for (;;) {
      const int t = take_tile(smem, p.tile_counter, slots);
      if (t >= num_tiles) break;
      const Tile tile = tile_at(t, tile_start, offsets, E, n_tiles);
      const int b_row = tile.expert * p.n;
      // Lanes < kBlocksN copy the weight-block scales, every lane 4 of the 128 row scales.
      const float* sfb = p.sfb + (int64_t(tile.expert) * (p.n / kBlockN) +
                                  block_row<kTileN>(p, tile.n, min(lane, kBlocksN - 1)) / kBlockN) * k_blocks;
      const float* sfa = p.sfa + int64_t(tile.row0) * k_blocks;
      const int halves = tile.rows > kHalfM ? 2 : 1;  // 64-row halves of A with rows in them
      const bool tail = tail_rows(tile, p.max_tail) > 0;
      for (int kb = 0; kb < k_blocks; ++kb, ++kseq) {
        cutlass::arch::ClusterBarrier::wait(&smem.empty[stage], phase ^ 1);
        const bool new_set = kSets && kb % kSetBlocks == 0;
        if (lane == 0) {
          constexpr int kSetBytes = kSetBlocks * sizeof(float);  // per row
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
              &smem.full[stage], halves * (C::kStageBytesA / 2) + C::kStageBytesB + (tail ? kTail * kTileK : 0) +
                                     (new_set ? (kTileM + (tail ? kTail : 0) + kBlocksN) * kSetBytes : 0));
          const auto hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
          for (int h = 0; h < halves; ++h)
            SM90_TMA_LOAD_2D::copy(&p.tma_a, &smem.full[stage], hint,
                                   smem.a + stage * C::kStageBytesA + h * (C::kStageBytesA / 2),
                                   kb * kTileK, tile.row0 + h * kHalfM);
          if (tail)
            SM90_TMA_LOAD_2D::copy(&p.tma_tail, &smem.full[stage], hint, smem.a_tail + stage * kTail * kTileK,
                                   kb * kTileK, tile.row0 + kTileM);
#pragma unroll
          for (int b = 0; b < kBlocksN; ++b)
            SM90_TMA_LOAD_2D::copy(&p.tma_b, &smem.full[stage], hint,
                                   smem.b + stage * C::kStageBytesB + b * (kBlockN * kTileK),
                                   kb * kTileK, b_row + block_row<kTileN>(p, tile.n, b));
          if (new_set) {  // rows past the buffer read as zeros
            const ScaleAt at = scale_at<kStages, kBlocksN, true>(stage, kseq);
            SM90_TMA_LOAD_2D::copy(&p.tma_sfa, &smem.full[stage], hint, smem.sfa + at.a, kb, tile.row0);
            if (tail)
              SM90_TMA_LOAD_2D::copy(&p.tma_sfa_tail, &smem.full[stage], hint, smem.sfa + at.a + kTileM * kSetBlocks,
                                     kb, tile.row0 + kTileM);
#pragma unroll
            for (int b = 0; b < kBlocksN; ++b)
              SM90_TMA_LOAD_2D::copy(&p.tma_sfb, &smem.full[stage], hint, smem.sfb + at.b + b * kSfbPitch, kb,
                                     (b_row + block_row<kTileN>(p, tile.n, b)) / kBlockN);
          }
        }
        if constexpr (!kSets) {
          if (lane < kBlocksN) cp_async_4(&smem.sfb[stage * kBlocksN + lane], sfb + kb);
#pragma unroll
          for (int j = 0; j < kTileM / 32; ++j)
            cp_async_4(&smem.sfa[stage * kSfaRows + 32 * j + lane],
                       sfa + min(32 * j + lane, tile.rows - 1) * k_blocks + kb);
          if (tail && lane < kTail)
            cp_async_4(&smem.sfa[stage * kSfaRows + kTileM + lane],
                       sfa + min(kTileM + lane, tile.rows - 1) * k_blocks + kb);
          cutlass::arch::cpasync_barrier_arrive_noinc(&smem.full[stage]);
        }
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kSets ? C::kConsumerRegsSets : C::kConsumerRegs>();
  const int half = wg - 1;  // this warpgroup's 64 rows of the tile
  TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename C::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b), typename C::SmemLayoutB{});
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, 1, 4, 2 * kStages) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, 1, 4, kBlocksN * kStages)
  // acc(i, 0, b): block b of 128 columns; values i = (2 columns, 2 rows 8 apart, 16 pieces of 8).
  Tensor acc = partition_fragment_C(mma, Shape<Int<kHalfM>, Int<kTileN>>{});
  Tensor part = partition_fragment_C(mma, Shape<Int<kHalfM>, Int<kBlockN>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kHalfM>, Int<kBlockN>>{}));
  const int my_row = get<0>(coord(0));  // within this half; the thread's other row is + 8
  static_assert(decltype(size(part))::value == 64, "64x128 fp32 accumulator: 64 values per thread");
  // The tail rows: weight block `half` (two 64-row A operands) x kTail rows of A (the N).
  TailMma tmma;
  auto tthr = tmma.get_thread_slice(threadIdx.x % 128);
  Tensor tTrA = tthr.make_fragment_A(tthr.partition_A(sB));  // (MMA, 2, 4, kBlocksN * kStages)
  Tensor tTrB = tthr.make_fragment_B(
      tthr.partition_B(make_tensor(make_smem_ptr(smem.a_tail), typename C::SmemLayoutTail{})));
  Tensor acc_t = partition_fragment_C(tmma, Shape<Int<kBlockN>, Int<kTail>>{});  // kTail values
  Tensor part_t = partition_fragment_C(tmma, Shape<Int<kBlockN>, Int<kTail>>{});
  // (weight row within the block, tail row) of each value
  Tensor coord_t = tthr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kTail>>{}));

  int kseq = 0;  // the K blocks taken so far (stage, phase, scales)
  TileSlots slots;
  for (;;) {
    const int t = read_tile(smem, slots);
    if (t >= num_tiles) break;
    const Tile tile = tile_at(t, tile_start, offsets, E, n_tiles);
    const int tile_rows = min(tile.rows, kTileM);
    const bool split = tile_rows <= kHalfM;  // by columns: weight block `half` of A's first half
    const int a_half = split ? 0 : half, b_first = split ? half : 0, blocks = split ? 1 : kBlocksN;
    const int tail = tail_rows(tile, p.max_tail);
    clear(acc);
    clear(acc_t);
    for (int kb = 0; kb < k_blocks; ++kb, ++kseq) {
      const int stage = kseq % kStages;
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[stage], (kseq / kStages) & 1);
      const ScaleAt at = scale_at<kStages, kBlocksN, kSets>(stage, kseq);
      const float a0 = smem.sfa[at.a + (a_half * kHalfM + my_row) * at.stride];
      const float a1 = smem.sfa[at.a + (a_half * kHalfM + my_row + 8) * at.stride];
#pragma unroll
      for (int b = 0; b < kBlocksN; ++b) {
        if (b >= blocks) break;
        warpgroup_fence_operand(part);
        warpgroup_arrive();
        mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
        for (int k = 0; k < size<2>(tCrA); ++k) {
          cute::gemm(mma, tCrA(_, _, k, 2 * stage + a_half), tCrB(_, _, k, kBlocksN * stage + b_first + b),
                     part);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        const float sb = smem.sfb[at.b + (b_first + b) * at.b_stride];
        const float r0 = a0 * sb, r1 = a1 * sb;
        warpgroup_wait<0>();
        warpgroup_fence_operand(part);
        if (b == blocks - 1 && !tail) {
          __syncwarp();
          if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[stage]);
        }
#pragma unroll
        for (int i = 0; i < size(part); ++i) acc(i, 0, b) += part(i) * ((i & 2) ? r1 : r0);
      }
      if (tail) {
        warpgroup_fence_operand(part_t);
        warpgroup_arrive();
        tmma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
        for (int k = 0; k < size<2>(tTrA); ++k) {
          cute::gemm(tmma, tTrA(_, _, k, kBlocksN * stage + half), tTrB(_, _, k, stage), part_t);
          tmma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        // This thread's four tail rows' scales, read while the wgmmas run (value i is tail row
        // 2q + (i & 1) + 8 * ((i >> 2) & 1), as in store_tail_activation).
        const float sb = smem.sfb[at.b + half * at.b_stride];
        const float* sa = smem.sfa + at.a + (kTileM + 2 * (lane & 3)) * at.stride;
        const float ts[4] = {sb * sa[0], sb * sa[at.stride], sb * sa[8 * at.stride], sb * sa[9 * at.stride]};
        warpgroup_wait<0>();
        warpgroup_fence_operand(part_t);
#pragma unroll
        for (int i = 0; i < size(part_t); ++i) acc_t(i) += part_t(i) * ts[(i & 1) + 2 * ((i >> 2) & 1)];
        __syncwarp();
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[stage]);
      }
    }
    const int rows = split ? tile_rows : tile_rows - half * kHalfM;  // rows this warpgroup stores
    const int64_t row0 = tile.row0 + (split ? 0 : half * kHalfM);
    uint8_t* out = smem.out + half * C::kBoxesPerHalf * kBoxBytes;
    if constexpr (kFused) {
      if (tail) {
        // check() admits gated activations only: anything else stops the kernel.
        if (!with_gated_activation(p.activation, [&](auto act) {
              store_tail_activation<decltype(act)::value, Out>(p, acc_t, coord_t, tile, tail, smem);
            }))
          __trap();
      }
      if (split) {
        hand_over_up<Out>(acc, smem.out + kBoxBytes, half);
        if (half == 1) continue;
      }
      if (!with_gated_activation(p.activation, [&](auto act) {
            store_activation<decltype(act)::value, Out>(p, acc, tile, out, row0, rows, my_row, lane);
          }))
        __trap();
    } else {
      if (tail) {  // a few scattered rows: straight from the registers
        Out* d = static_cast<Out*>(p.d) + (tile.row0 + kTileM) * int64_t(p.n) + tile.n * kTileN + half * kBlockN;
#pragma unroll
        for (int i = 0; i < size(acc_t); ++i)
          if (get<1>(coord_t(i)) < tail)
            d[get<1>(coord_t(i)) * int64_t(p.n) + get<0>(coord_t(i))] = Vec8<Out>::from_float(acc_t(i));
      }
      store_out<Out>(p, acc, out, row0, tile.n * kTileN + b_first * kBlockN, rows, my_row, lane, blocks);
    }
  }
  // The last stores must be done before the CTA (and its shared memory) goes.
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The most tail rows a full tile takes along: kTail, or fewer by MOE_KERNELS_CONTIG_TAIL (0:
// none; for A/B runs).
inline int max_tail() {
  static const int v = [] {
    const char* s = getenv("MOE_KERNELS_CONTIG_TAIL");
    return std::max(0, std::min(s ? atoi(s) : kTail, kTail));
  }();
  return v;
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 2D K-major e4m3 tensor [rows, k] loaded in boxes of 128 bytes of K x box_rows with the
// 128-byte swizzle (what GMMA::Layout_K_SW128_Atom expects); rows past the end read as zeros.
// A load's L2 misses fetch 256 bytes: both K blocks of an aligned pair, in one DRAM access.
inline bool encode(CUtensorMap* map, const void* base, int64_t rows, int64_t k, int box_rows) {
  auto fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k)};
  const cuuint32_t box[2] = {kTileK, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
            elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A [rows, k_blocks] fp32 scale tensor in boxes of kSetBlocks x box_rows (no swizzle); needs
// 16-byte rows (k_blocks % 4 == 0) and a 16-byte aligned base, else the scales go by cp.async.
inline bool encode_scales(CUtensorMap* map, const float* base, int64_t rows, int64_t k_blocks, int box_rows) {
  auto fn = encode_fn();
  if (!fn || k_blocks % kSetBlocks || reinterpret_cast<uintptr_t>(base) % 16) return false;
  const cuuint64_t dims[2] = {cuuint64_t(k_blocks), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k_blocks) * sizeof(float)};
  const cuuint32_t box[2] = {kSetBlocks, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Why a contiguous kernel (`what`) needing `smem` bytes of shared memory cannot run on the
// device, or MOEK_OK.
inline int check_smem(const char* what, const GroupedGemmArgs& a, size_t smem, char* err, size_t errlen) {
  int optin = 0;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device);
  if (smem > size_t(optin)) {
    snprintf(err, errlen, "%s: %d experts need %zu bytes of shared memory, the device allows %d", what,
             a.num_groups, smem, optin);
    return MOEK_UNSUPPORTED;
  }
  return MOEK_OK;
}

// Launches a persistent contiguous kernel with `smem` bytes of shared memory: one CTA per SM,
// never more than tiles can exist (each expert has at most rows / 128 + 1 M tiles, of n_tiles N
// tiles each).
template <class Kernel, class KernelParams>
int launch_persistent(const char* what, Kernel kernel, const KernelParams& p, size_t smem, int64_t n_tiles,
                      const GroupedGemmArgs& a, char* err, size_t errlen) {
  if (cudaError_t e = allow_smem(reinterpret_cast<const void*>(kernel), a.device, smem); e != cudaSuccess) {
    snprintf(err, errlen, "%s: %s", what, cudaGetErrorString(e));
    return MOEK_CUDA_ERROR;
  }
  const int64_t max_tiles = (a.rows / kTileM + a.max_active_groups) * n_tiles;
  const int grid = static_cast<int>(std::min<int64_t>(a.sm_count, max_tiles));
  if (cudaError_t e = launch(kernel, dim3(grid), dim3(kThreads), smem, a.stream, p); e != cudaSuccess) {
    snprintf(err, errlen, "%s launch: %s", what, cudaGetErrorString(e));
    return MOEK_CUDA_ERROR;
  }
  return MOEK_OK;
}

}  // namespace contig

// Out: the output's (and GEMM1's bias's) type, __nv_bfloat16 or __half.
template <int kTileN, class Out>
struct ContiguousBlockwise {
  static_assert(kTileN == 256, "contiguous fp8_block GEMM: 256 columns (two weight-scale blocks)");
  template <bool kFused>
  using Storage = typename contig::Config<kTileN, kFused>::SharedStorage;
  static constexpr int kMaxStorage = int(std::max(sizeof(Storage<true>), sizeof(Storage<false>)));

  static size_t smem_bytes(int num_experts, bool fused) {
    return (fused ? sizeof(Storage<true>) : sizeof(Storage<false>)) +
           sizeof(int32_t) * 2 * (size_t(num_experts) + 1);
  }

  template <bool kFused, bool kSets>
  static int registers() {
    return contig::kernel_registers<contig::gemm_kernel<kTileN, kFused, kSets, Out>>();
  }

  static int check(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace contig;
    if (!a.offsets || !a.tile_counter || !a.sfa_base || !a.sfb_base) {
      snprintf(err, errlen, "contiguous fp8_block GEMM: needs the experts' row offsets, a tile "
               "counter and both block-scale tensors (offsets=%p, tile_counter=%p, sfa=%p, sfb=%p)",
               (const void*)a.offsets, (const void*)a.tile_counter, (const void*)a.sfa_base,
               (const void*)a.sfb_base);
      return MOEK_INVALID_ARGUMENT;
    }
    const bool fused = a.act_out != nullptr;
    // (N = 2I with I % 128 == 0: the N check below covers the fused tile too.)
    if (fused && !(a.act_scale && is_gated(a.activation))) {
      snprintf(err, errlen, "contiguous fp8_block GEMM: cannot fuse activation %d with %d columns, "
               "N=%lld", a.activation, kTileN, (long long)a.n);
      return MOEK_UNSUPPORTED;
    }
    if (a.k % kTileK || a.n % kTileN) {
      snprintf(err, errlen, "contiguous fp8_block GEMM: N=%lld must be a multiple of %d and K=%lld of %d",
               (long long)a.n, kTileN, (long long)a.k, kTileK);
      return MOEK_UNSUPPORTED;
    }
    if (int st = check_smem("contiguous fp8_block GEMM", a, smem_bytes(a.num_groups, fused), err, errlen))
      return st;
    const int regs = std::min(fused ? registers<true, true>() : registers<false, true>(),
                              fused ? registers<true, false>() : registers<false, false>());
    if (regs < kRegsPerThread) {
      snprintf(err, errlen, "contiguous fp8_block GEMM: built with %d registers per thread, "
               "its warpgroups need %d", regs, kRegsPerThread);
      return MOEK_UNSUPPORTED;
    }
    return MOEK_OK;
  }

  static int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
    using namespace contig;
    if (int st = check(a, err, errlen)) return st;
    if (a.rows == 0) return MOEK_OK;
    Params p{};
    if (!encode(&p.tma_a, a.a_base, a.rows, a.k, kHalfM) ||
        !encode(&p.tma_tail, a.a_base, a.rows, a.k, kTail) ||
        !encode(&p.tma_b, a.b_base, int64_t(a.num_groups) * a.n, a.k, kBlockN) ||
        (a.act_out ? !encode(&p.tma_act, a.act_out, a.rows, a.n / 2, kHalfM)
                   : !encode(&p.tma_d, a.d_base, a.rows, 2 * a.n, kHalfM))) {
      snprintf(err, errlen, "contiguous fp8_block GEMM: cuTensorMapEncodeTiled failed");
      return MOEK_CUDA_ERROR;
    }
    p.sfa = a.sfa_base;
    p.sfb = a.sfb_base;
    const int64_t k_blocks = a.k / kTileK;
    const bool sets = encode_scales(&p.tma_sfa, a.sfa_base, a.rows, k_blocks, kTileM) &&
                   encode_scales(&p.tma_sfa_tail, a.sfa_base, a.rows, k_blocks, kTail) &&
                   encode_scales(&p.tma_sfb, a.sfb_base, int64_t(a.num_groups) * (a.n / kBlockN), k_blocks, 1);
    p.d = a.d_base;
    p.offsets = a.offsets;
    p.tile_counter = a.tile_counter;
    p.act_out = static_cast<uint8_t*>(a.act_out);
    p.act_scale = a.act_scale;
    p.act_bias = a.act_bias;
    p.activation = a.activation;
    p.inter = static_cast<int>(a.n / 2);
    p.act_alpha = a.act_alpha;
    p.act_limit = a.act_limit;
    p.max_tail = max_tail();
    p.num_experts = a.num_groups;
    p.n = static_cast<int>(a.n);
    p.k = static_cast<int>(a.k);
    const bool fused = p.act_out != nullptr;
    auto kernel = fused ? (sets ? gemm_kernel<kTileN, true, true, Out> : gemm_kernel<kTileN, true, false, Out>)
                        : (sets ? gemm_kernel<kTileN, false, true, Out> : gemm_kernel<kTileN, false, false, Out>);
    return launch_persistent("contiguous fp8_block GEMM", kernel, p, smem_bytes(a.num_groups, fused), a.n / kTileN, a,
                             err, errlen);
  }

  static size_t workspace_size(int, int) { return 0; }

  static constexpr GemmKernelOps kOps{&run, &check, &workspace_size, kMaxStorage, true};
};

}  // namespace moe_kernels::sm90
