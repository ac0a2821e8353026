// The whole forward of one token in one kernel (quant fp8, gated activations), for models
// whose one-token expert weights fit on chip across the SMs (Qwen3-30B-A3B: 8 experts,
// 25.2 MB of w13 and 12.6 MB of w2 over 132 SMs). At one token the forward is a stream of
// weights, and the grouped path's six launches (routing, expand, GEMM1, activation, GEMM2,
// finalize) cost more than the stream itself.
//
// One CTA per SM, all resident (a grid barrier between the GEMMs). After reading the token's
// expert ids, each CTA requests everything it will multiply at once: its GEMM1 units (16
// intermediate columns of one slot's expert: 16 gate + 16 up rows of w13) by bulk copies into
// shared memory, then its GEMM2 share (16 output columns of every slot's expert: 16 rows of
// w2 each) into registers. So the DRAM stream runs from the start to the end without a gap,
// and the grid barrier (every GEMM1 column is needed for GEMM2's per-token activation scale)
// waits while the w2 bytes are still arriving.
//
// The multiplications are mma.sync m16n8k16 on f16 (E4M3 converts exactly), weights as the
// 16-row operand and the token as column 0 of the 8-wide one. K is permuted the same way in
// both operands (a dot product does not care), so each thread reads 16 contiguous bytes of a
// weight row. Numerics follow the grouped path: the token quantized as expand does, GEMM1's
// accumulators dequantized with the token's and the weights' scales, the activation's output
// quantized as the activation kernel does, GEMM2's output dequantized and summed in slot order.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "act.cuh"
#include "vec.cuh"

namespace moe_kernels::one_token {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kCols = 16;            // columns per unit: GEMM1 intermediate, GEMM2 output
constexpr int kSplitK = kWarps / 2;  // GEMM1: warps per 16-row tile, each over a slice of K
constexpr int kMaxSlots = 8;
constexpr int kMaxUnits1 = 6;        // GEMM1 units per CTA (one mbarrier each)
constexpr int kMaxUnits2 = 2;        // GEMM2 units per CTA
constexpr int kMaxItems = 6;         // GEMM2 (slot, 64 bytes of K) items per warp, in registers

struct Params {
  const void* hidden;         // [1, H] 16-bit
  const void* topk_ids;       // [1, k] int32 or int64
  const float* topk_weights;  // [1, k]
  const uint8_t* w13;         // [E, 2I, H] E4M3
  const uint8_t* w2;          // [E, H, I] E4M3
  const void* w13_bias;       // [E, 2I] 16-bit, or null
  const void* w2_bias;        // [E, H] 16-bit, or null
  const float* w13_scale;     // [E, 2I] or [E]
  const float* w2_scale;      // [E, H] or [E]
  const float* a13_scale;     // static input scales, or null (per token)
  const float* a2_scale;
  void* out;                  // [1, H] 16-bit
  float* y;                   // workspace [k, I]: the activation's output, for every CTA
  int64_t expert_offset;
  int hidden_size, inter, top_k, num_experts;
  int ids64, w13_per_channel, w2_per_channel;
  float alpha, limit;
  int units1, units2;         // per CTA (run() computes them)
  unsigned long long* trace;  // PROBE ONLY: [grid, 16] globaltimer stamps
  int skip;  // PROBE ONLY: bit 0 w2 loads, 1 GEMM1 math, 2 grid barrier, 3 after the barrier, 4 w13 copies
};

// Shared memory: the GEMM1 units' weights, the token and GEMM2's inputs in E4M3, partial sums.
inline size_t smem_bytes(int hidden, int inter, int units1, int units2) {
  return size_t(units1) * 2 * kCols * hidden + hidden + size_t(kMaxSlots) * inter +
         kSplitK * 2 * kCols * sizeof(float) + size_t(units2) * kMaxSlots * (inter / 64) * kCols * sizeof(float);
}

__device__ __forceinline__ uint32_t f16x2(uint16_t e4m3x2) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(e4m3x2));
  return r;
}

