// How busy can the contig fp8_block kernel's consumer loop keep the tensor cores: with its
// operands already in shared memory, fed from L2, and with the weights streamed from DRAM the
// way the kernel reads them (L, below)? Each SM runs two consumer warpgroups over 4 stages of
// A (128 rows x 128 B) and B (256 rows x 128 B), as src/gemm/sm90/contiguous_gemm.cuh does per
// 128-deep K block; one K block is 4 batches of 4 wgmma m64n128k32 (1024 tensor cycles at the
// SM's peak). Prints cycles per K block, the tensor pipe's share and the weights' DRAM rate.
//   v0: the kernel's loop: per block, wgmmas into a 64-register partial sum, wait, promote
//       (64 FFMA with the row scales) into the 128-register accumulator
//   v2: both blocks' batches in flight into two partial sums (wait<1>, promote, wait<0>,
//       promote): what a second partial sum buys (wrong sums: one accumulator block)
//   v4: v0 with fast accumulation (no partial sums, no waits but one per K block): the ceiling
//   v1: v0 plus the kernel's tail (16 rows past the tile): weight block `half` x 16 rows as
//       8 wgmma m64n16k32, wait, promote (what a tile with tail rows costs per K block)
//   v3 / v5: swap-AB, the tile's rows as the wgmma's N (144 / 128 rows): per warpgroup its
//       weight block as two 64-row A operands, each 4 wgmma m64nNk32 into a partial sum, wait,
//       promote with a scale per column (row of the tile): does a tile of 128 + 16 rows cost
//       less that way than v1?
//   v6 / v7: v1 with the tail's running sum in shared memory (16 registers freed), its batch
//       issued first and promoted while block 0 computes (v6), or issued between blocks 0 and
//       1 so that each promotion runs under the next batch (v7)
//   v8: v0, and every second K block the tails of both K blocks in one batch of 16 wgmmas
//   v9: v0 with A from registers (wgmma RS): each warpgroup's 64 rows of A read from shared
//       memory once per K block (4 ldmatrix.x4) instead of once per 128-column block, i.e. 80
//       KB of operand reads per K block instead of 96: does shared-memory traffic bound the loop?
//   v10 / v11 / v12: v1 with the tail's weights from registers (wgmma RS: each warpgroup's
//       weight block loaded by 8 ldmatrix.x4 per K block, the tail's wgmmas then read no A from
//       shared memory), the same with m64n8k32 (a tail of at most 8 rows), and v1 with
//       m64n8k32 from shared memory: is a tail's price its weights' shared-memory reads (2 KB
//       per wgmma), or the wgmma count?
//   v13 / v14: v1 with the tail's partial sum in the main partial sum's registers (dead between
//       block 1's promotion and the next K block), as m64n32k32 (a tail of up to 32 rows, a
//       32-value running sum) or m64n16k32: could a tail of 17-32 rows replace a split tile?
//   w3 (mainloop3): three consumer warpgroups on a 192-row x 128-column tile (one weight
//       block; 160 registers each), each 64 rows: per K block one batch of 4 wgmma m64n128k32,
//       wait, promote. An expert of up to 192 rows would stream its weights once, with no tail;
//       the price is 16 KB of weights per 24 KB of A from L2 (today 32 per 16). Its tensor peak
//       is 768 cycles per K block; the weights' DRAM rate is the figure to compare.
// With the argument "rs": v9 against v0 (and v4) for L0, L1, L2 and L6; "tail": v1 against
// v10-v12 for L0, L1 and L6; with any other: L5 and L1
// alternately, 1000 launches each, eight times (the clocks settle).
// Not part of the library. Build and run on the GPU machine (CUTLASS headers from the wheel):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I$CUTLASS/include \
//     -o /tmp/mainloop benchmarks/probes/contig_mainloop.cu -lcuda && /tmp/mainloop
#include <cstdio>
#include <string>
#include <utility>
#include <vector>
#include <algorithm>
#include <cuda.h>
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cute/arch/mma_sm90_gmma_ext.hpp"  // m64n144 (v3)
#include "probe_common.cuh"

using Mma = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
using MmaRS = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
using TailMma = cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_SS_TN<>;
template <int N, bool kRS> struct TailOp;
template <> struct TailOp<16, false> { using T = TailMma; };
template <> struct TailOp<8, false> { using T = cute::SM90::GMMA::MMA_64x8x32_F32E4M3E4M3_SS_TN<>; };
template <> struct TailOp<16, true> { using T = cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_RS_TN<>; };
template <> struct TailOp<32, false> { using T = cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_SS_TN<>; };
template <> struct TailOp<8, true> { using T = cute::SM90::GMMA::MMA_64x8x32_F32E4M3E4M3_RS_TN<>; };
template <int N> struct SwapMma;
template <> struct SwapMma<144> { using T = cute::SM90::GMMA::MMA_64x144x32_F32E4M3E4M3_SS_TN<>; };
template <> struct SwapMma<128> { using T = Mma; };
using cute::SM90::GMMA::ScaleOut;
constexpr int kStages = 4, kKBlocks = 448, kA = 128 * 128, kB = 256 * 128;
constexpr int kScaleStride = 160;  // floats per stage: up to 144 row scales; [128]: the weight block's

