// A/B of the 4-bit decode GEMMs alone, one GEMM of a preset at a time (uniform routing, bf16
// tokens): the mma.sync kernel (decode_w4a16.cuh, 16- and 64-column blocks) against SM90's
// wgmma kernel (sm90/decode_w4_wgmma.cuh, 8- and 16-token passes), and a persistent form of
// the latter defined here (not built into the library). Outputs (NaN-poisoned
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

// Variant for the next A/B: the same kernel persistent, its ring running on across the tiles
// (units = (expert, 64-column block)) a block takes, so a unit's first steps are in flight
// while the previous unit finishes.
namespace moe_kernels {
namespace decode_w4_wgmma {
template <class In, class T, class W, int kN>
__global__ void __launch_bounds__(kThreads, 4) persistent_kernel(Params p, int nb) {
  __shared__ Smem<kN> sm;
  constexpr uint32_t kLbo = kN / 8 * 128, kSbo = 128;
  pdl_begin();
  const int units = p.active_groups[0] * nb;
  const int tid = threadIdx.x & 127, lane = tid & 31, r = lane >> 2, q = lane & 3, row0 = 16 * (tid >> 5) + r;
  auto tile_of = [&](int w) {
    return WeightTile<T>(p, p.active_groups[1 + w / nb], (w % nb) * kColumns + 16 * ((threadIdx.x >> 5) & 3));
  };
  auto rows_of = [&](int w) { return TokenRows<T, T>(p, p.active_groups[1 + w / nb]); };
  int pw = blockIdx.x, pm0 = 0, ps = 0;  // the copies' position
  if (pw >= units) return;
  WeightTile<T> pt = tile_of(pw);
  TokenRows<T, T> px = rows_of(pw);
  auto produce = [&](int stage) {
    if (pw < units) copy_step<T, kN>(p, pt, px, pm0, ps, (pw % nb) * kColumns, sm, stage);
    else cp_async_commit();
    if (pw < units && ++ps == pt.steps) {
      ps = 0;
      pm0 += kN;
      if (pm0 >= px.m_rows) {
        pm0 = 0;
        pw += gridDim.x;
        if (pw < units) { pt = tile_of(pw); px = rows_of(pw); }
      }
    }
  };
  int cw = blockIdx.x, cm0 = 0, cs = 0;  // the multiplies' position
  WeightTile<T> ct = pt;
  TokenRows<In, T> out = TokenRows<In, T>(p, ct.g);
  int crows = px.m_rows;
  int gi = ct.group >= kStepK ? 0 : (32 * q) / ct.group;
  for (int j = 0; j < kStages - 1; ++j) produce(j);
  float acc[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
  for (int j = 0; cw < units; ++j) {
    const int stage = j % kStages;
    cp_async_wait<kStages - 2>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    produce((j + kStages - 1) % kStages);
    uint32_t wv[2][16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = *reinterpret_cast<const uint4*>(sm.weights[stage] + h * 2048 + tid * 16);
      const uint32_t sc = sm.scales[stage][gi][row0 + 8 * h] * 0x10001u;
      const uint32_t zr = ct.zero ? sm.zeros[stage][gi][row0 + 8 * h] * 0x10001u : 0u;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t o[4];
        decode_w4::dequant8<T, W>(decode::word(w, c), o);
#pragma unroll
        for (int e = 0; e < 4; ++e) wv[h][4 * c + e] = decode_w4::fma2<T>(o[e], sc, zr);
      }
    }
    const uint32_t tok = smem_addr(sm.tokens[stage]);
    fence_acc<kN>(acc);
    wgmma_fence();
#pragma unroll
    for (int tt = 0; tt < 8; ++tt) {
      const uint32_t a[4] = {wv[0][2 * tt], wv[1][2 * tt], wv[0][2 * tt + 1], wv[1][2 * tt + 1]};
      wgmma<T, kN>(acc, a, desc(tok + 2 * tt * kLbo, kLbo, kSbo));
    }
    wgmma_commit_wait();
    fence_acc<kN>(acc);
    if (++cs == ct.steps) {  // the pass is done: store it, move on
      const int n_block = (cw % nb) * kColumns;
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const int m = cm0 + 8 * (i >> 2) + 2 * q + (i & 1), col = n_block + row0 + 8 * ((i >> 1) & 1);
        if (m < crows && col < ct.n) out.store(m, col, acc[i]);
        acc[i] = 0.f;
      }
      cs = 0;
      cm0 += kN;
      if (cm0 >= crows) {
        cm0 = 0;
        cw += gridDim.x;
        if (cw < units) {
          ct = tile_of(cw);
          out = TokenRows<In, T>(p, ct.g);
          crows = out.m_rows;
          gi = ct.group >= kStepK ? 0 : (32 * q) / ct.group;
        }
      }
    }
  }
  cp_async_wait<0>();
}
}  // namespace decode_w4_wgmma

