// What the kernel A/B harnesses share: error checks, bf16 bits, a hash for device-filled
// weights, the timer (CUDA events around back-to-back launches), a NaN-poisoned launch for the
// checks, the uniform routing, and the device arrays a grouped GEMM over the routed tokens reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gemm/grouped_gemm.h"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      printf("CUDA %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);           \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static inline float bf(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t tobf(float f) {
  __nv_bfloat16 h = __float2bfloat16(f);
  return reinterpret_cast<uint16_t&>(h);
}

__device__ __host__ inline uint32_t hash32(uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 32;
  return uint32_t(x);
}

// Microseconds per call of fn, over reps back-to-back calls after one warm-up call.
template <class Fn>
static float time_it(Fn fn, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  fn();
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) fn();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  return ms * 1000.f / reps;
}

// One launch for a check: fn() launches the kernel and returns its status (its message in err).
// The bf16 output `out` is filled with NaNs first, so entries the kernel leaves unwritten fail
// the check, then copied back into `host` (as many values); a failed launch exits.
template <class Fn>
static void run_poisoned(const char* what, Fn fn, const char* err, uint16_t* out, std::vector<uint16_t>& host) {
  CK(cudaMemset(out, 0xFF, host.size() * 2));
  if (fn()) { printf("%s: %s\n", what, err); exit(1); }
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost));
}

// T tokens routed to E experts, each token to topk distinct experts drawn uniformly. The routed
// rows are grouped by expert: expert e's count[e] rows start at row offset[e] of the token and
// output matrices; active lists the experts with at least one row.
struct Routing {
  std::vector<int> count, active, offset;  // offset: E + 1 entries, offset[E] == rows
  int rows;                                 // T * topk

  int expert_of(int row) const {
    int e = 0;
    while (offset[e + 1] <= row) ++e;
    return e;
  }
};

static Routing uniform_routing(int E, int topk, int T, std::mt19937& rng) {
  Routing r;
  r.count.assign(E, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<int> ids(E);
    for (int i = 0; i < E; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < topk; ++j) r.count[ids[j]]++;
  }
  r.offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    r.offset[e + 1] = r.offset[e] + r.count[e];
    if (r.count[e]) r.active.push_back(e);
  }
  r.rows = r.offset[E];
  return r;
}

// Device memory that is freed when this object goes out of scope (one per case).
class DeviceArrays {
 public:
  DeviceArrays() = default;
  DeviceArrays(const DeviceArrays&) = delete;
  DeviceArrays& operator=(const DeviceArrays&) = delete;
  ~DeviceArrays() {
    for (void* p : owned_) cudaFree(p);
  }

  // An uninitialized buffer of `bytes` bytes.
  template <class T>
  T* alloc(size_t bytes) {
    void* p;
    CK(cudaMalloc(&p, bytes));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  // A device copy of a host array.
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* p = alloc<T>(host.size() * sizeof(T));
    CK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }

 private:
  std::vector<void*> owned_;
};

// Group e's pointers (one entry per expert), on the host: its tokens (row offset[e] of A), its
// weights, its output (row offset[e] of D), and the scales where the kernel reads them (leave
// sfa or sfb empty for none).
struct GroupPointers {
  std::vector<const void*> a, b;
  std::vector<void*> d;
  std::vector<const float*> sfa, sfb;
};

// The arguments of a grouped GEMM with one group per expert: group e multiplies its
// routing.count[e] token rows (A, K wide) by its N x K weights (B) into D (N wide). Uploads the
// shapes, the active-group list, the pointers and the strides into `mem`; sets no kernel-specific
// field other than N, K and the active groups (sm_count, weight_group, ... are the caller's).
static moe_kernels::GroupedGemmArgs grouped_args(DeviceArrays& mem, const Routing& r, int N, int K,
                                                 const GroupPointers& p) {
  const int E = int(r.count.size());
  std::vector<int32_t> shapes(3 * E), act(1 + E, 0);
  for (int e = 0; e < E; ++e) {
    shapes[3 * e] = r.count[e]; shapes[3 * e + 1] = N; shapes[3 * e + 2] = K;
  }
  act[0] = r.active.size();
  for (size_t i = 0; i < r.active.size(); ++i) act[1 + i] = r.active[i];
  moe_kernels::GroupedGemmArgs a{};
  a.num_groups = E;
  a.problem_shapes = mem.upload(shapes);
  a.active_groups = mem.upload(act);
  a.max_active_groups = r.active.size();
  a.n = N;
  a.k = K;
  a.ptr_a = mem.upload(p.a);
  a.ptr_b = mem.upload(p.b);
  a.ptr_d = mem.upload(p.d);
  a.ptr_sfa = p.sfa.empty() ? nullptr : mem.upload(p.sfa);
  a.ptr_sfb = p.sfb.empty() ? nullptr : mem.upload(p.sfb);
  a.stride_a = mem.upload(std::vector<int64_t>(E, K));
  a.stride_b = mem.upload(std::vector<int64_t>(E, K));
  a.stride_d = mem.upload(std::vector<int64_t>(E, N));
  a.stream = 0;
  return a;
}
