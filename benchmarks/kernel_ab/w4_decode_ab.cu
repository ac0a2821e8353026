// A/B of the 4-bit decode GEMMs alone, one GEMM of a preset at a time (uniform routing, bf16
// tokens): the mma.sync kernel (decode_w4a16.cuh, 16- and 64-column blocks) against SM90's
// wgmma kernel (sm90/decode_w4_wgmma.cuh, 8- and 16-token passes), and that kernel's form on
// weights in quant4's fragment layout (defined here, not built into the library: a copy the
// harness makes, K padded to 128; INT4 with CUTLASS's value shuffle, MXFP4 without, so that
// dequant8's pairs are the A registers). Outputs (NaN-poisoned
// first) checked against a host reference on 256 sampled entries: |error| over the typical
// size of the dot product's terms. Medians of interleaved rounds of back-to-back launches.
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

using namespace moe_kernels;
using bf16 = __nv_bfloat16;

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

namespace frag {
using namespace decode_w4_wgmma;

// Nibble o of expert e's fragment-layout copy: its (row, k) (quant4.to_fragment_layout; kShuffle:
// CUTLASS's value shuffle, nibble p of a word = 4 e + 2 u + h, else 4 u + 2 h + e).
template <bool kShuffle>
__global__ void repack(const uint8_t* w, uint8_t* out, int E, int N, int K, int Kp) {
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

// decode_w4_wgmma's block on the fragment layout: per K step a block's 4 KB of weights is one
// piece (thread tid's 32 bytes at 32 tid, word j its A registers of wgmma j), and the tokens
// keep their natural K order (16-byte copies).
template <class W, int kN>
__global__ void __launch_bounds__(kThreads, 4) kernel(Params p, int kp) {
  using T = __nv_bfloat16;
  __shared__ Smem<kN> sm;
  constexpr uint32_t kLbo = kN / 8 * 128, kSbo = 128;
  pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int n_block = blockIdx.x * kColumns;
  const int active = p.active_groups[0];
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const int g = p.active_groups[1 + y];
    const int m_rows = p.problem_shapes[3 * g], n = p.problem_shapes[3 * g + 1], k = p.problem_shapes[3 * g + 2];
    if (n_block >= n) continue;
    const int steps = kp / kStepK, group = p.group;
    const uint8_t* wexp = static_cast<const uint8_t*>(p.ptr_b[g]);
    const uint16_t* scale = reinterpret_cast<const uint16_t*>(p.ptr_sfb[g]);
    const char* x = static_cast<const char*>(p.ptr_a[g]);
    const int64_t ldx = p.stride_a[g] * 2;
    T* d = static_cast<T*>(p.ptr_d[g]);
    const int64_t ldd = p.stride_d[g];
    auto copy = [&](int m0, int s, int stage) {
      if (s < steps) {
        const bool ok = n_block + 16 * (tid >> 5) < n;
        const uint8_t* src = wexp + (ok ? 1024 * (int64_t(n_block / 16 + (tid >> 5)) + int64_t(n / 16) * s) + 32 * lane : 0);
        cp_async_16(smem_addr(sm.weights[stage] + 32 * tid), src, ok);
        cp_async_16(smem_addr(sm.weights[stage] + 32 * tid + 16), src + (ok ? 16 : 0), ok);
        const int groups = group >= kStepK ? 1 : kStepK / group;
        if (tid < 8 * groups) {
          const int gi = tid >> 3, nn = n_block + 8 * (tid & 7), kg = (s * kStepK) / group + gi;
          const bool sok = nn < n && kg * group < k;
          cp_async_16(smem_addr(&sm.scales[stage][gi][8 * (tid & 7)]), scale + (sok ? int64_t(kg) * n + nn : 0), sok);
        }
        const uint32_t tok = smem_addr(sm.tokens[stage]);
        for (int id = tid; id < kN * 16; id += kThreads) {  // 16-byte chunk c (values 8c ..) of token m
          const int m = id >> 4, c = id & 15, kk = s * kStepK + 8 * c;
          const bool tok_ok = m0 + m < m_rows && kk < k;
          cp_async_16(tok + (c * (kN / 8) + (m >> 3)) * 128 + (m & 7) * 16,
                      x + (tok_ok ? (m0 + m) * ldx + int64_t(kk) * 2 : 0), tok_ok);
        }
      }
      cp_async_commit();
    };
    for (int m0 = 0; m0 < m_rows; m0 += kN) {
      float acc[kN / 2];
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) copy(m0, j, j);
      for (int j = 0; j < steps; ++j) {
        const int stage = j % kStages;
        cp_async_wait<kStages - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        copy(m0, j + kStages - 1, (j + kStages - 1) % kStages);
        const uint4 w0 = *reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid);
        const uint4 w1 = *reinterpret_cast<const uint4*>(sm.weights[stage] + 32 * tid + 16);
        uint32_t av[8][4];
#pragma unroll
        for (int wj = 0; wj < 8; ++wj) {
          const uint32_t word = decode::word(wj < 4 ? w0 : w1, wj & 3);
          const int gi = group >= kStepK ? 0 : (16 * wj) / group;
          const uint32_t s_lo = sm.scales[stage][gi][row0] * 0x10001u, s_hi = sm.scales[stage][gi][row0 + 8] * 0x10001u;
          uint32_t o[4];
          if constexpr (std::is_same_v<W, decode_w4::E2M1>) {
            decode_w4::dequant8<T, W>(word, o);  // o[i]: nibbles 2i, 2i + 1 = register a_i
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // nibbles i, i + 4 = register a_i (136 + q, then - 136)
              uint32_t raw;
              asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(raw) : "r"(word >> (4 * i)), "n"(0x000F000F), "r"(0x43084308u));
              o[i] = decode_w4::sub2<T>(raw, 0x43084308u);
            }
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) av[wj][i] = decode_w4::fma2<T>(o[i], i & 1 ? s_hi : s_lo, 0u);
        }
        const uint32_t tok = smem_addr(sm.tokens[stage]);
        fence_acc<kN>(acc);
        wgmma_fence();
#pragma unroll
        for (int wj = 0; wj < 8; ++wj) wgmma<T, kN>(acc, av[wj], desc(tok + 2 * wj * kLbo, kLbo, kSbo));
        wgmma_commit_wait();
        fence_acc<kN>(acc);
      }
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const int m = m0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n_block + row0 + 8 * ((i >> 1) & 1);
        if (m < m_rows && col < n) d[int64_t(m) * ldd + col] = __float2bfloat16(acc[i]);
      }
      cp_async_wait<0>();
      __syncthreads();
    }
  }
}

