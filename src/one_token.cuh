// The "one_token" tactic (src/one_token.cu launches it; benchmarks/probes/one_token_forward.cu
// times it and prints a timeline of its phases; docs/kernels/one-token.md: its design, its
// measurements and what was tried on it).
//
// The whole forward of one token in one kernel (quant fp8 or fp8_block, gated activations). At
// one token the forward is a stream of weights, and the grouped path's six launches (routing,
// expand, GEMM1, activation, GEMM2, finalize) cost more than the stream itself. Two forms (Plan,
// below): the w2 share held in shared memory, and, for larger models (DeepSeek-V3), w2 streamed
// after w13 (kStream).
//
// One CTA per SM, all resident (a cooperative launch: grid barrier between the GEMMs, since
// GEMM2's per-token (fp8) or per-128-column (fp8_block) activation scales need GEMM1 columns
// from other CTAs). After reading the token's
// expert ids, each CTA streams its GEMM1 units (16 intermediate columns of one slot's expert:
// 16 gate + 16 up rows of w13) through a ring of bulk copies (3 tiles in flight where shared
// memory holds them), multiplying each tile as it lands, and once its last w13 tile is
// requested, its GEMM2 share (16 output columns of every slot's expert: 16 rows of w2 each)
// into shared memory, to arrive during the barrier. A ring rather than everything requested at
// once: then every piece lands at the end of the stream.
//
// Warp roles in GEMM1: 16 compute warps take each tile as it lands and release its ring slot
// through an mbarrier that counts them; a 17th, the producer, refills the slot and applies the
// activation to each finished unit. No block-wide barrier in the loop: there every warp would
// wait for the slowest.
//
// The multiplications are mma.sync m16n8k16 on f16 (E4M3 converts exactly), weights as the
// 16-row operand and the token as column 0 of the 8-wide one. K is permuted the same way in
// both operands (a dot product does not care), so each thread reads 16 contiguous bytes of a
// weight row. Numerics follow the grouped path: the token quantized as expand does, GEMM1's
// accumulators dequantized with the token's and the weights' scales, the activation's output
// quantized as the activation kernel does, GEMM2's output dequantized and summed in slot order.
//
// fp8_block (kBlock): the token and GEMM2's inputs are quantized per 128 columns, and each 64
// bytes of K are multiplied into their own partial sums, which take their K block's scales
// (token x weight block) before they are added, as the grouped path promotes per K block. A w13
// tile's 16 rows lie in one 128-row weight block: its row of block scales comes with the tile,
// by a second bulk copy on the tile's mbarrier (hence hidden_size % 512 == 0: 16-byte rows).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "act.cuh"
#include "vec.cuh"

