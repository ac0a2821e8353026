// A/B of the 4-bit decode GEMMs alone, one GEMM of a preset at a time (uniform routing, bf16
// tokens): the mma.sync kernel (decode_w4a16.cuh, 16- and 64-column blocks) against SM90's
// wgmma kernel (sm90/decode_w4_wgmma.cuh, 8- and 16-token passes), all reading the prepared
// 4-bit layout (python/moe_kernels/quant4.py, docs/kernels/four-bit-layout.md), which the
// harness makes on the GPU from random weights in the checkpoint packing. Outputs (NaN-poisoned
// first) checked against a host reference on the checkpoint packing at 256 sampled entries:
// |error| over the typical size of the dot product's terms. Medians of interleaved rounds of
// back-to-back launches.
//
// For MXFP4 also the 16-column mma.sync block and the two wgmma blocks on the placed layout
// (w4a16_mxfp4's since, columns mma16p, wgmma8p and wgmma16p): each 32-bit word's eight E2M1 codes stored
// bit by bit where a mask, or one shift or rotate and a mask, puts each pair of codes in bf16's
// sign, lowest two exponent bits and top mantissa bit (9 instructions for the word's four
// registers, against about 17 for the byte lookup); a value so placed is the E2M1 value times
// 2^-126 (E2M1's subnormal 0.5 too, as a bf16 subnormal), so the scales are stored times 2^126,
// which bf16 holds for scales up to 2 only; "unfolded" (columns wgmma8u, wgmma16u): the same
// layout with the scales as they are, each register multiplied by 2^126 first (4 instructions
// more a word; any E8M0 scale). The gpt-oss "int4" rows run the INT4 path on the same shapes and
// groups of 32: the same bytes with INT4's cheaper conversion.
// "ring mma" (columns rmma8, rmma16, and rmma8p, rmma16p on the placed layout): the harness's own
// copy of the wgmma block (the same cp.async ring, copies and dequantization) with each warp's
// 16 rows multiplied by mma.sync m16n8k16 instead (the same A registers: wgmma's register-sourced
// A fragment is mma.sync's), the tokens' B registers by ldmatrix from the ring's core matrices,
// so the step needs no wgmma wait and no proxy fence (fence.proxy.async is MEMBAR.ALL.CTA +
// FENCE.VIEW.ASYNC.S in SASS, once per K step in the wgmma block).
// Build and run (docs/kernels/decode.md):
//   nvcc -O3 -std=c++17 -arch=sm_90a -I src -I include -I <build>/generated/include \
//        benchmarks/kernel_ab/w4_decode_ab.cu -o w4_decode_ab && ./w4_decode_ab [rounds [gemm [T [reps]]]]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gemm/decode_w4a16.cuh"
#include "gemm/sm90/decode_w4_wgmma.cuh"
#include "harness.cuh"

using bf16 = __nv_bfloat16;

// The placed layout (quant4.PLACED_BITS, decode_w4::E2M1Placed): register r's pair of codes
// (element 0 in its low half) from these bits of the word, [r][element][m, e0, e1, s].
namespace placed {
__device__ constexpr int kBit[4][2][4] = {
    {{6, 7, 8, 15}, {22, 23, 24, 31}},
    {{2, 3, 4, 11}, {18, 19, 20, 27}},
    {{28, 29, 30, 5}, {12, 13, 14, 21}},
    {{0, 1, 10, 9}, {16, 17, 26, 25}},
};
using Tag = moe_kernels::decode_w4::E2M1Placed;  // scales stored times 2^126 (the library's form)
struct Unfolded {};                              // scales as they are
}  // namespace placed

