// The activation between the two GEMMs, over the permuted rows, with GEMM1's bias fused.
#include <math.h>

#include <type_traits>

#include "kernels.h"
#include "act.cuh"
#include "launch.cuh"
#include "moe_kernels/c_api.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

// One team per permuted row (a warp, 8 rows per block; or the block, for long rows that are
// few: see run); rows past the routed total (offsets[E]) exit.
// 16-bit: out = act(g + bias). FP8: g holds raw GEMM1 accumulators, dequantized with the
// row's input scale and the weight scale first. Both FP8 modes quantize out to E4M3
// (quantize_row: per row, or per 128 columns for FP8_BLOCK, whose g is already dequantized).
constexpr int64_t kWarpRowCols = 1024;  // 32 lanes x 8 columns x quantize_row's kKeep
constexpr int kRowsPerBlock = 8;
constexpr int64_t kWarpRowsFrom = 4096;  // rows (tokens x top_k) for warp teams on long rows

// Warp teams: at most 80 registers, so 3 blocks (24 warps) fit on an SM; the block-team
// FP8 variants would spill at that limit.
template <int kAct, typename T, typename IdT, int kQuant, class Team>
__global__ void __launch_bounds__(256, std::is_same_v<Team, WarpTeam> ? 3 : 1)
activation_kernel(const T* g, const T* bias, void* out, int64_t inter, const IdT* ids,
                  int64_t expert_offset, const int32_t* offsets, const int32_t* row_src,
                  int num_experts, float alpha, float limit, Fp8Scales q) {
  constexpr bool kWarpRows = std::is_same_v<Team, WarpTeam>;
  const Team team;
  const int64_t r = kWarpRows ? blockIdx.x * int64_t(kRowsPerBlock) + (threadIdx.x >> 5)
                              : int64_t(blockIdx.x);
  if (r >= offsets[num_experts]) return;  // the whole team leaves together
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
  // Only now the wait for GEMM1: the row's expert and input scale come from routing and
  // expand, two or more launches back (launch.cuh), so that chain of loads overlaps GEMM1.
  pdl_begin();

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
      res[i] = activate<kAct>(gate.v[i], kGated ? up.v[i] : 0.0f, alpha, limit);
  };

  if constexpr (kQuant == MOEK_QUANT_NONE) {
    T* orow = static_cast<T*>(out) + r * inter;
    const int64_t step = int64_t(team.size()) * 8;
    for (int64_t j0 = team.rank() * 8; j0 < inter; j0 += kKeep * step) {
      float res[kKeep][8];
      compute_vectors(compute, j0, step, inter, res);
#pragma unroll
      for (int c = 0; c < kKeep; ++c) {
        if (j0 + c * step >= inter) break;
        Vec8<T> o;
#pragma unroll
        for (int i = 0; i < 8; ++i) o.v[i] = res[c][i];
        o.store(orow + j0 + c * step);
      }
    }
  } else {
    const int64_t scales_per_row = kQuant == MOEK_QUANT_FP8_BLOCK ? inter / 128 : 1;
    quantize_row<kQuant>(team, compute, inter, q.static_out,
                         RowSink{static_cast<uint8_t*>(out) + r * inter,
                                 q.row_out + r * scales_per_row});
  }
}

template <int kAct, typename T, typename IdT, int kQuant>
cudaError_t run(const void* g, const void* bias, void* out, int64_t max_rows, int64_t inter,
                   const void* ids, int64_t expert_offset, const RoutingBuffers& rb,
                   int num_experts, float alpha, float limit, const Fp8Scales& q,
                   cudaStream_t stream) {
  auto go = [&](auto team, unsigned blocks, int threads) {
    return launch(activation_kernel<kAct, T, IdT, kQuant, decltype(team)>, blocks, threads, 0,
                  stream, static_cast<const T*>(g), static_cast<const T*>(bias), out, inter,
                  static_cast<const IdT*>(ids), expert_offset, rb.offsets, rb.row_src,
                  num_experts, alpha, limit, q);
  };
  // A warp per row, unless the row is long and the rows are few: a warp walks its row's
  // columns alone (DeepSeek-V3 fp8_block, I = 2048, on H200: one token 13 us with a warp per
  // row, 4 us with a block; 128 tokens 16 vs 11 us; 1024 tokens 77 vs 94 us; 4096 tokens
  // 200 vs 264 us). FP8 with one dynamic scale per row computes the columns past
  // kWarpRowCols twice in a warp (for the amax, then to store), and still gains from many
  // rows on: a block per row holds one block per SM (156 registers); DeepSeek-V3's shape at
  // 16384 tokens, fp8: 3.0 ms with a block per row, 0.75 ms with a warp.
  const bool warp_rows = inter <= kWarpRowCols || max_rows >= kWarpRowsFrom;
  if (warp_rows)
    return go(WarpTeam{}, static_cast<unsigned>((max_rows + kRowsPerBlock - 1) / kRowsPerBlock),
              32 * kRowsPerBlock);
  const int64_t vecs = inter / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  return go(BlockTeam{}, static_cast<unsigned>(max_rows), threads);
}

template <typename T, typename IdT, int kQuant>
cudaError_t dispatch_act(int activation, const void* g, const void* bias, void* out,
                         int64_t max_rows, int64_t inter, const void* ids, int64_t expert_offset,
                         const RoutingBuffers& rb, int num_experts, float alpha, float limit,
                         const Fp8Scales& q, cudaStream_t stream) {
#define MOEK_ACT_CASE(A)                                                                   \
  case A:                                                                                  \
    return run<A, T, IdT, kQuant>(g, bias, out, max_rows, inter, ids, expert_offset, rb,  \
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
