// Finalize: the weighted sum of each token's top-k expert rows, in slot order, so the
// result is bitwise the same on every run. GEMM2's bias is fused here.
#include "kernels.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

template <typename T, typename IdT>
__global__ void finalize_kernel(const T* y, const T* bias, const float* weights, const IdT* ids,
                                int64_t expert_offset, const int32_t* pair_dst, T* out,
                                int64_t hidden, int top_k) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x * 8; j < hidden; j += int64_t(blockDim.x) * 8) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < top_k; ++s) {
      const int64_t p = t * top_k + s;
      const int32_t row = pair_dst[p];
      if (row < 0) continue;  // expert not on this rank
      const float w = weights[p];
      Vec8<T> v;
      v.load(y + int64_t(row) * hidden + j);
      if (bias) {
        Vec8<T> b;
        b.load(bias + local_expert(ids, p, expert_offset) * hidden + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) v.v[i] += b.v[i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v.v[i];
    }
    Vec8<T> o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = acc[i];
    o.store(out + t * hidden + j);
  }
}

template <typename T, typename IdT>
cudaError_t launch(const void* y, const void* bias, const float* w, const void* ids,
                   int64_t expert_offset, const RoutingBuffers& rb, void* out, int64_t tokens,
                   int top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t vecs = hidden / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  finalize_kernel<T, IdT><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
      static_cast<const T*>(y), static_cast<const T*>(bias), w, static_cast<const IdT*>(ids),
      expert_offset, rb.pair_dst, static_cast<T*>(out), hidden, top_k);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_finalize(bool fp16, const void* y, const void* bias, const float* topk_weights,
                            const void* topk_ids, bool ids_int64, int64_t expert_offset,
                            const RoutingBuffers& rb, void* out, int64_t num_tokens, int top_k,
                            int64_t hidden_size, cudaStream_t stream) {
  auto go = [&](auto t, auto id) {
    return launch<decltype(t), decltype(id)>(y, bias, topk_weights, topk_ids, expert_offset, rb,
                                             out, num_tokens, top_k, hidden_size, stream);
  };
  if (fp16) return ids_int64 ? go(__half{}, int64_t{}) : go(__half{}, int32_t{});
  return ids_int64 ? go(__nv_bfloat16{}, int64_t{}) : go(__nv_bfloat16{}, int32_t{});
}

}  // namespace moe_kernels
