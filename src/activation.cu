// The activation between the two GEMMs, over the permuted rows, with GEMM1's bias fused.
#include <math.h>

#include <type_traits>

#include "dispatch.cuh"
#include "kernels.h"
#include "act.cuh"
#include "launch.cuh"
#include "moe_kernels/c_api.h"
#include "vec.cuh"

namespace moe_kernels {
namespace {

// One team per permuted row (a warp, 8 rows per block; or the block, for long rows that are
// few: see run); rows past the routed total (offsets[E]) exit. out = act(g + bias), g as
// GEMM1 wrote it (dequantized); both FP8 modes quantize out to E4M3 (quantize_row: per row,
// or per 128 columns for FP8_BLOCK).
constexpr int64_t kWarpRowCols = 1024;  // 32 lanes x 8 columns x quantize_row's kKeep
constexpr int kRowsPerBlock = 8;
constexpr int64_t kWarpRowsFrom = 4096;  // rows (tokens x top_k) for warp teams on long rows

// Warp teams: at most 80 registers, so 3 blocks (24 warps) fit on an SM; the block-team
// FP8 variants would spill at that limit.
template <int kAct, typename T, typename IdT, int kFormat, class Team>
__global__ void __launch_bounds__(256, std::is_same_v<Team, WarpTeam> ? 3 : 1)
activation_kernel(const T* g, const T* bias, void* out, int64_t inter, const IdT* ids,
                  ExpertIndex experts, const int32_t* offsets, const int32_t* row_src,
                  int num_experts, float alpha, float limit, Fp8Scales q) {
  constexpr bool kWarpRows = std::is_same_v<Team, WarpTeam>;
  const Team team;
  const int64_t r = kWarpRows ? blockIdx.x * int64_t(kRowsPerBlock) + (threadIdx.x >> 5)
                              : int64_t(blockIdx.x);
  if (r >= offsets[num_experts]) return;  // the whole team leaves together
  constexpr bool kGated = is_gated(kAct);
  const int64_t n1 = kGated ? 2 * inter : inter;
  const T* grow = g + r * n1;
  const T* brow = bias ? bias + local_expert(ids, row_src[r], experts) * n1 : nullptr;
  // Only now the wait for GEMM1: the row's expert comes from routing, two or more launches
  // back (launch.cuh), so that chain of loads overlaps GEMM1.
  pdl_begin();

  auto compute = [&](int64_t j, float* res) {
    Vec8<T> gate, up;
    gate.load(grow + j);
    if constexpr (kGated) up.load(grow + inter + j);
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

  if constexpr (kFormat == MOEK_ACT_FORMAT_A16) {
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
    const int64_t scales_per_row = kFormat == MOEK_ACT_FORMAT_FP8_ROW128 ? inter / 128 : 1;
    quantize_row<kFormat>(team, compute, inter, q.static_out,
                         RowSink<T>{q.wide ? static_cast<void*>(static_cast<T*>(out) + r * inter)
                                           : static_cast<void*>(static_cast<uint8_t*>(out) + r * inter),
                                    q.row_out + r * scales_per_row, q.wide, q.permuted});
  }
}

// FP8 with a bias, over many rows: a block per run of rows, each thread owning 8 columns of
// gate and up. A row's bias is its expert's, and the rows are sorted by expert, so each
// thread keeps its columns' bias in registers while the expert stays the same. The
// warp-per-row kernel loads it again for every row, L1 hits that made it L1-bound
// (docs/design.md, "The activation step"). The arithmetic is the warp kernel's, value for
// value (activation, amax, E4M3 rounding).
constexpr int kColRows = 16;       // rows per block
constexpr int kColBatch = 4;       // rows loaded together
constexpr int64_t kColMaxInter = 2048;  // a thread per 8 columns, at most 256 threads

template <int kAct, typename T, typename IdT>
__global__ void __launch_bounds__(256)
activation_cols_kernel(const T* g, const T* bias, uint8_t* out, int64_t inter, const IdT* ids,
                       ExpertIndex experts, const int32_t* offsets, const int32_t* row_src,
                       int num_experts, float alpha, float limit, Fp8Scales q) {
  __shared__ float s_amax[2][kColBatch][kColMaxInter / 256];  // [batch parity][row][warp]
  constexpr bool kGated = is_gated(kAct);
  const int64_t n1 = kGated ? 2 * inter : inter;
  const int64_t rows = offsets[num_experts];
  const int64_t r0 = blockIdx.x * int64_t(kColRows), r_end = min(rows, r0 + kColRows);
  if (r0 >= r_end) return;
  const int64_t j = threadIdx.x * 8;
  const bool mine = j < inter;  // threads past the row (a warp's round-up) only join the amax
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t cur_e = -1;
  // This thread's columns' bias bits (gate, up), loaded with a row of a new expert (cur_e
  // starts at none).
  uint4 bg = make_uint4(0, 0, 0, 0), bu = bg;
  int parity = 0;
  for (int64_t rb = r0; rb < r_end; rb += kColBatch, parity ^= 1) {
    const int nb = int(r_end - rb < kColBatch ? r_end - rb : kColBatch);
    int64_t e[kColBatch];
    uint4 graw[kColBatch], uraw[kColBatch];
#pragma unroll
    for (int b = 0; b < kColBatch; ++b)
      e[b] = local_expert(ids, row_src[rb + min(b, nb - 1)], experts);
    // The rows' experts come from routing: before the wait for GEMM1.
    if (rb == r0) pdl_begin();
#pragma unroll
    for (int b = 0; b < kColBatch; ++b) {
      graw[b] = uraw[b] = make_uint4(0, 0, 0, 0);
      if (mine && b < nb) {
        graw[b] = *reinterpret_cast<const uint4*>(g + (rb + b) * n1 + j);
        if constexpr (kGated) uraw[b] = *reinterpret_cast<const uint4*>(g + (rb + b) * n1 + inter + j);
      }
    }
    float v[kColBatch][8], amax[kColBatch];
#pragma unroll
    for (int b = 0; b < kColBatch; ++b) {
      amax[b] = 0.f;
      if (b >= nb) continue;
      if (e[b] != cur_e) {  // the same for the whole block: its rows' expert changed
        cur_e = e[b];
        if (mine) {
          bg = *reinterpret_cast<const uint4*>(bias + cur_e * n1 + j);
          if constexpr (kGated) bu = *reinterpret_cast<const uint4*>(bias + cur_e * n1 + inter + j);
        }
      }
      Vec8<T> gate, up, bgv, buv;
      gate.unpack(graw[b]);
      up.unpack(uraw[b]);
      bgv.unpack(bg);
      buv.unpack(bu);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float gi = gate.v[i] + bgv.v[i], ui = kGated ? up.v[i] + buv.v[i] : 0.f;
        v[b][i] = activate<kAct>(gi, ui, alpha, limit);
        if (mine) amax[b] = fmaxf(amax[b], fabsf(v[b][i]));
      }
    }
    float scale[kColBatch];
    if (q.static_out) {
#pragma unroll
      for (int b = 0; b < kColBatch; ++b) scale[b] = *q.static_out;
    } else {
#pragma unroll
      for (int b = 0; b < kColBatch; ++b) {
        amax[b] = WarpTeam{}.amax(amax[b]);
        if (lane == 0) s_amax[parity][b][warp] = amax[b];
      }
      // One barrier per batch: the next batch writes the other parity, and the one after
      // this parity again only past the next batch's barrier, when every thread has read it.
      __syncthreads();
#pragma unroll
      for (int b = 0; b < kColBatch; ++b) {
        float m = 0.f;
        for (int w = 0; w < warps; ++w) m = fmaxf(m, s_amax[parity][b][w]);
        scale[b] = fp8_scale(m);
      }
    }
#pragma unroll
    for (int b = 0; b < kColBatch; ++b) {
      if (b >= nb) break;
      if (mine)
        store_fp8x8<T>(q.wide ? static_cast<void*>(reinterpret_cast<T*>(out) + (rb + b) * inter)
                              : static_cast<void*>(out + (rb + b) * inter),
                       q.wide, q.permuted, j, v[b], scale[b]);
      if (threadIdx.x == 0) q.row_out[rb + b] = scale[b];
    }
  }
}

template <int kAct, typename T, typename IdT, int kFormat>
cudaError_t run(const void* g, const void* bias, void* out, int64_t max_rows, int64_t inter,
                   const void* ids, ExpertIndex experts, const RoutingBuffers& rb,
                   int num_experts, float alpha, float limit, const Fp8Scales& q,
                   cudaStream_t stream) {
  auto go = [&](auto team, unsigned blocks, int threads) {
    return launch(activation_kernel<kAct, T, IdT, kFormat, decltype(team)>, blocks, threads, 0,
                  stream, static_cast<const T*>(g), static_cast<const T*>(bias), out, inter,
                  static_cast<const IdT*>(ids), experts, rb.offsets, rb.row_src,
                  num_experts, alpha, limit, q);
  };
  // A warp per row, unless the row is long and the rows are few, where a warp would walk its
  // row's columns alone. FP8 with one dynamic scale per row computes the columns past
  // kWarpRowCols twice in a warp (for the amax, then to store), and still gains from many rows
  // on: a block per row holds one block per SM (156 registers). Figures: docs/design.md, "The
  // activation step".
  if constexpr (kFormat == MOEK_ACT_FORMAT_FP8_ROW) {
    if (bias && max_rows >= kWarpRowsFrom && inter <= kColMaxInter) {
      const int threads = static_cast<int>((inter / 8 + 31) / 32 * 32);
      return launch(activation_cols_kernel<kAct, T, IdT>, static_cast<unsigned>((max_rows + kColRows - 1) / kColRows),
                    threads, 0, stream, static_cast<const T*>(g), static_cast<const T*>(bias),
                    static_cast<uint8_t*>(out), inter, static_cast<const IdT*>(ids), experts, rb.offsets,
                    rb.row_src, num_experts, alpha, limit, q);
    }
  }
  const bool warp_rows = inter <= kWarpRowCols || max_rows >= kWarpRowsFrom;
  if (warp_rows)
    return go(WarpTeam{}, static_cast<unsigned>((max_rows + kRowsPerBlock - 1) / kRowsPerBlock),
              32 * kRowsPerBlock);
  const int64_t vecs = inter / 8;
  const int threads = vecs >= 256 ? 256 : static_cast<int>((vecs + 31) / 32 * 32);
  return go(BlockTeam{}, static_cast<unsigned>(max_rows), threads);
}

template <typename T, typename IdT, int kFormat>
cudaError_t dispatch_act(int activation, const void* g, const void* bias, void* out,
                         int64_t max_rows, int64_t inter, const void* ids, ExpertIndex experts,
                         const RoutingBuffers& rb, int num_experts, float alpha, float limit,
                         const Fp8Scales& q, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;  // not an activation
  with_activation(activation, [&](auto act) {
    err = run<decltype(act)::value, T, IdT, kFormat>(g, bias, out, max_rows, inter, ids, experts,
                                                      rb, num_experts, alpha, limit, q, stream);
  });
  return err;
}

}  // namespace

cudaError_t launch_activation(int activation, bool fp16, const void* g, const void* bias,
                              void* out, int64_t max_rows, int64_t inter_size,
                              const void* topk_ids, bool ids_int64, ExpertIndex experts,
                              const RoutingBuffers& rb, int num_experts, float alpha,
                              float limit, const Fp8Scales& q, cudaStream_t stream) {
  auto by_format = [&](auto t, auto id) {
    cudaError_t err = cudaErrorInvalidValue;  // an activation format this kernel does not write
    with_act_format(q.act_format, [&](auto format) {
      err = dispatch_act<decltype(t), decltype(id), decltype(format)::value>(
          activation, g, bias, out, max_rows, inter_size, topk_ids, experts, rb, num_experts,
          alpha, limit, q, stream);
    });
    return err;
  };
  auto by_type = [&](auto id) { return fp16 ? by_format(__half{}, id) : by_format(__nv_bfloat16{}, id); };
  return ids_int64 ? by_type(int64_t{}) : by_type(int32_t{});
}

}  // namespace moe_kernels
