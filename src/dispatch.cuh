// One switch per runtime enum that selects a template: each caller passes a lambda that takes
// the value as a std::integral_constant, and a value outside the list runs nothing and returns
// false, so no caller maps an unknown value to some default branch.
#pragma once

#include <type_traits>

#include "moe_kernels/c_api.h"

namespace moe_kernels {

template <int... kValues, class F>
__host__ __device__ __forceinline__ bool dispatch(int value, F&& f) {
  bool hit = false;
  ((value == kValues ? (f(std::integral_constant<int, kValues>{}), hit = true) : false), ...);
  return hit;
}

// Every activation (modes.Activation), and the gated ones.
template <class F>
__host__ __device__ __forceinline__ bool with_activation(int act, F&& f) {
  return dispatch<MOEK_ACTIVATION_LIST>(act, f);
}
template <class F>
__host__ __device__ __forceinline__ bool with_gated_activation(int act, F&& f) {
  return dispatch<MOEK_GATED_ACTIVATION_LIST>(act, f);
}

__host__ __device__ constexpr bool is_activation(int act) {
  for (int known : {MOEK_ACTIVATION_LIST})
    if (act == known) return true;
  return false;
}

// Gated activations read 2 * I columns of GEMM1's output (gate, then up) per row.
__host__ __device__ constexpr bool is_gated(int act) {
  for (int gated : {MOEK_GATED_ACTIVATION_LIST})
    if (act == gated) return true;
  return false;
}

// The activation formats that routing/expand and the activation kernel implement.
template <class F>
__host__ __device__ __forceinline__ bool with_act_format(int format, F&& f) {
  return dispatch<MOEK_ACT_FORMAT_A16, MOEK_ACT_FORMAT_FP8_ROW, MOEK_ACT_FORMAT_FP8_ROW128>(format, f);
}

__host__ __device__ constexpr bool runner_has_act_format(int format) {
  return format == MOEK_ACT_FORMAT_A16 || format == MOEK_ACT_FORMAT_FP8_ROW ||
         format == MOEK_ACT_FORMAT_FP8_ROW128;
}

}  // namespace moe_kernels
