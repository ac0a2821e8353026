// Finalize: the weighted sum of each token's top-k expert rows, in slot order, so the
// result is bitwise the same on every run. GEMM2's bias is fused here.
#include <type_traits>

#include "kernels.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

template <typename T, typename IdT, bool kFp8>
__global__ void finalize_kernel(const T* y, const T* bias, const float* weights, const IdT* ids,
                                int64_t expert_offset, const int32_t* pair_dst, T* out,
                                int64_t hidden, int top_k, Fp8Scales q) {
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
      if constexpr (kFp8) {  // raw GEMM2 accumulators: dequantize
        const int64_t e = local_expert(ids, p, expert_offset);
        const float s = q.row[row];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          v.v[i] *= s * (q.per_channel ? q.weight[e * hidden + j + i] : q.weight[e]);
      }
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

template <typename T, typename IdT, bool kFp8>
cudaError_t launch(const void* y, const void* bias, const float* w, const void* ids,
                   int64_t expert_offset, const RoutingBuffers& rb, void* out, int64_t tokens,
                   int top_k, int64_t hidden, const Fp8Scales& q, cudaStream_t stream) {
  const int64_t vecs = hidden / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  finalize_kernel<T, IdT, kFp8><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
      static_cast<const T*>(y), static_cast<const T*>(bias), w, static_cast<const IdT*>(ids),
      expert_offset, rb.pair_dst, static_cast<T*>(out), hidden, top_k, q);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_finalize(bool fp16, const void* y, const void* bias, const float* topk_weights,
                            const void* topk_ids, bool ids_int64, int64_t expert_offset,
                            const RoutingBuffers& rb, void* out, int64_t num_tokens, int top_k,
                            int64_t hidden_size, const Fp8Scales& q, cudaStream_t stream) {
  auto go = [&](auto t, auto id, auto dequantize) {
    return launch<decltype(t), decltype(id), decltype(dequantize)::value>(
        y, bias, topk_weights, topk_ids, expert_offset, rb, out, num_tokens, top_k, hidden_size,
        q, stream);
  };
  // Only FP8's GEMM2 leaves raw accumulators; FP8_BLOCK's scales are applied in its mainloop.
  const bool dequant = q.quant == MOEK_QUANT_FP8;
  auto by_type = [&](auto id) {
    if (dequant) return fp16 ? go(__half{}, id, std::true_type{}) : go(__nv_bfloat16{}, id, std::true_type{});
    return fp16 ? go(__half{}, id, std::false_type{}) : go(__nv_bfloat16{}, id, std::false_type{});
  };
  return ids_int64 ? by_type(int64_t{}) : by_type(int32_t{});
}

}  // namespace moe_kernels
