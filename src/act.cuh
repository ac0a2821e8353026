// The activations, elementwise: used by the activation kernel and by GEMM epilogues that
// apply the activation themselves (the contiguous fp8_block GEMM), so both compute the same.
#pragma once

#include <math.h>

#include "moe_kernels/c_api.h"

namespace moe_kernels {

// Fast exp and division (a few ulp; 0 for x below about -88, where 1 + e^-x overflows): the
// IEEE division was most of a long row's instructions.
__device__ __forceinline__ float sigmoid_times(float x, float a) { return __fdividef(x, 1.0f + __expf(-a * x)); }
__device__ __forceinline__ float silu(float x) { return sigmoid_times(x, 1.0f); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
// PyTorch's gelu(approximate="tanh") (Hugging Face's gelu_pytorch_tanh).
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

template <int kAct>
__device__ __forceinline__ float activate(float gate, float up, float alpha, float limit) {
  if constexpr (kAct == MOEK_ACT_SWIGLU) return silu(gate) * up;
  if constexpr (kAct == MOEK_ACT_GEGLU) return gelu(gate) * up;
  if constexpr (kAct == MOEK_ACT_GEGLU_TANH) return gelu_tanh(gate) * up;
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
  if constexpr (kAct == MOEK_ACT_RELU) return fmaxf(gate, 0.0f);
  return gate;  // identity
}

}  // namespace moe_kernels
