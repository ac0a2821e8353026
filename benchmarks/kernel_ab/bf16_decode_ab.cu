// A/B of the 16-bit decode GEMM alone, one GEMM of a preset at a time (uniform routing, bf16):
// the mma.sync kernel (decode_gemm.cuh, 8/16 tokens x 16/64 columns, the best of the four per
// point) against a form defined here (not built into the library): one warpgroup per 64 weight
// rows, weights and tokens copied by cp.async into a ring of kStages K steps of 64 values in
// wgmma's K-major layout without swizzle, and shared-memory-sourced wgmma m64nNk16 with the
// weights as A (swap AB). Outputs (NaN-poisoned first) checked against a host reference on 256
// sampled entries. Medians of interleaved rounds of back-to-back launches.
//   nvcc -O3 -std=c++17 -arch=sm_90a -I src -I include -I <build>/generated/include \
//        benchmarks/kernel_ab/bf16_decode_ab.cu -o bf16_decode_ab && ./bf16_decode_ab [rounds [gemm [T]]]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm/decode_gemm.cuh"
#include "gemm/sm90/decode_w4_wgmma.cuh"  // smem_addr, cp_async_16, desc, wgmma fences
#include "harness.cuh"

using namespace moe_kernels;
using bf16 = __nv_bfloat16;

namespace ss {
using decode_w4_wgmma::cp_async_16;
using decode_w4_wgmma::desc;
using decode_w4_wgmma::smem_addr;

constexpr int kRows = 64, kStepK = 64;  // 128 bytes of K per row per step

template <int kN, int kStages>
struct Smem {
  alignas(128) char w[kStages][kRows * kStepK * 2];  // core matrix (kb, mb) at (kb * 8 + mb) * 128
  alignas(128) char x[kStages][kN * kStepK * 2];     // core matrix (kb, nb) at (kb * kN / 8 + nb) * 128
};

template <int kN>
__device__ __forceinline__ void wgmma_ss(float (&acc)[kN / 2], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kN == 8)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]) : "l"(a), "l"(b));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]),
                   "+f"(acc[7])
                 : "l"(a), "l"(b));
#endif
}

// Step s of (rows n0 .. n0 + 63, tokens m0 .. m0 + kN - 1) into `stage`; one commit group.
template <int kN, int kStages>
__device__ __forceinline__ void copy_step(const char* w, int64_t ldw, int n, const char* x, int64_t ldx, int m_rows,
                                          int k, int steps, int n0, int m0, int s, Smem<kN, kStages>& sm, int stage) {
  const int tid = threadIdx.x;
  if (s < steps) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // rows 4 a quarter-warp, chunks 2i, 2i + 1 (32 bytes a row)
      const int c = 2 * i + (tid & 1), row = ((tid >> 1) & 3) + 4 * (tid >> 3), kk = s * kStepK + 8 * c;
      const bool ok = n0 + row < n && kk < k;
      cp_async_16(smem_addr(sm.w[stage] + (c * 8 + row / 8) * 128 + (row % 8) * 16),
                  w + (ok ? (n0 + row) * ldw + int64_t(kk) * 2 : 0), ok);
    }
    for (int id = tid; id < kN * 8; id += 128) {
      const int tok = id >> 3, c = id & 7, kk = s * kStepK + 8 * c;
      const bool ok = m0 + tok < m_rows && kk < k;
      cp_async_16(smem_addr(sm.x[stage] + (c * (kN / 8) + tok / 8) * 128 + (tok % 8) * 16),
                  x + (ok ? (m0 + tok) * ldx + int64_t(kk) * 2 : 0), ok);
    }
  }
  decode_w4_wgmma::cp_async_commit();
}

