// 16-byte vectors of eight 16-bit values, converted to and from float registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

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

// topk_ids come as int32 or int64; the expert index relative to this rank's first expert.
template <typename IdT>
__device__ __forceinline__ int64_t local_expert(const IdT* ids, int64_t pair, int64_t expert_offset) {
  return static_cast<int64_t>(ids[pair]) - expert_offset;
}

}  // namespace moe_kernels