// c += rows g and g + 8 of a 16-row tile x the token (column 0), over 64 bytes of K: this
// thread's 16 bytes of each row (r0, r1) and of the token (x: lanes with g == 0; zeros
// elsewhere). MMA step q takes bytes 4q, 4q + 1 as k slots 2t, 2t + 1 and 4q + 2, 4q + 3 as
// slots 2t + 8, 2t + 9, in both operands.
__device__ __forceinline__ void dot64(float (&c)[4], const uint4& r0, const uint4& r1, const uint4& x) {
  const uint32_t a[4] = {r0.x, r0.y, r0.z, r0.w}, b[4] = {r1.x, r1.y, r1.z, r1.w};
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(f16x2(a[q] & 0xffff)), "r"(f16x2(b[q] & 0xffff)), "r"(f16x2(a[q] >> 16)),
          "r"(f16x2(b[q] >> 16)), "r"(f16x2(xs[q] & 0xffff)), "r"(f16x2(xs[q] >> 16)));
  }
}

__device__ __forceinline__ void stamp(const Params& p, int k) {
  if (p.trace && threadIdx.x == 0) {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    p.trace[blockIdx.x * 16 + k] = v;
  }
}

__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T>
__device__ __forceinline__ float round16(float v) { return Vec8<T>::to_float(Vec8<T>::from_float(v)); }

template <typename T>
struct SmemRow {  // quantize_row's sink: E4M3 bytes into shared memory, the scale too
  uint8_t* dst;
  float* scale_out;
  __device__ __forceinline__ void store(int64_t j, const float* v, float scale) const {
    *reinterpret_cast<uint2*>(dst + j) = to_fp8x8(v, scale);
  }
  __device__ __forceinline__ void scale(int64_t, float s) const { *scale_out = s; }
};

template <typename T, int kAct>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int H = p.hidden_size, I = p.inter;
  uint8_t* w13s = smem;                                       // units1 x 32 rows x H
  uint8_t* xq = w13s + size_t(p.units1) * 2 * kCols * H;      // [H]
  uint8_t* x2 = xq + H;                                       // [kMaxSlots, I]
  float* red = reinterpret_cast<float*>(x2 + kMaxSlots * I);  // [kSplitK, 32]
  float* part = red + kSplitK * 2 * kCols;                    // [items, 16]
  __shared__ int s_expert[kMaxSlots];
  __shared__ float s_weight[kMaxSlots], s_scale2[kMaxSlots], s_xscale;
  // What the epilogues need, loaded before the weight stream (behind it, each dependent load
  // took microseconds): GEMM1's 32 row scales and biases per unit, GEMM2's per slot and column.
  __shared__ float s_scale1[kMaxUnits1][2 * kCols], s_bias1[kMaxUnits1][2 * kCols];
  __shared__ float s_wscale2[kMaxSlots][kMaxUnits2 * kCols], s_bias2[kMaxSlots][kMaxUnits2 * kCols];
  __shared__ int s_slots;
  __shared__ __align__(8) uint64_t bar[kMaxUnits1];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stamp(p, 0);
  // The token's row and routing, all requested at once.
  uint4 xr = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < H / 8) xr = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.hidden) + 8 * threadIdx.x);
  if (threadIdx.x < p.top_k) {
    const int s = threadIdx.x;
    const int64_t id = p.ids64 ? static_cast<const int64_t*>(p.topk_ids)[s] : static_cast<const int32_t*>(p.topk_ids)[s];
    const int64_t e = id - p.expert_offset;
    s_expert[s] = e < 0 || e >= p.num_experts ? -1 : int(e);  // -1: another rank's expert (or -1)
    s_weight[s] = p.topk_weights[s];
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the slots with local experts, in order
    int n = 0;
    for (int s = 0; s < p.top_k; ++s)
      if (s_expert[s] >= 0) {
        s_expert[n] = s_expert[s];
        s_weight[n++] = s_weight[s];
      }
    s_slots = n;
    for (int i = 0; i < kMaxUnits1; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[i])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  stamp(p, 1);
  const int slots = s_slots, col_blocks = I / kCols, units1_total = slots * col_blocks;
  auto unit1 = [&](int i) { return int(blockIdx.x) + i * int(gridDim.x); };  // < units1_total
  const int chunks = I / 64;
  int units2_here = 0;
  for (int i = 0; i < p.units2; ++i) units2_here += unit1(i) < H / kCols;
  const int items = units2_here * slots * chunks;

  // GEMM1's weights first: unit u is slot u / col_blocks, intermediate columns
  // 16 (u % col_blocks) ...: its 16 gate rows, then its 16 up rows (I further).
  if (threadIdx.x == 0 && !(p.skip & 16)) {
    for (int i = 0; i < p.units1 && unit1(i) < units1_total; ++i) {
      const int u = unit1(i);
      const int64_t row = int64_t(s_expert[u / col_blocks]) * 2 * I + (u % col_blocks) * kCols;
      const uint32_t bytes = kCols * H, b = smem_u32(&bar[i]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(2 * bytes) : "memory");
      for (int h = 0; h < 2; ++h)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_u32(w13s + (2 * i + h) * size_t(bytes))),
            "l"(p.w13 + (row + h * int64_t(I)) * H), "r"(bytes), "r"(b)
            : "memory");
    }
  }
  // Then GEMM2's, into registers: item it (of this warp: warp + kWarps * ii) is unit
  // it / (slots * chunks), slot (it / chunks) % slots, 64 bytes of K at chunk it % chunks;
  // rows g and g + 8 of the unit's 16 output columns, this thread's 16 bytes of each.
  uint4 w2r[kMaxItems][2];
