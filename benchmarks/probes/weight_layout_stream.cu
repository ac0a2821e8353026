// Does the weights' memory layout cap how fast a grouped GEMM can stream them? DeepSeek-V3's
// w13 in FP8 (256 experts x 4096 rows x 7168 bytes = 7.5 GB) read once, the way the
// 128x128 GEMM tiles read it: a block per SM takes 128-row N tiles in order (tile t: expert
// t / 32, rows (t % 32) * 128) and walks K in 128-byte steps, 16 KB per step, through an
// 8-stage shared-memory ring; nothing is computed.
//   mode 0: row-major weights ([E * 4096, 7168], what the GEMMs read today), TMA 2D boxes of
//           128 bytes x 128 rows: each step touches 128 rows, 128 bytes each, 7168 apart
//   mode 1: the same bytes stored K-blocked (each 128x128 block contiguous), 16 KB bulk copies
//   mode 2: row-major, TMA boxes of 256 bytes x 64 rows (two steps per 128-row K step)
//   mode 3: mode 0 with two blocks per tile (blocks 2i and 2i+1 read the same tile, as the
//           M tiles of one expert share its weights), so half the bytes come from L2
// Not part of the library. Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/layout \
//     benchmarks/probes/weight_layout_stream.cu -lcuda && /tmp/layout
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda.h>
#include <cuda_runtime.h>
#include "probe_common.cuh"
#define CU(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("%s:%d CUresult %d\n", __FILE__, __LINE__, (int)r); exit(1);} } while (0)

constexpr int E = 256, N = 4096, KB = 7168;  // bytes per row
constexpr int TILE = 128, STEP = 16384, STAGES = 8;
constexpr int TILES = E * (N / TILE), KSTEPS = KB / 128;

__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* m, int x, int y, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(smem_u32(dst)), "l"(m), "r"(x), "r"(y), "r"(smem_u32(b)) : "memory");
}

template <int MODE>
__global__ void __launch_bounds__(64) stream(const __grid_constant__ CUtensorMap m128, const __grid_constant__ CUtensorMap m256,
                                             const char* blocked, unsigned* out) {
  extern __shared__ __align__(1024) char ring[];
  __shared__ uint64_t full[STAGES], empty[STAGES];
  if (threadIdx.x == 0) { for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); } }
  __syncthreads();
  const int per_tile = MODE == 3 ? 2 : 1;
  const int first = blockIdx.x / per_tile, stride = gridDim.x / per_tile;
  const int steps_per_k = MODE == 2 ? 2 : 1;
  int i = 0;
  unsigned acc = 0;
  for (int t = first; t < TILES; t += stride) {
    for (int k = 0; k < KSTEPS; ++k) for (int h = 0; h < steps_per_k; ++h, ++i) {
      int s = i % STAGES;
      if (threadIdx.x == 0) {
        if (i >= STAGES) mbar_wait(&empty[s], ((i / STAGES) - 1) & 1);
        mbar_expect(&full[s], STEP);
        if (MODE == 1) bulk(ring + s * STEP, blocked + (size_t(t) * KSTEPS + k) * STEP, STEP, &full[s]);
        else if (MODE == 2) tma2d(ring + s * STEP, &m256, k * 128 + 0, t * TILE + h * 64, &full[s]);
        else tma2d(ring + s * STEP, &m128, k * 128, t * TILE, &full[s]);
      }
      if (threadIdx.x == 32) {  // the consumer: wait, touch a word, release
        mbar_wait(&full[s], (i / STAGES) & 1);
        acc ^= *reinterpret_cast<volatile unsigned*>(ring + s * STEP + (i % 64) * 4);
        mbar_arrive(&empty[s]);
      }
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

int main() {
  const size_t bytes = size_t(E) * N * KB;
  char *w, *blocked; unsigned* out;
  CK(cudaMalloc(&w, bytes)); CK(cudaMalloc(&blocked, bytes)); CK(cudaMalloc(&out, 4));
  CK(cudaMemset(w, 1, bytes)); CK(cudaMemset(blocked, 2, bytes));
  CUtensorMap m128, m256;
  cuuint64_t dims[2] = {KB, cuuint64_t(E) * N}, strides[1] = {KB};
  cuuint32_t box128[2] = {128, 128}, box256[2] = {256, 64}, es[2] = {1, 1};
  CU(cuTensorMapEncodeTiled(&m128, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box128, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  CU(cuTensorMapEncodeTiled(&m256, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box256, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto timeit = [&](auto launch, const char* what, double moved) {
    launch(); CK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) { cudaEventRecord(a); launch(); cudaEventRecord(b); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms); }
    std::sort(ts.begin(), ts.end());
    printf("%-58s %8.1f us  %.2f TB/s\n", what, ts[3] * 1000, moved / ts[3] / 1e9);
  };
  timeit([&] { CK(cudaMemcpyAsync(blocked, w, bytes / 2, cudaMemcpyDeviceToDevice)); }, "copy, half the bytes (read + write)", double(bytes));
  const int smem = STAGES * STEP;
  auto run = [&](auto kern, const char* what) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    timeit([&] { kern<<<sms, 64, smem>>>(m128, m256, blocked, out); CK(cudaGetLastError()); }, what, double(bytes));
  };
  run(stream<0>, "mode 0: row-major, TMA 128 B x 128 rows");
  run(stream<1>, "mode 1: K-blocked, 16 KB bulk copies");
  run(stream<2>, "mode 2: row-major, TMA 256 B x 64 rows");
  run(stream<3>, "mode 3: mode 0, two blocks per tile (bytes counted once)");
  run(stream<0>, "mode 0 again");
  run(stream<1>, "mode 1 again");
  return 0;
}
