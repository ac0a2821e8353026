// The whole FP8 (W8A8) forward in two kernels, for a few tokens: no routing, no permuted
// copies, no separate activation or finalize launch. At one token the five-step forward
// spends most of its time in launch gaps and chains of dependent loads, not in the weights'
// bytes; here each block has one short chain and all of its weight bytes in flight at once.
//
//   up:   a block per ((token, slot) pair, 16 intermediate columns): quantizes the pair's
//         token (as expand does) into shared memory while its gate and up weight rows are on
//         the way, GEMM1 with K split over 8 warps, dequantizes, adds the bias, applies the
//         activation and writes h [T*k, I] in float32. It also asks L2 to prefetch its share
//         of the pair's expert's w2, so that `down` reads its weights from L2.
//   down: a block per (token, 16 output columns). Loads its first weight steps before waiting
//         for `up`, quantizes the token's h rows (as the activation kernel does), GEMM2 over
//         each local slot (K split over warps when there are fewer than 8 slots),
//         dequantizes, adds the bias and the slot's weight: the weighted sum in a fixed
//         order, so the result is the same on every run.
//
// The matrix product is the decode kernel's (gemm/decode_gemm.cuh): mma.sync m16n8k32 with
// 16 weight rows as A and the token as column 0 of B, lane q holding bytes 16q..16q+15 of each
// 64-byte half of a 128-byte K step for both operands.
#include <type_traits>

#include "act.cuh"
#include "gemm/decode_gemm.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "vec.cuh"

