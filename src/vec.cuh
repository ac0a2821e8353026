// 16-byte vectors of eight 16-bit values, converted to and from float registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "kernels.h"  // ExpertIndex
#include "moe_kernels/c_api.h"

namespace moe_kernels {

template <typename T>
struct Vec8 {
  float v[8];

  __device__ __forceinline__ void load(const T* p) { unpack(*reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void unpack(const uint4& raw) {
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(h[i]);
  }
  __device__ __forceinline__ void store(T* p) const {
    uint4 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = from_float(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ T from_float(float x) {
    if constexpr (sizeof(T) == 2 && std::is_same_v<T, __half>) return __float2half_rn(x);
    else return __float2bfloat16_rn(x);
  }
};

// Floats to E4M3, each x * (1 / scale) rounded to nearest even and saturated to +-448
// (moe_kernels/fp8.py defines the same for the reference): two (given 1 / scale), or eight
// as 8 bytes. One correctly rounded reciprocal and eight multiplies: eight IEEE divisions
// made the activation and expand kernels instruction-bound.
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b, float inv_scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv_scale), __fmul_rn(b, inv_scale)),
                                  __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint2 to_fp8x8(const float* v, float scale) {
  const float inv = __frcp_rn(scale);
  uint2 raw;
  uint16_t* h = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = to_fp8x2(v[2 * i], v[2 * i + 1], inv);
  return raw;
}

// Eight E4M3 codes (as to_fp8x8 packs them) as their values in T, exactly (E4M3's values are
// all bf16 and fp16 values): the 16-bit form of a quantized row that the 4-bit decode GEMM
// reads for W4A8 (Fp8Scales::wide), the row's scale still applied by the GEMM.
template <typename T>
__device__ __forceinline__ uint4 widen_fp8x8(uint2 codes) {
  uint4 out;
  uint32_t* w = reinterpret_cast<uint32_t*>(&out);
  const uint16_t* c = reinterpret_cast<const uint16_t*>(&codes);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(c[i]), __NV_E4M3);
    if constexpr (std::is_same_v<T, __half>) {
      w[i] = uint32_t(h.x) | (uint32_t(h.y) << 16);
    } else {
      const float2 f = __half22float2(__half2(h));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      w[i] = reinterpret_cast<const uint32_t&>(b);
    }
  }
  return out;
}

// Eight E4M3 codes of columns j .. j + 7 (j % 8 == 0) at their places in a row whose 32-column
// blocks are permuted (Fp8Scales::permuted): the pair of columns 2t, 2t + 1 of the eight goes to
// bytes 16b + 2u + 4t of its block (b, u: which half and which 8 of that half the eight are).
__device__ __forceinline__ void store_fp8x8_permuted(uint8_t* row, int64_t j, uint2 q) {
  uint8_t* dst = row + (j & ~int64_t(31)) + 16 * ((j >> 4) & 1) + 2 * ((j >> 3) & 1);
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&q);
#pragma unroll
  for (int t = 0; t < 4; ++t) *reinterpret_cast<uint16_t*>(dst + 4 * t) = pairs[t];
}

// Eight quantized E4M3 codes q of column j of a row starting at `row`: as bytes (permuted: see
// store_fp8x8_permuted), or (wide) their values in T.
template <typename T>
__device__ __forceinline__ void store_codes8(void* row, bool wide, bool permuted, int64_t j, uint2 q) {
  if (wide) *reinterpret_cast<uint4*>(static_cast<T*>(row) + j) = widen_fp8x8<T>(q);
  else if (permuted) store_fp8x8_permuted(static_cast<uint8_t*>(row), j, q);
  else *reinterpret_cast<uint2*>(static_cast<uint8_t*>(row) + j) = q;
}

// Eight quantized values at column j of a row starting at `row` (store_codes8).
template <typename T>
__device__ __forceinline__ void store_fp8x8(void* row, bool wide, bool permuted, int64_t j, const float* v,
                                            float scale) {
  store_codes8<T>(row, wide, permuted, j, to_fp8x8(v, scale));
}

// Largest |v| over the block (every thread gets it). blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_amax(float v) {
  __shared__ float warp_max[32];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_max may still be read by a previous call
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  float m = 0.f;
  for (int i = 0; i < (blockDim.x >> 5); ++i) m = fmaxf(m, warp_max[i]);
  return m;
}

// The E4M3 scale of a group whose largest magnitude is amax; 1 for a group of zeros.
__device__ __forceinline__ float fp8_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// Largest |v| over the 16 lanes of this half-warp; those 16 lanes must all call it.
__device__ __forceinline__ float half_warp_amax(float v) {
  const unsigned mask = 0xffffu << (threadIdx.x & 16);
#pragma unroll
  for (int d = 8; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, d));
  return v;
}