template <class In, class T, class W, int kTokens>
int run_persistent(const GroupedGemmArgs& a, int sm_count, char* err, size_t errlen) {
  if (int st = DecodeW4Wgmma<In, T, W, kTokens>::check(a, err, errlen)) return st;
  const decode_w4::Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                            a.stride_d, a.ptr_sfb, a.ptr_sfa, static_cast<const unsigned short*>(a.zero_base),
                            a.weight_group};
  const int nb = int((a.n + 63) / 64);
  const int grid = std::min(a.max_active_groups * nb, 4 * sm_count);
  const cudaError_t e = launch(decode_w4_wgmma::persistent_kernel<In, T, W, kTokens>, dim3(grid), dim3(128), 0,
                               a.stream, p, nb);
  if (e != cudaSuccess) { snprintf(err, errlen, "%s", cudaGetErrorString(e)); return MOEK_CUDA_ERROR; }
  return MOEK_OK;
}
}  // namespace moe_kernels

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
  printf("%-22s %4s %6s | %9s %9s | %9s %9s | %7s %7s | %s\n", "gemm", "T", "active", "mma16 us", "mma64 us",
         "wgmma8 us", "wgmma16 us", "speedup", "TB/s", "error: mma16 mma64 wgmma8 wgmma16");
  const std::string only = argc > 2 ? argv[2] : "";
  const int only_t = argc > 3 ? atoi(argv[3]) : 0;
  const int reps_override = argc > 4 ? atoi(argv[4]) : 0;
  for (const Case& cs : cases) {
    if ((!only.empty() && cs.name.find(only) == std::string::npos) || (only_t && cs.T != only_t)) continue;
    const int E = cs.E, N = cs.N, K = cs.K, G = cs.group;
    // Routing: T tokens, top-k distinct experts each, uniform.
    std::vector<int> count(E, 0);
    for (int t = 0; t < cs.T; ++t) {
      std::vector<int> ids(E);
      for (int i = 0; i < E; ++i) ids[i] = i;
      std::shuffle(ids.begin(), ids.end(), rng);
      for (int j = 0; j < cs.topk; ++j) count[ids[j]]++;
    }
    std::vector<int> active, offset(E + 1, 0);
    for (int e = 0; e < E; ++e) {
      offset[e + 1] = offset[e] + count[e];
      if (count[e]) active.push_back(e);
    }
    const int rows = offset[E];
    // Host data.
    const size_t nw = size_t(E) * N * K / 2, ns = size_t(E) * (K / G) * N;
    std::vector<uint16_t> hx(size_t(rows) * K);
    std::uniform_real_distribution<float> ux(-1.f, 1.f);
    for (auto& x : hx) x = tobf(ux(rng));
    // Device.
    uint8_t* dw; uint16_t *ds, *dx, *dd;
    CK(cudaMalloc(&dw, nw)); CK(cudaMalloc(&ds, ns * 2)); CK(cudaMalloc(&dx, hx.size() * 2 + 16));
    CK(cudaMalloc(&dd, size_t(rows) * N * 2 + 16));
    fill_w<<<1024, 256>>>(dw, nw);
    fill_s<<<1024, 256>>>(ds, ns);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    std::vector<int32_t> shapes(3 * E), act(1 + E, 0);
    std::vector<const void*> pa(E), pb(E);
    std::vector<void*> pd(E);
    std::vector<const float*> psfb(E), psfa(E, nullptr);
    std::vector<int64_t> sa(E, K), sb(E, K), sd(E, N);
    for (int e = 0; e < E; ++e) {
      shapes[3 * e] = count[e]; shapes[3 * e + 1] = N; shapes[3 * e + 2] = K;
      pa[e] = dx + size_t(offset[e]) * K;
      pb[e] = dw + size_t(e) * N * K / 2;
      pd[e] = dd + size_t(offset[e]) * N;
      psfb[e] = reinterpret_cast<const float*>(ds + size_t(e) * (K / G) * N);
    }
    act[0] = active.size();
    for (size_t i = 0; i < active.size(); ++i) act[1 + i] = active[i];
    int32_t *dshapes, *dact; const void **dpa, **dpb; void** dpd; const float **dpsfb, **dpsfa; int64_t *dsa, *dsb, *dsd;
    CK(cudaMalloc(&dshapes, shapes.size() * 4)); CK(cudaMalloc(&dact, act.size() * 4));
    CK(cudaMalloc(&dpa, E * 8)); CK(cudaMalloc(&dpb, E * 8)); CK(cudaMalloc(&dpd, E * 8));
    CK(cudaMalloc(&dpsfb, E * 8)); CK(cudaMalloc(&dpsfa, E * 8));
    CK(cudaMalloc(&dsa, E * 8)); CK(cudaMalloc(&dsb, E * 8)); CK(cudaMalloc(&dsd, E * 8));
    CK(cudaMemcpy(dshapes, shapes.data(), shapes.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dact, act.data(), act.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpa, pa.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpb, pb.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpd, pd.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpsfb, psfb.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpsfa, psfa.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsa, sa.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsb, sb.data(), E * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsd, sd.data(), E * 8, cudaMemcpyHostToDevice));
    GroupedGemmArgs a{};
    a.num_groups = E; a.problem_shapes = dshapes; a.ptr_a = dpa; a.stride_a = dsa; a.ptr_b = dpb; a.stride_b = dsb;
    a.ptr_d = dpd; a.stride_d = dsd; a.ptr_sfa = dpsfa; a.ptr_sfb = dpsfb; a.active_groups = dact;
    a.max_active_groups = active.size(); a.n = N; a.k = K; a.weight_group = G; a.zero_base = nullptr;
    a.stream = 0;
    char err[256];
    using D = decode_w4::E2M1;
    using I = decode_w4::Int4;
    auto old16 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 16>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 16>::run(a, err, sizeof err); };
    auto old64 = [&] { return cs.mx ? DecodeW4A16<bf16, bf16, D, 8, 64>::run(a, err, sizeof err) : DecodeW4A16<bf16, bf16, I, 8, 64>::run(a, err, sizeof err); };
    auto wg8 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 8>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 8>::run(a, err, sizeof err); };
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    auto pers8 = [&] { return cs.mx ? run_persistent<bf16, bf16, D, 8>(a, sms, err, sizeof err) : run_persistent<bf16, bf16, I, 8>(a, sms, err, sizeof err); };
    auto wg16 = [&] { return cs.mx ? DecodeW4Wgmma<bf16, bf16, D, 16>::run(a, err, sizeof err) : DecodeW4Wgmma<bf16, bf16, I, 16>::run(a, err, sizeof err); };
    // Host reference on sampled entries.
    std::vector<std::pair<int, int>> samples;
    for (int i = 0; i < 256; ++i) samples.push_back({int(rng() % rows), int(rng() % N)});
    std::vector<uint16_t> hd(size_t(rows) * N);
    auto check = [&](const char* what, auto fn) {
      CK(cudaMemset(dd, 0xFF, size_t(rows) * N * 2));  // NaN poison
      if (fn()) { printf("%s: %s\n", what, err); exit(1); }
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(hd.data(), dd, hd.size() * 2, cudaMemcpyDeviceToHost));
      double worst = 0;
      for (auto [row, n] : samples) {
        int e = 0;
        while (offset[e + 1] <= row) ++e;
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
                 ew16 = check("wgmma16", wg16), ep8 = check("persistent8", pers8);
    std::vector<float> t16, t64, tw8, tw16, tp8;
    const int reps = reps_override ? reps_override : cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {  // interleaved
      t16.push_back(time_it(old16, reps));
      t64.push_back(time_it(old64, reps));
      tw8.push_back(time_it(wg8, reps));
      tw16.push_back(time_it(wg16, reps));
      tp8.push_back(time_it(pers8, reps));
    }
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    const float m16 = med(t16), m64 = med(t64), mw8 = med(tw8), mw16 = med(tw16), mw = std::min(mw8, mw16);
    const double bytes = double(active.size()) * N * (K / 2 + 2.0 * K / G);
    printf("%-22s %4d %6zu | %9.1f %9.1f | %9.1f %9.1f | %7.3f %7.2f | persistent8 %9.1f (%.3f) | %.3g %.3g %.3g %.3g %.3g\n", cs.name.c_str(), cs.T,
           active.size(), m16, m64, mw8, mw16, std::min(m16, m64) / mw, bytes / mw * 1e-6, med(tp8), mw8 / med(tp8), e16, e64, ew8, ew16, ep8);
    fflush(stdout);
    cudaFree(dw); cudaFree(ds); cudaFree(dx); cudaFree(dd); cudaFree(dshapes); cudaFree(dact); cudaFree(dpa);
    cudaFree(dpb); cudaFree(dpd); cudaFree(dpsfb); cudaFree(dpsfa); cudaFree(dsa); cudaFree(dsb); cudaFree(dsd);
  }
  return 0;
}
