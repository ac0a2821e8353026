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

// s[i] = row_scale * the weight scale of column j + i: per channel (two 16-byte loads;
// j % 8 == 0 and the [E, N] scale rows start 32-byte aligned when N % 8 == 0) or per tensor.
__device__ __forceinline__ void load_scales8(const float* w, int64_t j, bool per_channel,
                                             float row_scale, float* s) {
  if (per_channel) {
    const float4 a = *reinterpret_cast<const float4*>(w + j);
    const float4 b = *reinterpret_cast<const float4*>(w + j + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = row_scale * v[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = row_scale * w[0];
  }
}

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
// 16-bit: out = act(g + bias). FP8: g holds raw GEMM1 accumulators, dequantized with the
// row's input scale and the weight scale first. Both FP8 modes quantize out to E4M3
// (quantize_row: per row, or per 128 columns for FP8_BLOCK, whose g is already dequantized).
template <int kAct, typename T, typename IdT, int kQuant>
__global__ void activation_kernel(const T* g, const T* bias, void* out, int64_t inter,
                                  const IdT* ids, int64_t expert_offset, const int32_t* offsets,
                                  const int32_t* row_src, int num_experts, float alpha,
                                  float limit, Fp8Scales q) {
  const int64_t r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  constexpr bool kGated = is_gated(kAct);
  constexpr bool kDequant = kQuant == MOEK_QUANT_FP8;
  const int64_t n1 = kGated ? 2 * inter : inter;
  const T* grow = g + r * n1;
  const bool need_expert = bias != nullptr || kDequant;
  const int64_t e = need_expert ? local_expert(ids, row_src[r], expert_offset) : 0;
  const T* brow = bias ? bias + e * n1 : nullptr;
  float in_scale = 1.f;
  const float* wscale = nullptr;
  if constexpr (kDequant) {
    in_scale = q.row[r];
    wscale = q.per_channel ? q.weight + e * n1 : q.weight + e;
  }

  auto compute = [&](int64_t j, float* res) {
    Vec8<T> gate, up;
    gate.load(grow + j);
    if constexpr (kGated) up.load(grow + inter + j);
    if constexpr (kDequant) {
      float sg[8], su[8];
      load_scales8(wscale, j, q.per_channel, in_scale, sg);
      if constexpr (kGated) load_scales8(wscale, inter + j, q.per_channel, in_scale, su);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        gate.v[i] *= sg[i];
        if constexpr (kGated) up.v[i] *= su[i];
      }
    }
    if (brow) {
      Vec8<T> b;
      b.load(brow + j);
#pragma unroll
      for (int i = 0; i < 8; ++i) gate.v[i] += b.v[i];
      if constexpr (kGated) {
        b.load(brow + inter + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) up.v[i] += b.v[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      res[i] = apply<kAct>(gate.v[i], kGated ? up.v[i] : 0.0f, alpha, limit);
  };

  if constexpr (kQuant == MOEK_QUANT_NONE) {
    T* orow = static_cast<T*>(out) + r * inter;
    for (int64_t j = threadIdx.x * 8; j < inter; j += int64_t(blockDim.x) * 8) {
      Vec8<T> res;
      compute(j, res.v);
      res.store(orow + j);
    }
  } else {
    const int64_t scales_per_row = kQuant == MOEK_QUANT_FP8_BLOCK ? inter / 128 : 1;
    quantize_row<kQuant>(compute, inter, static_cast<uint8_t*>(out) + r * inter, q.static_out,
                         q.row_out + r * scales_per_row);
  }
}

template <int kAct, typename T, typename IdT, int kQuant>
cudaError_t launch(const void* g, const void* bias, void* out, int64_t max_rows, int64_t inter,
                   const void* ids, int64_t expert_offset, const RoutingBuffers& rb,
                   int num_experts, float alpha, float limit, const Fp8Scales& q,
                   cudaStream_t stream) {
  const int64_t vecs = inter / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  activation_kernel<kAct, T, IdT, kQuant><<<static_cast<unsigned>(max_rows), threads, 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(bias), out, inter,
      static_cast<const IdT*>(ids), expert_offset, rb.offsets, rb.row_src, num_experts, alpha,
      limit, q);
  return cudaGetLastError();
}

template <typename T, typename IdT, int kQuant>
cudaError_t dispatch_act(int activation, const void* g, const void* bias, void* out,
                         int64_t max_rows, int64_t inter, const void* ids, int64_t expert_offset,
                         const RoutingBuffers& rb, int num_experts, float alpha, float limit,
                         const Fp8Scales& q, cudaStream_t stream) {
#define MOEK_ACT_CASE(A)                                                                   \
  case A:                                                                                  \
    return launch<A, T, IdT, kQuant>(g, bias, out, max_rows, inter, ids, expert_offset, rb,  \
                                   num_experts, alpha, limit, q, stream);
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
                              float limit, const Fp8Scales& q, cudaStream_t stream) {
  auto go = [&](auto t, auto id, auto quant) {
    return dispatch_act<decltype(t), decltype(id), decltype(quant)::value>(
        activation, g, bias, out, max_rows, inter_size, topk_ids, expert_offset, rb, num_experts,
        alpha, limit, q, stream);
  };
  auto by_quant = [&](auto t, auto id) {
    switch (q.quant) {
      case MOEK_QUANT_FP8: return go(t, id, std::integral_constant<int, MOEK_QUANT_FP8>{});
      case MOEK_QUANT_FP8_BLOCK: return go(t, id, std::integral_constant<int, MOEK_QUANT_FP8_BLOCK>{});
      default: return go(t, id, std::integral_constant<int, MOEK_QUANT_NONE>{});
    }
  };
  auto by_type = [&](auto id) { return fp16 ? by_quant(__half{}, id) : by_quant(__nv_bfloat16{}, id); };
  return ids_int64 ? by_type(int64_t{}) : by_type(int32_t{});
}

}  // namespace moe_kernels