namespace moe_kernels::one_token {

constexpr int kWarps = 16;                   // compute warps
constexpr int kThreads = (kWarps + 1) * 32;  // + the producer: copies, epilogue scales, activation
constexpr int kCols = 16;      // rows per weight tile: GEMM1 intermediate, GEMM2 output columns
constexpr int kMaxSlots = 8;
// GEMM1 units (16 gate + 16 up rows of one slot's w13) and GEMM2 units (16 rows of every slot's
// w2) per CTA, with the w2 share in shared memory or streamed (kStream, below).
__host__ __device__ constexpr int max_units1(bool stream) { return stream ? 8 : 6; }
__host__ __device__ constexpr int max_units2(bool stream) { return stream ? 4 : 2; }
constexpr int kMaxRing = 8;       // ring entries in flight per CTA
constexpr int kMaxRingShare = 3;  // ... with the share: 3 where shared memory holds them, else 2
constexpr size_t kStreamInFlight = 128 * 1024;  // streamed: the ring holds at least this (whole entries)
constexpr int kStamps = 32;    // trace entries per CTA
constexpr int kMaxKBlocks1 = 64;  // fp8_block: hidden_size / 128
constexpr int kMaxKBlocks2 = 16;  // fp8_block: intermediate_size / 128 (the launcher checks)

struct Params {
  const void* hidden;         // [1, H] 16-bit
  const void* topk_ids;       // [1, k] int32 or int64
  const float* topk_weights;  // [1, k]
  const uint8_t* w13;         // [E, 2I, H] E4M3
  const uint8_t* w2;          // [E, H, I] E4M3
  const void* w13_bias;       // [E, 2I] 16-bit, or null
  const void* w2_bias;        // [E, H] 16-bit, or null
  const float* w13_scale;     // [E, 2I] or [E]; fp8_block: [E, 2I / 128, H / 128]
  const float* w2_scale;      // [E, H] or [E]; fp8_block: [E, H / 128, I / 128]
  const float* a13_scale;     // static input scales, or null (per token)
  const float* a2_scale;
  void* out;                  // [1, H] 16-bit
  float* y;                   // workspace [k, I]: the activation's output, for every CTA
  ExpertIndex experts;
  float weight_scale;         // routed_scaling_factor: times every slot's weight
  int unit_weights;           // the inputs were weighted: slots sum with weight 1
  int hidden_size, inter, top_k, num_experts;
  int ids64, w13_per_channel, w2_per_channel;
  float alpha, limit;
  int units1, units2;         // per CTA, at most: <= max_units1, max_units2 of the form (the plan checks)
  int ring;                   // ring entries in flight, <= kMaxRing
  int w2_after;               // the w2 share is requested with w13 tile min(w2_after, last)
  unsigned long long* trace;  // or null: [grid, kStamps] clock64 stamps of the phases, globaltimer at 30, 31
};

// How a problem runs. Where shared memory holds it (Qwen3-30B-A3B), each CTA's GEMM2 share (16
// rows of each slot's w2 per unit) is copied in once, to land during the grid barrier, and w13
// comes through a ring of 16-row tiles. Where it does not (DeepSeek-V3: 1 MB of w2 rows per CTA),
// w2 streams through the same ring after w13 ("stream"; its first entries are in flight across
// the barrier), and a ring entry holds 8 rows of w13 (hidden_size bytes each) or a pair's 16
// rows of w2 (hence intermediate_size <= hidden_size / 2: with I = H, w2 in two 8-row entries
// per pair lost to the decode kernels). Every entry is one bulk copy: a copy costs the SM a fixed
// time to issue whatever its size, so entries cut into K pieces streamed far slower.
struct Plan {
  int stream = 0;
  int ring = 0;  // entries in flight; 0: the problem does not fit
};

inline size_t slot_bytes(int hidden, const Plan& pl) { return size_t(pl.stream ? 8 : kCols) * hidden; }

// Dynamic shared memory: the ring, the w2 share (not streamed), the token or (after the grid
// barrier, in the same room) GEMM2's inputs as f16 MMA fragments (two bytes per value), partial
// sums; fp8_block: each ring slot's row of w13 block scales.
inline size_t smem_bytes(int hidden, int inter, int units2, const Plan& pl, bool block) {
  return pl.ring * slot_bytes(hidden, pl) + (pl.stream ? 0 : size_t(units2) * kMaxSlots * kCols * inter) +
         2 * std::max(size_t(hidden), size_t(kMaxSlots) * inter) +
         ((pl.ring + 2) * kWarps * kCols + kWarps * kCols + (block ? pl.ring * hidden / 128 : 0)) * sizeof(float);
}

// The plan for a problem with `units1` GEMM1 and `units2` GEMM2 units per CTA, given `avail`
// bytes of dynamic shared memory. Streamed, the ring takes the entries that hold kStreamInFlight
// bytes, rounded up (DeepSeek-V3: 3 of 56 KB), or `stream_ring` (a probe's setting, when > 0).
inline Plan plan(int hidden, int inter, int top_k, int units1, int units2, bool block, size_t avail,
                 int stream_ring = 0) {
  Plan pl;
  if (units1 <= max_units1(false) && units2 <= max_units2(false) && units2 * top_k <= kWarps)
    for (pl.ring = kMaxRingShare; pl.ring >= 2; --pl.ring)
      if (smem_bytes(hidden, inter, units2, pl, block) <= avail) return pl;
  if (units1 > max_units1(true) || units2 > max_units2(true) || 2 * inter > hidden) return Plan{};
  pl.stream = 1;
  const size_t most =
      stream_ring > 0 ? size_t(stream_ring) : (kStreamInFlight + slot_bytes(hidden, pl) - 1) / slot_bytes(hidden, pl);
  for (pl.ring = int(std::clamp(most, size_t(2), size_t(kMaxRing))); pl.ring >= 2; --pl.ring)
    if (smem_bytes(hidden, inter, units2, pl, block) <= avail) return pl;
  return Plan{};
}

__device__ __forceinline__ uint32_t f16x2(uint16_t e4m3x2) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(e4m3x2));
  return r;
}

