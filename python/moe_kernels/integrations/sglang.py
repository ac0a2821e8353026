"""SGLang's Triton `fused_experts` (python/sglang/srt/layers/moe/fused_moe_triton/fused_moe.py),
run by this package's kernels: the same arguments, a StandardTopKOutput and a MoeRunnerConfig.

    from moe_kernels.integrations.sglang import MoeRunnerConfig, fused_experts
    out = fused_experts(hidden_states, w13_weight, w2_weight, topk_output,
                        MoeRunnerConfig(inplace=False, routed_scaling_factor=2.5))

topk_output: SGLang's StandardTopKOutput, or any (topk_weights, topk_ids, ...) tuple, or an
object with those attributes; ids are local expert ids (-1 and ids outside [0, E)
contribute nothing, as SGLang's expert-parallel dispatch leaves them).
moe_runner_config: SGLang's MoeRunnerConfig or the stand-in below (same fields); read:
- activation / is_gated: ("silu", gated) SwiGLU, ("gelu", gated) GeGLU (erf), and the
  non-gated "silu", "gelu", "relu2". With gemm1_alpha, gated "silu" is gpt-oss's clamped
  SwiGLU (swigluoai) with that alpha and limit gemm1_clamp_limit (None: no clamp), on
  gate/up rows interleaved unless gate_up_interleaved=False (de-interleaved once and
  cached, see moe_kernels.integrations._common).
- routed_scaling_factor multiplies the summed output (DeepSeek); apply_router_weight_on_input
  (top_k == 1) scales the input instead of the output.
- inplace writes the result into hidden_states (computed apart, then copied) and returns it.
- no_combine returns the per-slot outputs [T, k, H], each weighted by its router weight and
  not summed (routed_scaling_factor is not applied, as SGLang's): one core forward per slot,
  a slow path for debugging and for callers that combine themselves.
Quantization keywords as vLLM's (moe_kernels.integrations.vllm): use_fp8_w8a8 (per tensor,
per channel with per_channel_quant, or block_shape=[128, 128]) and use_int4_w4a16 (with
optional w1_zp/w2_zp; SGLang's uint8 [E, N, K/2], repacked once into the kernels' prepared
layout and cached); FP8 dynamic activations are quantized per token.
Refused, naming the field: INT8 modes, swiglu_limit (DeepSeek-V4's clamped SwiGLU),
gemm1_beta other than 1, other activations.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from ..problem import fail
from . import _common
from ._common import NO_LIMIT, check_routing, core_options, flag, optional_float

__all__ = ["MoeRunnerConfig", "StandardTopKOutput", "fused_experts"]


class StandardTopKOutput(NamedTuple):
    """SGLang's top-k result (sglang.srt.layers.moe.topk.StandardTopKOutput)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: Optional[torch.Tensor] = None


@dataclasses.dataclass
class MoeRunnerConfig:
    """SGLang's runner options (sglang.srt.layers.moe.moe_runner.MoeRunnerConfig), the fields
    fused_experts reads, with SGLang's defaults (inplace=True among them)."""

    num_experts: Optional[int] = None
    num_local_experts: Optional[int] = None
    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    routed_scaling_factor: Optional[float] = None
    gemm1_alpha: Optional[float] = None
    gemm1_clamp_limit: Optional[float] = None
    gate_up_interleaved: bool = True


_DEFAULTS = MoeRunnerConfig()
_GATED = {"silu": "swiglu", "gelu": "geglu"}
_NON_GATED = {"silu": "silu", "gelu": "gelu", "relu2": "relu2"}


def _field(config, name, default=None):
    return getattr(config, name, getattr(_DEFAULTS, name, default))


def _routing(topk_output):
    if hasattr(topk_output, "topk_weights") and hasattr(topk_output, "topk_ids"):
        return topk_output.topk_weights, topk_output.topk_ids
    if isinstance(topk_output, (tuple, list)) and len(topk_output) >= 2:
        return topk_output[0], topk_output[1]
    fail("topk_output", type(topk_output).__name__,
         "a StandardTopKOutput or a (topk_weights, topk_ids, ...) tuple", TypeError)


