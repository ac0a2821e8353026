// The whole FP8 (W8A8) forward in two kernels, for a few tokens: no routing, no permuted
// copies, no separate activation or finalize launch. At one token the five-step forward
// spends most of its time in launch gaps and chains of dependent loads, not in the weights'
// bytes.
//
//   up:   a block per (expert, 16 intermediate columns), for all the pairs routed to that
//         expert (the block of its first pair; blocks of later pairs of it exit). Quantizes
//         the tokens' rows into shared memory (as expand does), GEMM1 over its gate and up
//         rows with K split over 4 warps, dequantizes, adds the bias, applies the activation
//         and writes h [T*k, I] in float32.
//   down: a block per (token, 16 output columns). Quantizes the token's h rows (as the
//         activation kernel does), GEMM2 over each local slot's 16 weight rows, dequantizes,
//         adds the bias and the slot's weight: the weighted sum in a fixed order, so the
//         result is the same on every run. Before waiting for `up` it prefetches its weight
//         rows into L2 and loads its first batch into registers.
//
// The matrix product is the decode kernel's (gemm/decode_gemm.cuh): mma.sync m16n8k32 with
// 16 weight rows as A and up to 8 tokens as B, lane q holding bytes 16q..16q+15 of each
// 64-byte half of a 128-byte K step for both operands.
//
// Measured on H200 (Qwen3-30B-A3B, one token) and not kept: the weights staged through
// shared memory by cp.async or by TMA bulk copies (all of a block's chunks requested up
// front) were slower in both kernels than these register loads (ncu: up 15.7-16.3 vs
// 14.1 us, down 23.1-25.3 vs 15.3 us).
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

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 16;      // output columns per block: one mma M tile of weight rows
constexpr int kPass = 8;       // tokens per pass: the mma's N
constexpr int kStep = 128;     // K bytes per warp step
constexpr int kUpBatch = 2;    // up: K steps whose weight loads a warp has in flight together
constexpr int kDownBatch = 4;  // down: the same (its weights come from L2)

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