// c += rows g and g + 8 of a 16-row tile x the token (column 0), over 64 bytes of K: this
// thread's 16 bytes of each row (r0, r1) and the token's B fragments for them (b: lanes with
// g == 0; zeros elsewhere). MMA step q takes bytes 4q, 4q + 1 as k slots 2t, 2t + 1 and
// 4q + 2, 4q + 3 as slots 2t + 8, 2t + 9, in both operands; b holds (b0, b1) of steps 0-3.
// kHi = false: an 8-row w13 entry (streamed), rows g only (row g + 8 of the MMA is zeros, not converted).
template <bool kHi = true>
__device__ __forceinline__ void dot64(float (&c)[4], const uint4& r0, const uint4& r1, const uint4& b01,
                                      const uint4& b23) {
  const uint32_t a[4] = {r0.x, r0.y, r0.z, r0.w}, b[4] = {r1.x, r1.y, r1.z, r1.w};
  const uint32_t x[8] = {b01.x, b01.y, b01.z, b01.w, b23.x, b23.y, b23.z, b23.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(f16x2(a[q] & 0xffff)), "r"(kHi ? f16x2(b[q] & 0xffff) : 0u), "r"(f16x2(a[q] >> 16)),
          "r"(kHi ? f16x2(b[q] >> 16) : 0u), "r"(x[2 * q]), "r"(x[2 * q + 1]));
  }
}

// A quantized row as the B fragments dot64 takes, converted once (a conversion per weight
// byte is what the MMAs cost): for each 64 bytes of K and each t, 8 words (b0, b1 of steps
// 0-3). The row's fragments for chunk ch, thread t are at frag + (4 * ch + t) * 8.
__device__ __forceinline__ void load_frag(const uint32_t* frag, int ch, int t, bool mine, uint4& b01, uint4& b23) {
  if (mine) {
    b01 = *reinterpret_cast<const uint4*>(frag + (4 * ch + t) * 8);
    b23 = *reinterpret_cast<const uint4*>(frag + (4 * ch + t) * 8 + 4);
  } else {
    b01 = b23 = make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void stamp(const Params& p, int k, int who = 0) {
  if (p.trace && threadIdx.x == who) {
    p.trace[blockIdx.x * kStamps + k] = clock64();
  }
}

__device__ __forceinline__ void wait_parity(uint64_t* bar, int parity) {
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(
                   smem_u32(bar)), "r"(parity) : "memory");
}

// The weights are read once per forward: evict-first keeps them from pushing the workspace, the
// scales and the code out of L2.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
                   smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}

__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

template <typename T>
__device__ __forceinline__ float round16(float v) { return Vec8<T>::to_float(Vec8<T>::from_float(v)); }

template <typename T>  // a 16-bit float from its bits
__device__ __forceinline__ float bits_to_float(uint16_t v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(v));
  else return __uint_as_float(uint32_t(v) << 16);
}

struct FragRow {  // quantize_row's sink: E4M3 values as f16 B fragments (load_frag), the scale
  uint32_t* frag;
  float* scale_out;
  __device__ __forceinline__ void store(int64_t j, const float* v, float scale) const {
    const uint2 e = to_fp8x8(v, scale);  // columns j .. j + 7: steps q, q + 1 of one t
    *reinterpret_cast<uint4*>(frag + (4 * (j / 64) + (j % 64) / 16) * 8 + ((j % 16) / 4) * 2) =
        make_uint4(f16x2(e.x & 0xffff), f16x2(e.x >> 16), f16x2(e.y & 0xffff), f16x2(e.y >> 16));
  }
  __device__ __forceinline__ void scale(int64_t group, float s) const { scale_out[group] = s; }  // group 0 per token
};

// The threads of a warp pair (warps 2s, 2s + 1) as one quantize_row team: GEMM2's input rows,
// one slot's per pair, so that the whole row is loaded in one round from L2.
struct PairTeam {
  float* warp_amax;  // [kWarps] in shared memory
  __device__ __forceinline__ int rank() const { return threadIdx.x % 64; }
  __device__ __forceinline__ int size() const { return 64; }
  __device__ __forceinline__ float amax(float v) const {
    v = WarpTeam{}.amax(v);
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) warp_amax[warp] = v;
    asm volatile("bar.sync %0, 64;" ::"r"(1 + warp / 2) : "memory");  // named barriers 1 .. 8
    return fmaxf(warp_amax[warp & ~1], warp_amax[warp | 1]);
  }
};

// c += (the dot64 of r0, r1 with b01, b23) x scale: one K block's partial sums, promoted.
template <bool kHi = true>
__device__ __forceinline__ void dot64_scaled(float (&c)[4], const uint4& r0, const uint4& r1, const uint4& b01,
                                             const uint4& b23, float scale) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  dot64<kHi>(d, r0, r1, b01, b23);
  c[0] = fmaf(d[0], scale, c[0]);  // column 0 (the token): values 0 and 2
  c[2] = fmaf(d[2], scale, c[2]);
}