namespace moe_kernels {
namespace {

using decode::load_stream;
using decode::word;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 16;    // columns per block: one mma M tile of weight rows
constexpr int kStep = 128;   // K bytes per warp step
constexpr int kDownRing = 4;  // down: K steps whose weight loads a warp keeps in flight

// Sixteen values of a row (bf16, fp16 or float) as floats.
template <typename S>
__device__ __forceinline__ void load16(const S* p, float* v) {
  if constexpr (std::is_same_v<S, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 f = reinterpret_cast<const float4*>(p)[i];
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
  } else {
    Vec8<S> a, b;
    a.load(p);
    b.load(p + 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = a.v[i], v[8 + i] = b.v[i];
  }
}

// 16 values of a row quantized to E4M3 with `scale`, exactly as expand and the activation
// kernel quantize (to_fp8x8).
template <typename S>
__device__ __forceinline__ uint4 quantize16(const S* p, float scale) {
  float v[16];
  load16(p, v);
  const uint2 lo = to_fp8x8(v, scale), hi = to_fp8x8(v + 8, scale);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// Byte offset of lane q's 16 bytes of K step s, half h (the same for weights and tokens).
__device__ __forceinline__ int64_t piece_offset(int s, int h) {
  return int64_t(s) * kStep + 64 * h + 16 * (threadIdx.x & 3);
}

// A piece of a quantized row staged in shared memory (NULL: no such token); zeros past K.
__device__ __forceinline__ uint4 staged_piece(const uint8_t* row, int64_t k, int s, int h) {
  const int64_t off = piece_offset(s, h);
  return row && off < k ? *reinterpret_cast<const uint4*>(row + off) : make_uint4(0, 0, 0, 0);
}

// A piece of a weight row (E4M3 in memory), streamed past L1; zeros past K and past the
// last step (s >= steps).
__device__ __forceinline__ uint4 weight_piece(const uint8_t* row, int64_t k, int s, int steps, int h) {
  const int64_t off = piece_offset(s, h);
  return s < steps && off < k ? load_stream(row + off) : make_uint4(0, 0, 0, 0);
}

// acc += the 16 x 8 product of one K step: weights w[half][row r, r + 8], tokens b[half].
__device__ __forceinline__ void mma_step(float (&acc)[4], const uint4 (&w)[2][2], const uint4 (&b)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const uint32_t a[4] = {word(w[h][0], 2 * v), word(w[h][1], 2 * v), word(w[h][0], 2 * v + 1),
                             word(w[h][1], 2 * v + 1)};
      decode::mma<__nv_fp8_e4m3>(acc, a, word(b[h], 2 * v), word(b[h], 2 * v + 1));
    }
}

__device__ __forceinline__ float weight_scale(const float* s, bool per_channel, int64_t e,
                                              int64_t n_rows, int64_t col) {
  return per_channel ? s[e * n_rows + col] : s[e];
}

// Dynamic shared memory of down: per-slot metadata, then a quantized h row per warp.
__host__ __device__ constexpr size_t down_meta_bytes(int top_k) { return (12 * size_t(top_k) + 15) / 16 * 16; }
__host__ __device__ constexpr size_t down_smem(int top_k, int64_t inter) {
  return down_meta_bytes(top_k) + kWarps * size_t(inter);
}

// Up: persistent blocks, one per SM, each taking units (pair, 16 columns) b, b + grid, ...
// A unit's weights (kTiles x 16 rows x H bytes) stream into shared memory in pieces of up to
// kChunk bytes of K per row, by bulk copies (TMA) on an mbarrier each, kStages pieces ahead:
// all of a block's first pieces are requested right after the ids are read, so the weight
// stream does not wait for each block's chain of steps (registers alone could not hold
// enough bytes in flight). Rows are padded by kRowPad bytes so that the shared-memory loads
// of the mma fragments hit distinct banks.
constexpr int64_t kChunk = 2048;
constexpr int kRowPad = 64;  // rows r and r + 1 of an 8-lane LDS phase: 64 bytes apart mod 128
constexpr int kMaxStages = 8;
__host__ __device__ constexpr int64_t up_chunk(int64_t hidden) { return hidden < kChunk ? hidden : kChunk; }
// A tile's 16 rows whole (H <= kChunk) are one contiguous copy, unpadded (each bulk copy has
// a fixed cost: 16 row copies per tile made the kernel as slow as register loads); parts of
// rows are a copy per row, padded.
__host__ __device__ constexpr int64_t up_row_bytes(int64_t hidden) {
  return hidden <= kChunk ? hidden : kChunk + kRowPad;
}
__host__ __device__ constexpr size_t up_piece_bytes(int tiles, int64_t hidden) {
  return size_t(tiles) * kCols * up_row_bytes(hidden);
}
// Shared memory: the token row quantized, then the ring of pieces.
__host__ __device__ constexpr size_t up_smem(int tiles, int64_t hidden, int stages) {
  return (size_t(hidden) + 127) / 128 * 128 + stages * up_piece_bytes(tiles, hidden);
}
constexpr size_t kUpSmemBudget = 200 * 1024;
__host__ __device__ constexpr int up_stages(int tiles, int64_t hidden) {
  const size_t fixed = (size_t(hidden) + 127) / 128 * 128, piece = up_piece_bytes(tiles, hidden);
  const int64_t n = fixed + piece > kUpSmemBudget ? 1 : int64_t((kUpSmemBudget - fixed) / piece);
  return n > kMaxStages ? kMaxStages : int(n);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// The block's sequence of pieces: its units with a local expert, each in ceil(H / chunk)
// pieces. The producer (thread 0) walks it kStages pieces ahead of the block.
template <typename IdT>
struct UpCursor {
  int64_t unit;  // b + grid * i
  int64_t k0;    // the piece's first K byte
  int64_t e;     // the unit's local expert, or -1 past the end
  __device__ void find_local(const FusedUpParams& p, int64_t units, int64_t cols) {
    for (; unit < units; unit += gridDim.x) {
      e = static_cast<int64_t>(static_cast<const IdT*>(p.ids)[unit / cols]) - p.expert_offset;
      if (e >= 0 && e < p.num_experts) return;
    }
    e = -1;
  }
  __device__ void next(const FusedUpParams& p, int64_t units, int64_t cols, int64_t chunk) {
    k0 += chunk;
    if (k0 < p.hidden_size) return;
    k0 = 0;
    unit += gridDim.x;
    find_local(p, units, cols);
  }
};

template <typename T, typename IdT, int kAct>
__global__ void __launch_bounds__(kThreads, 1) fused_up_kernel(FusedUpParams p, int stages) {
  constexpr bool kGated = is_gated_act(kAct);
  constexpr int kTiles = kGated ? 2 : 1;  // gate rows, up rows: one mma M tile each
  extern __shared__ __align__(128) uint8_t s_dyn[];
  __shared__ float partial[kWarps][kTiles][kCols];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  static_assert(sizeof(partial) + sizeof(full) + 32 * sizeof(float) <= kFusedSmemBytes,
                "kFusedSmemBytes (the registry's figure) is a bound on this");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, q = lane & 3;
  const int64_t H = p.hidden_size, I = p.inter, n1 = kGated ? 2 * I : I;
  const int64_t chunk = up_chunk(H), row_bytes = up_row_bytes(H);
  const int64_t cols = I / kCols, units = p.pairs * cols;
  uint8_t* s_x = s_dyn;  // the current unit's token, quantized
  uint8_t* ring = s_dyn + (H + 127) / 128 * 128;
  const size_t piece_bytes = up_piece_bytes(kTiles, H);

  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) mbar_init(&full[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_begin();  // topk_ids and hidden_states come from the caller's previous kernels

  // Thread 0: request the first `stages` pieces, then L2 prefetch of this block's share of
  // the w2 rows that `down` will read (each pair's expert, H x I bytes, split over blocks).
  UpCursor<IdT> prod{blockIdx.x, 0, -1};
  auto issue = [&](int stage) {
    const int64_t n = H - prod.k0 < chunk ? H - prod.k0 : chunk;
    uint8_t* dst = ring + stage * piece_bytes;
    mbar_expect_tx(&full[stage], static_cast<uint32_t>(kTiles * kCols * n));
    const int64_t c0 = (prod.unit % cols) * kCols;
    for (int j = 0; j < kTiles; ++j) {
      const uint8_t* src = p.w13 + (prod.e * n1 + j * I + c0) * H + prod.k0;
      if (chunk == H)
        bulk_copy(dst + j * kCols * row_bytes, src, static_cast<uint32_t>(kCols * H), &full[stage]);
      else
        for (int rr = 0; rr < kCols; ++rr)
          bulk_copy(dst + (j * kCols + rr) * row_bytes, src + rr * H, static_cast<uint32_t>(n), &full[stage]);
    }
    prod.next(p, units, cols, chunk);
  };
  if (threadIdx.x == 0) {
    prod.find_local(p, units, cols);
    for (int i = 0; i < stages && prod.e >= 0; ++i) issue(i);
    const int64_t bytes = H * I, total = p.pairs * bytes;
    const int64_t share = (total / gridDim.x + 15) / 16 * 16;
    for (int64_t from = share * blockIdx.x, end = from + share < total ? from + share : total; from < end;) {
      const int64_t pr = from / bytes, off = from % bytes;
      const int64_t n = end - from < bytes - off ? end - from : bytes - off;
      const int64_t e = static_cast<int64_t>(static_cast<const IdT*>(p.ids)[pr]) - p.expert_offset;
      if (e >= 0 && e < p.num_experts)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p.w2 + e * bytes + off),
                     "r"(static_cast<uint32_t>(n)) : "memory");
      from += n;
    }
  }

  UpCursor<IdT> cons{blockIdx.x, 0, -1};
  cons.find_local(p, units, cols);
  int64_t x_pair = -1;  // the token in s_x (as its first pair)
  float x_scale = 1.f, ws[kTiles] = {}, bias[kTiles] = {};
  float acc[kTiles][4] = {};
  for (int g = 0; cons.e >= 0; ++g) {
    const int stage = g % stages;
    const int64_t pr = cons.unit / cols, c0 = (cons.unit % cols) * kCols, e = cons.e;
    if (cons.k0 == 0) {  // a new unit: its token and this thread's epilogue scale and bias
      if (threadIdx.x < kCols) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          ws[j] = weight_scale(p.w13_scale, p.w13_per_channel, e, n1, j * I + c0 + threadIdx.x);
          if (p.bias) bias[j] = Vec8<T>::to_float(static_cast<const T*>(p.bias)[e * n1 + j * I + c0 + threadIdx.x]);
        }
      }
      const int64_t tok = pr / p.top_k;
      if (x_pair < 0 || x_pair / p.top_k != tok) {
        const T* x = static_cast<const T*>(p.hidden) + tok * H;
        float amax = 0.f;
        if (!p.a13_scale)
          for (int64_t j = int64_t(threadIdx.x) * 8; j < H; j += kThreads * 8) {
            Vec8<T> v;
            v.load(x + j);
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v.v[i]));
          }
        x_scale = p.a13_scale ? *p.a13_scale : fp8_scale(block_amax(amax));
        __syncthreads();  // s_x may still be read for the previous token
        for (int64_t j = int64_t(threadIdx.x) * 8; j < H; j += kThreads * 8) {
          Vec8<T> v;
          v.load(x + j);
          *reinterpret_cast<uint2*>(s_x + j) = to_fp8x8(v.v, x_scale);
        }
        x_pair = pr;
        __syncthreads();
      }
    }
    mbar_wait(&full[stage], (g / stages) & 1);
    const uint8_t* piece = ring + stage * piece_bytes;
    const int64_t n = H - cons.k0 < chunk ? H - cons.k0 : chunk;
    const int steps = static_cast<int>((n + kStep - 1) / kStep);
    for (int s = warp; s < steps; s += kWarps) {
      uint4 b[2], w[kTiles][2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t off = piece_offset(s, h);
        const bool in = off < n;
        b[h] = r == 0 && in ? *reinterpret_cast<const uint4*>(s_x + cons.k0 + off) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < kTiles; ++j)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr)
            w[j][h][rr] = in ? *reinterpret_cast<const uint4*>(piece + (j * kCols + r + 8 * rr) * row_bytes + off)
                             : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < kTiles; ++j) mma_step(acc[j], w[j], b);
    }
    const bool last = cons.k0 + chunk >= H;
    cons.next(p, units, cols, chunk);
    __syncthreads();  // every warp is done with this stage
    if (threadIdx.x == 0 && prod.e >= 0) issue(stage);
    if (last) {
      // Column 0 (the token) of c0 and c2 in lanes q == 0: rows r and r + 8.
      if (q == 0) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          partial[warp][j][r] = acc[j][0];
          partial[warp][j][r + 8] = acc[j][2];
        }
      }
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
      __syncthreads();
      if (threadIdx.x < kCols) {
        float raw[kTiles] = {};
#pragma unroll
        for (int j = 0; j < kTiles; ++j)
#pragma unroll
          for (int ww = 0; ww < kWarps; ++ww) raw[j] += partial[ww][j][threadIdx.x];
        // As the activation kernel dequantizes: raw * (row scale * weight scale) + bias.
        const float gate = raw[0] * (x_scale * ws[0]) + bias[0];
        const float up = kGated ? raw[kTiles - 1] * (x_scale * ws[kTiles - 1]) + bias[kTiles - 1] : 0.f;
        p.h[pr * I + c0 + threadIdx.x] = apply<kAct>(gate, up, p.alpha, p.limit);
      }
      // partial is rewritten only after the next piece's __syncthreads.
    }
  }
}

