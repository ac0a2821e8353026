// Expert map: a counting sort of the T*k (token, slot) pairs by local expert, done on the
// device in three launches with no host sync, plus the expand/permute of hidden rows.
#include <type_traits>

#include "dispatch.cuh"
#include "kernels.h"
#include "launch.cuh"
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

template <typename IdT, bool kSmem>
__global__ void histogram_kernel(const IdT* ids, int64_t num_pairs, ExpertIndex experts,
                                 int num_experts, int32_t* counts) {
  extern __shared__ int32_t s_counts[];
  pdl_begin();
  if constexpr (kSmem) {
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
  }
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < num_pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    int64_t e = local_expert(ids, p, experts);
    if (e >= 0 && e < num_experts) atomicAdd(kSmem ? &s_counts[e] : &counts[e], 1);
  }
  if constexpr (kSmem) {
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
      if (s_counts[i]) atomicAdd(&counts[i], s_counts[i]);
  }
}

__device__ __forceinline__ void fill_group(const GroupSetup& g, int e, int32_t rows,
                                           int32_t row_offset) {
  g.problem_shapes[3 * e + 0] = rows;
  g.problem_shapes[3 * e + 1] = static_cast<int32_t>(g.n);
  g.problem_shapes[3 * e + 2] = static_cast<int32_t>(g.k);
  g.problem_shapes_t[3 * e + 0] = static_cast<int32_t>(g.n);
  g.problem_shapes_t[3 * e + 1] = rows;
  g.problem_shapes_t[3 * e + 2] = static_cast<int32_t>(g.k);
  g.ptr_a[e] = g.a_base + int64_t(row_offset) * g.k * g.a_bytes;
  g.ptr_b[e] = g.b_base + int64_t(e) * g.n * g.b_k * g.b_bits / 8;
  g.ptr_d[e] = g.d_base + int64_t(row_offset) * g.n * g.d_bytes;
  g.stride_a[e] = g.k;
  g.stride_b[e] = g.b_k;
  g.stride_d[e] = g.n;
  if (g.ptr_sfa) g.ptr_sfa[e] = g.sfa_base + int64_t(row_offset) * g.sfa_per_row;
  if (g.ptr_sfb)
    g.ptr_sfb[e] = reinterpret_cast<const float*>(reinterpret_cast<const char*>(g.sfb_base) +
                                                  int64_t(e) * g.sfb_group_bytes);
}

// Exclusive scan of the per-expert counts by one block, in chunks of its size with a carried
// running sum (so any number of experts). Writes offsets[0..E], both GEMMs' group arguments
// (and zeroes their tile counters) and the list of experts with rows (g1.active: [0] = how
// many, then which, in order); when `starts` is given, also each expert's first row (scatter
// cursors). The rows (low 32 bits) and the experts with rows (high 32 bits) are scanned
// together as one 64-bit sum.
__device__ void scan_experts(const int32_t* counts, int num_experts, int32_t* offsets,
                             const GroupSetup& g1, const GroupSetup& g2, int32_t* starts) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  __shared__ int64_t carry_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) carry_s = 0;
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int32_t c = e < num_experts ? counts[e] : 0;
    const int64_t mine = (int64_t(c > 0) << 32) | c;
    int64_t v = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int64_t n = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += n;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t w = warp_sums[lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        int64_t n = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += n;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const int64_t inclusive = carry_s + v + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (e < num_experts) {
      const int64_t before = inclusive - mine;
      const int32_t start = static_cast<int32_t>(before & 0xffffffff);
      offsets[e] = start;
      if (starts) starts[e] = start;
      if (c > 0) g1.active[1 + (before >> 32)] = e;
      fill_group(g1, e, c, start);
      fill_group(g2, e, c, start);
    }
    __syncthreads();
    if (threadIdx.x == kScanThreads - 1) carry_s = inclusive;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    offsets[num_experts] = static_cast<int32_t>(carry_s & 0xffffffff);
    g1.active[0] = static_cast<int32_t>(carry_s >> 32);
    *g1.tile_counter = 0;  // the GEMMs of this forward start from their first tile
    *g2.tile_counter = 0;
  }
}

