// The C ABI between the Python module `_C` and the per-arch kernel libraries
// (libmoe_kernels_sm90a.so, ...). Plain C types only: no libtorch, no C++ objects, so a
// library built once works with any PyTorch. Bump MOEK_ABI_VERSION on any change here.
#ifndef MOE_KERNELS_C_API_H_
#define MOE_KERNELS_C_API_H_

#include <stddef.h>
#include <stdint.h>

#define MOEK_ABI_VERSION 4

#if defined(__GNUC__)
#define MOEK_EXPORT __attribute__((visibility("default")))
#else
#define MOEK_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Element type of hidden states and output (and of 16-bit weights). Part of the ABI.
enum moek_dtype { MOEK_DTYPE_BF16 = 0, MOEK_DTYPE_FP16 = 1 };

// What the GEMMs compute in. NONE: 16-bit activations and weights (moek_dtype).
// FP8: E4M3 activations (quantized on the device: dynamic per token, or a static per-tensor
// scale) and E4M3 weights with per-tensor or per-output-channel float32 scales.
// FP8_BLOCK: E4M3 activations quantized on the device per token per 128 columns, E4M3
// weights with float32 scales per 128x128 block ([E, N/128, K/128], DeepSeek-V3 layout).
enum moek_quant { MOEK_QUANT_NONE = 0, MOEK_QUANT_FP8 = 1, MOEK_QUANT_FP8_BLOCK = 2 };

// Activation between the two GEMMs. Gated ones read [gate | up] halves of GEMM1's output.
enum moek_activation {
  MOEK_ACT_SWIGLU = 0,      // silu(gate) * up
  MOEK_ACT_GEGLU = 1,       // gelu(gate) * up  (erf gelu)
  MOEK_ACT_SWIGLU_OAI = 2,  // gpt-oss: g=min(gate,limit); u=clamp(up,-limit,limit); g*sigmoid(alpha*g)*(u+1)
  MOEK_ACT_SILU = 3,
  MOEK_ACT_GELU = 4,
  MOEK_ACT_RELU2 = 5,       // relu(x)^2
  MOEK_ACT_IDENTITY = 6,
};

enum moek_index_dtype { MOEK_INDEX_INT32 = 0, MOEK_INDEX_INT64 = 1 };

// Everything that sizes the workspace and selects kernels.
typedef struct {
  int64_t num_tokens;     // T
  int64_t hidden_size;    // H
  int64_t inter_size;     // I (GEMM1 has N = 2I for gated activations, I otherwise)
  int64_t num_experts;    // E_local: experts held by this rank
  int64_t top_k;          // k
  int64_t expert_offset;  // global id of local expert 0
  int32_t dtype;          // moek_dtype
  int32_t activation;     // moek_activation
  int32_t index_dtype;    // moek_index_dtype of topk_ids
  float act_alpha;        // swiglu_oai only
  float act_limit;        // swiglu_oai only
  int32_t quant;          // moek_quant
  int32_t w13_scale_per_channel;  // FP8: w13_scale is [E, N1] (1) or [E] (0)
  int32_t w2_scale_per_channel;   // FP8: w2_scale is [E, H] (1) or [E] (0)
                                  // (FP8_BLOCK: [E, N1/128, H/128] and [E, H/128, I/128])
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
  const float* w13_scale;      // FP8: dequantized weight = q * scale
  const float* w2_scale;
  const float* a13_scale;      // FP8: static per-tensor input scale, or NULL for per-token
                               // (FP8_BLOCK: must be NULL; always per token per 128)
  const float* a2_scale;
  void* out;                   // [T, H]
  void* workspace;
  size_t workspace_bytes;
  const char* gemm1;           // kernel names from the registry, or both MOEK_ONE_TOKEN
  const char* gemm2;
  int32_t device;
  void* stream;                // cudaStream_t
  int32_t last_step;           // 0: the whole forward. For timing the steps separately:
                               // stop after 1 routing, 2 GEMM1, 3 activation, 4 GEMM2.
} moek_args;

// The tactic that runs the whole forward of one token as one kernel (fp8, gated activations,
// when the experts' weights fit across the SMs: moek_one_token_check), as gemm1 and gemm2.
#define MOEK_ONE_TOKEN "one_token"
// One registry entry, as generated from cmake/catalog.py.
typedef struct {
  const char* name;
  const char* quant;           // the mode it serves: "bf16", "fp16", "fp8", "fp8_block"
  const char* act_dtype;
  const char* weight_dtype;
  const char* out_dtype;
  int32_t tile_m, tile_n, tile_k;
  int32_t cluster_m, cluster_n;
  const char* schedule;
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
// Why `name` cannot run on `device` (shared memory, cluster size), or MOEK_OK.
MOEK_EXPORT int moek_check_kernel(const char* name, int32_t device, char* err, size_t errlen);
MOEK_EXPORT int moek_workspace_size(const moek_shape* shape, int32_t device, size_t* bytes,
                                    char* err, size_t errlen);
MOEK_EXPORT int moek_run(const moek_args* args, char* err, size_t errlen);
// MOEK_OK if `shape` can take the MOEK_ONE_TOKEN tactic on `device`, else MOEK_UNSUPPORTED and why.
MOEK_EXPORT int moek_one_token_check(const moek_shape* shape, int32_t device, char* err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif  // MOE_KERNELS_C_API_H_