#pragma unroll
  for (int ii = 0; ii < kMaxItems; ++ii) {
    const int it = warp + kWarps * ii;
    if (it < items && !(p.skip & 1)) {
      const int unit = it / (slots * chunks), s = (it / chunks) % slots, c = it % chunks;
      const int64_t row = int64_t(s_expert[s]) * H + unit1(unit) * kCols + g;
      const uint8_t* src = p.w2 + row * I + 64 * c + 16 * t;
      w2r[ii][0] = ldg_stream(src);
      w2r[ii][1] = ldg_stream(src + 8 * int64_t(I));
    } else {
      w2r[ii][0] = w2r[ii][1] = make_uint4(0, 0, 0, 0);
    }
  }
  // The epilogues' scales and biases.
  for (int j = threadIdx.x; j < p.units1 * 2 * kCols; j += kThreads) {
    const int i = j / (2 * kCols), r = j % (2 * kCols), u = unit1(i);
    if (u >= units1_total) break;
    const int64_t e = s_expert[u / col_blocks], col = (r / kCols) * I + (u % col_blocks) * kCols + r % kCols;
    s_scale1[i][r] = p.w13_scale[p.w13_per_channel ? e * 2 * I + col : e];
    s_bias1[i][r] = p.w13_bias ? Vec8<T>::to_float(static_cast<const T*>(p.w13_bias)[e * 2 * I + col]) : 0.f;
  }
  for (int j = threadIdx.x; j < slots * units2_here * kCols; j += kThreads) {
    const int s = j / (units2_here * kCols), r = j % (units2_here * kCols);
    const int64_t e = s_expert[s], col = unit1(r / kCols) * kCols + r % kCols;
    s_wscale2[s][r] = p.w2_scale[p.w2_per_channel ? e * H + col : e];
    s_bias2[s][r] = p.w2_bias ? Vec8<T>::to_float(static_cast<const T*>(p.w2_bias)[e * H + col]) : 0.f;
  }
  // The token in E4M3 (expand's quantization: a static scale, or one per token).
  quantize_row<MOEK_QUANT_FP8>(
      BlockTeam{}, [&](int64_t, float* v) { Vec8<T> x; x.unpack(xr); for (int i = 0; i < 8; ++i) v[i] = x.v[i]; },
      H, p.a13_scale, SmemRow<T>{xq, &s_xscale});
  __syncthreads();

  stamp(p, 2);
  // GEMM1 and the activation, unit by unit as their weights land: warp w multiplies tile
  // w % 2 (gate, up) over K chunks w / 2, w / 2 + kSplitK, ...
  const int tile = warp & 1, ks = warp >> 1;
  for (int i = 0; i < p.units1 && unit1(i) < units1_total; ++i) {
    const int u = unit1(i);
    if (!(p.skip & 16))
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0; @!p bra W; }" ::"r"(
                     smem_u32(&bar[i])) : "memory");
    stamp(p, 3 + 2 * i);
    if (p.skip & 2) continue;
    const uint8_t* rows = w13s + (size_t(2 * i + tile) * kCols + g) * H + 16 * t;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int ch = ks; ch < H / 64; ch += kSplitK) {
      const uint4 r0 = *reinterpret_cast<const uint4*>(rows + 64 * ch);
      const uint4 r1 = *reinterpret_cast<const uint4*>(rows + 8 * H + 64 * ch);
      const uint4 x = g == 0 ? *reinterpret_cast<const uint4*>(xq + 64 * ch + 16 * t) : make_uint4(0, 0, 0, 0);
      dot64(c, r0, r1, x);
    }
    if (t == 0) {
      red[ks * 2 * kCols + tile * kCols + g] = c[0];
      red[ks * 2 * kCols + tile * kCols + g + 8] = c[2];
    }
    __syncthreads();
    if (threadIdx.x < kCols) {
      const int r = threadIdx.x;
      float gate = 0.f, up = 0.f;
      for (int k = 0; k < kSplitK; ++k) {
        gate += red[k * 2 * kCols + r];
        up += red[k * 2 * kCols + kCols + r];
      }
      // The grouped path's GEMM1 stores 16-bit accumulators; the activation kernel scales them.
      gate = round16<T>(gate) * (s_xscale * s_scale1[i][r]) + s_bias1[i][r];
      up = round16<T>(up) * (s_xscale * s_scale1[i][kCols + r]) + s_bias1[i][kCols + r];
      p.y[(u / col_blocks) * I + (u % col_blocks) * kCols + r] = activate<kAct>(gate, up, p.alpha, p.limit);
    }
    __syncthreads();  // red is reused
    stamp(p, 4 + 2 * i);
  }

  stamp(p, 9);
  if (!(p.skip & 4)) cooperative_groups::this_grid().sync();
  stamp(p, 10);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (p.skip & 8) {
    if (threadIdx.x == 0) static_cast<T*>(p.out)[blockIdx.x] = Vec8<T>::from_float(float(w2r[0][0].x ^ w2r[kMaxItems - 1][1].w));
    return;
  }

  // GEMM2's inputs: every slot's activation row in E4M3, a warp per slot (the activation
  // kernel's quantization), read past L1: other CTAs wrote them.
  if (warp < slots) {
    const float* yr = p.y + warp * I;
    quantize_row<MOEK_QUANT_FP8>(
        WarpTeam{}, [&](int64_t j, float* v) {
          const float4 a = __ldcg(reinterpret_cast<const float4*>(yr + j));
          const float4 b = __ldcg(reinterpret_cast<const float4*>(yr + j + 4));
          v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        },
        I, p.a2_scale, SmemRow<T>{x2 + warp * I, &s_scale2[warp]});
  }
  __syncthreads();
  stamp(p, 11);