template <class M = Mma, size_t... I>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float* d, ScaleOut s, std::index_sequence<I...>) {
  M::fma(a, b, d[I]..., s);
}
__device__ __forceinline__ uint64_t desc(uint32_t addr) {  // K-major, 128-byte swizzle
  return uint64_t((addr >> 4) & 0x3fff) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// 4 wgmmas over one 128-deep K block: 64 rows of A at a, N (128) rows of B at b.
template <class M = Mma, int kValues = 64>
__device__ __forceinline__ void batch(uint32_t a, uint32_t b, float* d, bool zero) {
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < 4; ++k)
    wgmma<M>(desc(a) + 2 * k, desc(b) + 2 * k, d, (zero && k == 0) ? ScaleOut::Zero : ScaleOut::One,
             std::make_index_sequence<kValues>{});
  cute::warpgroup_commit_batch();
}

// v9: the same batch with A from registers (af: this thread's fragments of the 4 k steps).
template <size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t* a, uint64_t b, float* d, ScaleOut s, std::index_sequence<I...>) {
  MmaRS::fma(a[0], a[1], a[2], a[3], b, d[I]..., s);
}
__device__ __forceinline__ void batch_rs(const uint32_t (&af)[4][4], uint32_t b, float* d) {
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < 4; ++k)
    wgmma_rs(af[k], desc(b) + 2 * k, d, k == 0 ? ScaleOut::Zero : ScaleOut::One, std::make_index_sequence<64>{});
  cute::warpgroup_commit_batch();
}
// A's fragments for the 4 k steps: warp w's 16 rows, 32 bytes of K each (128-byte swizzle). For
// timing only: which bytes land in which register is not checked against wgmma's fragment layout.
__device__ __forceinline__ void load_a(uint32_t a, int t, uint32_t (&af)[4][4]) {
  const int row = 16 * (t / 32) + t % 16;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t addr = a + row * 128 + (((2 * k + (t % 32) / 16) ^ (row % 8)) * 16);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(af[k][0]), "=r"(af[k][1]), "=r"(af[k][2]), "=r"(af[k][3]) : "r"(addr));
  }
}

// The kernel's tail: weight block w (two 64-row A operands) x 16 tail rows at `tail`, 8 wgmmas
// into d (16 values; no arrive or commit).
__device__ __forceinline__ void tail_wgmmas(uint32_t w, uint32_t tail, float* d) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      wgmma<TailMma>(desc(w + m * 8192) + 2 * k, desc(tail) + 2 * k, d + 8 * m,
                     k == 0 ? ScaleOut::Zero : ScaleOut::One, std::make_index_sequence<8>{});
}
// v10-v12: the tail as N-wide wgmmas (N / 2 values per 64-row operand: d and d + N / 2), its
// weights from registers (kRS: fragments loaded here, timing only) or from shared memory.
template <class M, size_t... I>
__device__ __forceinline__ void wgmma_tail_rs(const uint32_t* a, uint64_t b, float* d, ScaleOut s, std::index_sequence<I...>) {
  M::fma(a[0], a[1], a[2], a[3], b, d[I]..., s);
}
// A's fragments as load_a loads them, into 16 float registers (free ones: the main batches'
// partial sum, dead between its promotion and the next K block's first batch).
__device__ __forceinline__ void load_a_f(uint32_t a, int t, float* f) {
  const int row = 16 * (t / 32) + t % 16;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t addr = a + row * 128 + (((2 * k + (t % 32) / 16) ^ (row % 8)) * 16);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=f"(f[4 * k]), "=f"(f[4 * k + 1]), "=f"(f[4 * k + 2]), "=f"(f[4 * k + 3]) : "r"(addr));
  }
}
template <int N, bool kRS>
__device__ __forceinline__ void tail_wgmmas_n(uint32_t w, uint32_t tail, float* d, int t, float* frag) {
  using M = typename TailOp<N, kRS>::T;
  if constexpr (kRS) {
    load_a_f(w, t, frag);
    load_a_f(w + 8192, t, frag + 16);
    cute::warpgroup_arrive();  // the fragments written before the wgmmas read them
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float* f = frag + 16 * m + 4 * k;
        const uint32_t af[4] = {__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                                __float_as_uint(f[3])};
        wgmma_tail_rs<M>(af, desc(tail) + 2 * k, d + (N / 2) * m, k == 0 ? ScaleOut::Zero : ScaleOut::One,
                         std::make_index_sequence<N / 2>{});
      }
  } else {
    cute::warpgroup_arrive();
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma<M>(desc(w + m * 8192) + 2 * k, desc(tail) + 2 * k, d + (N / 2) * m,
                 k == 0 ? ScaleOut::Zero : ScaleOut::One, std::make_index_sequence<N / 2>{});
  }
}

// This thread's four tail rows' scales times the weight block's, from a stage's scales sc.
__device__ __forceinline__ void tail_scales(const float* sc, int t, float* out) {
  const float* ts = sc + 2 * (t % 4);
  out[0] = ts[0] * sc[128], out[1] = ts[1] * sc[128], out[2] = ts[8] * sc[128], out[3] = ts[9] * sc[128];
}

