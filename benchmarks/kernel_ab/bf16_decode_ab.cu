// A/B of the 16-bit decode GEMM alone, one GEMM of a preset at a time (uniform routing, bf16):
// the mma.sync kernel (decode_gemm.cuh, 8/16 tokens x 16/64 columns, the best of the four per
// point) against the ring form (decode_ring.cuh: 64 weight rows by 16 tokens with K steps of 256
// bytes, or by 64 tokens with steps of 128, both operands through a cp.async ring). Outputs
// (NaN-poisoned first) checked against a host reference on 256 sampled entries. Medians of
// interleaved rounds of back-to-back launches.
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
#include "gemm/decode_ring.cuh"
#include "harness.cuh"

using namespace moe_kernels;
using bf16 = __nv_bfloat16;

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
  printf("%-16s %4s %6s | %8s %8s %8s %8s | %8s %8s | %7s %6s | %s\n", "gemm", "T", "active", "m8x16", "m8x64",
         "m16x16", "m16x64", "ring16", "ring64", "speedup", "TB/s", "error: best mma, the ring forms");
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
    CK(cudaGetDevice(&a.device));
    char err[256];
    auto m8x16 = [&] { return DecodeGemm<bf16, bf16, false, 8, 16>::run(a, err, sizeof err); };
    auto m8x64 = [&] { return DecodeGemm<bf16, bf16, false, 8, 64>::run(a, err, sizeof err); };
    auto m16x16 = [&] { return DecodeGemm<bf16, bf16, false, 16, 16>::run(a, err, sizeof err); };
    auto m16x64 = [&] { return DecodeGemm<bf16, bf16, false, 16, 64>::run(a, err, sizeof err); };
    auto ring16 = [&] { return DecodeRing<bf16, bf16, false, 16, 256>::run(a, err, sizeof err); };
    auto ring64 = [&] { return DecodeRing<bf16, bf16, false, 64, 128>::run(a, err, sizeof err); };
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
    const double er = std::max(check("ring16", ring16), check("ring64", ring64));
    std::vector<float> t[6];
    const int reps = cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {
      t[0].push_back(time_it(m8x16, reps));
      t[1].push_back(time_it(m8x64, reps));
      t[2].push_back(time_it(m16x16, reps));
      t[3].push_back(time_it(m16x64, reps));
      t[4].push_back(time_it(ring16, reps));
      t[5].push_back(time_it(ring64, reps));
    }
    float m[6];
    for (int i = 0; i < 6; ++i) { std::sort(t[i].begin(), t[i].end()); m[i] = t[i][t[i].size() / 2]; }
    const float old = *std::min_element(m, m + 4), neu = std::min(m[4], m[5]);
    const double bytes = double(routing.active.size()) * N * K * 2;
    printf("%-16s %4d %6zu | %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f | %7.3f %6.2f | %.3g %.3g\n",
           cs.name.c_str(), cs.T, routing.active.size(), m[0], m[1], m[2], m[3], m[4], m[5],
           old / neu, bytes / neu * 1e-6, em, er);
    fflush(stdout);
  }
  return 0;
}