template <int kN, int kStages>
__global__ void __launch_bounds__(128, 4) kernel(decode::Params p) {
  __shared__ Smem<kN, kStages> sm;
  pdl_begin();
  const int active = p.active_groups[0];
  const int tid = threadIdx.x, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  const int n0 = blockIdx.x * kRows;
  for (int y = blockIdx.y; y < active; y += gridDim.y) {
    const int g = p.active_groups[1 + y];
    const int m_rows = p.problem_shapes[3 * g], n = p.problem_shapes[3 * g + 1], k = p.problem_shapes[3 * g + 2];
    const char* w = static_cast<const char*>(p.ptr_b[g]);
    const char* x = static_cast<const char*>(p.ptr_a[g]);
    const int64_t ldw = p.stride_b[g] * 2, ldx = p.stride_a[g] * 2;
    bf16* d = static_cast<bf16*>(p.ptr_d[g]);
    const int64_t ldd = p.stride_d[g];
    const int steps = (k + kStepK - 1) / kStepK;
    for (int m0 = 0; m0 < m_rows; m0 += kN) {
      float acc[kN / 2];
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) copy_step<kN, kStages>(w, ldw, n, x, ldx, m_rows, k, steps, n0, m0, j, sm, j);
      for (int j = 0; j < steps; ++j) {
        const int stage = j % kStages;
        decode_w4_wgmma::cp_async_wait<kStages - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        copy_step<kN, kStages>(w, ldw, n, x, ldx, m_rows, k, steps, n0, m0, j + kStages - 1, sm,
                               (j + kStages - 1) % kStages);
        const uint32_t a = smem_addr(sm.w[stage]), b = smem_addr(sm.x[stage]);
        decode_w4_wgmma::fence_acc<kN>(acc);
        decode_w4_wgmma::wgmma_fence();
#pragma unroll
        for (int t = 0; t < 4; ++t)
          wgmma_ss<kN>(acc, desc(a + 2 * t * 8 * 128, 8 * 128, 128), desc(b + 2 * t * (kN / 8) * 128, kN / 8 * 128, 128));
        decode_w4_wgmma::wgmma_commit_wait();
        decode_w4_wgmma::fence_acc<kN>(acc);
      }
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const int m = m0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n0 + row0 + 8 * ((i >> 1) & 1);
        if (m < m_rows && col < n) d[int64_t(m) * ldd + col] = __float2bfloat16(acc[i]);
      }
      decode_w4_wgmma::cp_async_wait<0>();
      __syncthreads();
    }
  }
}

template <int kN, int kStages>
int run(const GroupedGemmArgs& a, char* err, size_t errlen) {
  const decode::Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                         a.stride_d, a.ptr_sfa, a.ptr_sfb, a.sfb_base, a.n, a.sfb_per_channel};
  const dim3 grid(unsigned((a.n + kRows - 1) / kRows), unsigned(a.max_active_groups));
  const cudaError_t e = launch(kernel<kN, kStages>, grid, dim3(128), 0, a.stream, p);
  if (e != cudaSuccess) { snprintf(err, errlen, "%s", cudaGetErrorString(e)); return MOEK_CUDA_ERROR; }
  return MOEK_OK;
}
}  // namespace ss

__global__ void fill_w(uint16_t* w, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    bf16 h = __float2bfloat16(0.05f * ((hash32(i) >> 8) * (2.f / 16777216.f) - 1.f));
    w[i] = reinterpret_cast<uint16_t&>(h);
  }
}

