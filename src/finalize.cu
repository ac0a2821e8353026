// Finalize: the weighted sum of each token's top-k expert rows, in slot order, so the
// result is bitwise the same on every run. GEMM2's bias is fused here.

#include "kernels.h"
#include "launch.cuh"
#include "vec.cuh"

namespace moe_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kSlotBatch = 8;  // slot rows loaded together, so their latencies overlap

// Block (t, c): token t, columns [c * kThreads * 8, ...), 8 per thread. The token's slot
// rows and weights (times weight_scale; null weights: 1, the inputs were weighted) are read
// once into shared memory; each thread then loads its columns of
// up to kSlotBatch rows at a time and adds them up in slot order. y is GEMM2's output as it
// wrote it (FP8: dequantized by GEMM2).
template <typename T, typename IdT>
__global__ void __launch_bounds__(kThreads)
finalize_kernel(const T* y, const T* bias, const float* weights, float weight_scale, const IdT* ids,
                ExpertIndex experts, const int32_t* pair_dst, T* out, int64_t hidden,
                int top_k) {
  extern __shared__ int32_t s_meta[];  // rows, experts, weights: top_k each
  int32_t* s_row = s_meta;
  int32_t* s_expert = s_meta + top_k;
  float* s_w = reinterpret_cast<float*>(s_meta + 2 * top_k);
  const int64_t t = blockIdx.x;
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) {
    const int64_t p = t * top_k + s;
    const int32_t row = pair_dst[p];  // -1: the expert is not on this rank
    s_row[s] = row;
    s_w[s] = (weights ? weights[p] : 1.f) * weight_scale;
    s_expert[s] = row >= 0 && bias ? static_cast<int32_t>(local_expert(ids, p, experts)) : 0;
  }
  // The slots' rows and weights come from routing, two or more launches back (launch.cuh):
  // read before the wait for GEMM2, which GEMM2's rows need.
  pdl_begin();
  __syncthreads();
  const int64_t j = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (j >= hidden) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s0 = 0; s0 < top_k; s0 += kSlotBatch) {
    // Loads first, unconditionally (a slot that is absent or off this rank reads row 0 and
    // is skipped below), so that all kSlotBatch are in flight together.
    uint4 raw[kSlotBatch];
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      const int32_t row = s0 + b < top_k ? s_row[s0 + b] : -1;
      raw[b] = *reinterpret_cast<const uint4*>(y + int64_t(row > 0 ? row : 0) * hidden + j);
    }
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      const int s = s0 + b;
      if (s >= top_k || s_row[s] < 0) continue;
      Vec8<T> v;
      v.unpack(raw[b]);
      const int64_t e = s_expert[s];
      if (bias) {
        Vec8<T> bv;
        bv.load(bias + e * hidden + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) v.v[i] += bv.v[i];
      }
      const float w = s_w[s];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v.v[i];
    }
  }
  Vec8<T> o;
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = acc[i];
  o.store(out + t * hidden + j);
}

template <typename T, typename IdT>
cudaError_t run(const void* y, const void* bias, const float* w, float weight_scale, const void* ids,
                   ExpertIndex experts, const RoutingBuffers& rb, void* out, int64_t tokens,
                   int top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t vecs = hidden / 8;
  // Few tokens (decode): narrower blocks, so that each token's columns spread over more SMs.
  const int64_t per_block = tokens < 64 ? 64 : kThreads;
  const int threads = static_cast<int>(vecs >= per_block ? per_block : (vecs + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((vecs + threads - 1) / threads));
  return launch(finalize_kernel<T, IdT>, grid, threads, 3 * sizeof(int32_t) * top_k, stream,
                static_cast<const T*>(y), static_cast<const T*>(bias), w, weight_scale,
                static_cast<const IdT*>(ids), experts, rb.pair_dst, static_cast<T*>(out),
                hidden, top_k);
}

}  // namespace

cudaError_t launch_finalize(bool fp16, const void* y, const void* bias, const float* topk_weights,
                            float weight_scale, const void* topk_ids, bool ids_int64, ExpertIndex experts,
                            const RoutingBuffers& rb, void* out, int64_t num_tokens, int top_k,
                            int64_t hidden_size, cudaStream_t stream) {
  auto go = [&](auto t, auto id) {
    return run<decltype(t), decltype(id)>(y, bias, topk_weights, weight_scale, topk_ids, experts, rb, out,
                                          num_tokens, top_k, hidden_size, stream);
  };
  auto by_type = [&](auto id) { return fp16 ? go(__half{}, id) : go(__nv_bfloat16{}, id); };
  return ids_int64 ? by_type(int64_t{}) : by_type(int32_t{});
}

}  // namespace moe_kernels
