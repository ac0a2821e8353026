// A/B of the 16-bit decode GEMM alone, one GEMM of a preset at a time (uniform routing, bf16):
// the mma.sync kernel (decode_gemm.cuh, 8/16 tokens x 16/64 columns, the best of the four per
// point) against a form defined here (not built into the library) shaped as vLLM's tuned Triton
// MoE kernel decomposes decode: one block per (64 weight rows, 16 or 64 routed tokens of an
// expert), the tokens as mma.sync's M (in tiles of 16) and the weights as its N, both copied by
// cp.async into a ring of kStages stages of kK values in shared memory (swizzled for ldmatrix),
// the token blocks of one weight block adjacent in launch order. Outputs (NaN-poisoned first)
// checked against a host reference on 256 sampled entries. Medians of interleaved rounds of
// back-to-back launches.
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
#include "gemm/sm90/decode_w4_wgmma.cuh"  // smem_addr, cp.async
#include "harness.cuh"

using namespace moe_kernels;
using bf16 = __nv_bfloat16;

namespace tri {
using decode_w4_wgmma::cp_async_16;
using decode_w4_wgmma::smem_addr;

constexpr int kThreads = 128;  // 4 warps, 16 weight rows each
constexpr int kRows = 64;      // weight rows per block

// Per stage: kTok token rows and kRows weight rows of kK values (kK / 8 chunks of 16 bytes a
// row); chunk c of row r at slot c ^ (r & 7), so ldmatrix's eight row addresses hit 32 banks.
template <int kK, int kTok>
struct Stage {
  uint16_t x[kTok * kK];
  uint16_t w[kRows * kK];
};

__device__ __forceinline__ uint32_t slot(int row, int chunk, int kK) {
  return uint32_t(row * kK * 2 + ((chunk ^ (row & 7)) * 16));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Stage s's copies (tokens m0 .. m0 + kTok - 1 and weight rows n0 .. n0 + 63, K values s * kK ..),
// one commit group, empty past the last stage.
template <int kK, int kTok, int kStages>
__device__ __forceinline__ void copy_stage(const char* w, int64_t ldw, int n, const char* x, int64_t ldx, int m_rows,
                                           int k, int steps, int n0, int m0, int s, Stage<kK, kTok>* st) {
  constexpr int kChunks = kK / 8;
  if (s < steps) {
    Stage<kK, kTok>& sm = st[s % kStages];
    const uint32_t xs = smem_addr(sm.x), ws = smem_addr(sm.w);
#pragma unroll
    for (int id = threadIdx.x; id < kTok * kChunks; id += kThreads) {
      const int row = id / kChunks, c = id % kChunks, kk = s * kK + 8 * c;
      const bool ok = m0 + row < m_rows && kk < k;
      cp_async_16(xs + slot(row, c, kK), x + (ok ? (m0 + row) * ldx + int64_t(kk) * 2 : 0), ok);
    }
#pragma unroll
    for (int id = threadIdx.x; id < kRows * kChunks; id += kThreads) {
      const int row = id / kChunks, c = id % kChunks, kk = s * kK + 8 * c;
      const bool ok = n0 + row < n && kk < k;
      cp_async_16(ws + slot(row, c, kK), w + (ok ? (n0 + row) * ldw + int64_t(kk) * 2 : 0), ok);
    }
  }
  decode_w4_wgmma::cp_async_commit();
}

// Grid: (kTok-token blocks of the largest group, N / 64, groups): one block per (64 weight rows,
// kTok routed tokens of one expert), the tokens as mma.sync's M (in tiles of 16) and the weights
// as its N, both through a ring of kStages stages of kK values in shared memory. The token
// blocks of one weight block are adjacent in launch order, so their weight reads meet in L2.
template <int kK, int kTok, int kStages>
__global__ void __launch_bounds__(kThreads) kernel(decode::Params p) {
  constexpr int kMT = kTok / 16;  // mma M tiles
  extern __shared__ __align__(128) char smem[];
  Stage<kK, kTok>* st = reinterpret_cast<Stage<kK, kTok>*>(smem);
  pdl_begin();
  const int active = p.active_groups[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mat = lane >> 3, r8 = lane & 7;
  const int n0 = blockIdx.y * kRows, m0 = blockIdx.x * kTok;
  for (int y = blockIdx.z; y < active; y += gridDim.z) {
    const int g = p.active_groups[1 + y];
    const int m_rows = p.problem_shapes[3 * g], n = p.problem_shapes[3 * g + 1], k = p.problem_shapes[3 * g + 2];
    if (m0 >= m_rows || n0 >= n) continue;  // the same for the whole block
    const char* w = static_cast<const char*>(p.ptr_b[g]);
    const char* x = static_cast<const char*>(p.ptr_a[g]);
    const int64_t ldw = p.stride_b[g] * 2, ldx = p.stride_a[g] * 2;
    const int steps = (k + kK - 1) / kK;
    float acc[kMT][2][4] = {};
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j)
      copy_stage<kK, kTok, kStages>(w, ldw, n, x, ldx, m_rows, k, steps, n0, m0, j, st);
    for (int j = 0; j < steps; ++j) {
      decode_w4_wgmma::cp_async_wait<kStages - 2>();
      __syncthreads();  // stage j landed for everyone; everyone done with stage j - 1
      copy_stage<kK, kTok, kStages>(w, ldw, n, x, ldx, m_rows, k, steps, n0, m0, j + kStages - 1, st);
      const Stage<kK, kTok>& sm = st[j % kStages];
      const uint32_t xs = smem_addr(sm.x), ws = smem_addr(sm.w);
#pragma unroll
      for (int ks = 0; ks < kK / 16; ++ks) {
        uint32_t b[4];
        // B: (weight rows 16w + 0-7, k 0-7), (same, k 8-15), (16w + 8-15, k 0-7), (same, k 8-15)
        ldmatrix_x4(b, ws + slot(16 * warp + r8 + 8 * (mat >> 1), 2 * ks + (mat & 1), kK));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          uint32_t a[4];
          // A: matrices (tokens 16mt + 0-7, k 0-7), (+ 8-15, 0-7), (+ 0-7, 8-15), (+ 8-15, 8-15)
          ldmatrix_x4(a, xs + slot(16 * mt + r8 + 8 * (mat & 1), 2 * ks + (mat >> 1), kK));
#pragma unroll
          for (int t = 0; t < 2; ++t)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(acc[mt][t][0]), "+f"(acc[mt][t][1]), "+f"(acc[mt][t][2]), "+f"(acc[mt][t][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2 * t]), "r"(b[2 * t + 1]));
        }
      }
    }
    bf16* d = static_cast<bf16*>(p.ptr_d[g]);
    const int64_t ldd = p.stride_d[g];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // c0, c1: token lane / 4, columns 2 (lane % 4) + 0, 1; c2, c3: token + 8
          const int m = m0 + 16 * mt + (lane >> 2) + 8 * (i >> 1);
          const int col = n0 + 16 * warp + 8 * t + 2 * (lane & 3) + (i & 1);
          if (m < m_rows && col < n) d[int64_t(m) * ldd + col] = __float2bfloat16(acc[mt][t][i]);
        }
    decode_w4_wgmma::cp_async_wait<0>();
    __syncthreads();  // the ring is reused for the next group
  }
}