#pragma unroll
  for (int ii = 0; ii < kMaxItems; ++ii) {
    const int it = warp + kWarps * ii;
    if (it < items) {
      const int s = (it / chunks) % slots, ch = it % chunks;
      const uint4 x = g == 0 ? *reinterpret_cast<const uint4*>(x2 + s * I + 64 * ch + 16 * t) : make_uint4(0, 0, 0, 0);
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      dot64(c, w2r[ii][0], w2r[ii][1], x);
      if (t == 0) {
        part[it * kCols + g] = c[0];
        part[it * kCols + g + 8] = c[2];
      }
    }
  }
  __syncthreads();
  stamp(p, 12);
  // Finalize: each output column sums its slots in order, as the grouped path does.
  if (threadIdx.x < units2_here * kCols) {
    const int unit = threadIdx.x / kCols, r = threadIdx.x;
    float acc = 0.f;
    for (int s = 0; s < slots; ++s) {
      float d = 0.f;
      for (int ch = 0; ch < chunks; ++ch) d += part[((unit * slots + s) * chunks + ch) * kCols + r % kCols];
      acc += s_weight[s] * (round16<T>(d) * (s_scale2[s] * s_wscale2[s][r]) + s_bias2[s][r]);
    }
    static_cast<T*>(p.out)[unit1(unit) * kCols + r % kCols] = Vec8<T>::from_float(acc);
  }
  __syncthreads();
  stamp(p, 13);
}

}  // namespace moe_kernels::one_token