namespace moe_kernels::decode_w4 {
// The library's placed conversion times 2^126 (bf16 0x7E80): each value the E2M1 value itself.
template <>
__device__ __forceinline__ void fragment<__nv_bfloat16, placed::Unfolded>(uint32_t x, uint32_t (&a)[4]) {
  fragment<__nv_bfloat16, E2M1Placed>(x, a);
#pragma unroll
  for (int e = 0; e < 4; ++e) a[e] = mul2<__nv_bfloat16>(a[e], 0x7E807E80u);
}
}  // namespace moe_kernels::decode_w4

namespace ring_mma {
using namespace moe_kernels;
using namespace moe_kernels::decode_w4_wgmma;  // Smem, copy_step, dequantize_step, kStages, kColumns, kThreads
using decode_w4::Params;
using decode_w4::TokenRows;
using decode_w4::WeightTile;

// decode_w4_wgmma::block_tile with mma.sync in place of wgmma (see the top).
template <class T, class W, int kN, int kSlots, bool kZero>
__device__ __forceinline__ void block_tile(const Params& p, const WeightTile<T>& t, int n_block, Smem<kN>& sm) {
  const TokenRows<T, T> out_rows(p, t.g);
  const TokenRows<T, T> x_rows(p, t.g);
  const int tid = threadIdx.x & 127, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int steps = t.steps;
  for (int m0 = 0; m0 < x_rows.m_rows; m0 += kN) {
    float acc[kN / 8][4] = {};
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) copy_step<T, kN, kSlots, kZero>(p, t, x_rows, m0, j, n_block, sm, j);
    for (int j = 0; j < steps; ++j) {
      const int stage = j % kStages;
      cp_async::wait<kStages - 2>();
      __syncthreads();  // step j landed for everyone; everyone done with step j - 1's stage
      copy_step<T, kN, kSlots, kZero>(p, t, x_rows, m0, j + kStages - 1, n_block, sm, (j + kStages - 1) % kStages);
      uint32_t av[8][4];
      dequantize_step<T, W, kN, kSlots, kZero>(sm, stage, tid, row0, av);
      // Core matrix (token block u, k block kb) at (kb * kN / 8 + u) * 128 bytes: ldmatrix of k
      // blocks 2j .. 2j + 3 gives the B registers of K blocks j and j + 1 (token r, k 2q, 2q + 1).
      const uint32_t tok = smem_addr(sm.tokens[stage]);
#pragma unroll
      for (int u = 0; u < kN / 8; ++u)
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          uint32_t b[4];
          cp_async::ldmatrix_x4(b, tok + ((2 * j + (lane >> 3)) * (kN / 8) + u) * 128 + (lane & 7) * 16);
          decode::mma<T>(acc[u], av[j], b[0], b[1]);
          decode::mma<T>(acc[u], av[j + 1], b[2], b[3]);
        }
    }
#pragma unroll
    for (int u = 0; u < kN / 8; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + 8 * u + 2 * q + (e & 1), col = n_block + row0 + 8 * (e >> 1);
        if (m < x_rows.m_rows && col < t.n) out_rows.store(m, col, acc[u][e]);
      }
    cp_async::wait<0>();
    __syncthreads();
  }
}

template <class T, class W, int kN, int kSlots, bool kZero>
__global__ void __launch_bounds__(kThreads, 4) kernel(Params p) {
  __shared__ Smem<kN> sm;
  pdl_begin();
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const WeightTile<T> t(p, p.active_groups[1 + y], blockIdx.x * kColumns + 16 * ((threadIdx.x >> 5) & 3));
    block_tile<T, W, kN, kSlots, kZero>(p, t, blockIdx.x * kColumns, sm);
  }
}

// Groups of 32 or 128 (the harness's cases), no zero terms.
template <class T, class W, int kN>
int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
  if (int st = DecodeW4Wgmma<T, T, W, kN>::check(a, err, errlen)) return st;
  if (a.weight_group == 32)
    return decode_w4::launch_groups(kernel<T, W, kN, 4, false>, a, kColumns, kThreads, "ring mma", err, errlen);
  return decode_w4::launch_groups(kernel<T, W, kN, 1, false>, a, kColumns, kThreads, "ring mma", err, errlen);
}
}  // namespace ring_mma