template <class W, int kN>
int run(const GroupedGemmArgs& a, int kp, char* err, size_t errlen) {
  const Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                 a.stride_d, a.ptr_sfb, a.ptr_sfa, nullptr, a.weight_group};
  const dim3 grid(unsigned((a.n + kColumns - 1) / kColumns), unsigned(a.max_active_groups));
  const cudaError_t e = launch(kernel<W, kN>, grid, dim3(kThreads), 0, a.stream, p, kp);
  if (e != cudaSuccess) { snprintf(err, errlen, "%s", cudaGetErrorString(e)); return MOEK_CUDA_ERROR; }
  return MOEK_OK;
}
}  // namespace frag

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  std::vector<Case> cases;
  for (int T : {1, 16, 128}) {
    cases.push_back({"gpt-oss-120b mxfp4 g1", 128, 4, T, 5760, 2880, 32, true});
    cases.push_back({"gpt-oss-120b mxfp4 g2", 128, 4, T, 2880, 2880, 32, true});
    cases.push_back({"deepseek-v3 int4 g1", 256, 8, T, 4096, 7168, 128, false});
    cases.push_back({"deepseek-v3 int4 g2", 256, 8, T, 7168, 2048, 128, false});
    cases.push_back({"qwen3-30b int4 g1", 128, 8, T, 1536, 2048, 128, false});
    cases.push_back({"qwen3-30b int4 g2", 128, 8, T, 2048, 768, 128, false});
  }
  std::mt19937 rng(0);
  printf("%-22s %4s %6s | %9s %9s | %9s %9s | %9s %9s | %7s %7s %7s | %s\n", "gemm", "T", "active", "mma16 us",
         "mma64 us", "wgmma8 us", "wgmma16 us", "frag8 us", "frag16 us", "speedup", "frag x", "TB/s",
         "error: mma16 mma64 wgmma8 wgmma16 frag8 frag16");
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
    // The fragment-layout copy (K padded to 128).
    const int kp = (K + 127) / 128 * 128;
    uint8_t* dwf = mem.alloc<uint8_t>(size_t(E) * N * kp / 2);
    if (cs.mx) frag::repack<false><<<1024, 256>>>(dw, dwf, E, N, K, kp);
    else frag::repack<true><<<1024, 256>>>(dw, dwf, E, N, K, kp);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    GroupPointers gp;
    gp.sfa.assign(E, nullptr);
    for (int e = 0; e < E; ++e) {
      gp.a.push_back(dx + size_t(routing.offset[e]) * K);
      gp.b.push_back(dw + size_t(e) * N * K / 2);
      gp.d.push_back(dd + size_t(routing.offset[e]) * N);
      gp.sfb.push_back(reinterpret_cast<const float*>(ds + size_t(e) * (K / G) * N));
    }
    GroupedGemmArgs a = grouped_args(mem, routing, N, K, gp);
    a.weight_group = G; a.zero_base = nullptr;
    GroupPointers gpf = gp;
    for (int e = 0; e < E; ++e) gpf.b[e] = dwf + size_t(e) * N * kp / 2;
    GroupedGemmArgs af = grouped_args(mem, routing, N, K, gpf);
    af.weight_group = G; af.zero_base = nullptr;
    char err[256];
    using D = decode_w4::E2M1;
    using I = decode_w4::Int4;
    auto old16 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 16>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 16>::run(a, err, sizeof err); };
    auto old64 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 64>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 64>::run(a, err, sizeof err); };
    auto wg8 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 8>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 8>::run(a, err, sizeof err); };
    auto wg16 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 16>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 16>::run(a, err, sizeof err); };
    auto fr8 = [&] { return cs.mx ? frag::run<D, 8>(af, kp, err, sizeof err) : frag::run<I, 8>(af, kp, err, sizeof err); };
    auto fr16 = [&] { return cs.mx ? frag::run<D, 16>(af, kp, err, sizeof err) : frag::run<I, 16>(af, kp, err, sizeof err); };
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
    const double e16 = check("old16", old16), e64 = check("old64", old64), ew8 = check("wgmma8", wg8),
                 ew16 = check("wgmma16", wg16), ef8 = check("frag8", fr8), ef16 = check("frag16", fr16);
    std::vector<float> t16, t64, tw8, tw16, tf8, tf16;
    const int reps = reps_override ? reps_override : cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {  // interleaved
      t16.push_back(time_it(old16, reps));
      t64.push_back(time_it(old64, reps));
      tw8.push_back(time_it(wg8, reps));
      tw16.push_back(time_it(wg16, reps));
      tf8.push_back(time_it(fr8, reps));
      tf16.push_back(time_it(fr16, reps));
    }
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    const float m16 = med(t16), m64 = med(t64), mw8 = med(tw8), mw16 = med(tw16), mw = std::min(mw8, mw16);
    const float mf8 = med(tf8), mf16 = med(tf16), mf = std::min(mf8, mf16);
    const double bytes = double(routing.active.size()) * N * (K / 2 + 2.0 * K / G);
    // speedup: the best mma.sync block over the wgmma kernel; frag x: the wgmma kernel over its
    // fragment-layout form; TB/s: the wgmma kernel's
    printf("%-22s %4d %6zu | %9.1f %9.1f | %9.1f %9.1f | %9.1f %9.1f | %7.3f %7.3f %7.2f | %.3g %.3g %.3g %.3g %.3g %.3g\n",
           cs.name.c_str(), cs.T, routing.active.size(), m16, m64, mw8, mw16, mf8, mf16, std::min(m16, m64) / mw,
           mw / mf, bytes / mw * 1e-6, e16, e64, ew8, ew16, ef8, ef16);
    fflush(stdout);
  }
  return 0;
}
