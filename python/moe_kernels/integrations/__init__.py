"""Entry points shaped like the serving stacks' own, run by this package's kernels.

- moe_kernels.integrations.vllm.fused_experts: vLLM's fused_experts (activation names,
  expert_map, FP8 / INT4 / MXFP4 keyword flags or a FusedMoEQuantConfig).
- moe_kernels.integrations.sglang.fused_experts: SGLang's Triton fused_experts (a
  StandardTopKOutput and a MoeRunnerConfig: routed_scaling_factor, gemm1_alpha,
  gemm1_clamp_limit, no_combine, inplace).
- moe_kernels.integrations.flashinfer.cutlass_fused_moe: FlashInfer's cutlass_fused_moe
  (w31 weights, quant_scales lists).
- moe_kernels.integrations.transformers: a Hugging Face transformers experts backend,
  experts_implementation="moe_kernels" (imported on its own: it imports transformers, which
  this package otherwise never does; it keeps each experts module's layout on the module).

Layouts that differ from the core's (interleaved or swapped gate/up rows, INT4 nibbles and
scales) are converted once per source tensor and cached; clear_cache(), set_cache_size()
and cache_info() manage that memory (moe_kernels.integrations._common says how).
"""
from ._common import cache_info, clear_cache, set_cache_size

__all__ = ["cache_info", "clear_cache", "set_cache_size"]