__global__ void __launch_bounds__(kScanThreads)
build_groups_kernel(const int32_t* counts, int num_experts, int32_t* offsets, GroupSetup g1,
                    GroupSetup g2) {
  pdl_begin();
  scan_experts(counts, num_experts, offsets, g1, g2, nullptr);
}

// Small batches (decode): one block counts, scans and assigns rows in shared memory, so
// routing is one launch instead of a memset and three kernels. Rows within an expert are
// claimed in arrival order; any order gives the same GEMM rows, so results do not depend on it.
template <typename IdT>
__global__ void __launch_bounds__(kScanThreads)
route_small_kernel(const IdT* ids, int64_t num_pairs, ExpertIndex experts, int num_experts,
                   int32_t* offsets, int32_t* row_src, int32_t* pair_dst, GroupSetup g1,
                   GroupSetup g2) {
  extern __shared__ int32_t s_counts[];  // counts, then the next free row per expert
  pdl_begin();
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < num_pairs; p += blockDim.x) {
    const int64_t e = local_expert(ids, p, experts);
    if (e >= 0 && e < num_experts) atomicAdd(&s_counts[e], 1);
  }
  __syncthreads();
  scan_experts(s_counts, num_experts, offsets, g1, g2, s_counts);
  for (int64_t p = threadIdx.x; p < num_pairs; p += blockDim.x) {
    const int64_t e = local_expert(ids, p, experts);
    int32_t row = -1;
    if (e >= 0 && e < num_experts) {
      row = atomicAdd(&s_counts[e], 1);
      row_src[row] = static_cast<int32_t>(p);
    }
    pair_dst[p] = row;
  }
}

// Every destination row of one token: the same E4M3 bytes (or, wide, their values in T) and
// scales go to each of its local slots' rows (rows[s] < 0: the slot's expert is not on this
// rank).
template <typename T>
struct TokenRowsSink {
  void* x;  // column c0 of row 0
  float* scales;
  const int32_t* rows;
  int top_k;
  int64_t hidden, scales_per_row;
  bool wide, permuted;
  __device__ __forceinline__ void store(int64_t j, const float* v, float scale) const {
    const uint2 q = to_fp8x8(v, scale);
    if (wide) {
      const uint4 w = widen_fp8x8<T>(q);
      for (int s = 0; s < top_k; ++s)
        if (rows[s] >= 0) *reinterpret_cast<uint4*>(static_cast<T*>(x) + int64_t(rows[s]) * hidden + j) = w;
    } else {
      for (int s = 0; s < top_k; ++s)
        if (rows[s] >= 0) store_codes8<T>(static_cast<uint8_t*>(x) + int64_t(rows[s]) * hidden, false, permuted, j, q);
    }
  }
  __device__ __forceinline__ void scale(int64_t i, float sc) const {
    for (int s = 0; s < top_k; ++s)
      if (rows[s] >= 0) scales[int64_t(rows[s]) * scales_per_row + i] = sc;
  }
};

