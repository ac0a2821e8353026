// The activation between the two GEMMs, over the permuted rows, with GEMM1's bias fused.
#include <math.h>

#include <type_traits>

#include "kernels.h"
#include "moe_kernels/c_api.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

constexpr bool is_gated(int act) {
  return act == MOEK_ACT_SWIGLU || act == MOEK_ACT_GEGLU || act == MOEK_ACT_SWIGLU_OAI;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

template <int kAct>
__device__ __forceinline__ float apply(float gate, float up, float alpha, float limit) {
  if constexpr (kAct == MOEK_ACT_SWIGLU) return silu(gate) * up;
  if constexpr (kAct == MOEK_ACT_GEGLU) return gelu(gate) * up;
  if constexpr (kAct == MOEK_ACT_SWIGLU_OAI) {
    const float g = fminf(gate, limit);
    const float u = fminf(fmaxf(up, -limit), limit);
    return g / (1.0f + __expf(-alpha * g)) * (u + 1.0f);
  }
  if constexpr (kAct == MOEK_ACT_SILU) return silu(gate);
  if constexpr (kAct == MOEK_ACT_GELU) return gelu(gate);
  if constexpr (kAct == MOEK_ACT_RELU2) {
    const float r = fmaxf(gate, 0.0f);
    return r * r;
  }
  return gate;  // identity
}

// One block per permuted row; rows past the routed total (offsets[E]) exit at once.
template <int kAct, typename T, typename IdT>
__global__ void activation_kernel(const T* g, const T* bias, T* out, int64_t inter,
                                  const IdT* ids, int64_t expert_offset, const int32_t* offsets,
                                  const int32_t* row_src, int num_experts, float alpha,
                                  float limit) {
  const int64_t r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  const int64_t n1 = is_gated(kAct) ? 2 * inter : inter;
  const T* grow = g + r * n1;
  const T* brow = bias ? bias + local_expert(ids, row_src[r], expert_offset) * n1 : nullptr;
  T* orow = out + r * inter;
  for (int64_t j = threadIdx.x * 8; j < inter; j += int64_t(blockDim.x) * 8) {
    Vec8<T> gate, up, res;
    gate.load(grow + j);
    if constexpr (is_gated(kAct)) up.load(grow + inter + j);
    if (brow) {
      Vec8<T> b;
      b.load(brow + j);
#pragma unroll
      for (int i = 0; i < 8; ++i) gate.v[i] += b.v[i];
      if constexpr (is_gated(kAct)) {
        b.load(brow + inter + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) up.v[i] += b.v[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      res.v[i] = apply<kAct>(gate.v[i], is_gated(kAct) ? up.v[i] : 0.0f, alpha, limit);
    res.store(orow + j);
  }
}

template <int kAct, typename T, typename IdT>
cudaError_t launch(const void* g, const void* bias, void* out, int64_t max_rows, int64_t inter,
                   const void* ids, int64_t expert_offset, const RoutingBuffers& rb,
                   int num_experts, float alpha, float limit, cudaStream_t stream) {
  const int64_t vecs = inter / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  activation_kernel<kAct, T, IdT><<<static_cast<unsigned>(max_rows), threads, 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(bias), static_cast<T*>(out), inter,
      static_cast<const IdT*>(ids), expert_offset, rb.offsets, rb.row_src, num_experts, alpha,
      limit);
  return cudaGetLastError();
}

template <typename T, typename IdT>
cudaError_t dispatch_act(int activation, const void* g, const void* bias, void* out,
                         int64_t max_rows, int64_t inter, const void* ids, int64_t expert_offset,
                         const RoutingBuffers& rb, int num_experts, float alpha, float limit,
                         cudaStream_t stream) {
#define MOEK_ACT_CASE(A)                                                                         \
  case A:                                                                                      \
    return launch<A, T, IdT>(g, bias, out, max_rows, inter, ids, expert_offset, rb, num_experts, \
                             alpha, limit, stream);
  switch (activation) {
    MOEK_ACT_CASE(MOEK_ACT_SWIGLU)
    MOEK_ACT_CASE(MOEK_ACT_GEGLU)
    MOEK_ACT_CASE(MOEK_ACT_SWIGLU_OAI)
    MOEK_ACT_CASE(MOEK_ACT_SILU)
    MOEK_ACT_CASE(MOEK_ACT_GELU)
    MOEK_ACT_CASE(MOEK_ACT_RELU2)
    MOEK_ACT_CASE(MOEK_ACT_IDENTITY)
    default:
      return cudaErrorInvalidValue;
  }
#undef MOEK_ACT_CASE
}

}  // namespace

cudaError_t launch_activation(int activation, bool fp16, const void* g, const void* bias,
                              void* out, int64_t max_rows, int64_t inter_size,
                              const void* topk_ids, bool ids_int64, int64_t expert_offset,
                              const RoutingBuffers& rb, int num_experts, float alpha,
                              float limit, cudaStream_t stream) {
  auto go = [&](auto t, auto id) {
    using T = decltype(t);
    using IdT = decltype(id);
    return dispatch_act<T, IdT>(activation, g, bias, out, max_rows, inter_size, topk_ids,
                                expert_offset, rb, num_experts, alpha, limit, stream);
  };
  if (fp16) return ids_int64 ? go(__half{}, int64_t{}) : go(__half{}, int32_t{});
  return ids_int64 ? go(__nv_bfloat16{}, int64_t{}) : go(__nv_bfloat16{}, int32_t{});
}

}  // namespace moe_kernels
