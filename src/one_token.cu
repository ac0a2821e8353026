// The one-token forward (one_token.cuh; docs/kernels/one-token.md): when a problem fits it, and
// its launch.
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include <type_traits>

#include "dispatch.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "one_token.cuh"

namespace moe_kernels {

namespace {

int why_not(char* why, size_t n, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return 1;
}

template <typename T, int kAct, bool kStream>
const void* kernel_of(bool block) {
  return block ? reinterpret_cast<const void*>(one_token::forward_kernel<T, kAct, true, kStream>)
               : reinterpret_cast<const void*>(one_token::forward_kernel<T, kAct, false, kStream>);
}

// The kernel's static shared memory (the epilogues' scales and terms, barriers), the most of its
// instantiations', as built: dynamic plus static must fit the device's opt-in limit.
size_t static_smem() {
  static const size_t bytes = [] {
    size_t most = 0;
    auto take = [&most](const void* kernel) {
      cudaFuncAttributes fa{};
      if (cudaFuncGetAttributes(&fa, kernel) == cudaSuccess)
        most = fa.sharedSizeBytes > most ? fa.sharedSizeBytes : most;
      else
        cudaGetLastError();  // no image for this device: its launch reports that
    };
    auto take_form = [&](auto stream) {  // the share form or the streamed one
      constexpr bool kStream = decltype(stream)::value;
      for (bool block : {false, true}) {
        take(kernel_of<__half, MOEK_ACT_SWIGLU, kStream>(block));
        take(kernel_of<__half, MOEK_ACT_GEGLU, kStream>(block));
        take(kernel_of<__half, MOEK_ACT_SWIGLU_OAI, kStream>(block));
        take(kernel_of<__half, MOEK_ACT_GEGLU_TANH, kStream>(block));
        take(kernel_of<__nv_bfloat16, MOEK_ACT_SWIGLU, kStream>(block));
        take(kernel_of<__nv_bfloat16, MOEK_ACT_GEGLU, kStream>(block));
        take(kernel_of<__nv_bfloat16, MOEK_ACT_SWIGLU_OAI, kStream>(block));
        take(kernel_of<__nv_bfloat16, MOEK_ACT_GEGLU_TANH, kStream>(block));
      }
    };
    take_form(std::false_type{});
    take_form(std::true_type{});
    return most;
  }();
  return bytes;
}

// Dynamic shared memory a launch may take: the device's opt-in limit less the static part.
size_t dynamic_smem(int smem_optin) {
  return size_t(smem_optin) > static_smem() ? size_t(smem_optin) - static_smem() : 0;
}

}  // namespace

int one_token_problem(const moek_shape& s, int sm_count, int smem_optin, char* why, size_t n) {
  using namespace one_token;
  const long long H = s.hidden_size, I = s.inter_size, k = s.top_k;
  if (s.num_tokens != 1) return why_not(why, n, "one_token runs 1 token, not %lld", (long long)s.num_tokens);
  const bool block = s.act_format == MOEK_ACT_FORMAT_FP8_ROW128 && s.weight_format == MOEK_WEIGHT_FORMAT_E4M3_BLOCK128;
  if (!block && !(s.act_format == MOEK_ACT_FORMAT_FP8_ROW && s.weight_format == MOEK_WEIGHT_FORMAT_E4M3))
    return why_not(why, n, "one_token is for quant fp8 and fp8_block only");
  if (!is_gated(s.activation)) return why_not(why, n, "one_token needs a gated activation (swiglu, geglu, swiglu_oai, geglu_tanh)");
  if (k > kMaxSlots) return why_not(why, n, "one_token takes top_k <= %d, not %lld", kMaxSlots, k);
  if (H % 64 || I % 64)
    return why_not(why, n, "one_token needs hidden_size (%lld) and intermediate_size (%lld) multiples of 64", H, I);
  // fp8_block: a w13 tile's row of block scales comes by bulk copy (16-byte multiples).
  if (block && H % 512)
    return why_not(why, n, "one_token with fp8_block needs hidden_size (%lld) a multiple of 512", H);
  if (block && H / 128 > kMaxKBlocks1)
    return why_not(why, n, "one_token with fp8_block takes hidden_size <= %d, not %lld", 128 * kMaxKBlocks1, H);
  if (block && I / 128 > kMaxKBlocks2)
    return why_not(why, n, "one_token with fp8_block takes intermediate_size <= %d, not %lld", 128 * kMaxKBlocks2, I);
  const long long units1 = (k * I / kCols + sm_count - 1) / sm_count, units2 = (H / kCols + sm_count - 1) / sm_count;
  if (units1 > max_units1(true))
    return why_not(why, n, "one_token: top_k x intermediate_size = %lld is more than %d SMs hold", k * I, sm_count);
  if (units2 > max_units2(true))
    return why_not(why, n, "one_token: hidden_size %lld is more than %d SMs hold", H, sm_count);
  if (!plan(int(H), int(I), int(k), int(units1), int(units2), block, dynamic_smem(smem_optin)).ring)
    return why_not(why, n, "one_token: hidden_size %lld with intermediate_size %lld fits neither the w2 share in "
                   "%d bytes of shared memory nor streaming (intermediate_size <= hidden_size / 2)", H, I, smem_optin);
  return 0;
}

namespace {

template <typename T, int kAct, bool kBlock, bool kStream>
cudaError_t launch_typed(const one_token::Params& p, int device, int sm_count, size_t smem, cudaStream_t stream) {
  auto kernel = one_token::forward_kernel<T, kAct, kBlock, kStream>;
  if (cudaError_t e = allow_smem(reinterpret_cast<const void*>(kernel), device, smem)) return e;
  // Cooperative: every CTA resident, for the grid barrier between the GEMMs.
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(sm_count);
  cfg.blockDim = dim3(one_token::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = pdl_enabled() ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace

cudaError_t launch_one_token(const moek_args& a, float* y, int sm_count, int smem_optin, cudaStream_t stream) {
  const moek_shape& s = a.shape;
  one_token::Params p{};
  p.hidden = a.hidden;
  p.topk_ids = a.topk_ids;
  p.topk_weights = a.topk_weights;
  p.w13 = static_cast<const uint8_t*>(a.w13);
  p.w2 = static_cast<const uint8_t*>(a.w2);
  p.w13_bias = a.w13_bias;
  p.w2_bias = a.w2_bias;
  p.w13_scale = static_cast<const float*>(a.w13_scale);
  p.w2_scale = static_cast<const float*>(a.w2_scale);
  p.a13_scale = a.a13_scale;
  p.a2_scale = a.a2_scale;
  p.out = a.out;
  p.y = y;
  p.experts = ExpertIndex{s.expert_offset, a.expert_map, s.expert_map_size};
  p.weight_scale = s.routed_scaling_factor;
  p.unit_weights = s.router_weight_on_input;
  p.hidden_size = int(s.hidden_size);
  p.inter = int(s.inter_size);
  p.top_k = int(s.top_k);
  p.num_experts = int(s.num_experts);
  p.ids64 = s.index_dtype == MOEK_INDEX_INT64;
  p.w13_per_channel = s.w13_scale_per_channel;
  p.w2_per_channel = s.w2_scale_per_channel;
  p.alpha = s.act_alpha;
  p.limit = s.act_limit;
  p.units1 = int((s.top_k * s.inter_size / one_token::kCols + sm_count - 1) / sm_count);
  p.units2 = int((s.hidden_size / one_token::kCols + sm_count - 1) / sm_count);
  const bool block = s.act_format == MOEK_ACT_FORMAT_FP8_ROW128;
  // A probe's setting: the streamed form's ring entries (fewer where shared memory is short).
  static const int stream_ring = [] {
    const char* v = getenv("MOE_KERNELS_ONE_TOKEN_RING");
    return v ? atoi(v) : 0;
  }();
  const one_token::Plan pl = one_token::plan(p.hidden_size, p.inter, p.top_k, p.units1, p.units2, block,
                                             dynamic_smem(smem_optin), stream_ring);
  p.ring = pl.ring;
  p.w2_after = 1 << 30;  // with the last w13 tile (earlier requests were slower: docs/kernels/one-token.md)
  const size_t smem = one_token::smem_bytes(p.hidden_size, p.inter, p.units2, pl, block);
  const bool fp16 = s.dtype == MOEK_DTYPE_FP16;
  cudaError_t err = cudaErrorInvalidValue;  // one_token_problem admits gated activations only
  with_gated_activation(s.activation, [&](auto act) {
    constexpr int A = decltype(act)::value;
    auto typed = [&](auto t, auto blockwise, auto streamed) {
      err = launch_typed<decltype(t), A, decltype(blockwise)::value, decltype(streamed)::value>(
          p, a.device, sm_count, smem, stream);
    };
    auto by_form = [&](auto t, auto blockwise) {
      pl.stream ? typed(t, blockwise, std::true_type{}) : typed(t, blockwise, std::false_type{});
    };
    auto by_block = [&](auto t) { block ? by_form(t, std::true_type{}) : by_form(t, std::false_type{}); };
    fp16 ? by_block(__half{}) : by_block(__nv_bfloat16{});
  });
  return err;
}

}  // namespace moe_kernels
