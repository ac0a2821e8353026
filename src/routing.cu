// Expert map: a counting sort of the T*k (token, slot) pairs by local expert, done on the
// device in three launches with no host sync, plus the expand/permute of hidden rows.
#include <type_traits>

#include "kernels.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

// Experts whose counters fit in default (48 KB) shared memory get a per-block histogram;
// more experts fall back to global atomics, so there is no cap on E.
constexpr int kSmemHistogramExperts = 12 * 1024;
constexpr int kScanThreads = 1024;
// Up to this many (token, slot) pairs, one block does all of routing (route_small_kernel):
// at 8 pairs per thread it still finishes in a few microseconds, and it saves three launches.
constexpr int64_t kSmallRoutingPairs = 8 * kScanThreads;
constexpr int kCopyThreads = 128;

template <typename IdT, bool kSmem>
__global__ void histogram_kernel(const IdT* ids, int64_t num_pairs, int64_t expert_offset,
                                 int num_experts, int32_t* counts) {
  extern __shared__ int32_t s_counts[];
  if constexpr (kSmem) {
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
  }
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < num_pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    int64_t e = local_expert(ids, p, expert_offset);
    if (e >= 0 && e < num_experts) atomicAdd(kSmem ? &s_counts[e] : &counts[e], 1);
  }
  if constexpr (kSmem) {
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
      if (s_counts[i]) atomicAdd(&counts[i], s_counts[i]);
  }
}

__device__ __forceinline__ void fill_group(const GroupSetup& g, int e, int32_t rows,
                                           int32_t row_offset, int elem_bytes) {
  g.problem_shapes[3 * e + 0] = rows;
  g.problem_shapes[3 * e + 1] = static_cast<int32_t>(g.n);
  g.problem_shapes[3 * e + 2] = static_cast<int32_t>(g.k);
  g.ptr_a[e] = g.a_base + int64_t(row_offset) * g.k * elem_bytes;
  g.ptr_b[e] = g.b_base + int64_t(e) * g.n * g.k * elem_bytes;
  g.ptr_d[e] = g.d_base + int64_t(row_offset) * g.n * elem_bytes;
  g.stride_a[e] = g.k;
  g.stride_b[e] = g.k;
  g.stride_d[e] = g.n;
}

// Exclusive scan of the per-expert counts by one block, in chunks of its size with a carried
// running sum (so any number of experts). Writes offsets[0..E] and both GEMMs' group
// arguments; when `starts` is given, also each expert's first row (scatter cursors).
__device__ void scan_experts(const int32_t* counts, int num_experts, int32_t* offsets,
                             const GroupSetup& g1, const GroupSetup& g2, int elem_bytes,
                             int32_t* starts) {
  __shared__ int32_t warp_sums[kScanThreads / 32];
  __shared__ int32_t carry_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) carry_s = 0;
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int32_t c = e < num_experts ? counts[e] : 0;
    int32_t v = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int32_t n = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += n;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int32_t w = warp_sums[lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        int32_t n = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += n;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const int32_t carry = carry_s;
    const int32_t inclusive = carry + v + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (e < num_experts) {
      const int32_t start = inclusive - c;
      offsets[e] = start;
      if (starts) starts[e] = start;
      fill_group(g1, e, c, start, elem_bytes);
      fill_group(g2, e, c, start, elem_bytes);
    }
    __syncthreads();
    if (threadIdx.x == kScanThreads - 1) carry_s = inclusive;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[num_experts] = carry_s;
}

__global__ void __launch_bounds__(kScanThreads)
build_groups_kernel(const int32_t* counts, int num_experts, int32_t* offsets, GroupSetup g1,
                    GroupSetup g2, int elem_bytes) {
  scan_experts(counts, num_experts, offsets, g1, g2, elem_bytes, nullptr);
}

// Small batches (decode): one block counts, scans and assigns rows in shared memory, so
// routing is one launch instead of a memset and three kernels. Rows within an expert are
// claimed in arrival order; any order gives the same GEMM rows, so results do not depend on it.
template <typename IdT>
__global__ void __launch_bounds__(kScanThreads)
route_small_kernel(const IdT* ids, int64_t num_pairs, int64_t expert_offset, int num_experts,
                   int32_t* offsets, int32_t* row_src, int32_t* pair_dst, GroupSetup g1,
                   GroupSetup g2, int elem_bytes) {
  extern __shared__ int32_t s_counts[];  // counts, then the next free row per expert
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < num_pairs; p += blockDim.x) {
    const int64_t e = local_expert(ids, p, expert_offset);
    if (e >= 0 && e < num_experts) atomicAdd(&s_counts[e], 1);
  }
  __syncthreads();
  scan_experts(s_counts, num_experts, offsets, g1, g2, elem_bytes, s_counts);
  for (int64_t p = threadIdx.x; p < num_pairs; p += blockDim.x) {
    const int64_t e = local_expert(ids, p, expert_offset);
    int32_t row = -1;
    if (e >= 0 && e < num_experts) {
      row = atomicAdd(&s_counts[e], 1);
      row_src[row] = static_cast<int32_t>(p);
    }
    pair_dst[p] = row;
  }
}

