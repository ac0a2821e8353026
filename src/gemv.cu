// The small-batch path (the catalog's "gemv" schedule): the whole forward in two kernels that
// work on each (token, slot) pair directly, for a few tokens, where the grouped path's six
// launches (routing, expand, GEMM1, activation, GEMM2, finalize) cost more than the weights.
//
//   gemv_up:   a[p, j] = act(x_t . W13[e, j] + b, x_t . W13[e, I + j] + b)   (GEMM1 + activation)
//   gemv_down: out[t, n] = sum over slots, in slot order, of w[t, s] * (a[p_s] . W2[e_s, n] + b)
//              (GEMM2 + finalize)
//
// No sort and no permuted copies: a pair's expert weights are read by the blocks of that pair
// (a weight read twice when two of the tokens pick one expert: meant for a few tokens). Each
// warp computes whole dot products: lane l loads bytes 16l..16l+15 of each 512-byte step of a
// weight row (16-byte loads, several steps in flight), and the other operand (the token row or
// the slots' activation rows) sits in shared memory (Stage below), permuted so that the lanes'
// 16-byte reads of one step are contiguous (no bank conflicts).
//
// Quantization matches the grouped path and moe_kernels.fp8: GEMM1's input is quantized per
// token (or statically, or per 128 columns for FP8_BLOCK) by every block while it stages the
// row; the activation is written as float with each block's amax, and gemv_down quantizes the
// slots' rows with the scale those amaxes give before it uses them.
#include <cuda_fp8.h>

#include <type_traits>

#include "activations.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "vec.cuh"

namespace moe_kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
// Weights of type W: 16 bytes hold kVals values; a warp step covers kStep values of a row.
template <typename W> constexpr int kVals = 16 / int(sizeof(W));
template <typename W> constexpr int kStep = 32 * kVals<W>;

// A row's padded length in the staged layout.
template <typename W>
__host__ __device__ __forceinline__ int64_t padded(int64_t n) {
  return (n + kStep<W> - 1) / kStep<W> * kStep<W>;
}

__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ __half2 fp8x2_to_half2(uint32_t two) {
  return __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3));
}

// The other operand of the dot products, staged in shared memory in 16-byte units, lane-major
// within a step: lane l's values of step i are units (i * kUnits + q) * 32 + l.
//   E4M3 weights: the operand's E4M3 values as f16 (exact) times 2^-8, so that a product of
//     two stays below 2^10: packed f16 math (HFMA2) adds four products per accumulator half,
//     then float takes over. A third of the instructions of float math per weight byte.
//   16-bit weights: floats.
template <typename W>
struct Stage {
  static constexpr bool kFp8 = std::is_same_v<W, __nv_fp8_e4m3>;
  static constexpr int kPer = kFp8 ? 8 : 4;       // values per unit
  static constexpr int kUnits = kVals<W> / kPer;  // units per lane and step
  using Unit = std::conditional_t<kFp8, uint4, float4>;
  static constexpr int kValueBytes = kFp8 ? 2 : 4;

