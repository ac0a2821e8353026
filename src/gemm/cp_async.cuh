// Shared-memory primitives of our own kernels: 16-byte cp.async copies (global -> shared, L1
// bypassed), their commit groups, and ldmatrix. Arch-neutral (SM80+).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_kernels {
namespace cp_async {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared with an L2 prefetch of the 256 bytes around them; zeros where !ok.
__device__ __forceinline__ void copy_16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }

// Four 8x8 matrices of 16-bit values (8 rows of 16 bytes each); lane l points at row l % 8 of
// matrix l / 8 and receives, of each matrix, row l / 4's bytes 4 (l % 4) .. 4 (l % 4) + 3.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

}  // namespace cp_async
}  // namespace moe_kernels