// One block per pair: copy the token's hidden row to the pair's row (or nothing).
__global__ void __launch_bounds__(kCopyThreads)
expand_kernel(const int32_t* pair_dst, int top_k, const uint4* hidden, uint4* x,
              int64_t row_vecs) {
  const int64_t p = blockIdx.x;
  const int32_t row = pair_dst[p];
  if (row < 0) return;
  const uint4* src = hidden + (p / top_k) * row_vecs;
  uint4* dst = x + int64_t(row) * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += kCopyThreads) dst[i] = src[i];
}

// One block per pair: thread 0 claims the pair's row in its expert's block, then the block
// copies the token's hidden row there in 16-byte vectors (H % 8 == 0 is validated).
template <typename IdT>
__global__ void __launch_bounds__(kCopyThreads)
scatter_expand_kernel(const IdT* ids, int top_k, int64_t expert_offset, int num_experts,
                      const int32_t* offsets, int32_t* cursors, int32_t* row_src,
                      int32_t* pair_dst, const uint4* hidden, uint4* x, int64_t row_vecs) {
  __shared__ int32_t s_row;
  const int64_t p = blockIdx.x;
  if (threadIdx.x == 0) {
    const int64_t e = local_expert(ids, p, expert_offset);
    int32_t row = -1;
    if (e >= 0 && e < num_experts) {
      row = offsets[e] + atomicAdd(&cursors[e], 1);
      row_src[row] = static_cast<int32_t>(p);
    }
    pair_dst[p] = row;
    s_row = row;
  }
  __syncthreads();
  const int32_t row = s_row;
  if (row < 0) return;
  const uint4* src = hidden + (p / top_k) * row_vecs;
  uint4* dst = x + int64_t(row) * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += kCopyThreads) dst[i] = src[i];
}

template <typename IdT>
cudaError_t routing(const IdT* ids, int64_t num_pairs, int top_k, int64_t expert_offset,
                    int num_experts, const void* hidden, int64_t hidden_size, int elem_bytes,
                    void* x, RoutingBuffers rb, GroupSetup g1, GroupSetup g2, int sm_count,
                    cudaStream_t stream) {
  const int64_t row_vecs = hidden_size * elem_bytes / 16;
  cudaError_t err;
  if (num_pairs <= kSmallRoutingPairs && num_experts <= kSmemHistogramExperts) {
    route_small_kernel<IdT><<<1, kScanThreads, num_experts * sizeof(int32_t), stream>>>(
        ids, num_pairs, expert_offset, num_experts, rb.offsets, rb.row_src, rb.pair_dst, g1, g2,
        elem_bytes);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    expand_kernel<<<static_cast<unsigned>(num_pairs), kCopyThreads, 0, stream>>>(
        rb.pair_dst, top_k, static_cast<const uint4*>(hidden), static_cast<uint4*>(x), row_vecs);
    return cudaGetLastError();
  }
  err = cudaMemsetAsync(rb.counts, 0, sizeof(int32_t) * 2 * num_experts, stream);
  if (err != cudaSuccess) return err;
  constexpr int threads = 256;
  const int64_t want = (num_pairs + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 2 * sm_count ? want : 2 * sm_count);
  if (num_experts <= kSmemHistogramExperts) {
    histogram_kernel<IdT, true><<<blocks, threads, num_experts * sizeof(int32_t), stream>>>(
        ids, num_pairs, expert_offset, num_experts, rb.counts);
  } else {
    histogram_kernel<IdT, false><<<blocks, threads, 0, stream>>>(ids, num_pairs, expert_offset,
                                                                 num_experts, rb.counts);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  build_groups_kernel<<<1, kScanThreads, 0, stream>>>(rb.counts, num_experts, rb.offsets, g1, g2,
                                                      elem_bytes);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  scatter_expand_kernel<IdT><<<static_cast<unsigned>(num_pairs), kCopyThreads, 0, stream>>>(
      ids, top_k, expert_offset, num_experts, rb.offsets, rb.cursors, rb.row_src, rb.pair_dst,
      static_cast<const uint4*>(hidden), static_cast<uint4*>(x), row_vecs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_routing(const void* topk_ids, bool ids_int64, int64_t num_pairs, int top_k,
                           int64_t expert_offset, int num_experts, const void* hidden,
                           int64_t hidden_size, int elem_bytes, void* x, RoutingBuffers rb,
                           GroupSetup gemm1, GroupSetup gemm2, int sm_count, cudaStream_t stream) {
  if (ids_int64)
    return routing(static_cast<const int64_t*>(topk_ids), num_pairs, top_k, expert_offset,
                   num_experts, hidden, hidden_size, elem_bytes, x, rb, gemm1, gemm2, sm_count,
                   stream);
  return routing(static_cast<const int32_t*>(topk_ids), num_pairs, top_k, expert_offset,
                 num_experts, hidden, hidden_size, elem_bytes, x, rb, gemm1, gemm2, sm_count,
                 stream);
}

}  // namespace moe_kernels