  // The unit of values k..k+kPer-1 (k % kPer == 0).
  static __device__ __forceinline__ int64_t slot(int64_t k) {
    const int64_t i = k / kStep<W>, rem = k % kStep<W>;
    return (i * kUnits + (rem % kVals<W>) / kPer) * 32 + rem / kVals<W>;
  }
  // Values k..k+7 (k % 8 == 0): E4M3 bytes (kFp8) or floats.
  static __device__ __forceinline__ void store_fp8(Unit* base, int64_t k, uint2 q) {
    static_assert(kFp8);
    const __half2 s = __float2half2_rn(1.f / 256.f);
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
    h[0] = __hmul2(fp8x2_to_half2(q.x), s), h[1] = __hmul2(fp8x2_to_half2(q.x >> 16), s);
    h[2] = __hmul2(fp8x2_to_half2(q.y), s), h[3] = __hmul2(fp8x2_to_half2(q.y >> 16), s);
    base[slot(k)] = u;
  }
  static __device__ __forceinline__ void store_floats(Unit* base, int64_t k, const float* v) {
    static_assert(!kFp8);
    base[slot(k)] = make_float4(v[0], v[1], v[2], v[3]);
    base[slot(k + 4)] = make_float4(v[4], v[5], v[6], v[7]);
  }
  static __device__ __forceinline__ void store_zeros(Unit* base, int64_t k) {
    if constexpr (kFp8) base[slot(k)] = make_uint4(0, 0, 0, 0);
    else base[slot(k)] = base[slot(k + 4)] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  // sum_i w_i * x_i over the kVals weights in `raw` and lane `lane`'s values of `step`.
  static __device__ __forceinline__ float dot(const uint4& raw, const Unit* base, int step, int lane) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (kFp8) {
      const uint4 xa = base[(step * 2) * 32 + lane], xb = base[(step * 2 + 1) * 32 + lane];
      const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      __half2 a0 = __float2half2_rn(0.f), a1 = a0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a0 = __hfma2(fp8x2_to_half2(words[i]), *reinterpret_cast<const __half2*>(&xw[2 * i]), a0);
        a1 = __hfma2(fp8x2_to_half2(words[i] >> 16), *reinterpret_cast<const __half2*>(&xw[2 * i + 1]), a1);
      }
      const float2 f0 = __half22float2(a0), f1 = __half22float2(a1);
      return ((f0.x + f0.y) + (f1.x + f1.y)) * 256.f;
    } else {
      float x[8];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 v = base[(step * 2 + q) * 32 + lane];
        x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
      }
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (std::is_same_v<W, __nv_bfloat16>) {
          s0 = fmaf(__uint_as_float(words[i] << 16), x[2 * i], s0);
          s1 = fmaf(__uint_as_float(words[i] & 0xffff0000u), x[2 * i + 1], s1);
        } else {
          const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
          s0 = fmaf(a.x, x[2 * i], s0);
          s1 = fmaf(a.y, x[2 * i + 1], s1);
        }
      }
      return s0 + s1;
    }
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

