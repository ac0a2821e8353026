// The C ABI between the Python module `_C` and the per-arch kernel libraries
// (libmoe_kernels_sm90a.so, ...). Plain C types only: no libtorch, no C++ objects, so a
// library built once works with any PyTorch. Bump MOEK_ABI_VERSION on any change here.
#ifndef MOE_KERNELS_C_API_H_
#define MOE_KERNELS_C_API_H_

#include <stddef.h>
#include <stdint.h>

#define MOEK_ABI_VERSION 7

#if defined(__GNUC__)
#define MOEK_EXPORT __attribute__((visibility("default")))
#else
#define MOEK_EXPORT
#endif

// moek_activation, moek_act_format, moek_weight_format, moek_kernel_kind and the mode table,
// generated from python/moe_kernels/modes.py (the one declaration of the modes).
#include "moe_kernels/modes.h"

#ifdef __cplusplus
extern "C" {
#endif

// Element type of hidden states, output and biases (and of 16-bit weights). Part of the ABI.
enum moek_dtype { MOEK_DTYPE_BF16 = 0, MOEK_DTYPE_FP16 = 1 };

enum moek_index_dtype { MOEK_INDEX_INT32 = 0, MOEK_INDEX_INT64 = 1 };

// Everything that sizes the workspace and selects kernels. A mode is the pair
// (act_format, weight_format): routing and the activation kernel depend on act_format only.
typedef struct {
  int64_t num_tokens;     // T
  int64_t hidden_size;    // H
  int64_t inter_size;     // I (GEMM1 has N = 2I for gated activations, I otherwise)
  int64_t num_experts;    // E_local: experts held by this rank
  int64_t top_k;          // k
  int64_t expert_offset;  // global id of local expert 0
  int32_t dtype;          // moek_dtype
  int32_t act_format;     // moek_act_format: how the GEMMs' inputs are fed
  int32_t weight_format;  // moek_weight_format
  int32_t activation;     // moek_activation
  int32_t index_dtype;    // moek_index_dtype of topk_ids
  float act_alpha;        // swiglu_oai only
  float act_limit;        // swiglu_oai only
  int32_t w13_scale_per_channel;  // E4M3 weights: w13_scale is [E, N1] (1) or [E] (0)
  int32_t w2_scale_per_channel;   // E4M3 weights: w2_scale is [E, H] (1) or [E] (0)
                                  // (E4M3_BLOCK128: [E, N1/128, H/128] and [E, H/128, I/128])
  int32_t weight_group;   // 4-bit weights (INT4, MXFP4): 16-bit scales per this many along K ([E, K/g, N]); else 0
  int32_t weight_zero;    // INT4: w13_zero/w2_zero hold additive zero terms (dequantized = q * scale + zero)
  int32_t router_weight_on_input;  // the inputs were multiplied by the router weights: outputs sum unweighted
  float routed_scaling_factor;     // the output is multiplied by it (1: none)
  int64_t expert_map_size;         // > 0: expert_map maps this many global ids to local experts (then expert_offset is 0)
} moek_shape;

// One fused forward. All pointers are device pointers on `device`; biases may be NULL.
typedef struct {
  moek_shape shape;
  const void* hidden;          // [T, H]
  const void* topk_ids;        // [T, k]
  const float* topk_weights;   // [T, k]
  const void* w13;             // [E, N1, H]
  const void* w2;              // [E, H, I]
  const void* w13_bias;        // [E, N1] or NULL
  const void* w2_bias;         // [E, H] or NULL
  const void* w13_scale;       // weight scales as the weight format says (float32 for E4M3:
  const void* w2_scale;        //   dequantized weight = q * scale), or NULL for unscaled formats
  const float* a13_scale;      // FP8_ROW: static per-tensor input scale, or NULL for per-token
  const float* a2_scale;       //   (other activation formats: must be NULL)
  const void* w13_zero;        // INT4 with weight_zero: 16-bit zero terms laid out as the scales, else NULL
  const void* w2_zero;
  const int32_t* expert_map;   // [expert_map_size]: global id -> local expert or -1, or NULL
  void* out;                   // [T, H]
  void* workspace;
  size_t workspace_bytes;
  const char* forward;         // a FORWARD kernel from the registry (the whole forward), or NULL
  const char* gemm1;           // else GROUPED/DECODE/CONTIGUOUS kernels from the registry
  const char* gemm2;
  int32_t device;
  void* stream;                // cudaStream_t
  int32_t last_step;           // 0: the whole forward. For timing the steps separately:
                               // stop after 1 routing, 2 GEMM1, 3 activation, 4 GEMM2.
} moek_args;

// One registry entry, as generated from cmake/catalog.py. It serves the problems whose
// (act_format, weight_format, dtype) are its (act_format, weight_format, out_dtype).
typedef struct {
  const char* name;
  const char* mode;            // the mode it serves (a modes.MODES key)
  int32_t act_format;          // moek_act_format
  int32_t weight_format;       // moek_weight_format
  int32_t out_dtype;           // moek_dtype
  int32_t kind;                // moek_kernel_kind
  const char* schedule;        // catalog schedule
  const char* mainloop;        // "", "fastaccum" or "blockwise"
  int32_t swap_ab;             // the weights are the MMA's A operand
  int32_t tile_m, tile_n, tile_k;
  int32_t cluster_m, cluster_n;
  int32_t smem_bytes;
} moek_kernel_info;

// Status codes: 0 is success; the message buffer says what went wrong.
enum moek_status { MOEK_OK = 0, MOEK_INVALID_ARGUMENT = 1, MOEK_UNSUPPORTED = 2, MOEK_CUDA_ERROR = 3 };

MOEK_EXPORT int moek_abi_version(void);
MOEK_EXPORT const char* moek_arch(void);                 // e.g. "sm90a"
MOEK_EXPORT int moek_supports_cc(int major, int minor);  // 1 if this library runs on that cc
MOEK_EXPORT int moek_cuda_version(void);                 // CUDART_VERSION it was built with
MOEK_EXPORT int moek_num_kernels(void);
MOEK_EXPORT const moek_kernel_info* moek_kernel(int index);
// Why kernel `name` cannot run on `device` (arch, shared memory), or MOEK_OK. With `shape`
// (else NULL) also why it cannot serve that problem (its formats; a FORWARD kernel's limits).
MOEK_EXPORT int moek_check_kernel(const char* name, const moek_shape* shape, int32_t device,
                                  char* err, size_t errlen);
MOEK_EXPORT int moek_workspace_size(const moek_shape* shape, int32_t device, size_t* bytes,
                                    char* err, size_t errlen);
MOEK_EXPORT int moek_run(const moek_args* args, char* err, size_t errlen);
// Reads `bytes` (a multiple of 16, 16-byte aligned) at `data` on `stream` and XORs its 16-byte
// words into checksum[0..1] (device memory, the caller zeroes it): the benchmark's read-only
// streaming ceiling (src/probe.cu). method 0: vector loads (the only one).
MOEK_EXPORT int moek_read_probe(const void* data, size_t bytes, int32_t method,
                                unsigned long long* checksum, int32_t device, void* stream,
                                char* err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif  // MOE_KERNELS_C_API_H_
