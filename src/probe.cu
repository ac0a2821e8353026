// Read-only streaming probes: kernels that only read a buffer, as fast as the GPU can, and
// reduce it to a checksum (the XOR of its 16-byte words, so no load can be dropped). The
// benchmark times them on a buffer of a forward's weight size: a decode forward streams its
// weights once and writes almost nothing, so this rate, not a copy's (read + write), is the
// ceiling it is measured against.
//
//   method 0: 16-byte vector loads kept out of L1 (as the decode kernels load weights),
//             kUnroll loads in flight per thread, every SM full of threads.
//   method 1: bulk copies (cp.async.bulk, SM90+) of kChunk bytes into a ring of kStages
//             shared-memory buffers per block, one thread issuing, all threads reducing.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "moe_kernels/c_api.h"
#include "launch.cuh"

namespace moe_kernels {
namespace {

constexpr int kVecThreads = 512;
constexpr int kUnroll = 8;
constexpr int kBulkThreads = 256;
constexpr int kChunk = 16384;  // bytes per bulk copy
constexpr int kStages = 4;     // 64 KB of shared memory per block

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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void wait_phase(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
#endif

// Block b reads chunks b, b + grid, ... through its ring; the last chunk may be short.
__global__ void __launch_bounds__(kBulkThreads) read_bulk(const char* p, size_t bytes,
                                                          unsigned long long* checksum) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];  // kStages x kChunk
  __shared__ __align__(8) uint64_t full[kStages];
  pdl_begin();
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  auto chunk_bytes = [&](size_t c) {
    return static_cast<uint32_t>(c + 1 < chunks ? kChunk : bytes - c * kChunk);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) {
      const size_t c = blockIdx.x + size_t(s) * gridDim.x;
      if (c < chunks) bulk_load(ring + s * kChunk, p + c * kChunk, chunk_bytes(c), &full[s]);
    }
  uint4 acc = make_uint4(0, 0, 0, 0);
  int s = 0;
  uint32_t parity = 0;
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    wait_phase(&full[s], parity);
    const uint4* buf = reinterpret_cast<const uint4*>(ring + s * kChunk);
    const uint32_t words = chunk_bytes(c) / 16;
    for (uint32_t w = threadIdx.x; w < words; w += kBulkThreads) xor_into(acc, buf[w]);
    __syncthreads();  // every thread is done with stage s before it is refilled
    const size_t next = c + size_t(kStages) * gridDim.x;
    if (threadIdx.x == 0 && next < chunks) bulk_load(ring + s * kChunk, p + next * kChunk, chunk_bytes(next), &full[s]);
    if (++s == kStages) { s = 0; parity ^= 1; }
  }
  reduce_to(acc, checksum);
#endif
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
  int sms = 0, major = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
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
  } else if (method == 1) {
    if (major < 9) return fail(MOEK_UNSUPPORTED, "read probe: bulk copies need SM90 or newer");
    const size_t smem = size_t(kStages) * kChunk;
    const cudaError_t attr = cudaFuncSetAttribute(read_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem));
    if (attr != cudaSuccess) return fail(MOEK_CUDA_ERROR, "read probe: %s", cudaGetErrorString(attr));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_bulk, kBulkThreads, smem);
    const size_t chunks = (bytes + kChunk - 1) / kChunk;
    const size_t blocks = std::min<size_t>(size_t(sms) * (per_sm > 0 ? per_sm : 1), chunks);
    e = launch(read_bulk, dim3(static_cast<unsigned>(blocks)), dim3(kBulkThreads), smem, s,
               static_cast<const char*>(data), bytes, checksum);
  } else {
    return fail(MOEK_INVALID_ARGUMENT, "read probe: method %d, expected 0 (vector loads) or 1 (bulk copies)", method);
  }
  if (e != cudaSuccess) return fail(MOEK_CUDA_ERROR, "read probe launch: %s", cudaGetErrorString(e));
  return MOEK_OK;
}
