// Why did the third fused decode version's up kernel (9f74195) stream one token's w13 at
// ~1.9 TB/s when weight_stream_ceiling.cu's mode 0 streams at ~3.6-3.9? Same bytes (Qwen3-30B-A3B
// fp8, 8 random experts of 128, w13 8 x 1536 x 2048 B = 25.2 MB, 16 expert sets rotated),
// a block per SM, one producer thread issuing bulk copies into a shared-memory ring, one
// consumer warp that only waits and releases: no math. Graph of 32 launches, PDL on, median
// of 30 replays. What changes is how the bytes are cut and dealt to blocks:
//   mode 0: 16 KB pieces of the 8 slices laid end to end, block b takes pieces b, b + grid, ...
//           (the ceiling probe's order: the grid walks memory front to back); 6 x 16 KB ring
//   mode 1: the up kernel's order: units (slot, 16 columns), block b takes units b, b + grid,
//           ...; a unit is two 32 KB copies (its 16 gate rows, its 16 up rows); 6 x 32 KB ring,
//           so a block's ~3 units are all requested at the start (as in 9f74195)
//   mode 2: mode 1 with 16 KB copies, 12 x 16 KB ring (all requested at the start)
//   mode 3: mode 1 with 16 KB copies, 6 x 16 KB ring (streamed)
//   mode 4: mode 0 with all of a block's pieces requested at the start (12 x 16 KB ring)
// Then mode 0 alternating with a kernel that does nothing (a block of 256 threads per SM,
// no shared memory, PDL): with that kernel's default shared-memory carveout, and with the
// carveout set to the maximum (as the streaming kernel needs), to see what switching the
// SMs' L1/shared split between consecutive kernels costs.
// Not part of the library. Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/up \
//     benchmarks/probes/decode_up_pattern.cu && /tmp/up
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>
#include "probe_common.cuh"

constexpr int E = 128, K = 8, H = 2048, I = 768;
constexpr size_t W13 = size_t(2 * I) * H;  // bytes per expert
constexpr int SETS = 16;

struct Mode { int piece, stages; };
__host__ __device__ constexpr Mode mode_of(int m) {
  return m == 0 ? Mode{16384, 6} : m == 1 ? Mode{32768, 6} : m == 2 ? Mode{16384, 12} : m == 3 ? Mode{16384, 6} : Mode{16384, 12};
}

// Piece i of this block: its source, or NULL past the end.
template <int MODE>
__device__ const char* piece(const char* w13, const int* ids, int i) {
  constexpr int P = mode_of(MODE).piece;
  if (MODE == 0 || MODE == 4) {
    const size_t per = W13 / P, p = blockIdx.x + size_t(i) * gridDim.x;
    return p < K * per ? w13 + size_t(ids[p / per]) * W13 + (p % per) * P : nullptr;
  }
  constexpr int per_unit = 2 * 16 * H / P;  // copies per unit
  constexpr int per_half = per_unit / 2;
  const int unit = blockIdx.x + (i / per_unit) * gridDim.x, j = i % per_unit;
  if (unit >= K * (I / 16)) return nullptr;
  const int slot = unit / (I / 16), c0 = (unit % (I / 16)) * 16;
  const int half = j / per_half, sub = j % per_half;
  return w13 + size_t(ids[slot]) * W13 + size_t(half * I + c0) * H + size_t(sub) * P;
}

