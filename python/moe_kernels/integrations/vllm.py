"""vLLM's `fused_experts` (vllm/model_executor/layers/fused_moe/fused_moe.py), run by this
package's kernels: the same arguments, layouts and activation names.

    from moe_kernels.integrations.vllm import fused_experts
    out = fused_experts(hidden_states, w13_weight, w2_weight, topk_weights, topk_ids,
                        activation="silu", expert_map=expert_map)

Mapped:
- activation: vLLM's gated "silu" is SwiGLU (silu(gate) * up), "gelu" GeGLU (erf),
  "gelu_tanh" GeGLU with the tanh GELU, "swigluoai" gpt-oss's clamped SwiGLU on
  row-interleaved gate/up weights (even rows gate, odd rows up; w1, its bias and
  per-channel scales de-interleaved once and cached, see moe_kernels.integrations._common),
  with alpha 1.702 and limit 7.0 as vLLM's SwigluOAIAndMul (or quant_config's gemm1_alpha /
  gemm1_clamp_limit); "silu_no_mul", "gelu_no_mul", "relu2_no_mul" the non-gated ones.
  vLLM's MoEActivation members are taken too.
- expert_map (int32 [global_num_experts], global id -> local index or -1) goes to the core's
  expert_map; without one every expert is local (ids outside [0, E) contribute nothing).
- quantization, by the legacy keyword flags or a FusedMoEQuantConfig (`quant_config=`):
  use_fp8_w8a8 per tensor (w1_scale [E]) or per channel ([E, N] / [E, N, 1]), with static
  per-tensor a1_scale/a2_scale or dynamic activations, or block_shape=[128, 128] (fp8_block);
  use_int4_w4a16 (uint8 [E, N, K/2] unsigned nibbles with the implicit zero point 8, scales
  [E, N, K/g], optional packed zero points w1_zp/w2_zp [E, N/2, K/g]: re-packed, transposed
  and cached); use_mxfp4_w4a16 (uint8 [E, N, K/2] E2M1 with E8M0 scales [E, N, K/32]). The
  4-bit weights are taken in vLLM's layout and repacked once into the prepared layout the
  kernels read (moe_kernels.quant4), cached as the other conversions are.
  FP8 weights imply use_fp8_w8a8.
- inplace=True writes the result into hidden_states (computed apart, then copied: the core's
  out must not alias its input) and returns it.

Differences: dynamic FP8 activations are quantized per token, where vLLM's Triton kernels
(per_channel_quant=False, no a1_scale) take one scale per tensor: each token's scale is at
most the tensor's, so the results differ by rounding only. Refused, naming the argument:
INT8 modes, FP8 block sizes other than 128x128, "swigluoai" with 128x128 blocks (the
interleaved rows cross scale blocks), gated "relu2", "gelu_tanh_no_mul", "swiglustep".
"""
from __future__ import annotations

import torch

from ..problem import fail
from . import _common
from ._common import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_routing, core_options, flag, tensor_arg

__all__ = ["fused_experts", "ACTIVATIONS"]

# vLLM's activation name -> (the core's activation, gate/up rows interleaved)
ACTIVATIONS = {
    "silu": ("swiglu", False),
    "gelu": ("geglu", False),
    "gelu_tanh": ("geglu_tanh", False),
    "swigluoai": ("swiglu_oai", True),
    "silu_no_mul": ("silu", False),
    "gelu_no_mul": ("gelu", False),
    "relu2_no_mul": ("relu2", False),
}
_REFUSED = {"relu2": "gated relu2 (relu(gate)^2 * up) has no kernel; 'relu2_no_mul' is the non-gated one",
            "swiglustep": "SwiGLU-step (Step-3's clamped silu) has no kernel",
            "gelu_tanh_no_mul": "non-gated tanh GELU has no kernel ('gelu_no_mul' is the erf one)"}
_UNSUPPORTED_CONFIG = ("use_int8_w8a8", "use_int8_w8a16", "use_fp8_w8a16", "use_nvfp4_w4a16", "use_nvfp4_w4a4",
                       "use_mxfp4_w4a4", "use_mxfp4_w4a8")


def activation_for(activation):
    """vLLM's activation (a name or a MoEActivation member) -> (core activation, interleaved)."""
    name = getattr(activation, "value", activation)
    if not isinstance(name, str):
        fail("activation", repr(activation), f"one of {list(ACTIVATIONS)} (vLLM's names)", TypeError)
    if name in _REFUSED:
        fail("activation", repr(name), f"one of {list(ACTIVATIONS)}: {_REFUSED[name]}", NotImplementedError)
    if name not in ACTIVATIONS:
        fail("activation", repr(name), f"one of {list(ACTIVATIONS)} (vLLM's names)")
    return ACTIVATIONS[name]


