// What would a one-token forward without a grid barrier gain? The one_token kernel waits at a
// grid barrier between GEMM1 and GEMM2 (GEMM2's per-row activation scale needs the whole row);
// a row of one slot could instead be reduced within a thread-block cluster. This probe prints:
//   - how many clusters of 2..16 CTAs (one per SM: ~200 KB of shared memory each) fit at once;
//   - the time per round of a grid barrier (a counter in global memory, all CTAs spinning),
//     of a cluster barrier, and of an amax reduction across the cluster through distributed
//     shared memory (each CTA's value into rank 0, cluster barrier, rank 0 broadcasts back).
// Not part of the library. Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/cluster \
//     benchmarks/probes/cluster_barrier.cu && /tmp/cluster
#include <cooperative_groups.h>
#include "probe_common.cuh"

namespace cg = cooperative_groups;
constexpr int kSmem = 200 * 1024, kRounds = 1000;

// mode 0: grid barrier; 1: cluster barrier; 2: amax over the cluster through DSMEM.
template <int kMode>
__global__ void rounds(unsigned* counter, float* out, long long* cycles) {
  extern __shared__ float buf[];
  cg::cluster_group cluster = cg::this_cluster();
  float v = float(blockIdx.x % 7) + 1.f;
  __syncthreads();
  const long long start = clock64();
  for (int r = 0; r < kRounds; ++r) {
    if constexpr (kMode == 0) {
      __syncthreads();
      if (threadIdx.x == 0) {
        const unsigned target = (r + 1) * gridDim.x;
        atomicAdd(counter, 1u);
        while (atomicAdd(counter, 0u) < target) {}
      }
      __syncthreads();
    } else if constexpr (kMode == 1) {
      cluster.sync();
    } else {
      if (threadIdx.x == 0) {
        float* rank0 = cluster.map_shared_rank(buf, 0);
        rank0[cluster.block_rank()] = v;
      }
      cluster.sync();
      if (cluster.block_rank() == 0 && threadIdx.x < 32) {
        float m = threadIdx.x < int(cluster.num_blocks()) ? buf[threadIdx.x] : 0.f;
        for (int d = 16; d > 0; d /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
        if (threadIdx.x == 0) buf[32] = m;
      }
      cluster.sync();
      v = *cluster.map_shared_rank(buf + 32, 0) + 1.f;
      cluster.sync();  // rank 0's buffer is read before the next round writes it
    }
  }
  const long long end = clock64();
  if (threadIdx.x == 0) {
    out[blockIdx.x] = v;
    cycles[blockIdx.x] = end - start;
  }
}

// A launch of `ctas` CTAs of 128 threads in clusters of `cluster` (used in place: cfg points
// at attr).
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  ClusterLaunch(int ctas, int cluster) {
    cfg.gridDim = dim3(ctas);
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = kSmem;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
};

template <int kMode>
void time_rounds(const char* what, int ctas, int cluster, unsigned* counter, float* out, long long* cycles) {
  CK(cudaFuncSetAttribute(rounds<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  if (cluster > 8) CK(cudaFuncSetAttribute(rounds<kMode>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  ClusterLaunch launch(ctas, cluster);
  std::vector<float> us;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaMemset(counter, 0, 4));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a));
    CK(cudaLaunchKernelEx(&launch.cfg, rounds<kMode>, counter, out, cycles));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1e3f / kRounds);
  }
  std::sort(us.begin(), us.end());
  printf("%-44s %3d CTAs, clusters of %2d: %.3f us per round\n", what, ctas, cluster, us[2]);
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned* counter;
  float* out;
  long long* cycles;
  CK(cudaMalloc(&counter, 4));
  CK(cudaMalloc(&out, sms * 4));
  CK(cudaMalloc(&cycles, sms * 8));
  CK(cudaFuncSetAttribute(rounds<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(rounds<1>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int fits[17] = {};
  for (int c : {2, 4, 8, 16}) {
    ClusterLaunch launch(c * 64, c);
    CK(cudaOccupancyMaxActiveClusters(&fits[c], rounds<1>, &launch.cfg));
    printf("clusters of %2d CTAs (one per SM) that fit at once: %d (%d CTAs of %d SMs)\n", c, fits[c],
           fits[c] * c, sms);
  }
  const int ctas = sms / 8 * 8;  // whole clusters of 8
  time_rounds<0>("grid barrier (global counter)", ctas, 1, counter, out, cycles);
  time_rounds<1>("cluster barrier", ctas, 8, counter, out, cycles);
  time_rounds<2>("amax over the cluster (DSMEM, 3 barriers)", ctas, 8, counter, out, cycles);
  if (fits[16] > 0) {
    const int n16 = std::min(fits[16], sms / 16) * 16;
    time_rounds<1>("cluster barrier", n16, 16, counter, out, cycles);
    time_rounds<2>("amax over the cluster (DSMEM, 3 barriers)", n16, 16, counter, out, cycles);
  }
  return 0;
}