// A piece of a weight row (E4M3 in memory), streamed past L1; zeros past K.
__device__ __forceinline__ uint4 weight_piece(const uint8_t* row, int64_t k, int s, int h) {
  const int64_t off = piece_offset(s, h);
  return off < k ? load_stream(row + off) : make_uint4(0, 0, 0, 0);
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

// The E4M3 scale of a row: the static one, or amax / 448 over the row (one warp reads it,
// several loads in flight per lane).
template <typename S>
__device__ __forceinline__ float row_scale(const S* row, int64_t n, const float* static_scale) {
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

__device__ __forceinline__ float weight_scale(const float* s, bool per_channel, int64_t e,
                                              int64_t n_rows, int64_t col) {
  return per_channel ? s[e * n_rows + col] : s[e];
}

// Dynamic shared memory: up stages a pass's tokens quantized, rows padded by 64 bytes so that
// a quarter-warp's 16-byte loads (2 tokens x 4 pieces) hit distinct banks; down keeps
// per-slot metadata, then a quantized h row per warp.
__host__ __device__ constexpr int64_t up_row_bytes(int64_t hidden) { return hidden + 64; }
__host__ __device__ constexpr size_t up_smem(int pass, int64_t hidden) { return pass * up_row_bytes(hidden); }
__host__ __device__ constexpr size_t down_meta_bytes(int top_k) { return (12 * size_t(top_k) + 15) / 16 * 16; }
__host__ __device__ constexpr size_t down_smem(int top_k, int64_t inter) {
  return down_meta_bytes(top_k) + kWarps * size_t(inter);
}

template <typename T, typename IdT, int kAct>
__global__ void __launch_bounds__(kThreads) fused_up_kernel(FusedUpParams p, int pass) {
  constexpr bool kGated = is_gated_act(kAct);
  constexpr int kTiles = kGated ? 2 : 1;  // gate rows, up rows: one mma M tile each
  extern __shared__ __align__(16) uint8_t s_x[];  // [pass][up_row_bytes(H)] quantized tokens
  __shared__ int32_t s_pairs[kFusedMaxPairs];
  __shared__ int s_count;
  __shared__ float s_scale[kPass];
  __shared__ float partial[kWarps][kTiles][kPass][kCols + 1];
  static_assert(sizeof(s_pairs) + sizeof(s_count) + sizeof(s_scale) + sizeof(partial) <= kFusedSmemBytes,
                "kFusedSmemBytes (the registry's figure) is a bound on this");
  const IdT* ids = static_cast<const IdT*>(p.ids);
  const T* x = static_cast<const T*>(p.hidden);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, q = lane & 3;
  const int64_t H = p.hidden_size, I = p.inter, n1 = kGated ? 2 * I : I, ldx = up_row_bytes(H);
  const int k_steps = static_cast<int>((H + kStep - 1) / kStep);
  const int c0 = blockIdx.x * kCols;

  pdl_begin();  // topk_ids and hidden_states come from the caller's previous kernels
  const int64_t pr = blockIdx.y;
  const IdT id = ids[pr];
  const int64_t e = static_cast<int64_t>(id) - p.expert_offset;
  if (e < 0 || e >= p.num_experts) return;  // not this rank's expert: contributes nothing
  const uint8_t* wrow[kTiles][2];
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) wrow[j][i] = p.w13 + (e * n1 + j * I + c0 + r + 8 * i) * H;
  uint4 w[kUpBatch][kTiles][2][2];  // [step][tile][half][row r, r + 8]
  auto load_weights = [&](int s0) {
#pragma unroll
    for (int i = 0; i < kUpBatch; ++i)
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr)
            w[i][j][h][rr] = s0 + i * kWarps < k_steps ? weight_piece(wrow[j][rr], H, s0 + i * kWarps, h)
                                                       : make_uint4(0, 0, 0, 0);
  };
  // The first weight loads, and this thread's epilogue scales and biases (column c0 + tid %
  // 16), are in flight while the block finds its pairs and quantizes them.
  load_weights(warp);
  const int64_t my_n = c0 + threadIdx.x % kCols;
  float ws[kTiles], bias[kTiles] = {};
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    ws[j] = weight_scale(p.w13_scale, p.w13_per_channel, e, n1, j * I + my_n);
    if (p.bias) bias[j] = Vec8<T>::to_float(static_cast<const T*>(p.bias)[e * n1 + j * I + my_n]);
  }

  bool earlier = false;  // the expert's first pair's block does all of its pairs
  for (int64_t j = threadIdx.x; j < pr; j += kThreads) earlier |= ids[j] == id;
  if (__syncthreads_or(earlier)) return;
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  for (int64_t j = pr + threadIdx.x; j < p.pairs; j += kThreads)
    if (ids[j] == id) s_pairs[atomicAdd(&s_count, 1)] = static_cast<int32_t>(j);
  __syncthreads();
  const int count = s_count;

  bool preloaded = true;
  for (int m0 = 0; m0 < count; m0 += pass) {
    const int n_tok = count - m0 < pass ? count - m0 : pass;
    for (int i = warp; i < n_tok; i += kWarps) {
      const float sc = row_scale(x + int64_t(s_pairs[m0 + i] / p.top_k) * H, H, p.a13_scale);
      if (lane == 0) s_scale[i] = sc;
    }
    __syncthreads();
    const int64_t pieces = H / 16;
#pragma unroll 2
    for (int64_t i = threadIdx.x; i < n_tok * pieces; i += kThreads) {
      const int tok = static_cast<int>(i / pieces);
      const int64_t j = (i % pieces) * 16;
      *reinterpret_cast<uint4*>(s_x + tok * ldx + j) =
          quantize16(x + int64_t(s_pairs[m0 + tok] / p.top_k) * H + j, s_scale[tok]);
    }
    __syncthreads();
    const uint8_t* xrow = r < n_tok ? s_x + r * ldx : nullptr;  // this lane's token: column r of B
    float acc[kTiles][4] = {};
    for (int s0 = warp; s0 < k_steps; s0 += kWarps * kUpBatch) {
      if (!preloaded) load_weights(s0);
      preloaded = false;
#pragma unroll
      for (int i = 0; i < kUpBatch; ++i) {
        const uint4 b[2] = {staged_piece(xrow, H, s0 + i * kWarps, 0), staged_piece(xrow, H, s0 + i * kWarps, 1)};
#pragma unroll
        for (int j = 0; j < kTiles; ++j) mma_step(acc[j], w[i][j], b);  // zeros past K
      }
    }
    // c0: (row r, token 2q), c1: (r, 2q + 1), c2: (r + 8, 2q), c3: (r + 8, 2q + 1).
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      partial[warp][j][2 * q][r] = acc[j][0];
      partial[warp][j][2 * q + 1][r] = acc[j][1];
      partial[warp][j][2 * q][r + 8] = acc[j][2];
      partial[warp][j][2 * q + 1][r + 8] = acc[j][3];
    }
    __syncthreads();
    static_assert(kThreads == kPass * kCols, "one output per thread");
    const int tok = threadIdx.x / kCols, col = threadIdx.x % kCols;
    if (tok < n_tok) {
      float raw[kTiles] = {};
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) raw[j] += partial[ww][j][tok][col];
      // As the activation kernel dequantizes: raw * (row scale * weight scale) + bias.
      const float gate = raw[0] * (s_scale[tok] * ws[0]) + bias[0];
      const float up = kGated ? raw[kTiles - 1] * (s_scale[tok] * ws[kTiles - 1]) + bias[kTiles - 1] : 0.f;
      p.h[int64_t(s_pairs[m0 + tok]) * I + my_n] = apply<kAct>(gate, up, p.alpha, p.limit);
    }
    __syncthreads();  // s_scale, s_x and partial are reused by the next pass
  }
}