// The E4M3 scale of an h row: the static one, or amax / 448 over the row (one warp).
__device__ __forceinline__ float h_row_scale(const float* row, int64_t n, const float* static_scale) {
  if (static_scale) return *static_scale;
  float m = 0.f;
#pragma unroll 4
  for (int64_t j = (threadIdx.x & 31) * 16; j < n; j += 32 * 16) {
    float v[16];
    load16(row + j, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
  }
  return fp8_scale(WarpTeam{}.amax(m));
}

// Down: work items (slot, part): with fewer than 8 local slots, each slot's K steps are
// split into `parts` interleaved parts so that every warp has one; warp w takes items w,
// w + 8, ... Each warp keeps kDownRing K steps of weight loads in flight.
template <typename T, typename IdT>
__global__ void __launch_bounds__(kThreads, 2) fused_down_kernel(FusedDownParams p) {
  extern __shared__ __align__(128) uint8_t s_dyn[];
  int32_t* s_expert = reinterpret_cast<int32_t*>(s_dyn);  // per slot: local expert or -1,
  float* s_w = reinterpret_cast<float*>(s_expert + p.top_k);  // its weight,
  float* s_scale = s_w + p.top_k;                               // its h row's scale
  __shared__ float partial[kWarps][kCols];
  const IdT* ids = static_cast<const IdT*>(p.ids);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, q = lane & 3;
  const int64_t H = p.hidden_size, I = p.inter, t = blockIdx.y;
  uint8_t* s_h = s_dyn + down_meta_bytes(p.top_k) + warp * I;  // this warp's quantized h row
  const int n0 = blockIdx.x * kCols;
  const int k_steps = static_cast<int>((I + kStep - 1) / kStep);
  const int parts = p.top_k < kWarps ? kWarps / p.top_k : 1;
  const int items = p.top_k * parts;

  // The token's slots come from the caller's kernels, two launches back (launch.cuh): read
  // before the wait for `up`, and so are each warp's first weight steps (w2 rows n0 .. n0+15
  // of its slot's expert; `up` has had L2 prefetch them).
  for (int s = threadIdx.x; s < p.top_k; s += kThreads) {
    const int64_t e = static_cast<int64_t>(ids[t * p.top_k + s]) - p.expert_offset;
    s_expert[s] = e >= 0 && e < p.num_experts ? static_cast<int32_t>(e) : -1;
    s_w[s] = p.topk_weights[t * p.top_k + s];
  }
  __syncthreads();
  auto next_item = [&](int it) {  // this warp's next item with a local slot, from it on
    while (it < items && s_expert[it % p.top_k] < 0) it += kWarps;
    return it;
  };
  uint4 w[kDownRing][2][2];  // [ring slot][half][row r, r + 8]
  const uint8_t* wrow[2];
  int part = 0;
  float ws[2] = {}, bias[2] = {};  // lanes q == 0: the epilogue's, for columns n0 + r, n0 + r + 8
  auto start_item = [&](int it) {
    const int s = it % p.top_k;
    part = it / p.top_k;
    const int64_t e = s_expert[s], base = e * H + n0 + r;
    wrow[0] = p.w2 + base * I;
    wrow[1] = p.w2 + (base + 8) * I;
    if (q == 0)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        ws[c] = weight_scale(p.w2_scale, p.w2_per_channel, e, H, n0 + r + 8 * c);
        bias[c] = p.bias && part == 0 ? Vec8<T>::to_float(static_cast<const T*>(p.bias)[e * H + n0 + r + 8 * c]) : 0.f;
      }
  };
  auto load_step = [&](uint4 (&buf)[2][2], int i) {  // the item's i-th step: part + i * parts
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) buf[h][rr] = weight_piece(wrow[rr], I, part + i * parts, k_steps, h);
  };
  int it = next_item(warp);
  if (it < items) {
    start_item(it);
#pragma unroll
    for (int i = 0; i < kDownRing; ++i) load_step(w[i], i);
  }
  pdl_begin();

  for (int j = warp; j < p.top_k; j += kWarps)
    if (s_expert[j] >= 0) {
      const float sc = h_row_scale(p.h + (t * p.top_k + j) * I, I, p.a2_scale);
      if (lane == 0) s_scale[j] = sc;
    }
  __syncthreads();

  // A single token is column 0 of the mma's B (lanes with r == 0 read it; the other columns
  // are zeros), so c0 and c2 of lanes q == 0 hold its sums for columns n0 + r and n0 + r + 8.
  float total[2] = {0.f, 0.f};
  bool preloaded = true;
  for (; it < items; it = next_item(it + kWarps)) {
    const int s = it % p.top_k;
    if (!preloaded) {
      start_item(it);
#pragma unroll
      for (int i = 0; i < kDownRing; ++i) load_step(w[i], i);
    }
    preloaded = false;
    const float hs = s_scale[s];
    const float* hrow = p.h + (t * p.top_k + s) * I;
    for (int64_t j = lane * 16; j < I; j += 32 * 16)
      *reinterpret_cast<uint4*>(s_h + j) = quantize16(hrow + j, hs);
    __syncwarp();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int my_steps = (k_steps - part + parts - 1) / parts;
    for (int i0 = 0; i0 < my_steps; i0 += kDownRing) {
#pragma unroll
      for (int i = 0; i < kDownRing; ++i) {
        const int step = part + (i0 + i) * parts;
        const uint4 b[2] = {staged_piece(r == 0 ? s_h : nullptr, I, step, 0),
                            staged_piece(r == 0 ? s_h : nullptr, I, step, 1)};
        mma_step(acc, w[i], b);  // zeros past the item's steps
        load_step(w[i], i0 + i + kDownRing);
      }
    }
    __syncwarp();  // s_h is rewritten for the next item
    if (q == 0) {
#pragma unroll
      for (int c = 0; c < 2; ++c)  // as finalize: weight * (raw * (row scale * weight scale) + bias)
        total[c] += s_w[s] * (acc[2 * c] * (hs * ws[c]) + bias[c]);
    }
  }
  if (q == 0) {
    partial[warp][r] = total[0];
    partial[warp][r + 8] = total[1];
  }
  __syncthreads();
  if (threadIdx.x < kCols) {
    float v = 0.f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) v += partial[ww][threadIdx.x];
    static_cast<T*>(p.out)[t * H + n0 + threadIdx.x] = Vec8<T>::from_float(v);
  }
}

