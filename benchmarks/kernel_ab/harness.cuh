// What the kernel A/B harnesses share: error checks, bf16 bits, a hash for device-filled
// weights, and the timer (CUDA events around back-to-back launches).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      printf("CUDA %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);           \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static inline float bf(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t tobf(float f) {
  __nv_bfloat16 h = __float2bfloat16(f);
  return reinterpret_cast<uint16_t&>(h);
}

__device__ __host__ inline uint32_t hash32(uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 32;
  return uint32_t(x);
}

// Microseconds per call of fn, over reps back-to-back calls after one warm-up call.
template <class Fn>
static float time_it(Fn fn, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  fn();
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) fn();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  return ms * 1000.f / reps;
}