template <typename IdT>
__device__ __forceinline__ int64_t pair_expert(const void* ids, int64_t pair, int64_t offset, int experts) {
  const int64_t e = local_expert(static_cast<const IdT*>(ids), pair, offset);
  return e >= 0 && e < experts ? e : -1;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A warp's work is a list of items, 16 weight bytes per lane each: for each of its columns,
// for each of `rows` weight rows (gate and up; or the token's local slots), for each step.
// The list is walked in rounds of kRound items whose loads are all in flight together; the
// next round is prefetched into L2 meanwhile. Cursors advance without divisions.
constexpr int kRound = 8;
constexpr int kMaxCols = 16;  // columns per warp (cols_per_warp below)

struct Cursor {
  int col = 0, row = 0, step = 0;
  __device__ __forceinline__ void next(int rows, int steps) {
    if (++step == steps) {
      step = 0;
      if (++row == rows) row = 0, ++col;
    }
  }
};

// Loads (or, kPrefetch, L2-prefetches: one request per 128-byte line) the kRound items from
// `cur` on, of which `left` exist; at(cur) is the item's row pointer (step 0, lane 0).
template <bool kPrefetch, typename W, class At>
__device__ __forceinline__ void round_loads(uint4 (&buf)[kRound], Cursor cur, int left, int rows,
                                            int steps, int64_t chunks, int lane, At at) {
#pragma unroll
  for (int u = 0; u < kRound; ++u) {
    const int64_t chunk = int64_t(cur.step) * 32 + lane;
    const bool ok = u < left && chunk < chunks;
    if constexpr (kPrefetch) {
      if (ok && lane % 8 == 0) prefetch_l2(at(cur) + chunk * kVals<W>);
    } else {
      buf[u] = ok ? load_stream(at(cur) + chunk * kVals<W>) : make_uint4(0, 0, 0, 0);
    }
    cur.next(rows, steps);
  }
}

// Block (pair, column block): each warp computes cols_per_warp columns j of a (gate row j and
// up row I + j) against the pair's token row, staged (and quantized) in shared memory while
// the warps' first round of weight loads is in flight.
template <typename T, typename W, int kQuant, typename IdT>
__global__ void __launch_bounds__(kThreads) gemv_up_kernel(GemvArgs g, int cols_per_warp) {
  constexpr bool kBlock = kQuant == MOEK_QUANT_FP8_BLOCK;
  extern __shared__ float4 smem[];
  __shared__ float col_sums[kWarps][kMaxCols][2];
  const int64_t H = g.hidden, I = g.inter, padded_h = padded<W>(H);
  using S = Stage<W>;
  auto* xs = reinterpret_cast<typename S::Unit*>(smem);
  float* x_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + padded_h * S::kValueBytes);  // FP8_BLOCK: per 128
  float* warp_amax = x_scales + (kBlock ? H / 128 : 1);
  // The forward's first kernel: nothing is read before the wait (launch.cuh).
  pdl_wait();
  const int64_t pair = blockIdx.x;
  const int64_t e = pair_expert<IdT>(g.ids, pair, g.expert_offset, g.num_experts);
  if (e < 0) return;  // the whole block: an expert of another rank, or none
  const int64_t t = pair / g.top_k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool gated = is_gated(g.activation);
  const int rows = gated ? 2 : 1, steps = static_cast<int>(padded_h / kStep<W>);
  const int64_t n1 = gated ? 2 * I : I, chunks = H / kVals<W>;
  const int items = cols_per_warp * rows * steps;
  const W* w = static_cast<const W*>(g.w13) + e * n1 * H;
  auto column = [&](int c) { return (int64_t(blockIdx.y) * cols_per_warp + c) * kWarps + warp; };
  auto weight_row = [&](const Cursor& c) { return c.row * I + column(c.col); };
  auto at = [&](const Cursor& c) { return w + weight_row(c) * H; };
  uint4 buf[kRound];
  round_loads<false, W>(buf, Cursor{}, items, rows, steps, chunks, lane, at);

  // Stage x_t: floats (16-bit weights), or quantized to E4M3 after a first pass for the
  // dynamic scales (per token, or per 128 columns: 16 threads' vectors).
  const T* xrow = static_cast<const T*>(g.hidden_states) + t * H;
  if constexpr (kQuant == MOEK_QUANT_NONE) {
    for (int64_t c = threadIdx.x; c < H / 8; c += kThreads) {
      Vec8<T> v;
      v.load(xrow + c * 8);
      S::store_floats(xs, c * 8, v.v);
    }
  } else {
    float amax = 0.f;
    if (kBlock || !g.a13_scale) {
      for (int64_t c = threadIdx.x; c < H / 8; c += kThreads) {
        Vec8<T> v;
        v.load(xrow + c * 8);
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v.v[i]));
        if constexpr (kBlock) {  // kThreads % 16 == 0 and H % 128 == 0: whole half-warps
          m = half_warp_amax(m);
          if ((threadIdx.x & 15) == 0) x_scales[c / 16] = fp8_scale(m);
        }
        amax = fmaxf(amax, m);
      }
    }
    if constexpr (kQuant == MOEK_QUANT_FP8) {
      const float scale = g.a13_scale ? *g.a13_scale : fp8_scale(block_amax(amax));
      if (threadIdx.x == 0) x_scales[0] = scale;
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < H / 8; c += kThreads) {
      Vec8<T> v;
      v.load(xrow + c * 8);
      S::store_fp8(xs, c * 8, to_fp8x8(v.v, x_scales[kBlock ? c / 16 : 0]));
    }
  }
  for (int64_t k = H + 8 * threadIdx.x; k < padded_h; k += 8 * kThreads) S::store_zeros(xs, k);
  __syncthreads();

  const int64_t sf_k = H / 128, sf_n = (n1 + 127) / 128;  // FP8_BLOCK weight scales
  float acc[2] = {0.f, 0.f};
  Cursor cur;
  for (int i0 = 0; i0 < items; i0 += kRound) {
    if (i0 > 0) round_loads<false, W>(buf, cur, items - i0, rows, steps, chunks, lane, at);
    Cursor ahead = cur;
#pragma unroll
    for (int u = 0; u < kRound; ++u) ahead.next(rows, steps);
    round_loads<true, W>(buf, ahead, items - i0 - kRound, rows, steps, chunks, lane, at);
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      if (i0 + u >= items) break;
      const int64_t chunk = int64_t(cur.step) * 32 + lane;
      float d = S::dot(buf[u], xs, cur.step, lane);
      if constexpr (kBlock) {
        const int64_t grp = chunk * kVals<W> / 128;
        d = chunk < chunks ? d * x_scales[grp] * g.w13_scale[(e * sf_n + weight_row(cur) / 128) * sf_k + grp] : 0.f;
      }
      if (cur.row == 0) acc[0] += d;
      else acc[1] += d;
      if (cur.step == steps - 1 && cur.row == rows - 1) {  // the column is complete (warp-uniform)
        const float s0 = warp_sum(acc[0]), s1 = gated ? warp_sum(acc[1]) : 0.f;
        if (lane == 0) col_sums[warp][cur.col][0] = s0, col_sums[warp][cur.col][1] = s1;
        acc[0] = acc[1] = 0.f;
      }
      cur.next(rows, steps);
    }
  }
  __syncwarp();
  // Epilogues, a lane per column: dequantize, bias, activation.
  float my_amax = 0.f;
  if (lane < cols_per_warp) {
    const int64_t j = column(lane), rows2[2] = {j, I + j};
    float v0 = col_sums[warp][lane][0], v1 = col_sums[warp][lane][1];
    if constexpr (kQuant == MOEK_QUANT_FP8) {
      const float* ws = g.w13_scale + (g.w13_per_channel ? e * n1 : e);
      v0 *= x_scales[0] * ws[g.w13_per_channel ? rows2[0] : 0];
      if (gated) v1 *= x_scales[0] * ws[g.w13_per_channel ? rows2[1] : 0];
    }
    if (g.w13_bias) {
      const T* b = static_cast<const T*>(g.w13_bias) + e * n1;
      v0 += Vec8<T>::to_float(b[rows2[0]]);
      if (gated) v1 += Vec8<T>::to_float(b[rows2[1]]);
    }
    const float y = apply_act(g.activation, v0, v1, g.act_alpha, g.act_limit);
    g.a[pair * I + j] = y;
    my_amax = fabsf(y);
  }
  if (g.a_amax) {  // the block's amax, for gemv_down's dynamic scales
    my_amax = WarpTeam{}.amax(my_amax);
    if (lane == 0) warp_amax[warp] = my_amax;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0.f;
      for (int i = 0; i < kWarps; ++i) m = fmaxf(m, warp_amax[i]);
      g.a_amax[pair * gridDim.y + blockIdx.y] = m;
    }
  }
  pdl_trigger();  // late: gemv_down's blocks would only wait on the SMs this grid still needs
}