template <int MODE>
__global__ void __launch_bounds__(64, 1) up_stream(const char* w13, const int* ids_all, int set, unsigned* out) {
  constexpr Mode M = mode_of(MODE);
  extern __shared__ __align__(128) char ring[];
  __shared__ uint64_t full[M.stages], empty[M.stages];
  if (threadIdx.x == 0) for (int s = 0; s < M.stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); }
  __syncthreads();
  pdl();
  const int* ids = ids_all + set * K;
  unsigned acc = 0;
  if (threadIdx.x == 0) {
    for (int i = 0;; ++i) {
      const char* src = piece<MODE>(w13, ids, i);
      if (!src) break;
      const int s = i % M.stages;
      if (i >= M.stages) mbar_wait(&empty[s], ((i / M.stages) - 1) & 1);
      mbar_expect(&full[s], M.piece);
      bulk(ring + size_t(s) * M.piece, src, M.piece, &full[s]);
    }
  } else if (threadIdx.x == 32) {
    for (int i = 0; piece<MODE>(w13, ids, i); ++i) {
      const int s = i % M.stages;
      mbar_wait(&full[s], (i / M.stages) & 1);
      acc ^= *reinterpret_cast<volatile unsigned*>(ring + size_t(s) * M.piece + (i % 64) * 4);
      mbar_arrive(&empty[s]);
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

__global__ void __launch_bounds__(256) idle_kernel(const char*, const int* ids_all, int set, unsigned* out) {
  pdl();
  if (ids_all[set] == -12345) out[0] = 1;
}

int main() {
  char* w13; int* ids; unsigned* out;
  CK(cudaMalloc(&w13, E * W13)); CK(cudaMalloc(&out, 4));
  CK(cudaMemset(w13, 1, E * W13));
  std::vector<int> h(SETS * K); std::mt19937 rng(0);
  for (int s = 0; s < SETS; ++s) { std::vector<int> perm(E); for (int e = 0; e < E; ++e) perm[e] = e; std::shuffle(perm.begin(), perm.end(), rng); for (int j = 0; j < K; ++j) h[s * K + j] = perm[j]; }
  CK(cudaMalloc(&ids, h.size() * 4)); CK(cudaMemcpy(ids, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  const double bytes = K * W13;
  // idle: 0 none, 1 an idle kernel after each, 2 the same with the maximum shared carveout
  auto measure = [&](auto kern, int mode, int smem, int usepdl, int idle = 0) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(idle_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                            idle == 2 ? int(cudaSharedmemCarveoutMaxShared) : int(cudaSharedmemCarveoutDefault)));
    std::vector<float> ts;
    time_graph(st, 32, [&](int i) {
      cudaLaunchAttribute a[1]; a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; a[0].val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t c{}; c.stream = st; c.attrs = a; c.numAttrs = usepdl; c.gridDim = sms; c.blockDim = 64; c.dynamicSmemBytes = smem;
      CK(cudaLaunchKernelEx(&c, kern, (const char*)w13, (const int*)ids, i % SETS, out));
      if (idle) { c.blockDim = 256; c.dynamicSmemBytes = 0; CK(cudaLaunchKernelEx(&c, idle_kernel, (const char*)w13, (const int*)ids, i % SETS, out)); }
    }, ts);
    printf("mode %d%s pdl %d: %.2f us per launch (min %.2f) = %.2f TB/s (floor at 4.22: %.2f us)\n", mode, idle == 0 ? "" : idle == 1 ? " + idle kernel" : " + idle kernel, max shared carveout", usepdl, ts[15], ts[0], bytes / ts[15] / 1e6, bytes / 4.22e6);
  };
  for (int usepdl = 0; usepdl < 2; ++usepdl) {
    measure(up_stream<0>, 0, mode_of(0).piece * mode_of(0).stages, usepdl);
    measure(up_stream<1>, 1, mode_of(1).piece * mode_of(1).stages, usepdl);
    measure(up_stream<2>, 2, mode_of(2).piece * mode_of(2).stages, usepdl);
    measure(up_stream<3>, 3, mode_of(3).piece * mode_of(3).stages, usepdl);
    measure(up_stream<4>, 4, mode_of(4).piece * mode_of(4).stages, usepdl);
  }
  for (int usepdl = 0; usepdl < 2; ++usepdl) {
    printf("idle kernel alone (as 'mode 9'; TB/s meaningless):\n");
    measure(idle_kernel, 9, 0, usepdl);
  }
  for (int usepdl = 0; usepdl < 2; ++usepdl)
    for (int idle = 1; idle <= 2; ++idle) {
      measure(up_stream<0>, 0, mode_of(0).piece * mode_of(0).stages, usepdl, idle);
      measure(up_stream<1>, 1, mode_of(1).piece * mode_of(1).stages, usepdl, idle);
    }
  return 0;
}