using namespace moe_kernels;

static float e2m1(int v) {
  static const float t[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  return (v & 8 ? -1.f : 1.f) * t[v & 7];
}

struct Case {
  std::string name;
  int E, topk, T, N, K, group;
  bool mx;
};

__global__ void fill_w(uint8_t* w, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    w[i] = hash32(i) & 0xFF;
}
__global__ void fill_s(uint16_t* s, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    bf16 h = __float2bfloat16(0.01f + 0.01f * (hash32(i + (1ull << 40)) >> 8) * (1.f / 16777216.f));
    s[i] = reinterpret_cast<uint16_t&>(h);
  }
}

namespace layout {
// Byte i of expert ex's prepared copy (K padded to Kp): its two nibbles' (row, k), as
// quant4.to_fragment_layout places them (kShuffle: INT4's value shuffle, nibble p of a word =
// 4 e + 2 u + h, else 4 u + 2 h + e, for MXFP4).
template <bool kShuffle>
__global__ void prepare(const uint8_t* w, uint8_t* out, int E, int N, int K, int Kp) {
  const size_t per = size_t(N) * Kp / 2, total = per * E;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t ex = i / per, b = i % per;
    uint8_t byte = 0;
    for (int half = 0; half < 2; ++half) {
      const size_t o = 2 * b + half;
      const int atom = int(o / 2048), within = int(o % 2048), a = atom % (N / 16), st = atom / (N / 16);
      const int lane = within / 64, j = (within % 64) / 8, pp = within % 8;
      const int e = kShuffle ? pp / 4 : pp % 2, u = kShuffle ? (pp / 2) % 2 : pp / 4, h = kShuffle ? pp % 2 : (pp / 2) % 2;
      const int n = 16 * a + lane / 4 + 8 * h, k = 128 * st + 16 * j + 8 * u + 2 * (lane % 4) + e;
      const int v = k < K ? (w[(ex * N + n) * (K / 2) + k / 2] >> (4 * (k & 1))) & 15 : 0;
      byte |= uint8_t(v << (4 * half));
    }
    out[i] = byte;
  }
}

// The MXFP4 prepared copy (nibble 2r + e of a word: register r's element e) rewritten in the
// placed layout, word by word.
__global__ void to_placed(uint32_t* w, size_t words) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t x = w[i];
    uint32_t y = 0;
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) {
        const uint32_t code = (x >> (4 * (2 * r + e))) & 15u;
        for (int b = 0; b < 4; ++b) y |= ((code >> b) & 1u) << placed::kBit[r][e][b];
      }
    w[i] = y;
  }
}