constexpr int kRowBytes = 7168, kTileKBlocks = kRowBytes / 128, kEpilogue = 9500;
__device__ long long g_waited[1024];  // mainloop: each consumer warpgroup's cycles at the full barriers
struct Src {
  CUtensorMap w;         // L >= 4: the weights, row-major [experts * 4096, 7168]
  CUtensorMap act;       // L = 6: A, row-major [8192, 7168] (58 MB), boxes of 64 rows x 128 B
  const uint8_t* a;      // kL2Bytes, read by every CTA (stays in L2)
  const uint8_t* b;      // kL2Bytes (L = 1) or this CTA's kKBlocks * kB bytes, from DRAM (L >= 2)
  const float* scales;   // L >= 3: [rows][56], K-major row scales as the kernel reads them
};
constexpr int kL2Bytes = 64 * kB;

// L: how the stages are filled. 0: never (the operands stay in shared memory); 1: a producer
// warp copies A and B into each stage (bulk copies, mbarriers as in the kernel) from a few MB
// that stay in L2; 2: B from DRAM (each CTA streams its own), A from L2; 3: 2 plus the 128 row
// scales per stage, 4 bytes per lane with cp.async, as the kernel's loader reads them;
// 4: 3 with B by TMA boxes (128 rows x 128 B, 128-byte swizzle) from row-major weights, as the
// kernel reads DeepSeek-V3's w13: a CTA's 8 tiles are (expert, N tile) pairs, gate block n and
// up block n, 56 K blocks each; 5: 4 with both consumer warpgroups pausing kEpilogue cycles
// after each tile (the fused epilogue's time per tile, measured in the kernel); 6: 5 with A by
// TMA boxes (64 rows x 128 B) from a row-major [8192, 7168] tensor, an expert's 128 rows shared
// by the 16 CTAs of its N tiles, as the kernel reads A (5 copies A from a contiguous 16 KB).
// Both kernels' shared memory (v6-v8: then 16 KB for the tails' running sums): `stages` stages of stage_bytes (operands, a fixed pattern), then
// the scales ([stage][kScaleStride]), then the full and empty barriers.
struct Stages {
  float* scales;
  uint64_t* full;
  uint64_t* empty;
};
__host__ __device__ constexpr int smem_bytes(int stages, int stage_bytes) {
  return stages * stage_bytes + stages * kScaleStride * 4 + 32 + 16 * stages;
}
__device__ __forceinline__ Stages setup_stages(uint8_t* smem, int stages, int stage_bytes, int full_count,
                                               int empty_count) {
  Stages st;
  st.scales = reinterpret_cast<float*>(smem + stages * stage_bytes);
  st.full = reinterpret_cast<uint64_t*>(st.scales + stages * kScaleStride + 8);
  st.empty = st.full + stages;
  for (int i = threadIdx.x; i < stages * stage_bytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u ^ (i * 0x01010101u & 0x07070707u);
  for (int i = threadIdx.x; i < stages * kScaleStride; i += blockDim.x) st.scales[i] = 1.0f + 1e-3f * (i % 7);
  if (threadIdx.x < stages) {
    mbar_init(&st.full[threadIdx.x], full_count);
    mbar_init(&st.empty[threadIdx.x], empty_count);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  return st;
}

__device__ __forceinline__ void fence(float* r, int n) {  // wgmma results: not read before the wait
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int V, int L>
__global__ void __launch_bounds__(384, 1) mainloop(long long* cycles, float* sink, const __grid_constant__ Src src) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const Stages st = setup_stages(smem, kStages, kA + kB, L >= 3 ? 33 : 1, 8);
  float* tail_sum = reinterpret_cast<float*>(smem + smem_bytes(kStages, kA + kB));  // v6, v7: 2 x 8 KB
  float* scales = st.scales;
  uint64_t *full = st.full, *empty = st.empty;
  const int wg = threadIdx.x / 128, half = wg - 1, t = threadIdx.x % 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (L == 0 || threadIdx.x >= 32) return;
    const uint8_t* b_src = L == 1 ? src.b : src.b + size_t(blockIdx.x) * kKBlocks * kB;
    for (int kb = 0; kb < kKBlocks; ++kb) {
      const int s = kb % kStages;
      mbar_wait(&empty[s], ((kb / kStages) & 1) ^ 1);
      if (threadIdx.x == 0) {
        mbar_expect(&full[s], kA + kB);
        const size_t off_a = size_t(kb % 64) * kA, off_b = L == 1 ? size_t(kb % 64) * kB : size_t(kb) * kB;
        if constexpr (L == 6) {  // A as the kernel reads it: the tile's expert's 128 rows (16 CTAs share them)
          const int tile = blockIdx.x + (kb / kTileKBlocks) * gridDim.x, x = (kb % kTileKBlocks) * 128;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                         ::"r"(smem_u32(smem + s * (kA + kB) + h * kA / 2)), "l"(&src.act), "r"(x),
                         "r"((tile / 16) * 128 % 8192 + 64 * h), "r"(smem_u32(&full[s])) : "memory");
        } else {
          bulk(smem + s * (kA + kB), src.a + off_a, kA, &full[s]);
        }
        if constexpr (L >= 4) {
          const int tile = blockIdx.x + (kb / kTileKBlocks) * gridDim.x, x = (kb % kTileKBlocks) * 128;
          const int row = (tile / 16) * 4096 + (tile % 16) * 128;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                         ::"r"(smem_u32(smem + s * (kA + kB) + kA + h * kB / 2)), "l"(&src.w), "r"(x), "r"(row + h * 2048),
                         "r"(smem_u32(&full[s])) : "memory");
        } else {
          bulk(smem + s * (kA + kB) + kA, b_src + off_b, kB / 2, &full[s]);
          bulk(smem + s * (kA + kB) + kA + kB / 2, b_src + off_b + kB / 2, kB / 2, &full[s]);
        }
      }
      if constexpr (L >= 3) {
        const int row0 = (blockIdx.x * 977 + kb / 56 * 128) % 32768;  // a 128-row tile's rows
#pragma unroll
        for (int j = 0; j < 4; ++j)
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(scales + s * kScaleStride + 32 * j + threadIdx.x)),
                       "l"(src.scales + size_t(row0 + 32 * j + threadIdx.x) * 56 + kb % 56) : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(&full[s])) : "memory");
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");  // as the kernel's consumers
  const uint32_t base = smem_u32(smem);
  const int my_row = (t / 32) * 16 + (t % 32) / 4;
  constexpr int kSwapN = V == 3 ? 144 : 128;  // v3, v5
  constexpr int kAccN = V == 3 || V == 5 ? kSwapN / 2 : 64;
  float acc[2][kAccN], part[2][kAccN], acc_t[16], part_t[16], part_t2[2][16], acc_t32[32];