// The threads that work on one row: the whole block (long rows), or one warp (short rows,
// several per block). Every thread of a team must make the same amax() calls.
struct BlockTeam {
  __device__ __forceinline__ int rank() const { return threadIdx.x; }
  __device__ __forceinline__ int size() const { return blockDim.x; }
  __device__ __forceinline__ float amax(float v) const { return block_amax(v); }
};
struct WarpTeam {
  __device__ __forceinline__ int rank() const { return threadIdx.x & 31; }
  __device__ __forceinline__ int size() const { return 32; }
  __device__ __forceinline__ float amax(float v) const {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    return v;
  }
};

// Where a quantized row goes: E4M3 bytes (or, wide, their values in T) and scales for one
// destination row.
template <typename T>
struct RowSink {
  void* dst;      // the row's first element
  float* scales;  // the row's first scale
  bool wide, permuted;
  __device__ __forceinline__ void store(int64_t j, const float* v, float scale) const {
    store_fp8x8<T>(dst, wide, permuted, j, v, scale);
  }
  __device__ __forceinline__ void scale(int64_t i, float s) const { scales[i] = s; }
};

// Up to kKeep vectors at once: value(j, v[c]) for each j = j0 + c * step < n. Straight-line
// code for each count, so that the loads of all of them are in flight together.
constexpr int kKeep = 4;
template <int kCount, class F>
__device__ __forceinline__ void compute_n(F value, int64_t j0, int64_t step, float (&v)[kKeep][8]) {
#pragma unroll
  for (int c = 0; c < kCount; ++c) value(j0 + c * step, v[c]);
}
template <class F>
__device__ __forceinline__ void compute_vectors(F value, int64_t j0, int64_t step, int64_t n,
                                                float (&v)[kKeep][8]) {
  const int64_t count = j0 < n ? (n - j0 + step - 1) / step : 0;
  static_assert(kKeep == 4, "one case per count below");
  switch (count) {
    case 0: break;
    case 1: compute_n<1>(value, j0, step, v); break;
    case 2: compute_n<2>(value, j0, step, v); break;
    case 3: compute_n<3>(value, j0, step, v); break;
    default: compute_n<4>(value, j0, step, v); break;
  }
}

// Quantizes one row of n values to E4M3, the team striding it 8 columns per thread;
// value(j, v) computes the 8 floats of columns j..j+7 into v, sink stores them (a RowSink,
// or anything with its two methods).
//   MOEK_ACT_FORMAT_FP8_ROW: one scale for the row, *static_scale or amax / 448 over the row; stored as
//     scale 0. A dynamic scale needs the whole row first: each thread keeps its first kKeep
//     vectors in registers, and only columns beyond those are computed twice.
//   MOEK_ACT_FORMAT_FP8_ROW128: a dynamic scale per 128 columns, i.e. per 16 consecutive lanes,
//     stored as scale j / 128. Needs n % 128 == 0 and a team size that is a multiple of 16.
template <int kFormat, class Team, class F, class Sink>
__device__ __forceinline__ void quantize_row(Team team, F value, int64_t n,
                                             const float* static_scale, const Sink& sink) {
  const int64_t step = int64_t(team.size()) * 8;
  const int64_t first = team.rank() * 8;
  if constexpr (kFormat == MOEK_ACT_FORMAT_FP8_ROW128) {
    for (int64_t j0 = first; j0 < n; j0 += kKeep * step) {
      float v[kKeep][8];
      compute_vectors(value, j0, step, n, v);
#pragma unroll
      for (int c = 0; c < kKeep; ++c) {
        const int64_t j = j0 + c * step;
        if (j >= n) break;  // the same for the 16 lanes of a group (n % 128 == 0)
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[c][i]));
        const float scale = fp8_scale(half_warp_amax(amax));
        if ((team.rank() & 15) == 0) sink.scale(j / 128, scale);
        sink.store(j, v[c], scale);
      }
    }
  } else {
    float kept[kKeep][8];
    compute_vectors(value, first, step, n, kept);
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < kKeep; ++c)
      if (first + c * step < n)
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(kept[c][i]));
    if (!static_scale) {
      for (int64_t j = first + kKeep * step; j < n; j += step) {
        float v[8];
        value(j, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
      }
    }
    const float scale = static_scale ? *static_scale : fp8_scale(team.amax(amax));
    if (team.rank() == 0) sink.scale(0, scale);
#pragma unroll
    for (int c = 0; c < kKeep; ++c) {
      const int64_t j = first + c * step;
      if (j < n) sink.store(j, kept[c], scale);
    }
    for (int64_t j = first + kKeep * step; j < n; j += step) {
      float v[8];
      value(j, v);
      sink.store(j, v, scale);
    }
  }
}

// topk_ids come as int32 or int64.
template <typename IdT>
__device__ __forceinline__ int64_t local_expert(const IdT* ids, int64_t pair, const ExpertIndex& experts) {
  return experts.local(static_cast<int64_t>(ids[pair]));
}

}  // namespace moe_kernels