// Block (token, column block): each warp computes cols_per_warp output columns n over the
// token's local slots, against their activation rows, staged (and quantized) in shared
// memory. The weights and slots come from the caller, two launches back (launch.cuh): the
// first round of weight loads is issued before the wait for gemv_up.
template <typename T, typename W, int kQuant, typename IdT>
__global__ void __launch_bounds__(kThreads)
gemv_down_kernel(GemvArgs g, int cols_per_warp, int up_blocks) {
  constexpr bool kBlock = kQuant == MOEK_QUANT_FP8_BLOCK;
  extern __shared__ float4 smem[];
  __shared__ float col_sums[kWarps][kMaxCols];
  const int64_t H = g.hidden, I = g.inter, padded_i = padded<W>(I), k = g.top_k;
  const int64_t groups = kBlock ? I / 128 : 1;
  using S = Stage<W>;
  auto* as = reinterpret_cast<typename S::Unit*>(smem);        // [k][padded_i] values
  float* a_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + k * padded_i * S::kValueBytes);  // [k][groups]
  float* s_w = a_scales + k * groups;                           // [k] routing weights
  int32_t* s_e = reinterpret_cast<int32_t*>(s_w + k);           // [k] local experts
  int32_t* s_slot = s_e + k;                                    // [k] their slots
  int32_t* s_count = s_slot + k;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int n = 0;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = pair_expert<IdT>(g.ids, t * k + s, g.expert_offset, g.num_experts);
      if (e < 0) continue;
      s_e[n] = static_cast<int32_t>(e);
      s_slot[n] = static_cast<int32_t>(s);
      s_w[n] = g.topk_weights[t * k + s];
      ++n;
    }
    *s_count = n;
  }
  __syncthreads();
  const int nl = *s_count;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int steps = static_cast<int>(padded_i / kStep<W>);
  const int64_t chunks = I / kVals<W>;
  const int items = cols_per_warp * nl * steps;
  const W* w2 = static_cast<const W*>(g.w2);
  auto column = [&](int c) { return (int64_t(blockIdx.y) * cols_per_warp + c) * kWarps + warp; };
  auto at = [&](const Cursor& c) { return w2 + (int64_t(s_e[c.row]) * H + column(c.col)) * I; };
  uint4 buf[kRound];
  round_loads<false, W>(buf, Cursor{}, items, nl, steps, chunks, lane, at);
  pdl_wait();

  // Each local slot's scales (FP8), a warp per slot: static, or from gemv_up's block amaxes
  // (per 128 columns: the blocks of that group; a block covers 8 * cols_per_warp columns,
  // which divide 128).
  if constexpr (kQuant != MOEK_QUANT_NONE) {
    const int64_t per_group = up_blocks / groups;
    for (int li = warp; li < nl; li += kWarps) {
      const float* part = g.a_amax ? g.a_amax + (t * k + s_slot[li]) * up_blocks : nullptr;
      for (int64_t grp0 = 0; grp0 < groups; grp0 += 32) {
        float m = 0.f;
        if (!kBlock) {
          for (int64_t b = lane; b < up_blocks && part; b += 32) m = fmaxf(m, part[b]);
          m = WarpTeam{}.amax(m);
        } else if (grp0 + lane < groups) {
          for (int64_t b = (grp0 + lane) * per_group; b < (grp0 + lane + 1) * per_group; ++b) m = fmaxf(m, part[b]);
        }
        if (kBlock ? grp0 + lane < groups : lane == 0)
          a_scales[li * groups + grp0 + (kBlock ? lane : 0)] = !kBlock && g.a2_scale ? *g.a2_scale : fp8_scale(m);
      }
    }
    __syncthreads();
  }
  // The slots' rows, 8 values per thread and loop step, a slot per outer step (unrolled: several
  // loads in flight per thread); quantized with the slot's scales (FP8).
  const int64_t row_units = padded_i / S::kPer;
