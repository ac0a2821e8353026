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
// 16-bit: out = act(g + bias). fp8: g holds raw GEMM1 accumulators, dequantized with the
// row's input scale and the weight scale; the result is quantized to E4M3 with the static
// scale or the row's amax (a first pass finds it, a second recomputes and stores).
template <int kAct, typename T, typename IdT, bool kFp8>
__global__ void activation_kernel(const T* g, const T* bias, void* out, int64_t inter,
                                  const IdT* ids, int64_t expert_offset, const int32_t* offsets,
                                  const int32_t* row_src, int num_experts, float alpha,
                                  float limit, Fp8Scales q) {
  const int64_t r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  constexpr bool kGated = is_gated(kAct);
  const int64_t n1 = kGated ? 2 * inter : inter;
  const T* grow = g + r * n1;
  const bool need_expert = bias != nullptr || kFp8;
  const int64_t e = need_expert ? local_expert(ids, row_src[r], expert_offset) : 0;
  const T* brow = bias ? bias + e * n1 : nullptr;
  float in_scale = 1.f;
  const float* wscale = nullptr;
  if constexpr (kFp8) {
    in_scale = q.row[r];
    wscale = q.per_channel ? q.weight + e * n1 : q.weight + e;
  }

  auto compute = [&](int64_t j, Vec8<T>& res) {
    Vec8<T> gate, up;
    gate.load(grow + j);
    if constexpr (kGated) up.load(grow + inter + j);
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        gate.v[i] *= in_scale * (q.per_channel ? wscale[j + i] : wscale[0]);
        if constexpr (kGated) up.v[i] *= in_scale * (q.per_channel ? wscale[inter + j + i] : wscale[0]);
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
      res.v[i] = apply<kAct>(gate.v[i], kGated ? up.v[i] : 0.0f, alpha, limit);
  };

  if constexpr (!kFp8) {
    T* orow = static_cast<T*>(out) + r * inter;
    for (int64_t j = threadIdx.x * 8; j < inter; j += int64_t(blockDim.x) * 8) {
      Vec8<T> res;
      compute(j, res);
      res.store(orow + j);
    }
  } else {
    float scale;
    if (q.static_out) {
      scale = *q.static_out;
    } else {
      float amax = 0.f;
      for (int64_t j = threadIdx.x * 8; j < inter; j += int64_t(blockDim.x) * 8) {
        Vec8<T> res;
        compute(j, res);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(res.v[i]));
      }
      scale = fp8_scale(block_amax(amax));
    }
    if (threadIdx.x == 0) q.row_out[r] = scale;
    uint8_t* orow = static_cast<uint8_t*>(out) + r * inter;
    for (int64_t j = threadIdx.x * 8; j < inter; j += int64_t(blockDim.x) * 8) {
      Vec8<T> res;
      compute(j, res);
      store_fp8x8(orow + j, res.v, scale);
    }
  }
}

template <int kAct, typename T, typename IdT, bool kFp8>
cudaError_t launch(const void* g, const void* bias, void* out, int64_t max_rows, int64_t inter,
                   const void* ids, int64_t expert_offset, const RoutingBuffers& rb,
                   int num_experts, float alpha, float limit, const Fp8Scales& q,
                   cudaStream_t stream) {
  const int64_t vecs = inter / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  activation_kernel<kAct, T, IdT, kFp8><<<static_cast<unsigned>(max_rows), threads, 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(bias), out, inter,
      static_cast<const IdT*>(ids), expert_offset, rb.offsets, rb.row_src, num_experts, alpha,
      limit, q);
  return cudaGetLastError();
}

template <typename T, typename IdT, bool kFp8>
cudaError_t dispatch_act(int activation, const void* g, const void* bias, void* out,
                         int64_t max_rows, int64_t inter, const void* ids, int64_t expert_offset,
                         const RoutingBuffers& rb, int num_experts, float alpha, float limit,
                         const Fp8Scales& q, cudaStream_t stream) {
#define MOEK_ACT_CASE(A)                                                                   \
  case A:                                                                                  \
    return launch<A, T, IdT, kFp8>(g, bias, out, max_rows, inter, ids, expert_offset, rb,  \
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
                              float limit, bool fp8, const Fp8Scales& q, cudaStream_t stream) {
  auto go = [&](auto t, auto id, auto quantize) {
    return dispatch_act<decltype(t), decltype(id), decltype(quantize)::value>(
        activation, g, bias, out, max_rows, inter_size, topk_ids, expert_offset, rb, num_experts,
        alpha, limit, q, stream);
  };
  auto by_type = [&](auto id) {
    if (fp8) return fp16 ? go(__half{}, id, std::true_type{}) : go(__nv_bfloat16{}, id, std::true_type{});
    return fp16 ? go(__half{}, id, std::false_type{}) : go(__nv_bfloat16{}, id, std::false_type{});
  };
  return ids_int64 ? by_type(int64_t{}) : by_type(int32_t{});
}

}  // namespace moe_kernels
