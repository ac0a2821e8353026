// 16-byte vectors of eight 16-bit values, converted to and from float registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "moe_kernels/c_api.h"

namespace moe_kernels {

template <typename T>
struct Vec8 {
  float v[8];

  __device__ __forceinline__ void load(const T* p) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
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

// Eight floats to E4M3, each x / scale rounded to nearest even and saturated to +-448
// (moe_kernels/fp8.py defines the same for the reference).
__device__ __forceinline__ void store_fp8x8(uint8_t* p, const float* v, float scale) {
  uint2 raw;
  uint16_t* h = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i] / scale, v[2 * i + 1] / scale),
                                    __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint2*>(p) = raw;
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

// Quantizes one row of n values to E4M3 at dst, the block striding it 8 columns per
// thread; value(j, v) computes the 8 floats of columns j..j+7 into v.
//   MOEK_QUANT_FP8: one scale for the row, *static_scale or amax / 448 over the row; written
//     to scales[0]. A dynamic scale needs the whole row first: each thread keeps its first
//     kKeep vectors in registers, and only columns beyond those are computed twice.
//   MOEK_QUANT_FP8_BLOCK: a dynamic scale per 128 columns, i.e. per 16 consecutive lanes,
//     written to scales[j / 128]. Needs n % 128 == 0 and blockDim.x % 16 == 0.
template <int kQuant, class F>
__device__ __forceinline__ void quantize_row(F value, int64_t n, uint8_t* dst,
                                             const float* static_scale, float* scales) {
  const int64_t step = int64_t(blockDim.x) * 8;
  const int64_t first = threadIdx.x * 8;
  if constexpr (kQuant == MOEK_QUANT_FP8_BLOCK) {
    for (int64_t j = first; j < n; j += step) {
      float v[8];
      value(j, v);
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
      const float scale = fp8_scale(half_warp_amax(amax));
      if ((threadIdx.x & 15) == 0) scales[j / 128] = scale;
      store_fp8x8(dst + j, v, scale);
    }
  } else {
    constexpr int kKeep = 4;
    float kept[kKeep][8];
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < kKeep; ++c) {
      const int64_t j = first + c * step;
      if (j < n) {
        value(j, kept[c]);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(kept[c][i]));
      }
    }
    if (!static_scale) {
      for (int64_t j = first + kKeep * step; j < n; j += step) {
        float v[8];
        value(j, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
      }
    }
    const float scale = static_scale ? *static_scale : fp8_scale(block_amax(amax));
    if (threadIdx.x == 0) scales[0] = scale;
#pragma unroll
    for (int c = 0; c < kKeep; ++c) {
      const int64_t j = first + c * step;
      if (j < n) store_fp8x8(dst + j, kept[c], scale);
    }
    for (int64_t j = first + kKeep * step; j < n; j += step) {
      float v[8];
      value(j, v);
      store_fp8x8(dst + j, v, scale);
    }
  }
}

// topk_ids come as int32 or int64; the expert index relative to this rank's first expert.
template <typename IdT>
__device__ __forceinline__ int64_t local_expert(const IdT* ids, int64_t pair, int64_t expert_offset) {
  return static_cast<int64_t>(ids[pair]) - expert_offset;
}

}  // namespace moe_kernels