// bf16 scales times 2^126 (exact: the harness's scales are 0.01-0.02).
__global__ void scales_placed(const uint16_t* s, uint16_t* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const bf16 v = __float2bfloat16(__bfloat162float(reinterpret_cast<const bf16&>(s[i])) * 0x1p126f);
    out[i] = reinterpret_cast<const uint16_t&>(v);
  }
}
}  // namespace layout

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  std::vector<Case> cases;
  for (int T : {1, 16, 128}) {
    cases.push_back({"gpt-oss-120b mxfp4 g1", 128, 4, T, 5760, 2880, 32, true});
    cases.push_back({"gpt-oss-120b mxfp4 g2", 128, 4, T, 2880, 2880, 32, true});
    cases.push_back({"gpt-oss-120b int4 g1", 128, 4, T, 5760, 2880, 32, false});
    cases.push_back({"gpt-oss-120b int4 g2", 128, 4, T, 2880, 2880, 32, false});
    cases.push_back({"deepseek-v3 int4 g1", 256, 8, T, 4096, 7168, 128, false});
    cases.push_back({"deepseek-v3 int4 g2", 256, 8, T, 7168, 2048, 128, false});
    cases.push_back({"qwen3-30b int4 g1", 128, 8, T, 1536, 2048, 128, false});
    cases.push_back({"qwen3-30b int4 g2", 128, 8, T, 2048, 768, 128, false});
  }
  std::mt19937 rng(0);
  printf("%-22s %4s %6s | %9s %9s | %9s %9s | %7s %7s | %9s %9s %9s | %9s %9s | %s\n", "gemm", "T", "active",
         "mma16 us", "mma64 us", "wgmma8 us", "wgmma16 us", "speedup", "TB/s", "mma16p", "wgmma8p", "wgmma16p",
         "wgmma8u", "wgmma16u", "error: mma16 mma64 wgmma8 wgmma16 (mma16p wgmma8p wgmma16p wgmma8u wgmma16u) | "
         "ring mma rmma8 rmma16 rmma8p rmma16p us (errors)");
  const std::string only = argc > 2 ? argv[2] : "";
  const int only_t = argc > 3 ? atoi(argv[3]) : 0;
  const int reps_override = argc > 4 ? atoi(argv[4]) : 0;
  for (const Case& cs : cases) {
    if ((!only.empty() && cs.name.find(only) == std::string::npos) || (only_t && cs.T != only_t)) continue;
    const int E = cs.E, N = cs.N, K = cs.K, G = cs.group;
    const Routing routing = uniform_routing(E, cs.topk, cs.T, rng);
    const int rows = routing.rows;
    // Host data.
    const size_t nw = size_t(E) * N * K / 2, ns = size_t(E) * (K / G) * N;
    std::vector<uint16_t> hx(size_t(rows) * K);
    std::uniform_real_distribution<float> ux(-1.f, 1.f);
    for (auto& x : hx) x = tobf(ux(rng));
    // Device.
    DeviceArrays mem;
    uint8_t* dw = mem.alloc<uint8_t>(nw);
    uint16_t* ds = mem.alloc<uint16_t>(ns * 2);
    uint16_t* dx = mem.alloc<uint16_t>(hx.size() * 2 + 16);
    uint16_t* dd = mem.alloc<uint16_t>(size_t(rows) * N * 2 + 16);
    fill_w<<<1024, 256>>>(dw, nw);
    fill_s<<<1024, 256>>>(ds, ns);
    // The prepared copy the kernels read (K padded to 128).
    const int kp = (K + 127) / 128 * 128;
    uint8_t* dwf = mem.alloc<uint8_t>(size_t(E) * N * kp / 2);
    if (cs.mx) layout::prepare<false><<<1024, 256>>>(dw, dwf, E, N, K, kp);
    else layout::prepare<true><<<1024, 256>>>(dw, dwf, E, N, K, kp);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    GroupPointers gp;
    gp.sfa.assign(E, nullptr);
    for (int e = 0; e < E; ++e) {
      gp.a.push_back(dx + size_t(routing.offset[e]) * K);
      gp.b.push_back(dwf + size_t(e) * N * kp / 2);
      gp.d.push_back(dd + size_t(routing.offset[e]) * N);
      gp.sfb.push_back(reinterpret_cast<const float*>(ds + size_t(e) * (K / G) * N));
    }
    GroupedGemmArgs a = grouped_args(mem, routing, N, K, gp);
    a.weight_group = G; a.zero_base = nullptr;
    // MXFP4: the placed copy of the weights and its scales.
    GroupedGemmArgs ap = a, au = a;
    if (cs.mx) {
      uint8_t* dwp = mem.alloc<uint8_t>(size_t(E) * N * kp / 2);
      uint16_t* dsp = mem.alloc<uint16_t>(ns * 2);  // bytes
      CK(cudaMemcpy(dwp, dwf, size_t(E) * N * kp / 2, cudaMemcpyDeviceToDevice));
      layout::to_placed<<<1024, 256>>>(reinterpret_cast<uint32_t*>(dwp), size_t(E) * N * kp / 8);
      layout::scales_placed<<<1024, 256>>>(ds, dsp, ns);
      CK(cudaDeviceSynchronize());
      GroupPointers gq = gp;
      for (int e = 0; e < E; ++e) {
        gq.b[e] = dwp + size_t(e) * N * kp / 2;
        gq.sfb[e] = reinterpret_cast<const float*>(dsp + size_t(e) * (K / G) * N);
      }
      ap = grouped_args(mem, routing, N, K, gq);
      ap.weight_group = G; ap.zero_base = nullptr;
      gq.sfb = gp.sfb;  // the placed weights with the scales as they are
      au = grouped_args(mem, routing, N, K, gq);
      au.weight_group = G; au.zero_base = nullptr;
    }
    char err[256];
    using D = decode_w4::E2M1;
    using I = decode_w4::Int4;
    auto mma16 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 16>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 16>::run(a, err, sizeof err); };
    auto mma64 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 64>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 64>::run(a, err, sizeof err); };
    auto wg8 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 8>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 8>::run(a, err, sizeof err); };
    auto wg16 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 16>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 16>::run(a, err, sizeof err); };
    auto mma16p = [&] { return DecodeW4A16<bf16, bf16, placed::Tag, 8, 16>::run(ap, err, sizeof err); };
    auto wg8p = [&] { return DecodeW4Wgmma<bf16, bf16, placed::Tag, 8>::run(ap, err, sizeof err); };
    auto wg16p = [&] { return DecodeW4Wgmma<bf16, bf16, placed::Tag, 16>::run(ap, err, sizeof err); };
    auto wg8u = [&] { return DecodeW4Wgmma<bf16, bf16, placed::Unfolded, 8>::run(au, err, sizeof err); };
    auto wg16u = [&] { return DecodeW4Wgmma<bf16, bf16, placed::Unfolded, 16>::run(au, err, sizeof err); };
    auto rm8 = [&] { return cs.mx ? ring_mma::run<bf16, D, 8>(a, err, sizeof err) : ring_mma::run<bf16, I, 8>(a, err, sizeof err); };
    auto rm16 = [&] { return cs.mx ? ring_mma::run<bf16, D, 16>(a, err, sizeof err) : ring_mma::run<bf16, I, 16>(a, err, sizeof err); };
    auto rm8p = [&] { return ring_mma::run<bf16, placed::Tag, 8>(ap, err, sizeof err); };
    auto rm16p = [&] { return ring_mma::run<bf16, placed::Tag, 16>(ap, err, sizeof err); };
    // Host reference on sampled entries.
    std::vector<std::pair<int, int>> samples;
    for (int i = 0; i < 256; ++i) samples.push_back({int(rng() % rows), int(rng() % N)});
    std::vector<uint16_t> hd(size_t(rows) * N);
    auto check = [&](const char* what, auto fn) {
      run_poisoned(what, fn, err, dd, hd);
      double worst = 0;
      for (auto [row, n] : samples) {
        const int e = routing.expert_of(row);
        double ref = 0, mag = 0;
        std::vector<uint8_t> wrow(K / 2);
        std::vector<uint16_t> srow(K / G);
        CK(cudaMemcpy(wrow.data(), dw + (size_t(e) * N + n) * (K / 2), K / 2, cudaMemcpyDeviceToHost));
        for (int gi = 0; gi < K / G; ++gi)
          CK(cudaMemcpy(&srow[gi], ds + (size_t(e) * (K / G) + gi) * N + n, 2, cudaMemcpyDeviceToHost));
        for (int k = 0; k < K; ++k) {
          const uint8_t byte = wrow[k / 2];
          const int v = k & 1 ? byte >> 4 : byte & 15;
          const float q = cs.mx ? e2m1(v) : float(v >= 8 ? v - 16 : v);
          const float w = bf(tobf(q * bf(srow[k / G])));
          ref += double(w) * bf(hx[size_t(row) * K + k]);
          mag += std::fabs(double(w) * bf(hx[size_t(row) * K + k]));
        }
        const double got = bf(hd[size_t(row) * N + n]);
        const double err_ = std::fabs(got - ref) / (mag / std::sqrt(double(K)) + 1e-6);
        worst = std::isnan(got) ? 1e30 : std::max(worst, err_);
      }
      return worst;
    };
    const double e16 = check("mma16", mma16), e64 = check("mma64", mma64), ew8 = check("wgmma8", wg8),
                 ew16 = check("wgmma16", wg16);
    const double em16p = cs.mx ? check("mma16p", mma16p) : 0, ep8 = cs.mx ? check("wgmma8p", wg8p) : 0,
                 ep16 = cs.mx ? check("wgmma16p", wg16p) : 0;
    const double eu8 = cs.mx ? check("wgmma8u", wg8u) : 0, eu16 = cs.mx ? check("wgmma16u", wg16u) : 0;
    const double er8 = check("rmma8", rm8), er16 = check("rmma16", rm16);
    const double er8p = cs.mx ? check("rmma8p", rm8p) : 0, er16p = cs.mx ? check("rmma16p", rm16p) : 0;
    std::vector<float> t16, t64, tw8, tw16, tm16p, tp8, tp16, tu8, tu16, tr8, tr16, tr8p, tr16p;
    const int reps = reps_override ? reps_override : cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {  // interleaved
      t16.push_back(time_it(mma16, reps));
      t64.push_back(time_it(mma64, reps));
      tw8.push_back(time_it(wg8, reps));
      tw16.push_back(time_it(wg16, reps));
      tr8.push_back(time_it(rm8, reps));
      tr16.push_back(time_it(rm16, reps));
      if (cs.mx) {
        tr8p.push_back(time_it(rm8p, reps));
        tr16p.push_back(time_it(rm16p, reps));
        tm16p.push_back(time_it(mma16p, reps));
        tp8.push_back(time_it(wg8p, reps));
        tp16.push_back(time_it(wg16p, reps));
        tu8.push_back(time_it(wg8u, reps));
        tu16.push_back(time_it(wg16u, reps));
      }
    }
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0.f : v[v.size() / 2]; };
    const float m16 = med(t16), m64 = med(t64), mw8 = med(tw8), mw16 = med(tw16), mw = std::min(mw8, mw16);
    const float mm16p = med(tm16p), mp8 = med(tp8), mp16 = med(tp16), mu8 = med(tu8), mu16 = med(tu16);
    const float mr8 = med(tr8), mr16 = med(tr16), mr8p = med(tr8p), mr16p = med(tr16p);
    const double bytes = double(routing.active.size()) * N * (K / 2 + 2.0 * K / G);
    // speedup: the best mma.sync block over the best wgmma one; TB/s: the best wgmma one's (the
    // weight and scale bytes of the active experts over the unpadded K)
    printf("%-22s %4d %6zu | %9.1f %9.1f | %9.1f %9.1f | %7.3f %7.2f | %9.1f %9.1f %9.1f | %9.1f %9.1f | "
           "%.3g %.3g %.3g %.3g (%.3g %.3g %.3g %.3g %.3g) | ring mma %9.1f %9.1f %9.1f %9.1f (%.3g %.3g %.3g %.3g)\n",
           cs.name.c_str(), cs.T, routing.active.size(), m16, m64, mw8, mw16, std::min(m16, m64) / mw,
           bytes / mw * 1e-6, mm16p, mp8, mp16, mu8, mu16, e16, e64, ew8, ew16, em16p, ep8, ep16, eu8, eu16,
           mr8, mr16, mr8p, mr16p, er8, er16, er8p, er16p);
    fflush(stdout);
  }
  return 0;
}