#pragma unroll
  for (int i = 0; i < kAccN; ++i) acc[0][i] = acc[1][i] = part[0][i] = part[1][i] = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) acc_t[i] = part_t[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) acc_t32[i] = 0.f;
  const long long start = clock64();
  long long waited = 0;
  for (int kb = 0; kb < kKBlocks; ++kb) {
    const int s = kb % kStages;
    if (L > 0) {
      const long long w0 = clock64();
      mbar_wait(&full[s], (kb / kStages) & 1);
      waited += clock64() - w0;
    }
    const uint32_t a = base + s * (kA + kB) + half * 8192, b0 = base + s * (kA + kB) + kA;
    const float* sc = scales + s * kScaleStride;
    const float r0 = sc[half * 64 + my_row] * sc[128], r1 = sc[half * 64 + my_row + 8] * sc[128];
    auto main_blocks = [&] {  // the kernel's loop: per 128-column block, batch, wait, promote
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        batch(a, b0 + blk * 16384, part[0], true);
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[blk][i] += part[0][i] * ((i & 2) ? r1 : r0);
      }
    };
    if constexpr (V == 9) {
      uint32_t af[4][4];
      load_a(a, t, af);
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        batch_rs(af, b0 + blk * 16384, part[0]);
        cute::warpgroup_wait<0>();
        fence(part[0], 64);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[blk][i] += part[0][i] * ((i & 2) ? r1 : r0);
      }
    } else if constexpr (V == 0 || V == 1) {
      main_blocks();
      if constexpr (V == 1) {  // the tail: 16 rows (the stage's first: contents do not matter)
        const uint32_t w = b0 + half * 16384, tail = base + s * (kA + kB);
        cute::warpgroup_arrive();
        tail_wgmmas(w, tail, part_t);
        cute::warpgroup_commit_batch();
        float t4[4];
        tail_scales(sc, t, t4);
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int i = 0; i < 16; ++i) acc_t[i] += part_t[i] * t4[(i & 1) + 2 * ((i >> 2) & 1)];
      }
    } else if constexpr (V == 13 || V == 14) {  // the tail into part's registers, n32 or n16
      constexpr int kN = V == 13 ? 32 : 16;
      main_blocks();
      const uint32_t w = b0 + half * 16384, tail = base + s * (kA + kB);
      tail_wgmmas_n<kN, false>(w, tail, part[0], t, nullptr);
      cute::warpgroup_commit_batch();
      float t8[8];  // this thread's tail rows' scales: 2q + j % 2 + 8 * (j / 2) (timing only for n32)
#pragma unroll
      for (int j = 0; j < kN / 4; ++j) t8[j] = sc[2 * (t % 4) + j % 2 + 8 * (j / 2)] * sc[128];
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < kN; ++i) acc_t32[i] += part[0][i] * t8[(i & 1) + 2 * ((i % (kN / 2)) >> 2)];
    } else if constexpr (V >= 10 && V <= 12) {  // v1 with the tail RS (n16, n8) or SS n8
      constexpr int kN = V == 10 ? 16 : 8;
      main_blocks();
      const uint32_t w = b0 + half * 16384, tail = base + s * (kA + kB);
      tail_wgmmas_n<kN, V != 12>(w, tail, part_t, t, part[0]);  // fragments in part's registers
      cute::warpgroup_commit_batch();
      float t4[4];
      tail_scales(sc, t, t4);
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < kN; ++i) acc_t[i] += part_t[i] * t4[(i & 1) + 2 * ((i >> 2) & 1)];
    } else if constexpr (V == 8) {  // v0, and every second K block the tail of both in one batch
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        batch(a, b0 + blk * 16384, part[0], true);
        cute::warpgroup_wait<0>();
        fence(part[0], 64);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[blk][i] += part[0][i] * ((i & 2) ? r1 : r0);
      }
      if (kb & 1) {
        cute::warpgroup_arrive();
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // K blocks kb - 1 (stage s - 1) and kb
          const int sj = j ? s : (s + kStages - 1) % kStages;
          tail_wgmmas(base + sj * (kA + kB) + kA + half * 16384, base + sj * (kA + kB), part_t2[j]);
        }
        cute::warpgroup_commit_batch();
        float t4[4], u4[4];  // K blocks kb's and kb - 1's
        tail_scales(sc, t, t4);
        tail_scales(scales + ((s + kStages - 1) % kStages) * kScaleStride, t, u4);
        cute::warpgroup_wait<0>();
        fence(part_t2[0], 16);
        fence(part_t2[1], 16);
        float4* sum = reinterpret_cast<float4*>(tail_sum) + half * 512 + t;  // the tail's sum in smem
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float4 v = sum[128 * j];
          const int c = 2 * (j & 1);
          v.x += part_t2[0][4 * j] * u4[c] + part_t2[1][4 * j] * t4[c];
          v.y += part_t2[0][4 * j + 1] * u4[c + 1] + part_t2[1][4 * j + 1] * t4[c + 1];
          v.z += part_t2[0][4 * j + 2] * u4[c] + part_t2[1][4 * j + 2] * t4[c];
          v.w += part_t2[0][4 * j + 3] * u4[c + 1] + part_t2[1][4 * j + 3] * t4[c + 1];
          sum[128 * j] = v;
        }
      }
    } else if constexpr (V == 6 || V == 7) {  // v1's tail, its running sum in shared memory
      const uint32_t w = b0 + half * 16384, tail = base + s * (kA + kB);
      float4* sum = reinterpret_cast<float4*>(tail_sum) + half * 512 + t;  // 4 float4 per thread, 128 apart
      auto tail_batch = [&] {
        cute::warpgroup_arrive();
        tail_wgmmas(w, tail, part_t);
        cute::warpgroup_commit_batch();
      };
      auto tail_promote = [&] {
        fence(part_t, 16);
        float t4[4];
        tail_scales(sc, t, t4);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float4 v = sum[128 * j];
          v.x += part_t[4 * j] * t4[2 * (j & 1)];
          v.y += part_t[4 * j + 1] * t4[2 * (j & 1) + 1];
          v.z += part_t[4 * j + 2] * t4[2 * (j & 1)];
          v.w += part_t[4 * j + 3] * t4[2 * (j & 1) + 1];
          sum[128 * j] = v;
        }
      };
      auto promote = [&](float* into) {
        fence(part[0], 64);
#pragma unroll
        for (int i = 0; i < 64; ++i) into[i] += part[0][i] * ((i & 2) ? r1 : r0);
      };
      if constexpr (V == 6) {  // tail first, promoted while block 0 computes
        tail_batch();
        batch(a, b0, part[0], true);
        cute::warpgroup_wait<1>();
        tail_promote();
        cute::warpgroup_wait<0>();
        promote(acc[0]);
        batch(a, b0 + 16384, part[0], true);
        cute::warpgroup_wait<0>();
        promote(acc[1]);
      } else {  // block 0, the tail; block 0 promoted while the tail computes, the tail while block 1 does
        batch(a, b0, part[0], true);
        tail_batch();
        cute::warpgroup_wait<1>();
        promote(acc[0]);
        batch(a, b0 + 16384, part[0], true);
        cute::warpgroup_wait<1>();
        tail_promote();
        cute::warpgroup_wait<0>();
        promote(acc[1]);
      }
    } else if constexpr (V == 3 || V == 5) {  // swap-AB: weights (A) x the tile's kSwapN rows (B)
      const uint32_t w = b0 + half * 16384, rows = base + s * (kA + kB);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        batch<typename SwapMma<kSwapN>::T, kAccN>(w + m * 8192, rows, part[0], true);
        cute::warpgroup_wait<0>();
        // value i: row (of the tile) 8 * (i / 4) + 2 * (t % 4) + i % 2, times the weight block's
#pragma unroll
        for (int j = 0; j < kAccN / 4; ++j) {
          const float2 rs = *reinterpret_cast<const float2*>(sc + 8 * j + 2 * (t % 4));
          const float s0 = rs.x * sc[128], s1 = rs.y * sc[128];
          acc[m][4 * j] += part[0][4 * j] * s0;
          acc[m][4 * j + 1] += part[0][4 * j + 1] * s1;
          acc[m][4 * j + 2] += part[0][4 * j + 2] * s0;
          acc[m][4 * j + 3] += part[0][4 * j + 3] * s1;
        }
      }
    } else if constexpr (V == 2) {
      batch(a, b0, part[0], true);
      batch(a, b0 + 16384, part[1], true);
      cute::warpgroup_wait<1>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[0][i] += part[0][i] * ((i & 2) ? r1 : r0);
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[0][i] += part[1][i] * ((i & 2) ? r1 : r0);
    } else {
      batch(a, b0, acc[0], false);
      batch(a, b0 + 16384, acc[1], false);
      cute::warpgroup_wait<1>();  // (the stage is released one K block late: fine for timing)
    }
    __syncwarp();
    if (L > 0 && t % 32 == 0) mbar_arrive(&empty[s]);
    if (L >= 5 && kb % kTileKBlocks == kTileKBlocks - 1) {
      const long long e0 = clock64();
      while (clock64() - e0 < kEpilogue) {}
    }
  }
  cute::warpgroup_wait<0>();
  const long long end = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAccN; ++i) s += acc[0][i] + acc[1][i] + part[0][i] + part[1][i];