template <typename T, int kAct, bool kBlock, bool kStream>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  constexpr int kFormat = kBlock ? MOEK_ACT_FORMAT_FP8_ROW128 : MOEK_ACT_FORMAT_FP8_ROW;
  constexpr int kMaxUnits1 = max_units1(kStream), kMaxUnits2 = max_units2(kStream);
  constexpr int kRows1 = kStream ? 8 : kCols, kPerHalf = kCols / kRows1;  // w13 rows per entry, entries per half
  extern __shared__ __align__(128) uint8_t smem[];
  const int H = p.hidden_size, I = p.inter, ring_n = p.ring, red_n = ring_n + 2;
  const size_t slot = size_t(kRows1) * H;
  uint8_t* ring = smem;                                        // ring x slot bytes
  uint8_t* w2s = ring + ring_n * slot;                         // the share: pairs x 16 rows x I
  uint32_t* xq = reinterpret_cast<uint32_t*>(w2s + (kStream ? 0 : size_t(p.units2) * kMaxSlots * kCols * I));  // [H / 2]
  uint32_t* x2 = xq;  // [kMaxSlots][I / 2], written after the grid barrier, when xq is done with
  float* red = reinterpret_cast<float*>(xq + max(H, kMaxSlots * I) / 2);  // [ring + 2][kWarps][16]
  float* part_sums = red + red_n * kWarps * kCols;             // [kWarps][16]
  float* ring_sc = part_sums + kWarps * kCols;                 // fp8_block: [ring][H / 128]
  __shared__ int s_expert[kMaxSlots];
  // The token's and GEMM2's inputs' scales: one per row, or (fp8_block) one per 128 columns.
  __shared__ float s_weight[kMaxSlots], s_scale2[kMaxSlots][kBlock ? kMaxKBlocks2 : 1],
      s_xscale[kBlock ? kMaxKBlocks1 : 1], s_amax[kWarps];
  __shared__ float s_scale1[kMaxUnits1][2 * kCols], s_bias1[kMaxUnits1][2 * kCols];
  // GEMM2's weight scales: per (slot, column); fp8_block: per (pair, K block), in the same room.
  __shared__ float s_wscale2[kMaxSlots][kMaxUnits2 * kCols], s_bias2[kMaxSlots][kMaxUnits2 * kCols];
  static_assert(kMaxKBlocks2 == kCols, "fp8_block's GEMM2 scales take s_wscale2's room");
  __shared__ float s_term[kMaxUnits2 * kMaxSlots][kCols];
  __shared__ int s_slots;
  // full: an entry landed; empty: every compute warp has read it and written its partial sums
  __shared__ __align__(8) uint64_t full[kMaxRing], empty[kMaxRing], w2_full;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (threadIdx.x == kWarps * 32) {
    for (int i = 0; i < ring_n; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[i])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[i])), "r"(kWarps));
    }
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&w2_full)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stamp(p, 0);
  if (p.trace && threadIdx.x == 0) {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    p.trace[blockIdx.x * kStamps + 30] = v;
  }
  // The token's row (its first 8 * kThreads columns) and routing, requested together; warp 0
  // keeps the slots with local experts, in order.
  const T* x = static_cast<const T*>(p.hidden);
  uint4 xr = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < H / 8) xr = *reinterpret_cast<const uint4*>(x + 8 * threadIdx.x);
  if (warp == 0) {
    int e = -1;
    float w = 0.f;
    if (lane < p.top_k) {
      const int64_t id = p.ids64 ? static_cast<const int64_t*>(p.topk_ids)[lane]
                                 : static_cast<const int32_t*>(p.topk_ids)[lane];
      const int64_t local = p.experts.local(id);
      e = local < 0 || local >= p.num_experts ? -1 : int(local);
      w = (p.unit_weights ? 1.f : p.topk_weights[lane]) * p.weight_scale;
    }
    const unsigned local = __ballot_sync(0xffffffffu, e >= 0);  // -1: another rank's expert (or -1)
    if (e >= 0) {
      const int n = __popc(local & ((1u << lane) - 1));
      s_expert[n] = e;
      s_weight[n] = w;
    }
    if (lane == 0) s_slots = __popc(local);
  }
  __syncthreads();
  stamp(p, 1);
  const int slots = s_slots, col_blocks = I / kCols, chunks1 = H / 64, chunks2 = I / 64;
  auto unit_at = [&](int i) { return int(blockIdx.x) + i * int(gridDim.x); };
  int units = 0, units2 = 0;  // this CTA's GEMM1 and GEMM2 units
  while (units < p.units1 && unit_at(units) < slots * col_blocks) ++units;
  while (units2 < p.units2 && unit_at(units2) < H / kCols) ++units2;
  // Ring entries: w13 first (unit j / (2 kPerHalf): its gate rows, then its up rows), then the
  // streamed w2 (entry tiles + q: pair q, 16 rows of unit q / slots of slot q % slots).
  const int tiles = 2 * kPerHalf * units, pairs = units2 * slots, tiles2 = kStream ? pairs : 0;
  const int halves = 2 * units;  // partial sums handed over: one per w13 half, then one per pair
  const bool producer = warp == kWarps;

  // The producer's lane 0: entry j into ring slot j % ring. Without kStream, with w13 tile
  // w2_at, the w2 share: 16 rows of each slot's expert per GEMM2 unit.
  const int w2_at = min(p.w2_after, max(tiles, 1) - 1);
  auto issue = [&](int j) {
    uint8_t* dst = ring + (j % ring_n) * slot;
    uint64_t* bar = &full[j % ring_n];
    if (j < tiles) {
      const int u = unit_at(j / (2 * kPerHalf));
      const int64_t row = int64_t(s_expert[u / col_blocks]) * 2 * I + (j / kPerHalf) % 2 * I +
                          (u % col_blocks) * kCols + (j % kPerHalf) * kRows1;
      const uint32_t sc_bytes = kBlock ? H / 128 * sizeof(float) : 0;  // the rows' block scales
      expect_bytes(bar, uint32_t(slot) + sc_bytes);
      bulk_copy(dst, p.w13 + row * H, uint32_t(slot), bar);
      if constexpr (kBlock)  // row / 128: the entry's rows are in one 128-row block (I % 128 == 0)
        bulk_copy(ring_sc + (j % ring_n) * (H / 128), p.w13_scale + row / 128 * (H / 128), sc_bytes, bar);
    } else if (kStream && j < tiles + tiles2) {
      const int q = j - tiles;
      const int64_t row = int64_t(s_expert[q % slots]) * H + unit_at(q / slots) * kCols;
      expect_bytes(bar, kCols * I);
      bulk_copy(dst, p.w2 + row * I, kCols * I, bar);
    }
    if (!kStream && j == w2_at && pairs > 0) {
      expect_bytes(&w2_full, pairs * kCols * I);
      for (int q = 0; q < pairs; ++q) {
        const int64_t row = int64_t(s_expert[q % slots]) * H + unit_at(q / slots) * kCols;
        bulk_copy(w2s + q * size_t(kCols) * I, p.w2 + row * I, kCols * I, &w2_full);
      }
    }
  };
  if (producer && lane == 0)
    for (int j = 0; j < ring_n; ++j) issue(j);
  stamp(p, 9, kWarps * 32);

  // The token in E4M3 (expand's quantization: a static scale, one per token or per 128 columns).
  quantize_row<kFormat>(
      BlockTeam{}, [&](int64_t j, float* v) {
        uint4 raw = xr;  // a copy: xr stays in registers
        if (j != 8 * threadIdx.x) raw = *reinterpret_cast<const uint4*>(x + j);
        Vec8<T> xv;
        xv.unpack(raw);
        for (int i = 0; i < 8; ++i) v[i] = xv.v[i];
      },
      H, p.a13_scale, FragRow{xq, s_xscale});
  __syncthreads();
  stamp(p, 2);

  // The epilogues' scales and biases. The producer loads GEMM1's into registers before its loop
  // and stores them to shared memory once the first tile is consumed. GEMM2's (kEpi2 entries,
  // one per compute thread) are loaded here and stored before the grid barrier, so the producer
  // holds no register arrays for them (as arrays after its loop they spilled in the streamed
  // instantiations). Every load is unconditional (a valid index where there is nothing to load)
  // and nothing reads a loaded register before the store: a select on a load's value would make
  // the producer wait for the loads before its first refill.
  constexpr int kPer1 = kMaxUnits1 * 2 * kCols / 32, kEpi2 = kMaxSlots * kMaxUnits2 * kCols;
  static_assert(kEpi2 <= kWarps * 32, "a compute thread per GEMM2 epilogue entry");
  // Entry j: slot j / (kMaxUnits2 * kCols), column j % (kMaxUnits2 * kCols) of the CTA's GEMM2
  // columns; fp8_block's scales: pair j / kMaxKBlocks2, K block j % kMaxKBlocks2.
  const int j2 = threadIdx.x;
  const bool has2 = j2 < kEpi2 && j2 / (kMaxUnits2 * kCols) < slots && j2 % (kMaxUnits2 * kCols) < units2 * kCols;
  const bool has_block2 = j2 < kEpi2 && j2 / kMaxKBlocks2 < pairs && j2 % kMaxKBlocks2 < I / 128;
  float sc2;
  uint16_t bi2;  // the bias's bits (without a bias: a scale's, unused)
  {
    const uint16_t* b2 = static_cast<const uint16_t*>(p.w2_bias ? p.w2_bias : p.w2_scale);
    const int r = j2 % (kMaxUnits2 * kCols);
    const int64_t e = has2 ? s_expert[j2 / (kMaxUnits2 * kCols)] : 0;
    const int64_t col = has2 ? unit_at(r / kCols) * kCols + r % kCols : 0;
    if constexpr (kBlock) {
      const int q = j2 / kMaxKBlocks2, kb = j2 % kMaxKBlocks2;
      const int64_t eq = has_block2 ? s_expert[q % slots] : 0, hb = has_block2 ? unit_at(q / slots) * kCols / 128 : 0;
      sc2 = p.w2_scale[has_block2 ? (eq * (H / 128) + hb) * (I / 128) + kb : 0];
    } else {
      sc2 = p.w2_scale[p.w2_per_channel ? e * H + col : e];
    }
    bi2 = b2[p.w2_bias ? e * H + col : 0];
  }
  if (producer) {
    float sc1[kPer1];
    uint16_t bi1[kPer1];
    const uint16_t* b1 = static_cast<const uint16_t*>(p.w13_bias ? p.w13_bias : p.w13_scale);
    auto has1 = [&](int k) { return (lane + 32 * k) / (2 * kCols) < units; };
#pragma unroll
    for (int k = 0; k < kPer1; ++k) {
      const int j = lane + 32 * k, r = j % (2 * kCols), u = has1(k) ? unit_at(j / (2 * kCols)) : 0;
      const int64_t e = has1(k) ? s_expert[u / col_blocks] : 0, col = (r / kCols) * I + (u % col_blocks) * kCols + r % kCols;
      sc1[k] = kBlock ? 1.f : p.w13_scale[p.w13_per_channel ? e * 2 * I + col : e];  // fp8_block: in the MMAs
      bi1[k] = b1[p.w13_bias ? e * 2 * I + col : 0];
    }
    auto store_scales = [&] {
#pragma unroll
      for (int k = 0; k < kPer1; ++k) {
        const int j = lane + 32 * k;
        s_scale1[j / (2 * kCols)][j % (2 * kCols)] = has1(k) ? sc1[k] : 0.f;
        s_bias1[j / (2 * kCols)][j % (2 * kCols)] = has1(k) && p.w13_bias ? bits_to_float<T>(bi1[k]) : 0.f;
      }
      __syncwarp();
    };
    if (tiles == 0) store_scales();
    stamp(p, 12, kWarps * 32);
    // As each entry is consumed: the slot refilled; after a unit's last entry, the activation
    // of the unit's 16 columns from the warps' partial sums, to the workspace.
    for (int j = 0; j < tiles; ++j) {
      wait_parity(&empty[j % ring_n], (j / ring_n) & 1);
      if (j == 0) stamp(p, 13, kWarps * 32);
      if (lane == 0) issue(j + ring_n);
      if (j == 0) store_scales();
      if (j % (2 * kPerHalf) == 2 * kPerHalf - 1 && lane < kCols) {
        const int i = j / (2 * kPerHalf), u = unit_at(i), r = lane;
        const float* red_gate = red + ((2 * i) % red_n) * kWarps * kCols;
        const float* red_up = red + ((2 * i + 1) % red_n) * kWarps * kCols;
        float gate = 0.f, up = 0.f;
        for (int w = 0; w < kWarps; ++w) {
          gate += red_gate[w * kCols + r];
          up += red_up[w * kCols + r];
        }
        // As the grouped path's GEMM1 stores them: dequantized in fp32 (fp8: the token's and the
        // weights' scales; fp8_block: already in the sums), rounded once to 16 bits; then the bias.
        const float xs = kBlock ? 1.f : s_xscale[0];
        gate = round16<T>(gate * (xs * s_scale1[i][r])) + s_bias1[i][r];
        up = round16<T>(up * (xs * s_scale1[i][kCols + r])) + s_bias1[i][kCols + r];
        p.y[(u / col_blocks) * I + (u % col_blocks) * kCols + r] = activate<kAct>(gate, up, p.alpha, p.limit);
      }
    }
    stamp(p, 3, kWarps * 32);
  } else {
    // GEMM1, entry by entry as they land: warp w takes K chunks w, w + 16, ... of its rows, in
    // two chains of MMAs, and hands its partial sums to the producer (per half: rows g, g + 8;
    // an 8-row entry gives one of the two). Those have ring + 2 entries: while the warps write
    // the sums of the half that ends at entry j + ring, the producer may still read the two of
    // the unit that ends at entry j.
    for (int j = 0; j < tiles; ++j) {
      wait_parity(&full[j % ring_n], (j / ring_n) & 1);
      if (j == 0) stamp(p, 10);
      const uint8_t* rows = ring + (j % ring_n) * slot + g * H + 16 * t;
      const float* tile_sc = ring_sc + (j % ring_n) * (H / 128);  // fp8_block
      auto mac = [&](float (&acc)[4], int ch, const uint4& b01, const uint4& b23) {
        const uint4 r0 = *reinterpret_cast<const uint4*>(rows + 64 * ch);
        const uint4 r1 = kStream ? r0 : *reinterpret_cast<const uint4*>(rows + 8 * H + 64 * ch);
        if constexpr (kBlock) dot64_scaled<!kStream>(acc, r0, r1, b01, b23, s_xscale[ch / 2] * tile_sc[ch / 2]);
        else dot64<!kStream>(acc, r0, r1, b01, b23);
      };
      float c[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f};
      for (int ch = warp; ch < chunks1; ch += 2 * kWarps) {
        uint4 b01, b23;
        load_frag(xq, ch, t, g == 0, b01, b23);
        mac(c, ch, b01, b23);
        const int ch2 = ch + kWarps;
        if (ch2 < chunks1) {
          load_frag(xq, ch2, t, g == 0, b01, b23);
          mac(c2, ch2, b01, b23);
        }
      }
      float* red_half = red + ((j / kPerHalf) % red_n) * kWarps * kCols + warp * kCols;
      if (t == 0) {
        red_half[g + (j % kPerHalf) * kRows1] = c[0] + c2[0];
        if (!kStream) red_half[g + 8] = c[2] + c2[2];
      }
      __syncwarp();  // the warp's reads of the slot and writes of its sums, before lane 0 releases them
      if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[j % ring_n])) : "memory");
    }
  }

  if (j2 < kEpi2) {  // read after the grid barrier's __syncthreads
    (&s_wscale2[0][0])[j2] = (kBlock ? has_block2 : has2) ? sc2 : 0.f;
    s_bias2[j2 / (kMaxUnits2 * kCols)][j2 % (kMaxUnits2 * kCols)] = has2 && p.w2_bias ? bits_to_float<T>(bi2) : 0.f;
  }
  cooperative_groups::this_grid().sync();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  stamp(p, 4);

  // GEMM2's inputs: every slot's activation row in E4M3, a warp pair per slot (the activation
  // kernel's quantization), read past L1: other CTAs wrote them.
  if (warp < 2 * slots) {
    const float* yr = p.y + (warp / 2) * I;
    quantize_row<kFormat>(
        PairTeam{s_amax}, [&](int64_t j, float* v) {
          const float4 a = __ldcg(reinterpret_cast<const float4*>(yr + j));
          const float4 b = __ldcg(reinterpret_cast<const float4*>(yr + j + 4));
          v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        },
        I, p.a2_scale, FragRow{x2 + (warp / 2) * I / 2, s_scale2[warp / 2]});
  }
  __syncthreads();
  stamp(p, 5);
  // GEMM2's output as the grouped path stores it: dequantized in fp32 (fp8_block: already in the
  // sums), rounded once to 16 bits; then the bias, as finalize adds it. Pair q, column r.
  auto term = [&](int q, int r, float d) {
    const int s = q % slots, c = (q / slots) * kCols + r;
    return round16<T>(kBlock ? d : d * (s_scale2[s][0] * s_wscale2[s][c])) + s_bias2[s][c];
  };
  // Finalize: each output column of unit u sums its slots' terms in order, as the grouped path does.
  auto finish = [&](int u, int r) {
    float acc = 0.f;
    for (int s = 0; s < slots; ++s) acc = fmaf(s_weight[s], s_term[u * slots + s][r], acc);
    static_cast<T*>(p.out)[unit_at(u) * kCols + r] = Vec8<T>::from_float(acc);
  };
  // GEMM2 pair q's rows g (and g + 8) at `rows`: warps from `first` on, `stride` apart, take its
  // K chunks in two chains; c, c2: the sums.
  auto gemm2 = [&](const uint8_t* rows, int q, int first, int stride, float (&c)[4], float (&c2)[4]) {
    const int s = q % slots;
    const float* pair_sc = &s_wscale2[0][0] + q * kMaxKBlocks2;  // fp8_block
    auto mac = [&](float (&acc)[4], int ch, const uint4& b01, const uint4& b23) {
      const uint4 r0 = *reinterpret_cast<const uint4*>(rows + 64 * ch);
      const uint4 r1 = *reinterpret_cast<const uint4*>(rows + 8 * I + 64 * ch);
      if constexpr (kBlock) dot64_scaled(acc, r0, r1, b01, b23, s_scale2[s][ch / 2] * pair_sc[ch / 2]);
      else dot64(acc, r0, r1, b01, b23);
    };
    for (int ch = first; ch < chunks2; ch += 2 * stride) {
      uint4 b01, b23;
      load_frag(x2 + s * I / 2, ch, t, g == 0, b01, b23);
      mac(c, ch, b01, b23);
      const int ch2 = ch + stride;
      if (ch2 < chunks2) {
        load_frag(x2 + s * I / 2, ch2, t, g == 0, b01, b23);
        mac(c2, ch2, b01, b23);
      }
    }
  };
  if constexpr (kStream) {
    // GEMM2 through the ring, entry by entry: all compute warps split each entry's K chunks; the
    // producer refills, then turns each pair's partial sums into its term and, at a unit's last
    // slot, the unit's output.
    if (producer) {
      for (int j = tiles; j < tiles + tiles2; ++j) {
        wait_parity(&empty[j % ring_n], (j / ring_n) & 1);
        if (j == tiles) stamp(p, 15, kWarps * 32);
        if (lane == 0) issue(j + ring_n);
        const int q = j - tiles;
        if (lane < kCols) {
          const float* red_q = red + ((halves + q) % red_n) * kWarps * kCols;
          float d = 0.f;
          for (int w = 0; w < kWarps; ++w) d += red_q[w * kCols + lane];
          s_term[q][lane] = term(q, lane, d);
          if (q % slots == slots - 1) finish(q / slots, lane);
        }
      }
      if (slots == 0 && lane < kCols)  // none of the token's experts here: zeros
        for (int u = 0; u < units2; ++u) finish(u, lane);
    } else {
      for (int j = tiles; j < tiles + tiles2; ++j) {
        wait_parity(&full[j % ring_n], (j / ring_n) & 1);
        if (j == tiles) stamp(p, 14);
        if (j == tiles + tiles2 / 2) stamp(p, 16);
        const int q = j - tiles;
        const uint8_t* rows = ring + (j % ring_n) * slot + g * I + 16 * t;
        float c[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f};
        gemm2(rows, q, warp, kWarps, c, c2);
        float* red_q = red + ((halves + q) % red_n) * kWarps * kCols + warp * kCols;
        if (t == 0) {
          red_q[g] = c[0] + c2[0];
          red_q[g + 8] = c[2] + c2[2];
        }
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[j % ring_n])) : "memory");
      }
    }
    stamp(p, 7);
  } else {
    // GEMM2 from the share: pair q gets kWarps / pairs warps, each a share of its K chunks
    // (the plan keeps pairs <= kWarps).
    const int warps_per_pair = pairs > 0 ? kWarps / pairs : 1, q = warp / warps_per_pair;
    if (q < pairs) {
      wait_parity(&w2_full, 0);
      stamp(p, 8);
      float c[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f};
      gemm2(w2s + size_t(q) * kCols * I + g * I + 16 * t, q, warp % warps_per_pair, warps_per_pair,
            c, c2);
      if (t == 0) {
        part_sums[warp * kCols + g] = c[0] + c2[0];
        part_sums[warp * kCols + g + 8] = c[2] + c2[2];
      }
    }
    __syncthreads();
    stamp(p, 6);
    // Each (pair, column) term in parallel, then each output column sums its slots.
    if (threadIdx.x < pairs * kCols) {
      const int pq = threadIdx.x / kCols, r = threadIdx.x % kCols;
      float d = 0.f;
      for (int w = 0; w < warps_per_pair; ++w) d += part_sums[(pq * warps_per_pair + w) * kCols + r];
      s_term[pq][r] = term(pq, r, d);
    }
    __syncthreads();
    stamp(p, 11);
    if (threadIdx.x < units2 * kCols) finish(threadIdx.x / kCols, threadIdx.x % kCols);
    stamp(p, 7);
  }
  if (p.trace && threadIdx.x == 0) {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    p.trace[blockIdx.x * kStamps + 31] = v;
  }
}

}  // namespace moe_kernels::one_token
