// The interface every generated grouped-GEMM instantiation implements, and the registry
// that lists them. One group per local expert; shapes and pointers live in device memory,
// written by the routing kernels, so launching never needs the per-expert counts on the host.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_kernels/c_api.h"

namespace moe_kernels {

// D_g[M_g, N] = A_g[M_g, K] x B_g[N, K]^T for each group g; row-major A/D, K-major B.
struct GroupedGemmArgs {
  int num_groups;
  int32_t* problem_shapes;  // [num_groups][3] = (M, N, K)
  int32_t* problem_shapes_t;  // [num_groups][3] = (N, M, K): for kernels that swap A and B
  const void** ptr_a;
  int64_t* stride_a;        // leading dimension of each A_g
  const void** ptr_b;
  int64_t* stride_b;
  void** ptr_d;
  int64_t* stride_d;
  // FP8 only, per group: A's and B's scales. fp8_block (block-scaled kernels): A's [M_g, K/128]
  // and B's [N/128, K/128], applied in the mainloop. fp8: A's [M_g] (one per row) and B's [N]
  // (sfb_per_channel) or [1], applied to the output: D = acc * sfa[m] * sfb[n or 0].
  const float** ptr_sfa;
  const float** ptr_sfb;
  bool sfb_per_channel;
  void* workspace;          // at least workspace_size(num_groups, sm_count) bytes
  // For kernels that size their grid and pick a variant on the host (the decode schedule):
  // the groups with rows, listed on the device ([0]: how many, [1..]: which), an upper bound
  // on that count, and N and K (the same for every group).
  const int32_t* active_groups;
  int max_active_groups;
  int64_t n, k;
  // Mixed-input (4-bit) kernels: weight scales per group of this many along K; B's scale
  // pointers are ptr_sfb (one per group, [K / weight_group, N] each).
  int weight_group;
  // INT4 with zero points: 16-bit additive zero terms (dequantized = q * scale + zero) laid out
  // as the scales, group g's at zero_base + g * (K / weight_group) * N elements; else NULL.
  const void* zero_base;
  // For kernels that address all groups through one tensor each (the contiguous schedule):
  // the experts' row offsets [num_groups + 1] on the device, the row capacity of A and D, and
  // the base pointers the per-group ones above point into; and a counter (zero at launch,
  // routing resets it every forward) from which the CTAs take their tiles.
  const int32_t* offsets;
  int32_t* tile_counter;
  int64_t rows;
  const void* a_base;
  const void* b_base;
  void* d_base;
  const float* sfa_base;
  const float* sfb_base;
  // GEMM1 only, for kernels with GemmKernelOps::fuses_activation (else act_out is NULL and D
  // is written as usual): instead of D, the gated activation of D (gate columns [0, I), up
  // columns [I, 2I), I = n / 2) plus the bias, quantized to E4M3 per row per 128 columns, as the
  // activation kernel would write it: act_out [rows, I], act_scale [rows, I / 128].
  void* act_out;
  float* act_scale;
  const void* act_bias;  // [E, 2I] or NULL
  int activation;        // moek_activation, gated
  float act_alpha, act_limit;
  int device;
  int sm_count;
  cudaStream_t stream;
};

struct GemmKernelOps {
  int (*run)(const GroupedGemmArgs& args, char* err, size_t errlen);
  // Whether run() can take these arguments, from host-side values only; launches nothing, so
  // the runner asks both GEMMs before the forward's first launch.
  int (*check)(const GroupedGemmArgs& args, char* err, size_t errlen);
  size_t (*workspace_size)(int num_groups, int sm_count);
  int smem_bytes;
  bool fuses_activation;  // takes GroupedGemmArgs::act_out (the fp8_block gated activation)
  // FP8 activations: reads its input's E4M3 values widened to the hidden dtype (Fp8Scales::wide),
  // written so by the step before it, instead of the E4M3 bytes.
  bool wide_fp8_tokens = false;
  // FP8 activations: reads each 32 columns of its input's E4M3 bytes permuted (Fp8Scales::permuted):
  // byte 4t + i (and 16 + the same) holds column {2t, 2t + 1, 2t + 8, 2t + 9}[i] (and 16 + the
  // same), so that 4-bit weights in the fragment layout of 16-bit MMAs are the A registers of
  // E4M3 ones (src/gemm/sm90/contiguous_w4.cuh).
  bool permuted_fp8_tokens = false;
};

struct KernelEntry {
  moek_kernel_info info;
  const GemmKernelOps* ops;
};

// Generated registry (<arch>/registry.cpp).
extern const KernelEntry kKernels[];
extern const int kNumKernels;
extern const char* const kArchName;  // per-arch library suffix, e.g. "sm90a"
extern const int kArchMajor, kArchMinor;

}  // namespace moe_kernels