// max_rows: the most rows any group has (the grid's first dimension covers them kTok at a time).
template <int kK, int kTok, int kStages>
int run(const GroupedGemmArgs& a, int max_rows, char* err, size_t errlen) {
  const decode::Params p{a.problem_shapes, a.active_groups, a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_d,
                         a.stride_d, a.ptr_sfa, a.ptr_sfb, a.sfb_base, a.n, a.sfb_per_channel};
  constexpr int kSmem = kStages * sizeof(Stage<kK, kTok>);
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel<kK, kTok, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) { snprintf(err, errlen, "%s", cudaGetErrorString(attr)); return MOEK_CUDA_ERROR; }
  const dim3 grid(unsigned((max_rows + kTok - 1) / kTok), unsigned((a.n + kRows - 1) / kRows),
                  unsigned(a.max_active_groups < 65535 ? a.max_active_groups : 65535));
  const cudaError_t e = launch(kernel<kK, kTok, kStages>, grid, dim3(kThreads), kSmem, a.stream, p);
  if (e != cudaSuccess) { snprintf(err, errlen, "%s", cudaGetErrorString(e)); return MOEK_CUDA_ERROR; }
  return MOEK_OK;
}
}  // namespace tri

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
  printf("%-16s %4s %6s | %8s %8s %8s %8s | %8s %8s %8s %8s | %7s %6s | %s\n", "gemm", "T", "active", "m8x16", "m8x64",
         "m16x16", "m16x64", "k128s4", "k256s3", "k64s6", "m64k64s4", "speedup", "TB/s",
         "error: best mma, the four ring forms");
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
    const int max_rows = *std::max_element(routing.count.begin(), routing.count.end());
    // (kK, tokens, stages): vLLM's tuned H100/H200 configs at these sizes are 16 x 64 x 64-256
    // with 2-5 stages, and 32-64 tokens per block from 64 routed rows per expert.
    auto k128s4 = [&] { return tri::run<128, 16, 4>(a, max_rows, err, sizeof err); };
    auto k256s3 = [&] { return tri::run<256, 16, 3>(a, max_rows, err, sizeof err); };
    auto k64s6 = [&] { return tri::run<64, 16, 6>(a, max_rows, err, sizeof err); };
    auto m64k64s4 = [&] { return tri::run<64, 64, 4>(a, max_rows, err, sizeof err); };
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
    const double er = std::max({check("k128s4", k128s4), check("k256s3", k256s3), check("k64s6", k64s6),
                                check("m64k64s4", m64k64s4)});
    std::vector<float> t[8];
    const int reps = cs.T >= 128 ? 20 : 100;
    for (int r = 0; r < rounds; ++r) {
      t[0].push_back(time_it(m8x16, reps));
      t[1].push_back(time_it(m8x64, reps));
      t[2].push_back(time_it(m16x16, reps));
      t[3].push_back(time_it(m16x64, reps));
      t[4].push_back(time_it(k128s4, reps));
      t[5].push_back(time_it(k256s3, reps));
      t[6].push_back(time_it(k64s6, reps));
      t[7].push_back(time_it(m64k64s4, reps));
    }
    float m[8];
    for (int i = 0; i < 8; ++i) { std::sort(t[i].begin(), t[i].end()); m[i] = t[i][t[i].size() / 2]; }
    const float old = *std::min_element(m, m + 4), neu = *std::min_element(m + 4, m + 8);
    const double bytes = double(routing.active.size()) * N * K * 2;
    printf("%-16s %4d %6zu | %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f %8.1f | %7.3f %6.2f | %.3g %.3g\n",
           cs.name.c_str(), cs.T, routing.active.size(), m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7],
           old / neu, bytes / neu * 1e-6, em, er);
    fflush(stdout);
  }
  return 0;
}
