// Read-only streaming probe: a kernel that only reads a buffer, as fast as the GPU can, and
// reduces it to a checksum (the XOR of its 16-byte words, so no load can be dropped). The
// benchmark times them on a buffer of a forward's weight size: a decode forward streams its
// weights once and writes almost nothing, so this rate, not a copy's (read + write), is the
// ceiling it is measured against.
//
//   method 0: 16-byte vector loads kept out of L1 (as the decode kernels load weights),
//             kUnroll loads in flight per thread, every SM full of threads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "moe_kernels/c_api.h"
#include "launch.cuh"

namespace moe_kernels {
namespace {

constexpr int kVecThreads = 512;
constexpr int kUnroll = 8;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void xor_into(uint4& a, const uint4& b) {
  a.x ^= b.x; a.y ^= b.y; a.z ^= b.z; a.w ^= b.w;
}

// The block's XOR into checksum[0..1] (two 64-bit words: bytes 0-7 and 8-15 of the words).
__device__ __forceinline__ void reduce_to(uint4 v, unsigned long long* checksum) {
  for (int o = 16; o > 0; o >>= 1) {
    v.x ^= __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y ^= __shfl_xor_sync(0xffffffffu, v.y, o);
    v.z ^= __shfl_xor_sync(0xffffffffu, v.z, o);
    v.w ^= __shfl_xor_sync(0xffffffffu, v.w, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicXor(checksum, (static_cast<unsigned long long>(v.y) << 32) | v.x);
    atomicXor(checksum + 1, (static_cast<unsigned long long>(v.w) << 32) | v.z);
  }
}

__global__ void __launch_bounds__(kVecThreads) read_vector(const uint4* p, size_t words,
                                                           unsigned long long* checksum) {
  pdl_begin();
  uint4 acc = make_uint4(0, 0, 0, 0);
  const size_t step = size_t(gridDim.x) * kVecThreads * kUnroll;
  size_t i = size_t(blockIdx.x) * kVecThreads * kUnroll + threadIdx.x;
  for (; i + (kUnroll - 1) * kVecThreads < words; i += step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_stream(p + i + u * kVecThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) xor_into(acc, v[u]);
  }
  for (int u = 0; u < kUnroll && i + u * kVecThreads < words; ++u) xor_into(acc, load_stream(p + i + u * kVecThreads));
  reduce_to(acc, checksum);
}

}  // namespace
}  // namespace moe_kernels

using namespace moe_kernels;

extern "C" int moek_read_probe(const void* data, size_t bytes, int32_t method, unsigned long long* checksum,
                               int32_t device, void* stream, char* err, size_t errlen) {
  auto fail = [&](int st, const char* fmt, auto... a) {
    snprintf(err, errlen, fmt, a...);
    return st;
  };
  if (!data || !checksum)
    return fail(MOEK_INVALID_ARGUMENT, "read probe: null buffer or checksum");
  if (bytes == 0 || bytes % 16)
    return fail(MOEK_INVALID_ARGUMENT, "read probe: bytes=%zu, expected a positive multiple of 16", bytes);
  if (reinterpret_cast<uintptr_t>(data) % 16 || reinterpret_cast<uintptr_t>(checksum) % 8)
    return fail(MOEK_INVALID_ARGUMENT, "read probe: the buffer must be 16-byte aligned and the checksum 8-byte "
                "aligned (got %p and %p)", data, static_cast<void*>(checksum));
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return fail(MOEK_CUDA_ERROR, "read probe: cannot query device %d", device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  if (method == 0) {
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_vector, kVecThreads, 0);
    const size_t words = bytes / 16, per_block = size_t(kVecThreads) * kUnroll;
    const size_t blocks = std::min<size_t>(size_t(sms) * (per_sm > 0 ? per_sm : 1), (words + per_block - 1) / per_block);
    e = launch(read_vector, dim3(static_cast<unsigned>(blocks)), dim3(kVecThreads), 0, s,
               static_cast<const uint4*>(data), words, checksum);
  } else {
    return fail(MOEK_INVALID_ARGUMENT, "read probe: method %d, expected 0 (vector loads)", method);
  }
  if (e != cudaSuccess) return fail(MOEK_CUDA_ERROR, "read probe launch: %s", cudaGetErrorString(e));
  return MOEK_OK;
}