#pragma unroll
  for (int i = 0; i < 16; ++i) s += acc_t[i] + tail_sum[half * 2048 + 128 * i + t];
#pragma unroll
  for (int i = 0; i < 32; ++i) s += acc_t32[i];
  sink[blockIdx.x * 256 + threadIdx.x - 128] = s;
  if (t == 0) cycles[blockIdx.x * 2 + half] = end - start;
  if (t == 0) g_waited[blockIdx.x * 2 + half] = waited;
}

// w3: 3 consumer warpgroups, 192 x 128 tiles (one 128-row weight block), 5 stages of 40 KB.
constexpr int kStages3 = 5, kA3 = 192 * 128, kB3 = 128 * 128, kEpilogue3 = 5000;  // half the outputs
template <int L>
__global__ void __launch_bounds__(512, 1) mainloop3(long long* cycles, float* sink, const __grid_constant__ Src src) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const Stages st = setup_stages(smem, kStages3, kA3 + kB3, 1, 12);
  float* scales = st.scales;
  uint64_t *full = st.full, *empty = st.empty;
  const int wg = threadIdx.x / 128, slice = wg - 1, t = threadIdx.x % 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 32;");  // 128 * 32 + 384 * 160 = 512 * 128
    if (L == 0 || threadIdx.x != 0) return;
    const uint8_t* b_src = L == 1 ? src.b : src.b + size_t(blockIdx.x) * kKBlocks * kB3;
    for (int kb = 0; kb < kKBlocks; ++kb) {
      const int s = kb % kStages3;
      mbar_wait(&empty[s], ((kb / kStages3) & 1) ^ 1);
      mbar_expect(&full[s], kA3 + kB3);
      uint8_t* stage = smem + s * (kA3 + kB3);
      bulk(stage, src.a + size_t(kb % 64) * kA3, kA3, &full[s]);
      if constexpr (L >= 4) {  // a CTA's tiles: (expert, 128-row N block), 56 K blocks each
        const int tile = blockIdx.x + (kb / kTileKBlocks) * gridDim.x, x = (kb % kTileKBlocks) * 128;
        const int row = (tile / 32) * 4096 + (tile % 32) * 128;
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                     ::"r"(smem_u32(stage + kA3)), "l"(&src.w), "r"(x), "r"(row), "r"(smem_u32(&full[s])) : "memory");
      } else {
        bulk(stage + kA3, b_src + (L == 1 ? size_t(kb % 64) : size_t(kb)) * kB3, kB3, &full[s]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 160;");
  const uint32_t base = smem_u32(smem);
  const int my_row = (t / 32) * 16 + (t % 32) / 4;
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = part[i] = 0.f;
  const long long start = clock64();
  for (int kb = 0; kb < kKBlocks; ++kb) {
    const int s = kb % kStages3;
    if (L > 0) mbar_wait(&full[s], (kb / kStages3) & 1);
    const uint32_t a = base + s * (kA3 + kB3) + slice * 8192, b = base + s * (kA3 + kB3) + kA3;
    const float* sc = scales + s * kScaleStride;
    const float r0 = sc[slice * 64 + my_row] * sc[128], r1 = sc[slice * 64 + my_row + 8] * sc[128];
    batch(a, b, part, true);
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] += part[i] * ((i & 2) ? r1 : r0);
    __syncwarp();
    if (L > 0 && t % 32 == 0) mbar_arrive(&empty[s]);
    if (L == 5 && kb % kTileKBlocks == kTileKBlocks - 1) {
      const long long e0 = clock64();
      while (clock64() - e0 < kEpilogue3) {}
    }
  }
  const long long end = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum += acc[i];
  sink[blockIdx.x * 384 + threadIdx.x - 128] = sum;
  if (t == 0) cycles[blockIdx.x * 3 + slice] = end - start;
}

