// Probe for src/one_token.cuh (the one_token tactic): one token of fp8 (k 8, SwiGLU, dynamic
// per-token scales, per-tensor weight scales), Qwen3-30B-A3B's shape by default (E 128, H 2048,
// I 768); -DPE=, -DPH=, -DPI= set another (Qwen3-235B-A22B: 128, 4096, 1536; DeepSeek-V3's
// shape: 256, 7168, 2048), and the launcher's plan picks the form (share or streamed; -DSTREAM:
// streamed).
// Checks the output against a float64 host reference of the same quantization (exit status 2
// where a set is off by more than 5% of the output's largest magnitude), then times
// the kernel in CUDA graphs of 32 launches over 16 expert sets (so the bytes come from HBM),
// median of 30 replays, PDL on and off; and prints a timeline of the phases (clock64 stamps
// per CTA, converted with the SM clock measured against globaltimer over the kernel), for each
// point in the w13 stream at which the w2 share may be requested (the library: after the last
// tile; the streamed form has one). ONE_SET=1 repeats one expert set, so that the weights come
// from L2.
//   python3 cmake/generate_kernels.py --archs 90a --catalog minimal --out /tmp/gen  # modes.h
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -I/tmp/gen/include \
//     -o /tmp/one_token benchmarks/probes/one_token_forward.cu && /tmp/one_token
#include <cmath>
#include <random>

#include <cuda_fp8.h>

#include "probe_common.cuh"
#include "one_token.cuh"

using namespace moe_kernels;
// The floor's rate in bytes/s, an input rather than a result: pass -DPBW= with the copy rate
// `bench` prints for the GPU at hand (docs/performance.md holds the measured ones).
#ifndef PBW
#define PBW 4.23e12
#endif
#ifndef PE
#define PE 128
#define PH 2048
#define PI 768
#endif
constexpr int E = PE, K = 8, H = PH, I = PI, SETS = 16;
#ifndef RING  // ring entries in flight; 0: the plan's
#define RING 0
#endif

__global__ void fill_e4m3(uint8_t* w, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    const float f = (int(h % 2001) - 1000) / 1000.f;  // [-1, 1]
    w[i] = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  }
}

static double e4m3(uint8_t b) { __nv_fp8_e4m3 v; v.__x = b; return double(float(v)); }
static uint8_t to_e4m3(float f) { return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3); }

// Per-token quantization as the kernels do it: scale amax / 448, x * (1 / scale) rounded.
static std::vector<double> quant_dequant(const std::vector<float>& x) {
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float scale = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / scale;
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = e4m3(to_e4m3(x[i] * inv)) * scale;
  return r;
}