// The block reads columns [c0, c1) of token row `src` (H % 8 == 0) once and writes them to
// each of the token's rows of x: as is (A16), or quantized to E4M3 once
// (quantize_row in vec.cuh says how, per mode; FP8 with a dynamic scale needs the whole
// row, FP8_BLOCK 128-column multiples). `rows` is in shared memory.
template <typename T, int kFormat>
__device__ __forceinline__ void expand_token(const T* src, void* x, const int32_t* rows,
                                             int top_k, int64_t hidden, int64_t c0, int64_t c1,
                                             const Fp8Scales& q) {
  if constexpr (kFormat == MOEK_ACT_FORMAT_A16) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* x4 = reinterpret_cast<uint4*>(x);
    const int64_t vecs = hidden / 8;
    for (int64_t i = c0 / 8 + threadIdx.x; i < c1 / 8; i += blockDim.x) {
      const uint4 v = s4[i];
      for (int s = 0; s < top_k; ++s)
        if (rows[s] >= 0) x4[int64_t(rows[s]) * vecs + i] = v;
    }
  } else {
    constexpr bool kBlock = kFormat == MOEK_ACT_FORMAT_FP8_ROW128;
    quantize_row<kFormat>(
        BlockTeam{},
        [&](int64_t j, float* v) {
          Vec8<T> in;
          in.load(src + c0 + j);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = in.v[i];
        },
        c1 - c0, q.static_out,
        TokenRowsSink<T>{q.wide ? static_cast<void*>(static_cast<T*>(x) + c0)
                                : static_cast<void*>(static_cast<uint8_t*>(x) + c0),
                         q.row_out + (kBlock ? c0 / 128 : 0), rows, top_k, hidden,
                         kBlock ? hidden / 128 : 1, q.wide, q.permuted});
  }
}

// Threads per token block: one 8-column vector each, at most 256 (multiples of 32, which
// the FP8 amax needs).
int expand_threads(int64_t hidden) {
  const int64_t vecs = hidden / 8;
  return vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
}

// Columns per expand_kernel block: a few tokens (decode) would otherwise leave most SMs idle
// while one block per token walks its whole row. FP8 with a dynamic per-token scale needs
// the whole row in one block.
constexpr int64_t kExpandChunk = 1024;  // 128 threads x 8 columns; a multiple of 128
bool expand_splits(int format, const Fp8Scales& q) {
  return format != MOEK_ACT_FORMAT_FP8_ROW || q.static_out != nullptr;
}

// Block (t, c): token t, columns [c * kExpandChunk, ...) (c = 0 only: the whole row when
// the mode cannot split); rows already assigned by route_small_kernel.
template <typename T, int kFormat>
__global__ void __launch_bounds__(256)
expand_kernel(const int32_t* pair_dst, int top_k, const T* hidden, void* x, int64_t hidden_size,
              Fp8Scales q) {
  extern __shared__ int32_t s_rows[];  // [top_k]
  pdl_begin();
  const int64_t t = blockIdx.x;
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) s_rows[s] = pair_dst[t * top_k + s];
  __syncthreads();
  const int64_t c0 = gridDim.y > 1 ? blockIdx.y * kExpandChunk : 0;
  const int64_t c1 = gridDim.y > 1 && c0 + kExpandChunk < hidden_size ? c0 + kExpandChunk : hidden_size;
  expand_token<T, kFormat>(hidden + t * hidden_size, x, s_rows, top_k, hidden_size, c0, c1, q);
}

// One block per token: its slots' threads claim their rows in the experts' blocks, then
// the block expands the token's hidden row to them.
template <typename IdT, typename T, int kFormat>
__global__ void __launch_bounds__(256)
scatter_expand_kernel(const IdT* ids, int top_k, ExpertIndex experts, int num_experts,
                      const int32_t* offsets, int32_t* cursors, int32_t* row_src,
                      int32_t* pair_dst, const T* hidden, void* x, int64_t hidden_size,
                      Fp8Scales q) {
  extern __shared__ int32_t s_rows[];  // [top_k]
  pdl_begin();
  const int64_t t = blockIdx.x;
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) {
    const int64_t p = t * top_k + s;
    const int64_t e = local_expert(ids, p, experts);
    int32_t row = -1;
    if (e >= 0 && e < num_experts) {
      row = offsets[e] + atomicAdd(&cursors[e], 1);
      row_src[row] = static_cast<int32_t>(p);
    }
    pair_dst[p] = row;
    s_rows[s] = row;
  }
  __syncthreads();
  expand_token<T, kFormat>(hidden + t * hidden_size, x, s_rows, top_k, hidden_size, 0,
                          hidden_size, q);
}