struct Case {
  std::string name;
  int E, topk, T, N, K;
};

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 3;
  const std::string only = argc > 2 ? argv[2] : "";
  const int only_t = argc > 3 ? atoi(argv[3]) : 0;
  std::vector<Case> cases;
  for (int T : {1, 16, 128}) {
    cases.push_back({"mixtral-8x7b g1", 8, 2, T, 28672, 4096});
    cases.push_back({"mixtral-8x7b g2", 8, 2, T, 4096, 14336});
    cases.push_back({"qwen3-30b g1", 128, 8, T, 1536, 2048});
    cases.push_back({"qwen3-30b g2", 128, 8, T, 2048, 768});
    cases.push_back({"deepseek-v3 g1", 256, 8, T, 4096, 7168});
    cases.push_back({"deepseek-v3 g2", 256, 8, T, 7168, 2048});
  }
  std::mt19937 rng(0);
  printf("%-16s %4s %6s | %8s %8s %8s %8s | %8s %8s %8s | %7s %6s | %s\n", "gemm", "T", "active", "m8x16", "m8x64",
         "m16x16", "m16x64", "ss8s4", "ss8s5", "ss16s4", "speedup", "TB/s", "error: best mma, ss8s4, ss8s5, ss16s4");
  for (const Case& cs : cases) {
    if ((!only.empty() && cs.name.find(only) == std::string::npos) || (only_t && cs.T != only_t)) continue;
    const int E = cs.E, N = cs.N, K = cs.K;
    const Routing routing = uniform_routing(E, cs.topk, cs.T, rng);
    const int rows = routing.rows;
    const size_t nw = size_t(E) * N * K;
    std::vector<uint16_t> hx(size_t(rows) * K);
    std::uniform_real_distribution<float> ux(-1.f, 1.f);
    for (auto& v : hx) v = tobf(ux(rng));
    DeviceArrays mem;
    uint16_t* dw = mem.alloc<uint16_t>(nw * 2);
    uint16_t* dx = mem.alloc<uint16_t>(hx.size() * 2 + 16);
    uint16_t* dd = mem.alloc<uint16_t>(size_t(rows) * N * 2 + 16);
    fill_w<<<1024, 256>>>(dw, nw);
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    GroupPointers gp;
    for (int e = 0; e < E; ++e) {
      gp.a.push_back(dx + size_t(routing.offset[e]) * K);
      gp.b.push_back(dw + size_t(e) * N * K);
      gp.d.push_back(dd + size_t(routing.offset[e]) * N);
    }
    GroupedGemmArgs a = grouped_args(mem, routing, N, K, gp);
    CK(cudaDeviceGetAttribute(&a.sm_count, cudaDevAttrMultiProcessorCount, 0));
    char err[256];
    auto m8x16 = [&] { return DecodeGemm<bf16, bf16, false, 8, 16>::run(a, err, sizeof err); };
    auto m8x64 = [&] { return DecodeGemm<bf16, bf16, false, 8, 64>::run(a, err, sizeof err); };
    auto m16x16 = [&] { return DecodeGemm<bf16, bf16, false, 16, 16>::run(a, err, sizeof err); };
    auto m16x64 = [&] { return DecodeGemm<bf16, bf16, false, 16, 64>::run(a, err, sizeof err); };
    auto s8s4 = [&] { return ss::run<8, 4>(a, err, sizeof err); };
    auto s8s6 = [&] { return ss::run<8, 5>(a, err, sizeof err); };
    auto s16s4 = [&] { return ss::run<16, 4>(a, err, sizeof err); };
    std::vector<std::pair<int, int>> samples;
    for (int i = 0; i < 256; ++i) samples.push_back({int(rng() % rows), int(rng() % N)});
    std::vector<uint16_t> hd(size_t(rows) * N), wrow(K);
    auto check = [&](const char* what, auto fn) {
      run_poisoned(what, fn, err, dd, hd);
      double worst = 0;
      for (auto [row, n] : samples) {
        const int e = routing.expert_of(row);
        CK(cudaMemcpy(wrow.data(), dw + (size_t(e) * N + n) * K, K * 2, cudaMemcpyDeviceToHost));
        double ref = 0, mag = 0;
        for (int k = 0; k < K; ++k) {
          const double t = double(bf(wrow[k])) * bf(hx[size_t(row) * K + k]);
          ref += t;
          mag += std::fabs(t);
        }
        const double got = bf(hd[size_t(row) * N + n]);
        worst = std::isnan(got) ? 1e30 : std::max(worst, std::fabs(got - ref) / (mag / std::sqrt(double(K)) + 1e-6));
      }
      return worst;
    };
    const double em = std::max({check("m8x16", m8x16), check("m8x64", m8x64), check("m16x16", m16x16),
                                check("m16x64", m16x64)});
    const double e84 = check("ss8s4", s8s4), e86 = check("ss8s5", s8s6), e164 = check("ss16s4", s16s4);
    std::vector<float> t[7];
    const int reps = cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {
      t[0].push_back(time_it(m8x16, reps));
      t[1].push_back(time_it(m8x64, reps));
      t[2].push_back(time_it(m16x16, reps));
      t[3].push_back(time_it(m16x64, reps));
      t[4].push_back(time_it(s8s4, reps));
      t[5].push_back(time_it(s8s6, reps));
      t[6].push_back(time_it(s16s4, reps));
    }
    float m[7];
    for (int i = 0; i < 7; ++i) { std::sort(t[i].begin(), t[i].end()); m[i] = t[i][t[i].size() / 2]; }
    const float old = *std::min_element(m, m + 4), neu = *std::min_element(m + 4, m + 7);
    const double bytes = double(routing.active.size()) * N * K * 2;
    printf("%-16s %4d %6zu | %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f | %7.3f %6.2f | %.3g %.3g %.3g %.3g\n",
           cs.name.c_str(), cs.T, routing.active.size(), m[0], m[1], m[2], m[3], m[4], m[5], m[6], old / neu,
           bytes / neu * 1e-6, em, e84, e86, e164);
    fflush(stdout);
  }
  return 0;
}