// Launches kernel `reps` times, one CTA per SM; prints the median CTA's cycles per K block (of
// `warpgroups` consumer warpgroups' clocks) against `peak` tensor cycles, and the DRAM rate of
// `b_bytes` per K block when `dram`.
template <class Kernel>
void time_loop(const char* tag, const char* what, Kernel kernel, int threads, int smem, int warpgroups,
               double peak, double b_bytes, bool dram, int sms, long long* d_cycles, float* sink, Src src,
               int reps) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<long long> c(sms * warpgroups);
  std::vector<double> per, us;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  long long* d_waited;
  CK(cudaGetSymbolAddress(reinterpret_cast<void**>(&d_waited), g_waited));
  std::vector<long long> w(sms * warpgroups);
  std::vector<double> wait_share;
  for (int rep = 0; rep < reps; ++rep) {
    CK(cudaMemset(d_waited, 0, w.size() * 8));
    CK(cudaEventRecord(e0));
    kernel<<<sms, threads, smem>>>(d_cycles, sink, src);
    CK(cudaEventRecord(e1));
    CK(cudaDeviceSynchronize());
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1e3);
    CK(cudaMemcpy(c.data(), d_cycles, c.size() * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w.data(), d_waited, w.size() * 8, cudaMemcpyDeviceToHost));
    double wsum = 0, csum = 0;
    for (size_t i = 0; i < c.size(); ++i) wsum += w[i], csum += c[i];
    wait_share.push_back(100.0 * wsum / csum);
    std::sort(c.begin(), c.end());
    per.push_back(double(c[c.size() / 2]) / kKBlocks);
  }
  if (reps > 5) {  // sustained: the last 5 launches
    per.erase(per.begin(), per.end() - 5);
    us.erase(us.begin(), us.end() - 5);
  }
  std::sort(per.begin(), per.end());
  std::sort(us.begin(), us.end());
  const double mhz = per[2] * kKBlocks / us[2], tbs = dram ? double(sms) * kKBlocks * b_bytes / us[2] / 1e6 : 0;
  printf("%5.0f us, %4.0f MHz, B from DRAM %.2f TB/s  ", us[2], mhz, tbs);
  printf("%s %-58s %7.0f cycles per K block, tensor pipe %4.1f%%", tag, what, per[2], 100.0 * peak / per[2]);
  if (warpgroups == 2) printf(", at the full barriers %4.1f%%", wait_share.back());  // (mainloop only; last launch)
  printf("\n");
}

