// Launchers for the non-GEMM steps of the fused MoE forward (routing.cu, activation.cu,
// finalize.cu). All take device pointers and a stream, never sync, never allocate.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dispatch.cuh"
#include "moe_kernels/c_api.h"

namespace moe_kernels {

// Device-side description of one grouped GEMM's per-expert arguments, filled by the
// routing kernels: A_e = a_base + offsets[e] rows, B_e = b_base + e * n * k, D_e likewise.
// FP8 GEMMs also get scale pointers: SFA_e = sfa_base + offsets[e] rows of sfa_per_row floats,
// SFB_e = sfb_base + e * sfb_per_group (fp8_block: [ceil(k/128)] per row and [ceil(n/128),
// ceil(k/128)] per expert; fp8: one per row, and n per expert per channel or one per tensor).
// Which local expert a global expert id is: id - offset (this rank's experts are a contiguous
// range), or map[id] with a global-to-local map (-1: held elsewhere; ids past it: none). The
// callers check the result against the local expert count.
struct ExpertIndex {
  int64_t offset;
  const int32_t* map;  // [map_size], or null
  int64_t map_size;
  __host__ __device__ __forceinline__ int64_t local(int64_t id) const {
    if (!map) return id - offset;
    return id >= 0 && id < map_size ? map[id] : -1;
  }
};

struct GroupSetup {
  int32_t* problem_shapes;  // [E][3]: (M, N, K)
  int32_t* problem_shapes_t;  // [E][3]: (N, M, K), for the swap-AB kernels
  const void** ptr_a;
  int64_t* stride_a;
  const void** ptr_b;
  int64_t* stride_b;
  void** ptr_d;
  int64_t* stride_d;
  const char* a_base;
  const char* b_base;
  char* d_base;
  int64_t n, k;
  int64_t b_k;              // the weights' K extent: k, or for 4-bit weights k padded to 128 (their
                            // fragment layout, quant4.py), so an expert's weights are n * b_k / 2 bytes
  int32_t a_bytes, b_bits, d_bytes;  // element sizes (the weights' in bits: 4-bit ones pack two a byte)
  const float** ptr_sfa;    // NULL unless the activations are quantized
  const float** ptr_sfb;    // NULL unless the weights are scaled (INT4: 16-bit scales)
  const float* sfa_base;
  const float* sfb_base;
  const void* zero_base;    // INT4 with zero points: 16-bit zero terms, laid out as the scales; else NULL
  int64_t sfa_per_row;      // floats
  int64_t sfb_group_bytes;  // bytes of one expert's weight scales (FP8: floats; INT4: 16-bit)
  bool sfb_per_channel;     // FP8: n weight scales per expert (else one)
  int32_t weight_group;     // 4-bit weights: scales per this many along K (else 0)
  int32_t* active;          // [E + 1]: experts with rows, [0] = how many (both GEMMs share it)
  int32_t* tile_counter;    // this GEMM's next tile, for kernels that take tiles dynamically
                            // (the contiguous schedule); routing zeroes it every forward
};

// How a step writes a GEMM's input (dequantized = q * scale): `act_format` is the problem's
// moek_act_format. The GEMMs dequantize their outputs themselves (E4M3 weights: in the
// epilogue, 128x128 blocks: in the mainloop). FP8_ROW: per row, or with a static per-tensor
// scale; FP8_ROW128: per row per 128 columns. `row_out` gets the scales ([rows] or
// [rows, cols / 128]) either way.
struct Fp8Scales {
  int act_format = MOEK_ACT_FORMAT_A16;
  const float* static_out = nullptr;  // FP8_ROW: static per-tensor scale to quantize with, or NULL
  float* row_out = nullptr;         // scales written when quantizing
  // The E4M3 values written as 16-bit values of the hidden dtype (exactly), for a GEMM that
  // reads them so (GemmKernelOps::wide_fp8_tokens): rows of 2 bytes per column.
  bool wide = false;
  // The E4M3 bytes of each 32 columns in the order a 4-bit-weight GEMM on the FP8 tensor cores
  // reads them (GemmKernelOps::permuted_fp8_tokens; vec.cuh, store_fp8x8).
  bool permuted = false;
};

// The one-token forward (src/one_token.cuh): the whole forward as one cooperative kernel, the
// registry's FORWARD kernels. 0 if `s` fits it on a device with these limits, else 1 and why.
int one_token_problem(const moek_shape& s, int sm_count, int smem_optin, char* why, size_t n);
// Launches it; y: workspace for top_k * inter_size floats (GEMM1's activated output).
cudaError_t launch_one_token(const moek_args& a, float* y, int sm_count, int smem_optin, cudaStream_t stream);

// Routing indices shared by the steps. A "pair" p = t * top_k + slot.
struct RoutingBuffers {
  int32_t* counts;     // [E] rows per expert (zeroed by the launcher)
  int32_t* cursors;    // [E] scatter cursors (zeroed by the launcher)
  int32_t* offsets;    // [E + 1] exclusive prefix sum of counts; offsets[E] = rows in total
  int32_t* row_src;    // [T * k] permuted row -> pair
  int32_t* pair_dst;   // [T * k] pair -> permuted row, or -1 if its expert is not local
};

// Counts rows per expert, scans them, writes both GEMMs' group arguments, then scatters
// each pair's hidden row into its expert's block of `x`: copied (16-bit), or quantized to
// E4M3 as q.quant says, scales written to `q.row_out`.
cudaError_t launch_routing(const void* topk_ids, bool ids_int64, int64_t num_pairs, int top_k,
                           ExpertIndex experts, int num_experts, const void* hidden,
                           bool hidden_fp16, int64_t hidden_size, void* x,
                           const Fp8Scales& q, RoutingBuffers rb, GroupSetup gemm1,
                           GroupSetup gemm2, int sm_count, cudaStream_t stream);

// out[r, :] = act(g[r, :] + bias[e_r]) for the permuted rows; gated ones read [gate | up].
// Both FP8 modes quantize out to E4M3 (q).
cudaError_t launch_activation(int activation, bool fp16, const void* g, const void* bias,
                              void* out, int64_t max_rows, int64_t inter_size,
                              const void* topk_ids, bool ids_int64, ExpertIndex experts,
                              const RoutingBuffers& rb, int num_experts, float alpha,
                              float limit, const Fp8Scales& q, cudaStream_t stream);

// out[t, :] = sum over slots, in slot order, of w[t, slot] * weight_scale * (y[row(t, slot)] + bias[e])
// (w = 1 where topk_weights is null: they were applied to the inputs).
cudaError_t launch_finalize(bool fp16, const void* y, const void* bias, const float* topk_weights,
                            float weight_scale, const void* topk_ids, bool ids_int64, ExpertIndex experts,
                            const RoutingBuffers& rb, void* out, int64_t num_tokens, int top_k,
                            int64_t hidden_size, cudaStream_t stream);

}  // namespace moe_kernels