def activation_for(config):
    """The config's activation -> (core activation, gate/up rows interleaved, alpha, limit)."""
    name = _field(config, "activation")
    gated = flag("moe_runner_config.is_gated", _field(config, "is_gated"))
    alpha = optional_float("moe_runner_config.gemm1_alpha", _field(config, "gemm1_alpha"))
    limit = optional_float("moe_runner_config.gemm1_clamp_limit", _field(config, "gemm1_clamp_limit"))
    if _field(config, "swiglu_limit") is not None:
        fail("moe_runner_config.swiglu_limit", repr(_field(config, "swiglu_limit")),
             "None: DeepSeek-V4's clamped SwiGLU has no kernel", NotImplementedError)
    beta = optional_float("moe_runner_config.gemm1_beta", _field(config, "gemm1_beta"))
    if beta is not None and beta != 1.0:
        fail("moe_runner_config.gemm1_beta", beta, "None or 1.0 (gpt-oss's (up + 1))", NotImplementedError)
    table = _GATED if gated else _NON_GATED
    if name not in table:
        fail("moe_runner_config.activation", f"{name!r} with is_gated={gated}",
             f"one of {list(table)} (is_gated={gated})")
    if gated and name == "silu" and alpha is not None:
        interleaved = flag("moe_runner_config.gate_up_interleaved", _field(config, "gate_up_interleaved", True))
        return "swiglu_oai", interleaved, alpha, NO_LIMIT if limit is None else limit
    if alpha is not None or limit is not None:
        fail("moe_runner_config.gemm1_alpha/gemm1_clamp_limit", (alpha, limit),
             "None unless activation='silu' is gated with gemm1_alpha (gpt-oss's SwiGLU)")
    return table[name], False, None, None


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_output,
                  moe_runner_config, b1=None, b2=None, use_fp8_w8a8: bool = False,
                  use_int8_w8a8: bool = False, use_int8_w8a16: bool = False,
                  use_int4_w4a16: bool = False, per_channel_quant: bool = False, w1_scale=None,
                  w2_scale=None, w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None,
                  block_shape=None) -> torch.Tensor:
    """SGLang's fused_experts: [T, H] (or [T, k, H] with no_combine). See the module docstring."""
    if moe_runner_config is None:
        fail("moe_runner_config", "None", "a MoeRunnerConfig (moe_kernels.integrations.sglang has one)", TypeError)
    topk_weights, topk_ids = _routing(topk_output)
    check_routing(hidden_states, w1, w2, topk_weights, topk_ids,
                  ("hidden_states", "w1", "w2", "topk_output.topk_weights", "topk_output.topk_ids"))
    for name, v in (("use_int8_w8a8", use_int8_w8a8), ("use_int8_w8a16", use_int8_w8a16)):
        if flag(name, v):
            fail(name, True, f"False: INT8 has no kernels (modes: {_common.TRITON_SUPPORTED})", NotImplementedError)
    cfg = moe_runner_config
    inplace = flag("moe_runner_config.inplace", _field(cfg, "inplace"))
    no_combine = flag("moe_runner_config.no_combine", _field(cfg, "no_combine"))
    if inplace and no_combine:
        fail("moe_runner_config", "inplace=True with no_combine=True", "at most one (SGLang refuses both)")
    on_input = _field(cfg, "apply_router_weight_on_input")
    _common.check_router_weight_on_input("moe_runner_config.apply_router_weight_on_input", on_input, topk_ids,
                                         b1, "b1")
    scaling = optional_float("moe_runner_config.routed_scaling_factor", _field(cfg, "routed_scaling_factor"))
    act, interleaved, alpha, limit = activation_for(cfg)
    kw = _common.triton_weights(hidden_states, w1, w2, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
                                a2_scale=a2_scale, w1_zp=w1_zp, w2_zp=w2_zp, w1_bias=b1, w2_bias=b2,
                                block_shape=block_shape, use_fp8_w8a8=use_fp8_w8a8,
                                use_int4_w4a16=use_int4_w4a16, use_mxfp4_w4a16=False,
                                per_channel_quant=per_channel_quant, interleaved=interleaved, names=("b1", "b2"))
    if act == "swiglu_oai":
        kw["swiglu_alpha"], kw["swiglu_limit"] = alpha, limit
    w13, w2c = kw.pop("w13"), kw.pop("w2")
    if no_combine:
        kw.update(core_options(apply_router_weight_on_input=on_input))
        T, k = topk_ids.shape
        out = torch.empty((T, k, hidden_states.shape[1]), dtype=hidden_states.dtype, device=hidden_states.device)
        for slot in range(k):  # each slot alone: its weight and id, summed over nothing
            out[:, slot] = _common.core_fused_moe(hidden_states, w13, w2c, topk_weights[:, slot:slot + 1].contiguous(),
                                                  topk_ids[:, slot:slot + 1].contiguous(), activation=act, **kw)
        return out
    kw.update(core_options(apply_router_weight_on_input=on_input, routed_scaling_factor=scaling))
    out = _common.core_fused_moe(hidden_states, w13, w2c, topk_weights, topk_ids, activation=act, **kw)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out