template <typename IdT, typename T, int kFormat>
cudaError_t routing(const IdT* ids, int64_t num_pairs, int top_k, ExpertIndex experts,
                    int num_experts, const T* hidden, int64_t hidden_size, void* x,
                    const Fp8Scales& q, RoutingBuffers rb, GroupSetup g1, GroupSetup g2,
                    int sm_count, cudaStream_t stream) {
  cudaError_t err;
  const unsigned tokens = static_cast<unsigned>(num_pairs / top_k);
  const int threads = expand_threads(hidden_size);
  const size_t rows_smem = sizeof(int32_t) * top_k;
  if (num_pairs <= kSmallRoutingPairs && num_experts <= kSmemHistogramExperts) {
    err = launch(route_small_kernel<IdT>, 1, kScanThreads, num_experts * sizeof(int32_t), stream,
                 ids, num_pairs, experts, num_experts, rb.offsets, rb.row_src, rb.pair_dst,
                 g1, g2);
    if (err != cudaSuccess) return err;
    const bool split = expand_splits(kFormat, q) && hidden_size > kExpandChunk;
    const dim3 grid(tokens, split ? static_cast<unsigned>((hidden_size + kExpandChunk - 1) / kExpandChunk) : 1);
    return launch(expand_kernel<T, kFormat>, grid, split ? int(kExpandChunk / 8) : threads, rows_smem,
                  stream, rb.pair_dst, top_k, hidden, x, hidden_size, q);
  }
  // A memset is not a kernel (no PDL): the histogram after it is launched plainly.
  err = cudaMemsetAsync(rb.counts, 0, sizeof(int32_t) * 2 * num_experts, stream);
  if (err != cudaSuccess) return err;
  constexpr int hist_threads = 256;
  const int64_t want = (num_pairs + hist_threads - 1) / hist_threads;
  const int blocks = static_cast<int>(want < 2 * sm_count ? want : 2 * sm_count);
  if (num_experts <= kSmemHistogramExperts) {
    histogram_kernel<IdT, true><<<blocks, hist_threads, num_experts * sizeof(int32_t), stream>>>(
        ids, num_pairs, experts, num_experts, rb.counts);
  } else {
    histogram_kernel<IdT, false><<<blocks, hist_threads, 0, stream>>>(ids, num_pairs, experts,
                                                                 num_experts, rb.counts);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = launch(build_groups_kernel, 1, kScanThreads, 0, stream, rb.counts, num_experts,
               rb.offsets, g1, g2);
  if (err != cudaSuccess) return err;
  return launch(scatter_expand_kernel<IdT, T, kFormat>, tokens, threads, rows_smem, stream, ids,
                top_k, experts, num_experts, rb.offsets, rb.cursors, rb.row_src,
                rb.pair_dst, hidden, x, hidden_size, q);
}

}  // namespace

cudaError_t launch_routing(const void* topk_ids, bool ids_int64, int64_t num_pairs, int top_k,
                           ExpertIndex experts, int num_experts, const void* hidden,
                           bool hidden_fp16, int64_t hidden_size, void* x,
                           const Fp8Scales& q, RoutingBuffers rb, GroupSetup gemm1,
                           GroupSetup gemm2, int sm_count, cudaStream_t stream) {
  auto by_type = [&](auto id, auto t) {
    using IdT = decltype(id);
    using T = decltype(t);
    cudaError_t err = cudaErrorInvalidValue;  // an activation format routing does not implement
    with_act_format(q.act_format, [&](auto format) {
      err = routing<IdT, T, decltype(format)::value>(
          static_cast<const IdT*>(topk_ids), num_pairs, top_k, experts, num_experts,
          static_cast<const T*>(hidden), hidden_size, x, q, rb, gemm1, gemm2, sm_count, stream);
    });
    return err;
  };
  auto by_id = [&](auto id) {
    return hidden_fp16 ? by_type(id, __half{}) : by_type(id, __nv_bfloat16{});
  };
  return ids_int64 ? by_id(int64_t{}) : by_id(int32_t{});
}

}  // namespace moe_kernels