template <typename T, typename IdT>
cudaError_t run(int activation, const FusedUpParams& up, const FusedDownParams& down, int64_t tokens,
                bool up_only, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t e0 = cudaGetDevice(&device);
  if (e0 == cudaSuccess) e0 = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e0 != cudaSuccess) return e0;
  const int64_t units = up.pairs * (up.inter / kCols);
  const unsigned up_grid = static_cast<unsigned>(units < sms ? units : sms);
  auto go = [&](auto act) {
    auto* kernel = fused_up_kernel<T, IdT, decltype(act)::value>;
    constexpr int tiles = is_gated_act(decltype(act)::value) ? 2 : 1;
    const int stages = up_stages(tiles, up.hidden_size);
    const size_t smem = up_smem(tiles, up.hidden_size, stages);
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    return launch(kernel, dim3(up_grid), kThreads, smem, stream, up, stages);
  };
  cudaError_t err;
  switch (activation) {
#define MOEK_ACT_CASE(A) \
  case A: err = go(std::integral_constant<int, A>{}); break;
    MOEK_ACT_CASE(MOEK_ACT_SWIGLU)
    MOEK_ACT_CASE(MOEK_ACT_GEGLU)
    MOEK_ACT_CASE(MOEK_ACT_SWIGLU_OAI)
    MOEK_ACT_CASE(MOEK_ACT_SILU)
    MOEK_ACT_CASE(MOEK_ACT_GELU)
    MOEK_ACT_CASE(MOEK_ACT_RELU2)
    MOEK_ACT_CASE(MOEK_ACT_IDENTITY)
#undef MOEK_ACT_CASE
    default: return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess || up_only) return err;
  const dim3 down_grid(static_cast<unsigned>(down.hidden_size / kCols), static_cast<unsigned>(tokens));
  auto* kernel = fused_down_kernel<T, IdT>;
  const size_t smem = down_smem(down.top_k, down.inter);
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  return launch(kernel, down_grid, kThreads, smem, stream, down);
}

}  // namespace