template <int V, int L>
void run(const char* what, int sms, long long* d_cycles, float* sink, Src src, int reps = 5) {
  char tag[16];
  snprintf(tag, sizeof tag, "v%d L%d", V, L);
  time_loop(tag, what, mainloop<V, L>, 384, smem_bytes(kStages, kA + kB) + 16384, 2,
            1024, kB, L >= 2, sms, d_cycles, sink, src, reps);
}
template <int L>
void run3(const char* what, int sms, long long* d_cycles, float* sink, Src src) {
  char tag[16];
  snprintf(tag, sizeof tag, "w3 L%d", L);
  time_loop(tag, what, mainloop3<L>, 512, smem_bytes(kStages3, kA3 + kB3), 3,
            768, kB3, L >= 2, sms, d_cycles, sink, src, 5);
}

int main(int argc, char** argv) {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* d_cycles;
  float* sink;
  CK(cudaMalloc(&d_cycles, sms * 3 * 8));
  CK(cudaMalloc(&sink, sms * 384 * 4));
  Src src;
  uint8_t *a, *b;
  float* sc;
  CK(cudaMalloc(&a, kL2Bytes));
  CK(cudaMalloc(&b, size_t(sms) * kKBlocks * kB));
  CK(cudaMalloc(&sc, size_t(32768 + 512) * 56 * 4));
  CK(cudaMemset(a, 0x38, kL2Bytes));
  CK(cudaMemset(b, 0x38, size_t(sms) * kKBlocks * kB));
  CK(cudaMemset(sc, 0, size_t(32768 + 512) * 56 * 4));
  src.a = a;
  src.b = b;
  src.scales = sc;
  {  // 66 experts x 4096 rows x 7168 bytes: the same 1.9 GB as b
    cuuint64_t dims[2] = {kRowBytes, cuuint64_t(sms) * kKBlocks * kB / kRowBytes}, strides[1] = {kRowBytes};
    cuuint32_t box[2] = {128, 128}, es[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&src.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, b, dims, strides, box, es,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", int(r)); return 1; }
  }
  {  // L = 6: A [8192, 7168]
    uint8_t* act;
    CK(cudaMalloc(&act, size_t(8192) * kRowBytes));
    CK(cudaMemset(act, 0x38, size_t(8192) * kRowBytes));
    cuuint64_t dims[2] = {kRowBytes, 8192}, strides[1] = {kRowBytes};
    cuuint32_t box[2] = {128, 64}, es[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&src.act, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, act, dims, strides, box, es,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", int(r)); return 1; }
  }
  if (argc > 1 && std::string(argv[1]) == "rs") {  // v9 against v0, each way of filling the stages
    run<0, 0>("the kernel's loop (wait, promote, per block)", sms, d_cycles, sink, src);
    run<9, 0>("v0 with A from registers (wgmma RS)", sms, d_cycles, sink, src);
    run<0, 1>("v0, stages filled from L2", sms, d_cycles, sink, src);
    run<9, 1>("v9, stages filled from L2", sms, d_cycles, sink, src);
    run<0, 2>("v0, B from DRAM (32 KB per K block per SM)", sms, d_cycles, sink, src);
    run<9, 2>("v9, B from DRAM", sms, d_cycles, sink, src);
    run<4, 2>("v4, B from DRAM", sms, d_cycles, sink, src);
    run<0, 6>("v0 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
    run<9, 6>("v9 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
    run<4, 6>("v4 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "tail32") {  // a 32-row tail in part's registers
    for (int r = 0; r < 2; ++r) {
      run<0, 0>("the kernel's loop (wait, promote, per block)", sms, d_cycles, sink, src);
      run<1, 0>("v0 plus a 16-row tail (the kernel's)", sms, d_cycles, sink, src);
      run<14, 0>("v1, its partial sum in part's registers", sms, d_cycles, sink, src);
      run<13, 0>("v14 as m64n32k32: a 32-row tail", sms, d_cycles, sink, src);
      run<0, 1>("v0, stages filled from L2", sms, d_cycles, sink, src);
      run<1, 1>("v1, stages filled from L2", sms, d_cycles, sink, src);
      run<14, 1>("v14, stages filled from L2", sms, d_cycles, sink, src);
      run<13, 1>("v13, stages filled from L2", sms, d_cycles, sink, src);
      run<0, 6>("v0 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
      run<1, 6>("v1 L5", sms, d_cycles, sink, src);
      run<14, 6>("v14 L5", sms, d_cycles, sink, src);
      run<13, 6>("v13 L5", sms, d_cycles, sink, src);
    }
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "tail") {  // the tail's wgmmas: SS n16 (v1), RS n16, RS n8, SS n8
    run<0, 0>("the kernel's loop (wait, promote, per block)", sms, d_cycles, sink, src);
    run<1, 0>("v0 plus a 16-row tail (the kernel's, SS m64n16k32)", sms, d_cycles, sink, src);
    run<10, 0>("v1, the tail's weights from registers (RS m64n16k32)", sms, d_cycles, sink, src);
    run<11, 0>("v1, RS m64n8k32 (a tail of 8 rows)", sms, d_cycles, sink, src);
    run<12, 0>("v1, SS m64n8k32", sms, d_cycles, sink, src);
    run<0, 1>("v0, stages filled from L2", sms, d_cycles, sink, src);
    run<1, 1>("v1, stages filled from L2", sms, d_cycles, sink, src);
    run<10, 1>("v10, stages filled from L2", sms, d_cycles, sink, src);
    run<11, 1>("v11, stages filled from L2", sms, d_cycles, sink, src);
    run<0, 6>("v0 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
    run<1, 6>("v1 L5", sms, d_cycles, sink, src);
    run<10, 6>("v10 L5", sms, d_cycles, sink, src);
    run<11, 6>("v11 L5", sms, d_cycles, sink, src);
    run<12, 6>("v12 L5", sms, d_cycles, sink, src);
    run<0, 6>("v0 L5 (again)", sms, d_cycles, sink, src);
    run<1, 6>("v1 L5 (again)", sms, d_cycles, sink, src);
    run<10, 6>("v10 L5 (again)", sms, d_cycles, sink, src);
    return 0;
  }
  if (argc > 1) {  // sustained: launches back to back for a few seconds, as a benchmark's replays
    for (int round = 0; round < 8; ++round) {
      run<0, 5>("v0 L5, sustained (1000 launches, the last 5)", sms, d_cycles, sink, src, 1000);
      run<0, 1>("v0 L1, sustained (1000 launches, the last 5)", sms, d_cycles, sink, src, 1000);
    }
    return 0;
  }
  run<0, 0>("the kernel's loop (wait, promote, per block)", sms, d_cycles, sink, src);
  run<1, 0>("v0 plus a 16-row tail (the kernel's tail tile)", sms, d_cycles, sink, src);
  run<6, 0>("v1, tail sum in smem, tail first (wait<1>)", sms, d_cycles, sink, src);
  run<7, 0>("v1, tail sum in smem, tail between blocks 0 and 1", sms, d_cycles, sink, src);
  run<8, 0>("v1, the tail every second K block, both in one batch", sms, d_cycles, sink, src);
  run<5, 0>("swap-AB, 128 rows as N", sms, d_cycles, sink, src);
  run<3, 0>("swap-AB, 144 rows as N (128 + a 16-row tail)", sms, d_cycles, sink, src);
  run<2, 0>("two partial sums in flight", sms, d_cycles, sink, src);
  run<4, 0>("fast accumulation (no promotion)", sms, d_cycles, sink, src);
  run<0, 1>("v0, stages filled from L2", sms, d_cycles, sink, src);
  run<4, 1>("v4, stages filled from L2", sms, d_cycles, sink, src);
  run<0, 2>("v0, B from DRAM (32 KB per K block per SM)", sms, d_cycles, sink, src);
  run<4, 2>("v4, B from DRAM", sms, d_cycles, sink, src);
  run<0, 3>("v0, B from DRAM, row scales by cp.async", sms, d_cycles, sink, src);
  run<0, 4>("v0 L3, B by TMA boxes from row-major weights", sms, d_cycles, sink, src);
  run<0, 5>("v0 L4, a 9500-cycle epilogue pause per tile", sms, d_cycles, sink, src);
  run<1, 5>("v1 L4, a 9500-cycle epilogue pause per tile", sms, d_cycles, sink, src);
  run<8, 5>("v8 L4, a 9500-cycle epilogue pause per tile", sms, d_cycles, sink, src);
  run<0, 6>("v0 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
  run<1, 6>("v1 L5, A by TMA boxes from row-major [8192, 7168]", sms, d_cycles, sink, src);
  run<4, 5>("v4 L4, a 9500-cycle epilogue pause per tile", sms, d_cycles, sink, src);
  run3<0>("3 warpgroups, 192 x 128 tile, operands resident", sms, d_cycles, sink, src);
  run3<1>("w3, stages filled from L2", sms, d_cycles, sink, src);
  run3<2>("w3, B from DRAM (16 KB per K block per SM)", sms, d_cycles, sink, src);
  run3<4>("w3, B by TMA boxes from row-major weights", sms, d_cycles, sink, src);
  run3<5>("w3 L4, a 5000-cycle epilogue pause per tile", sms, d_cycles, sink, src);
  return 0;
}