#pragma unroll 4
  for (int li = 0; li < nl; ++li) {
    const float* arow = g.a + (t * k + s_slot[li]) * I;
    for (int64_t kk = 8 * threadIdx.x; kk < padded_i; kk += 8 * kThreads) {
      if (kk >= I) {
        S::store_zeros(as + li * row_units, kk);
        continue;
      }
      const float4 lo = __ldg(reinterpret_cast<const float4*>(arow + kk));
      const float4 hi = __ldg(reinterpret_cast<const float4*>(arow + kk + 4));
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      if constexpr (kQuant == MOEK_QUANT_NONE) S::store_floats(as + li * row_units, kk, v);
      else S::store_fp8(as + li * row_units, kk, to_fp8x8(v, a_scales[li * groups + (kBlock ? kk / 128 : 0)]));
    }
  }
  __syncthreads();

  const int64_t sf_k = I / 128, sf_n = (H + 127) / 128;  // FP8_BLOCK weight scales
  float acc = 0.f;
  Cursor cur;
  for (int i0 = 0; i0 < items; i0 += kRound) {
    if (i0 > 0) round_loads<false, W>(buf, cur, items - i0, nl, steps, chunks, lane, at);
    Cursor ahead = cur;
#pragma unroll
    for (int u = 0; u < kRound; ++u) ahead.next(nl, steps);
    round_loads<true, W>(buf, ahead, items - i0 - kRound, nl, steps, chunks, lane, at);
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      if (i0 + u >= items) break;
      const int li = cur.row;
      const int64_t chunk = int64_t(cur.step) * 32 + lane, e = s_e[li];
      const float d = S::dot(buf[u], as + li * row_units, cur.step, lane);
      float scale = s_w[li];
      if constexpr (kBlock) {
        const int64_t grp = chunk * kVals<W> / 128;
        scale = chunk < chunks ? scale * a_scales[li * groups + grp] *
                                     g.w2_scale[(e * sf_n + column(cur.col) / 128) * sf_k + grp]
                               : 0.f;
      } else if constexpr (kQuant == MOEK_QUANT_FP8) {
        scale *= a_scales[li] * g.w2_scale[g.w2_per_channel ? e * H + column(cur.col) : e];
      }
      acc = fmaf(d, scale, acc);
      if (cur.step == steps - 1 && li == nl - 1) {  // the column is complete (warp-uniform)
        const float sum = warp_sum(acc);
        if (lane == 0) col_sums[warp][cur.col] = sum;
        acc = 0.f;
      }
      cur.next(nl, steps);
    }
  }
  __syncwarp();
  if (lane < cols_per_warp) {  // epilogues, a lane per column: biases, then the store
    const int64_t n = column(lane);
    float v = nl ? col_sums[warp][lane] : 0.f;
    if (g.w2_bias)
      for (int li = 0; li < nl; ++li)
        v += s_w[li] * Vec8<T>::to_float(static_cast<const T*>(g.w2_bias)[int64_t(s_e[li]) * H + n]);
    static_cast<T*>(g.out)[t * H + n] = Vec8<T>::from_float(v);
  }
  pdl_trigger();
}