def _config_value(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # a config property that asserts on a field it does not hold
        return None


def _merge_config(config, explicit: dict) -> dict:
    """A FusedMoEQuantConfig's fields as the legacy keyword arguments; a field given both
    ways is refused."""
    for name in _UNSUPPORTED_CONFIG:
        if _config_value(config, name):
            fail("quant_config", f"{name}=True", f"one of: {_common.TRITON_SUPPORTED}", NotImplementedError)
    merged = dict(explicit)
    fields = {"w1_scale": "w1_scale", "w2_scale": "w2_scale", "a1_scale": "a1_scale", "a2_scale": "a2_scale",
              "w1_zp": "w1_zp", "w2_zp": "w2_zp", "w1_bias": "w1_bias", "w2_bias": "w2_bias",
              "block_shape": "block_shape", "per_channel_quant": "per_act_token_quant",
              "use_fp8_w8a8": "use_fp8_w8a8", "use_int4_w4a16": "use_int4_w4a16",
              "use_mxfp4_w4a16": "use_mxfp4_w4a16", "gemm1_alpha": "gemm1_alpha",
              "gemm1_clamp_limit": "gemm1_clamp_limit"}
    for arg, attr in fields.items():
        value = _config_value(config, attr)
        if value is None or value is False:
            continue
        if not (merged.get(arg) is None or merged.get(arg) is False):
            fail(arg, "a value here and in quant_config", "one of them")
        merged[arg] = bool(value) if isinstance(value, bool) else value
    return merged


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, inplace: bool = False,
                  activation="silu", apply_router_weight_on_input: bool = False,
                  global_num_experts: int = -1, expert_map: torch.Tensor | None = None,
                  w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, block_shape=None,
                  w1_bias=None, w2_bias=None, *, quant_config=None, use_fp8_w8a8: bool = False,
                  use_int8_w8a8: bool = False, use_int8_w8a16: bool = False,
                  use_int4_w4a16: bool = False, use_mxfp4_w4a16: bool = False,
                  per_channel_quant: bool = False, w1_zp=None, w2_zp=None) -> torch.Tensor:
    """vLLM's fused_experts: out[t] = sum_slot topk_weights[t, slot] * expert(topk_ids[t, slot])(x[t]).

    hidden_states [T, H] bf16/fp16; w1 [E, 2I, H] (gate rows then up rows, or alternating for
    "swigluoai"; [E, I, H] for the *_no_mul activations), w2 [E, H, I]; topk_weights float32
    and topk_ids int32/int64 [T, k]. See the module docstring for what maps and what is refused.
    """
    check_routing(hidden_states, w1, w2, topk_weights, topk_ids,
                  ("hidden_states", "w1", "w2", "topk_weights", "topk_ids"))
    flag("inplace", inplace)
    for name, v in (("use_int8_w8a8", use_int8_w8a8), ("use_int8_w8a16", use_int8_w8a16)):
        if flag(name, v):
            fail(name, True, f"False: INT8 has no kernels (modes: {_common.TRITON_SUPPORTED})", NotImplementedError)
    q = {"w1_scale": w1_scale, "w2_scale": w2_scale, "a1_scale": a1_scale, "a2_scale": a2_scale,
         "w1_zp": w1_zp, "w2_zp": w2_zp, "w1_bias": w1_bias, "w2_bias": w2_bias, "block_shape": block_shape,
         "per_channel_quant": per_channel_quant, "use_fp8_w8a8": use_fp8_w8a8,
         "use_int4_w4a16": use_int4_w4a16, "use_mxfp4_w4a16": use_mxfp4_w4a16,
         "gemm1_alpha": None, "gemm1_clamp_limit": None}
    if quant_config is not None:
        q = _merge_config(quant_config, q)
    act, interleaved = activation_for(activation)
    alpha, limit = q.pop("gemm1_alpha"), q.pop("gemm1_clamp_limit")
    if act != "swiglu_oai" and (alpha is not None or limit is not None):
        fail("quant_config", "gemm1_alpha/gemm1_clamp_limit", f"None for activation={activation!r} "
             "(they are swigluoai's alpha and limit)")
    _common.check_router_weight_on_input("apply_router_weight_on_input", apply_router_weight_on_input, topk_ids,
                                         q["w1_bias"])
    E = w1.shape[0]
    if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int) or \
            (global_num_experts != -1 and global_num_experts < E):
        fail("global_num_experts", repr(global_num_experts), f"-1 or an int >= the {E} local experts of w1")
    if expert_map is not None:
        tensor_arg("expert_map", expert_map, 1, torch.int32)
        if global_num_experts != -1 and expert_map.shape[0] != global_num_experts:
            fail("expert_map", f"shape {tuple(expert_map.shape)}", f"({global_num_experts},): one entry per "
                 "global expert (global_num_experts)")
    kw = _common.triton_weights(hidden_states, w1, w2, interleaved=interleaved, **q)
    if act == "swiglu_oai":
        kw["swiglu_alpha"] = GPT_OSS_ALPHA if alpha is None else float(alpha)
        kw["swiglu_limit"] = GPT_OSS_LIMIT if limit is None else float(limit)
    kw.update(core_options(apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map))
    w13, w2c = kw.pop("w13"), kw.pop("w2")
    out = _common.core_fused_moe(hidden_states, w13, w2c, topk_weights, topk_ids, activation=act, **kw)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out