int main() {
  uint8_t *w13, *w2; float *ws13, *ws2, *topw, *y; int* ids; __nv_bfloat16 *x, *out;
  CK(cudaMalloc(&w13, size_t(E) * 2 * I * H)); CK(cudaMalloc(&w2, size_t(E) * H * I));
  fill_e4m3<<<1024, 256>>>(w13, size_t(E) * 2 * I * H, 1234u);
  fill_e4m3<<<1024, 256>>>(w2, size_t(E) * H * I, 777u);
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> U(0.5f, 1.5f);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> h_ws13(E), h_ws2(E);
  for (int e = 0; e < E; ++e) { h_ws13[e] = 0.02f * U(rng); h_ws2[e] = 0.05f * U(rng); }
  std::vector<int> h_ids(SETS * K);
  std::vector<float> h_w(SETS * K);
  for (int s = 0; s < SETS; ++s) {
    std::vector<int> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    float sum = 0.f;
    for (int j = 0; j < K; ++j) { h_ids[s * K + j] = perm[j]; h_w[s * K + j] = U(rng); sum += h_w[s * K + j]; }
    for (int j = 0; j < K; ++j) h_w[s * K + j] /= sum;
  }
  std::vector<__nv_bfloat16> h_x(SETS * H);
  for (auto& v : h_x) v = __float2bfloat16(N(rng));
  CK(cudaMalloc(&ws13, E * 4)); CK(cudaMalloc(&ws2, E * 4)); CK(cudaMalloc(&topw, SETS * K * 4));
  CK(cudaMalloc(&ids, SETS * K * 4)); CK(cudaMalloc(&x, SETS * H * 2)); CK(cudaMalloc(&out, SETS * H * 2));
  CK(cudaMalloc(&y, K * I * 4));
  CK(cudaMemcpy(ws13, h_ws13.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ws2, h_ws2.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(topw, h_w.data(), SETS * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ids, h_ids.data(), SETS * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(x, h_x.data(), SETS * H * 2, cudaMemcpyHostToDevice));

  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  one_token::Params p{};
  p.topk_weights = topw; p.w13 = w13; p.w2 = w2; p.w13_scale = ws13; p.w2_scale = ws2;
  p.y = y; p.hidden_size = H; p.inter = I; p.top_k = K; p.num_experts = E;
  p.alpha = 1.702f; p.limit = 7.f;
  p.units1 = (K * I / one_token::kCols + sms - 1) / sms;
  p.units2 = (H / one_token::kCols + sms - 1) / sms;
  auto k_share = one_token::forward_kernel<__nv_bfloat16, MOEK_ACT_SWIGLU, false, false>;
  auto k_stream = one_token::forward_kernel<__nv_bfloat16, MOEK_ACT_SWIGLU, false, true>;
  int optin; CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  cudaFuncAttributes fa1, fa2; CK(cudaFuncGetAttributes(&fa1, k_share)); CK(cudaFuncGetAttributes(&fa2, k_stream));
  const size_t avail = optin - std::max(fa1.sharedSizeBytes, fa2.sharedSizeBytes);
  one_token::Plan pl = one_token::plan(H, I, K, p.units1, p.units2, false, avail, RING);
#ifdef STREAM  // -DSTREAM: the streamed form where the share would fit
  if (!pl.stream) pl = one_token::plan(H, I, K, one_token::max_units1(false) + 1, p.units2, false, avail, RING);
#endif
  if (!pl.ring) { printf("the plan does not fit\n"); return 1; }
  if (RING && !pl.stream) pl.ring = RING;  // the share form's ring, as asked
  p.ring = pl.ring;
  const size_t smem = one_token::smem_bytes(H, I, p.units2, pl, false);
  printf("E %d H %d I %d: grid %d, units1 %d, units2 %d, %s, ring %d, smem %zu\n", E, H, I, sms, p.units1, p.units2,
         pl.stream ? "streamed" : "share", p.ring, smem);
  const double floor_us = double(K) * 3 * I * H / PBW * 1e6;
  cudaStream_t st; CK(cudaStreamCreate(&st));

  auto launch = [&](auto kern, int set, bool pdl, bool coop) {
    one_token::Params q = p;
    q.hidden = x + set * H; q.topk_ids = ids + set * K; q.topk_weights = topw + set * K; q.out = out + set * H;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    cudaLaunchAttribute a[2]; int n = 0;
    if (pdl) { a[n].id = cudaLaunchAttributeProgrammaticStreamSerialization; a[n++].val.programmaticStreamSerializationAllowed = 1; }
    if (coop) { a[n].id = cudaLaunchAttributeCooperative; a[n++].val.cooperative = 1; }
    cudaLaunchConfig_t c{}; c.stream = st; c.attrs = a; c.numAttrs = n;
    c.gridDim = sms; c.blockDim = one_token::kThreads; c.dynamicSmemBytes = smem;
    return cudaLaunchKernelEx(&c, kern, q);
  };
  auto k_coop = pl.stream ? k_stream : k_share;

  // Correctness: every set once with each kernel, against the host reference.
  const int w2_afters[] = {99, 0, 2, 4};  // w13 tile the w2 share is requested with
  const int variants = pl.stream ? 1 : 4;  // the streamed form has no share
  std::vector<double> worst(4, 0.0);
  for (int v = 0; v < variants; ++v) {
    p.w2_after = w2_afters[v];
    CK(cudaMemset(out, 0xff, SETS * H * 2));  // poison (NaN)
    for (int s = 0; s < SETS; ++s)
      CK(launch(k_coop, s, false, true));
    CK(cudaStreamSynchronize(st));
    std::vector<__nv_bfloat16> h_out(SETS * H);
    CK(cudaMemcpy(h_out.data(), out, SETS * H * 2, cudaMemcpyDeviceToHost));
    for (int s = 0; s < 3; ++s) {
      std::vector<float> xf(H);
      for (int j = 0; j < H; ++j) xf[j] = __bfloat162float(h_x[s * H + j]);
      const std::vector<double> xd = quant_dequant(xf);
      std::vector<double> ref(H, 0.0);
      for (int j = 0; j < K; ++j) {
        const int ex = h_ids[s * K + j];
        std::vector<uint8_t> a(size_t(2) * I * H), b(size_t(H) * I);
        CK(cudaMemcpy(a.data(), w13 + size_t(ex) * 2 * I * H, a.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), w2 + size_t(ex) * H * I, b.size(), cudaMemcpyDeviceToHost));
        std::vector<float> act(I);
        for (int c = 0; c < I; ++c) {
          double gsum = 0, usum = 0;
          for (int k = 0; k < H; ++k) { gsum += xd[k] * e4m3(a[size_t(c) * H + k]); usum += xd[k] * e4m3(a[size_t(I + c) * H + k]); }
          gsum *= h_ws13[ex]; usum *= h_ws13[ex];
          act[c] = float(gsum / (1.0 + std::exp(-gsum)) * usum);
        }
        const std::vector<double> ad = quant_dequant(act);
        for (int o = 0; o < H; ++o) {
          double d = 0;
          for (int c = 0; c < I; ++c) d += ad[c] * e4m3(b[size_t(o) * I + c]);
          ref[o] += h_w[s * K + j] * d * h_ws2[ex];
        }
      }
      double amax = 0, err = 0;
      for (int o = 0; o < H; ++o) {
        amax = std::max(amax, std::fabs(ref[o]));
        const double v = __bfloat162float(h_out[s * H + o]);
        err = std::isfinite(v) ? std::max(err, std::fabs(v - ref[o])) : 1e30;
      }
      worst[v] = std::max(worst[v], err / amax);
    }
    printf("w2_after %d: worst |out - ref| / max|ref| over 3 sets = %.3g%s\n", w2_afters[v], worst[v],
           worst[v] > 0.05 ? "  MISMATCH (exit status 2)" : "");
  }

  // Can a cooperative launch be captured into a graph (with PDL)?
  bool coop_ok = true;
  {
    cudaGraph_t gr; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    cudaError_t e1 = launch(k_coop, 0, true, true);
    cudaError_t e2 = cudaStreamEndCapture(st, &gr);
    cudaError_t e3 = e2 == cudaSuccess ? cudaGraphInstantiate(&ge, gr, 0) : e2;
    cudaError_t e4 = e3 == cudaSuccess ? cudaGraphLaunch(ge, st) : e3;
    cudaError_t e5 = cudaStreamSynchronize(st);
    printf("cooperative + PDL in a graph: launch %s, capture %s, instantiate %s, replay %s, sync %s\n",
           cudaGetErrorString(e1), cudaGetErrorString(e2), cudaGetErrorString(e3), cudaGetErrorString(e4),
           cudaGetErrorString(e5));
    coop_ok = e1 == cudaSuccess && e4 == cudaSuccess && e5 == cudaSuccess;
    cudaGetLastError();
  }
  // ONE_SET=1: every launch the same experts, whose weights then stay in L2.
  const int sets_used = getenv("ONE_SET") ? 1 : SETS;
  for (int round = 0; round < 2; ++round)
    for (int v = 0; v < variants; ++v)
      for (int pdl = 1; pdl >= 0; --pdl) {
        if (!coop_ok) continue;
        p.w2_after = w2_afters[v];
        std::vector<float> ts;
        bool ok = true;
        time_graph(st, 32, [&](int i) {
          cudaError_t e = launch(k_coop, i % sets_used, pdl, true);
          if (e != cudaSuccess) { ok = false; printf("  launch: %s\n", cudaGetErrorString(e)); cudaGetLastError(); }
        }, ts);
        if (ok) printf("ring %d, w2 with tile %-2d pdl %d: %.2f us (min %.2f)  = %.0f%% of the %.1f us floor\n", p.ring, w2_afters[v], pdl, ts[15], ts[0], 100 * floor_us / ts[15], floor_us);
      }
  // Timeline: clock64 stamps per CTA, one launch after warm-up (each set's weights cold
  // in L2 as far as 16 sets allow), relative to the earliest start.
  {
    constexpr int S = one_token::kStamps;
    unsigned long long* tr; CK(cudaMalloc(&tr, sms * S * 8));
    const char* what[] = {"start", "ids", "token quantized", "gemm1 done", "post-sync", "y quantized", "gemm2 mma", "end", "w2 landed", "first tiles issued", "tile 0 landed", "terms", "producer ready", "tile 0 consumed", "w2 entry 0 landed", "w2 entry 0 consumed", "gemm2 half"};
    for (int rep = 0; rep < variants; ++rep) {
      p.w2_after = w2_afters[rep];
      for (int i = 0; i < 40; ++i) CK(launch(k_coop, i % sets_used, true, true));
      CK(cudaMemset(tr, 0, sms * S * 8));
      p.trace = tr;
      CK(launch(k_coop, (rep * 5 + 3) % sets_used, true, true));
      p.trace = nullptr;
      CK(cudaStreamSynchronize(st));
      std::vector<unsigned long long> h(sms * S);
      CK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
      double ghz = 0;
      for (int b = 0; b < sms; ++b) ghz += double(h[b * S + 7] - h[b * S]) / double(h[b * S + 31] - h[b * S + 30]);
      ghz /= sms;
      printf("timeline, w2 with tile %d (us from each CTA's own start, by clock64 at %.2f GHz: mean / max over CTAs that have the point)\n", w2_afters[rep], ghz);
      for (int k = 0; k < 17; ++k) {
        double sum = 0, mx = 0; int n = 0;
        for (int b = 0; b < sms; ++b) if (h[b * S + k]) { double v = (h[b * S + k] - h[b * S]) / ghz / 1000.0; sum += v; mx = std::max(mx, v); ++n; }
        if (n) printf("  %-12s %6.2f / %6.2f  (%d)\n", what[k], sum / n, mx, n);
      }
    }
  }
  return *std::max_element(worst.begin(), worst.end()) > 0.05 ? 2 : 0;  // the E4M3 rounding stays near 2%
}