template <typename T, typename IdT>
__global__ void __launch_bounds__(kThreads) fused_down_kernel(FusedDownParams p) {
  extern __shared__ __align__(16) uint8_t s_dyn[];
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

  // The token's slots come from the caller's kernels, two launches back (launch.cuh): read
  // before the wait for `up`, and this block's weight rows (16 rows x I bytes, contiguous
  // per expert) are prefetched into L2 while `up` runs; each warp's first batch goes to
  // registers.
  for (int s = threadIdx.x; s < p.top_k; s += kThreads) {
    const int64_t e = static_cast<int64_t>(ids[t * p.top_k + s]) - p.expert_offset;
    s_expert[s] = e >= 0 && e < p.num_experts ? static_cast<int32_t>(e) : -1;
    s_w[s] = p.topk_weights[t * p.top_k + s];
  }
  __syncthreads();
  for (int s = 0; s < p.top_k; ++s) {
    if (s_expert[s] < 0) continue;
    const uint8_t* rows = p.w2 + (int64_t(s_expert[s]) * H + n0) * I;
    for (int64_t o = int64_t(threadIdx.x) * 128; o < kCols * I; o += kThreads * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rows + o));
  }
  uint4 w[kDownBatch][2][2];  // [step][half][row r, r + 8]
  const uint8_t* wrow[2];
  auto load_weights = [&](int s0) {
#pragma unroll
    for (int i = 0; i < kDownBatch; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
          w[i][h][rr] = s0 + i < k_steps ? weight_piece(wrow[rr], I, s0 + i, h) : make_uint4(0, 0, 0, 0);
  };
  auto first_slot = [&](int s) {  // this warp's next local slot from s on, or top_k
    while (s < p.top_k && s_expert[s] < 0) s += kWarps;
    return s;
  };
  auto set_rows = [&](int s) {
    const int64_t base = int64_t(s_expert[s]) * H + n0 + r;
    wrow[0] = p.w2 + base * I;
    wrow[1] = p.w2 + (base + 8) * I;
  };
  int s = first_slot(warp);
  if (s < p.top_k) {
    set_rows(s);
    load_weights(0);
  }
  pdl_begin();

  for (int j = warp; j < p.top_k; j += kWarps)
    if (s_expert[j] >= 0) {
      const float sc = row_scale(p.h + (t * p.top_k + j) * I, I, p.a2_scale);
      if (lane == 0) s_scale[j] = sc;
    }
  __syncthreads();

  // Warp w takes slots w, w + 4, ...; a single token is column 0 of the mma's B (lanes with
  // r == 0 read it; the other columns are zeros), so c0 and c2 of lanes q == 0 hold its sums
  // for columns n0 + r and n0 + r + 8.
  float total[2] = {0.f, 0.f};
  bool preloaded = true;
  for (; s < p.top_k; s = first_slot(s + kWarps)) {
    const int32_t e = s_expert[s];
    const float hs = s_scale[s];
    const float* hrow = p.h + (t * p.top_k + s) * I;
    for (int64_t j = lane * 16; j < I; j += 32 * 16)
      *reinterpret_cast<uint4*>(s_h + j) = quantize16(hrow + j, hs);
    __syncwarp();
    if (!preloaded) set_rows(s);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < k_steps; s0 += kDownBatch) {
      if (!preloaded) load_weights(s0);
      preloaded = false;
#pragma unroll
      for (int i = 0; i < kDownBatch; ++i) {
        const uint4 b[2] = {staged_piece(r == 0 ? s_h : nullptr, I, s0 + i, 0),
                            staged_piece(r == 0 ? s_h : nullptr, I, s0 + i, 1)};
        mma_step(acc, w[i], b);
      }
    }
    __syncwarp();  // s_h is rewritten for the next slot
    if (q == 0) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // as finalize: weight * (raw * (row scale * weight scale) + bias)
        const int64_t n = n0 + r + 8 * c;
        float v = acc[2 * c] * (hs * weight_scale(p.w2_scale, p.w2_per_channel, e, H, n));
        if (p.bias) v += Vec8<T>::to_float(static_cast<const T*>(p.bias)[e * H + n]);
        total[c] += s_w[s] * v;
      }
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
  const dim3 up_grid(static_cast<unsigned>(up.inter / kCols), static_cast<unsigned>(up.pairs));
  // Tokens per pass: an expert has at most T of them, unless a token names it twice.
  const int pass = static_cast<int>(tokens < kPass ? tokens : kPass);
  auto go = [&](auto act) {
    auto* kernel = fused_up_kernel<T, IdT, decltype(act)::value>;
    const size_t smem = up_smem(pass, up.hidden_size);
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    return launch(kernel, up_grid, kThreads, smem, stream, up, pass);
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
         up_smem(kPass, hidden) <= kLimit && down_smem(static_cast<int>(top_k), inter) <= kLimit;
}

}  // namespace moe_kernels