// Columns per warp: the busiest SM's share, ceil(blocks / SMs) blocks of 8 * c columns plus the
// block's staging (`stage_cols`: its bytes in columns' weight bytes, halved as L2 reads), as
// small as possible, with a block for every SM; ties to more columns. A block covers 8 * c columns that divide n (and 128,
// for FP8_BLOCK's group amaxes).
int cols_per_warp(int64_t n, int64_t rows, int sm_count, double stage_cols) {
  int best = 1;
  double best_cost = 0.0;
  for (int c = 1; c <= kMaxCols && n % (kWarps * c) == 0; c *= 2) {
    const int64_t blocks = n / (kWarps * c) * rows;
    if (c > 1 && blocks < sm_count) break;  // an SM without a block
    const double cost = double((blocks + sm_count - 1) / sm_count) * (kWarps * c + stage_cols);
    if (c == 1 || cost <= best_cost) best = c, best_cost = cost;
  }
  return best;
}

template <typename T, typename W, int kQuant, typename IdT>
cudaError_t run(const GemvArgs& g, int last_kernel, cudaStream_t stream) {
  const int64_t pairs = g.num_tokens * g.top_k;
  auto up = gemv_up_kernel<T, W, kQuant, IdT>;
  const size_t up_smem = gemv_smem_bytes(g, true, sizeof(W));
  if (up_smem > 48 * 1024)
    if (cudaError_t e = cudaFuncSetAttribute(up, cudaFuncAttributeMaxDynamicSharedMemorySize, int(up_smem))) return e;
  const int64_t wb = sizeof(W), rows1 = is_gated(g.activation) ? 2 : 1;
  // gemv_up stages the token row (read twice for dynamic scales); gemv_down k float rows.
  const int up_cpw = cols_per_warp(g.inter, pairs, g.sm_count, 2.0 * g.hidden * sizeof(T) / 2 / (rows1 * g.hidden * wb));
  const int down_cpw = cols_per_warp(g.hidden, g.num_tokens, g.sm_count, 4.0 * g.inter / 2 / (g.inter * wb));
  const int up_blocks = static_cast<int>(g.inter / (kWarps * up_cpw));
  GemvArgs ga = g;
  if (kQuant == MOEK_QUANT_NONE || (kQuant == MOEK_QUANT_FP8 && g.a2_scale)) ga.a_amax = nullptr;
  if (cudaError_t e = launch(up, dim3(unsigned(pairs), unsigned(up_blocks)), kThreads, up_smem, stream, ga, up_cpw))
    return e;
  if (last_kernel < 2) return cudaSuccess;
  auto down = gemv_down_kernel<T, W, kQuant, IdT>;
  const size_t down_smem = gemv_smem_bytes(g, false, sizeof(W));
  if (down_smem > 48 * 1024)
    if (cudaError_t e = cudaFuncSetAttribute(down, cudaFuncAttributeMaxDynamicSharedMemorySize, int(down_smem))) return e;
  return launch(down, dim3(unsigned(g.num_tokens), unsigned(g.hidden / (kWarps * down_cpw))), kThreads,
                down_smem, stream, ga, down_cpw, up_blocks);
}

}  // namespace