cudaError_t launch_fused_decode(int activation, bool ids_int64, int64_t tokens,
                                const FusedUpParams& up, const FusedDownParams& down, bool up_only,
                                cudaStream_t stream) {
  if (!fused_decode_fits(up.pairs, up.hidden_size, up.inter, up.top_k))
    return cudaErrorInvalidValue;  // the runner checks this first, with a message
  // FP8 hidden states and outputs are bf16 (the catalog's FP8 rows).
  return ids_int64 ? run<__nv_bfloat16, int64_t>(activation, up, down, tokens, up_only, stream)
                   : run<__nv_bfloat16, int32_t>(activation, up, down, tokens, up_only, stream);
}

int fused_decode_as_gemm(const GroupedGemmArgs&, char* err, size_t errlen) {
  snprintf(err, errlen, "a fused kernel runs the whole forward, not one grouped GEMM");
  return MOEK_INVALID_ARGUMENT;
}

size_t fused_decode_workspace(int, int) { return 0; }

bool fused_decode_fits(int64_t pairs, int64_t hidden, int64_t inter, int64_t top_k) {
  // Dynamic shared memory within SM90's and SM100's 227 KB per block, next to the static part.
  constexpr size_t kLimit = 227 * 1024 - kFusedSmemBytes;
  return pairs <= kFusedMaxPairs && hidden % kCols == 0 && inter % kCols == 0 &&
         up_smem(2, hidden, up_stages(2, hidden)) <= kLimit && down_smem(static_cast<int>(top_k), inter) <= kLimit;
}

}  // namespace moe_kernels
