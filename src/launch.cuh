// Kernel launches with programmatic dependent launch (PDL, SM90+): each of our kernels may be
// scheduled while the previous kernel on the stream is still finishing, so the launch
// latency between the forward's steps overlaps with work. Every kernel launched this way
// calls pdl_begin(): it waits for the previous grid to complete (and its memory to be
// visible), then lets the next kernel be scheduled. Since the wait comes before the
// trigger, a kernel that runs has the grid two launches back complete: before its wait it
// may read what was written two or more launches back (routing's lists and scales, the
// caller's inputs, the weights), never what the previous kernel writes. The forward's first
// kernel (routing) reads nothing before its wait. Ordering of the writes is therefore that
// of a plain stream; only launch gaps and dependent-load chains shrink.
// MOE_KERNELS_PDL=0 turns it off (plain launches; pdl_begin() is then a no-op).
#pragma once

#include <cuda_runtime.h>
#include <stdlib.h>

#include <mutex>
#include <utility>
#include <vector>

namespace moe_kernels {

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = getenv("MOE_KERNELS_PDL");
    return !(v && v[0] == '0');
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL unless it is turned off; returns
// the launch error.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Raises `kernel`'s dynamic shared-memory limit on the current device `device` to `bytes`,
// unless an earlier call for that kernel and device asked as much. The limit belongs to the
// device's copy of the kernel and only ever grows, so a concurrent launch that needs more is
// never undercut; each new high-water mark costs one driver call.
inline cudaError_t allow_smem(const void* kernel, int device, size_t bytes) {
  struct Mark {
    const void* kernel;
    int device;
    size_t bytes;
  };
  static std::mutex mu;
  static std::vector<Mark> marks;
  std::lock_guard<std::mutex> lock(mu);
  Mark* mark = nullptr;
  for (Mark& m : marks)
    if (m.kernel == kernel && m.device == device) mark = &m;
  if (mark && bytes <= mark->bytes) return cudaSuccess;
  const int limit = static_cast<int>(bytes);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit)) return e;
  if (mark) mark->bytes = bytes;
  else marks.push_back({kernel, device, bytes});
  return cudaSuccess;
}

}  // namespace moe_kernels