size_t gemv_smem_bytes(const GemvArgs& g, bool up, int weight_bytes) {
  const int64_t step = 32 * 16 / weight_bytes;
  auto pad = [&](int64_t n) { return (n + step - 1) / step * step; };
  const bool block = g.quant == MOEK_QUANT_FP8_BLOCK;
  const int64_t value_bytes = weight_bytes == 1 ? 2 : 4;  // Stage<W>::kValueBytes
  if (up) return value_bytes * pad(g.hidden) + sizeof(float) * ((block ? g.hidden / 128 : 1) + kWarps);
  const int64_t groups = block ? g.inter / 128 : 1;
  return g.top_k * (value_bytes * pad(g.inter) + sizeof(float) * (groups + 3)) + sizeof(int32_t);
}

cudaError_t launch_gemv(const GemvArgs& g, int last_kernel, cudaStream_t stream) {
  auto by_id = [&](auto t, auto w, auto quant) {
    using T = decltype(t);
    using W = decltype(w);
    return g.ids_int64 ? run<T, W, decltype(quant)::value, int64_t>(g, last_kernel, stream)
                       : run<T, W, decltype(quant)::value, int32_t>(g, last_kernel, stream);
  };
  using Q = std::integral_constant<int, MOEK_QUANT_FP8>;
  using QB = std::integral_constant<int, MOEK_QUANT_FP8_BLOCK>;
  using QN = std::integral_constant<int, MOEK_QUANT_NONE>;
  switch (g.quant) {
    // The FP8 modes have bf16 activations and output (the catalog's FP8 kernels, api.py).
    case MOEK_QUANT_FP8: return g.fp16 ? cudaErrorInvalidValue : by_id(__nv_bfloat16{}, __nv_fp8_e4m3{}, Q{});
    case MOEK_QUANT_FP8_BLOCK: return g.fp16 ? cudaErrorInvalidValue : by_id(__nv_bfloat16{}, __nv_fp8_e4m3{}, QB{});
    default: return g.fp16 ? by_id(__half{}, __half{}, QN{}) : by_id(__nv_bfloat16{}, __nv_bfloat16{}, QN{});
  }
}

}  // namespace moe_kernels
