// The activations between the two GEMMs, on float values; shared by the grouped path's
// activation kernel and the small-batch (gemv) path.
#pragma once

#include <math.h>

#include "moe_kernels/c_api.h"

namespace moe_kernels {

constexpr bool is_gated(int act) {
  return act == MOEK_ACT_SWIGLU || act == MOEK_ACT_GEGLU || act == MOEK_ACT_SWIGLU_OAI;
}

// Fast exp and division (a few ulp; 0 for x below about -88, where 1 + e^-x overflows): the
// IEEE division was most of a long row's instructions.
__device__ __forceinline__ float sigmoid_times(float x, float a) { return __fdividef(x, 1.0f + __expf(-a * x)); }
__device__ __forceinline__ float silu(float x) { return sigmoid_times(x, 1.0f); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

template <int kAct>
__device__ __forceinline__ float apply(float gate, float up, float alpha, float limit) {
  if constexpr (kAct == MOEK_ACT_SWIGLU) return silu(gate) * up;
  if constexpr (kAct == MOEK_ACT_GEGLU) return gelu(gate) * up;
  if constexpr (kAct == MOEK_ACT_SWIGLU_OAI) {
    const float g = fminf(gate, limit);
    const float u = fminf(fmaxf(up, -limit), limit);
    return sigmoid_times(g, alpha) * (u + 1.0f);
  }
  if constexpr (kAct == MOEK_ACT_SILU) return silu(gate);
  if constexpr (kAct == MOEK_ACT_GELU) return gelu(gate);
  if constexpr (kAct == MOEK_ACT_RELU2) {
    const float r = fmaxf(gate, 0.0f);
    return r * r;
  }
  return gate;  // identity
}

// The same by a runtime code, for kernels that do not instantiate one variant per activation.
__device__ __forceinline__ float apply_act(int act, float gate, float up, float alpha, float limit) {
  switch (act) {
    case MOEK_ACT_SWIGLU: return apply<MOEK_ACT_SWIGLU>(gate, up, alpha, limit);
    case MOEK_ACT_GEGLU: return apply<MOEK_ACT_GEGLU>(gate, up, alpha, limit);
    case MOEK_ACT_SWIGLU_OAI: return apply<MOEK_ACT_SWIGLU_OAI>(gate, up, alpha, limit);
    case MOEK_ACT_SILU: return apply<MOEK_ACT_SILU>(gate, up, alpha, limit);
    case MOEK_ACT_GELU: return apply<MOEK_ACT_GELU>(gate, up, alpha, limit);
    case MOEK_ACT_RELU2: return apply<MOEK_ACT_RELU2>(gate, up, alpha, limit);
    default: return gate;  // identity
  }
}

}  // namespace moe_kernels
