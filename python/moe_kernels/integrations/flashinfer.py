"""FlashInfer's `cutlass_fused_moe` (flashinfer/fused_moe/core.py), run by this package's
kernels, so a FlashInfer user switches with one import:

    from moe_kernels.integrations.flashinfer import cutlass_fused_moe
    out = cutlass_fused_moe(x, token_selected_experts, token_final_scales, w31, w2,
                            torch.bfloat16, quant_scales=None)[0]

Like FlashInfer's it returns a list whose first element is the output [T, H] (written into
`output=` when given); FlashInfer's other list entries (min-latency mode's) are not returned.

Layouts: fc1_expert_weights is TensorRT-LLM's w31, [E, 2I, H] with the up rows first, then
the gate rows ([E, I, H] for non-gated activations); it is swapped once into the core's
[gate; up] and cached (fc1_expert_biases and fc1's scales alike; see
moe_kernels.integrations._common). token_selected_experts are global ids; with ep_size > 1
this rank holds experts [ep_rank * E, (ep_rank + 1) * E). tp_size/tp_rank: the weights are
this rank's slices and the output its partial sum; fc2_expert_biases is added on tp_rank 0
only, as FlashInfer does.

Modes, by the weights' dtype and quant_scales:
- 16-bit: input and weights bf16 (or fp16), quant_scales None or [].
- FP8 per tensor: float8_e4m3fn weights, quant_scales = [fc1_dequant [E] (weight scale x
  input scale), fc2_quant (scalar: 1 / GEMM2's input scale), fc2_dequant [E] (weight scale x
  GEMM2's input scale), fc1_input_dequant (scalar: the input's scale)], converted to the
  core's static-scale fp8 mode. The input may be FP8 already (FlashInfer's convention; it is
  dequantized with fc1_input_dequant and re-quantized by the kernels, exactly) or bf16/fp16.
- FP8 128x128 blocks (use_deepseek_fp8_block_scale=True): bf16/fp16 input, quant_scales =
  [fc1 [E, 2I/128, H/128] (w31 order), fc2 [E, H/128, I/128]].
- MXFP4 weights with 16-bit activations (use_w4_group_scaling=True, uint8 weights):
  quant_scales = [fc1, fc2] as moe_kernels.prepare.interleave_moe_scales_for_sm90_mixed_gemm
  returns them with quant_type "fp4" (16-bit [E, K/32, N], times 2^126 for bf16 or 2^14 for
  fp16, or that viewed as int32, as FlashInfer's callers pass it), or the checkpoint's E8M0
  uint8 [E, N, K/32]. The weights must be as
  moe_kernels.prepare.interleave_moe_weights_for_sm90_mixed_gemm returns them for "fp4": the
  prepared (placed) layout uint8 [E, ceil(K/128), N/16, 1024] (w31's halves swapped as whole 16-row blocks, once
  and cached), made from the checkpoint's weights once at load time. 3-D uint8 weights (the
  checkpoint packing, or FlashInfer's own interleaved bytes: they cannot be told apart) are
  refused, naming that helper.
Activations (activation_type, FlashInfer's ActivationType or its int): Swiglu, Geglu (erf),
GegluTanh, Silu, Gelu (erf), Relu, Relu2, Identity; Swiglu (or SwigluBias) with
swiglu_alpha/swiglu_beta/swiglu_limit (per-expert float32 [E], all experts alike, or floats)
is gpt-oss's clamped SwiGLU when beta is 1.
Refused, naming the argument: NVFP4, MXFP8, INT4 and W4A8 scales, per-expert GEMM2 FP8
input scales, per-expert swiglu values that differ, SwigluStep, Situ, input_sf,
min_latency_mode, enable_alltoall, use_packed_weights, use_wfp4afp8_humming, clusters.
Accepted and not used: tune_max_num_tokens, enable_pdl, use_fused_finalize, profile_ids
(FlashInfer's tuning and launch options), workspace_buffer (the core allocates its own).
"""
from __future__ import annotations

import enum

import torch

from ..problem import fail
from . import _common
from ._common import CACHE, FP8, NO_LIMIT, cached, check_routing, flag, swap_halves, tensor_arg

__all__ = ["ActivationType", "cutlass_fused_moe", "w31_to_w13"]


class ActivationType(enum.IntEnum):
    """FlashInfer's ActivationType (flashinfer.tllm_enums), the same values."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


_ACTIVATIONS = {ActivationType.Gelu: "gelu", ActivationType.Relu: "relu", ActivationType.Silu: "silu",
                ActivationType.Swiglu: "swiglu", ActivationType.Geglu: "geglu",
                ActivationType.SwigluBias: "swiglu", ActivationType.Relu2: "relu2",
                ActivationType.GegluTanh: "geglu_tanh", ActivationType.Identity: "identity"}
_GATED = ("swiglu", "geglu", "geglu_tanh")
_HIDDEN = (torch.bfloat16, torch.float16)


def w31_to_w13(w31: torch.Tensor) -> torch.Tensor:
    """FlashInfer's fc1 [E, 2I, ...] (up rows, then gate rows) as the core's w13 [gate; up]
    (for converting at load time and calling moe_kernels.fused_moe directly)."""
    return swap_halves(w31, 1)


def activation_for(activation_type):
    try:
        value = ActivationType[activation_type] if isinstance(activation_type, str) else ActivationType(
            int(activation_type))
    except (KeyError, ValueError, TypeError):
        fail("activation_type", repr(activation_type), f"a FlashInfer ActivationType, one of "
             f"{[a.name for a in _ACTIVATIONS]}")
    if value not in _ACTIVATIONS:
        fail("activation_type", value.name, f"one of {[a.name for a in _ACTIVATIONS]} (no kernel for "
             f"{value.name})", NotImplementedError)
    return value, _ACTIVATIONS[value]


def _uniform(name, value, E):
    """A per-expert swiglu value (float32 [E], or a float) as one float; experts must agree."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    t = tensor_arg(name, value, 1, torch.float32)
    if t.shape[0] != E:
        fail(name, f"shape {tuple(t.shape)}", f"({E},): one value per local expert")

    def read():  # one host read per tensor version, kept
        lo, hi = float(t.min()), float(t.max())
        if lo != hi:
            fail(name, f"values from {lo} to {hi}", "one value for every expert (the kernels take one)",
                 NotImplementedError)
        return lo
    return CACHE.get("uniform", (t,), read)


def _swiglu(swiglu_alpha, swiglu_beta, swiglu_limit, E):
    """FlashInfer's SwigluBias, gate_c * sigmoid(alpha * gate_c) * (up_c + beta) with gate and
    up clamped by limit, as the core's activation: beta 1 is gpt-oss's; beta 0 with no alpha
    or limit is plain SwiGLU."""
    alpha = _uniform("swiglu_alpha", swiglu_alpha, E)
    beta = _uniform("swiglu_beta", swiglu_beta, E)
    limit = _uniform("swiglu_limit", swiglu_limit, E)
    beta = 0.0 if beta is None else beta
    if beta == 1.0:
        return "swiglu_oai", {"swiglu_alpha": 1.0 if alpha is None else alpha,
                              "swiglu_limit": NO_LIMIT if limit is None else min(limit, NO_LIMIT)}
    if beta == 0.0 and alpha in (None, 1.0) and (limit is None or limit >= NO_LIMIT):
        return "swiglu", {}
    fail("swiglu_alpha/swiglu_beta/swiglu_limit", (alpha, beta, limit),
         "beta 1 (gpt-oss's clamped SwiGLU), or beta 0 with alpha 1 and no limit (SwiGLU)", NotImplementedError)


def _scales(quant_scales, n, mode):
    if not isinstance(quant_scales, (list, tuple)) or len(quant_scales) != n:
        got = f"{len(quant_scales)} tensors" if isinstance(quant_scales, (list, tuple)) else \
            type(quant_scales).__name__
        fail("quant_scales", got, f"a list of {n} tensors for {mode}")
    return list(quant_scales)


def _w4_scale(name, s, dtype):
    """An MXFP4 scale as the core takes it, 16-bit [E, K/32, N] (from itself, its int32 view,
    or the checkpoint's E8M0 uint8 [E, N, K/32])."""
    tensor_arg(name, s, 3)
    if s.dtype == torch.uint8:
        return cached("mxfp4_scale", lambda t: _common.mxfp4_kernel_scales(t, dtype), s, extra=(dtype,))
    if s.dtype == torch.int32:
        return s.view(dtype)
    if s.dtype == dtype:
        return s
    fail(name, f"dtype {s.dtype}", f"{dtype} [E, K/32, N] (moe_kernels.prepare.interleave_moe_scales_for_"
         "sm90_mixed_gemm), its int32 view, or E8M0 torch.uint8 [E, N, K/32]", TypeError)


def cutlass_fused_moe(input: torch.Tensor, token_selected_experts: torch.Tensor,
                      token_final_scales: torch.Tensor, fc1_expert_weights: torch.Tensor,
                      fc2_expert_weights: torch.Tensor, output_dtype: torch.dtype, quant_scales=None,
                      fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None, swiglu_alpha=None,
                      swiglu_beta=None, swiglu_limit=None, tp_size: int = 1, tp_rank: int = 0,
                      ep_size: int = 1, ep_rank: int = 0, cluster_size: int = 1, cluster_rank: int = 0,
                      output=None, enable_alltoall: bool = False, use_deepseek_fp8_block_scale: bool = False,
                      use_w4_group_scaling: bool = False, use_mxfp8_act_scaling: bool = False,
                      min_latency_mode: bool = False, use_packed_weights: bool = False,
                      use_wfp4afp8_humming: bool = False, tune_max_num_tokens: int = 8192, enable_pdl=None,
                      activation_type=ActivationType.Swiglu, swizzled_input_sf: bool = True,
                      use_fused_finalize: bool = True, profile_ids=None, workspace_buffer=None, *,
                      situ_beta=None, situ_linear_beta=None) -> list:
    """FlashInfer's cutlass_fused_moe: [output], output[t] = sum_slot token_final_scales[t, slot]
    * expert(token_selected_experts[t, slot])(input[t]). See the module docstring."""
    check_routing(input, fc1_expert_weights, fc2_expert_weights, token_final_scales, token_selected_experts,
                  ("input", "fc1_expert_weights", "fc2_expert_weights", "token_final_scales",
                   "token_selected_experts"),
                  weight_ndim=None if use_w4_group_scaling is True else 3)  # 4-bit: prepared, 4-D
    for name, v in (("enable_alltoall", enable_alltoall), ("use_mxfp8_act_scaling", use_mxfp8_act_scaling),
                    ("min_latency_mode", min_latency_mode), ("use_packed_weights", use_packed_weights),
                    ("use_wfp4afp8_humming", use_wfp4afp8_humming)):
        if flag(name, v):
            fail(name, True, "False (no kernel for it)", NotImplementedError)
    for name, v in (("input_sf", input_sf), ("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
        if v is not None:
            fail(name, "a tensor", "None (NVFP4 inputs and the Situ activation have no kernels)", NotImplementedError)
    if (cluster_size, cluster_rank) != (1, 0):
        fail("cluster_size/cluster_rank", (cluster_size, cluster_rank), "(1, 0)", NotImplementedError)
    for name, v in (("tp_size", tp_size), ("ep_size", ep_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            fail(name, repr(v), "a positive int")
    for name, v, size in (("tp_rank", tp_rank, tp_size), ("ep_rank", ep_rank, ep_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size:
            fail(name, repr(v), f"an int in [0, {size})")
    flag("use_deepseek_fp8_block_scale", use_deepseek_fp8_block_scale)
    flag("use_w4_group_scaling", use_w4_group_scaling)
    if output_dtype not in _HIDDEN:
        fail("output_dtype", repr(output_dtype), "torch.bfloat16 or torch.float16")
    act_type, act = activation_for(activation_type)
    E = fc1_expert_weights.shape[0]
    kw = {}
    if act == "swiglu":
        act, kw = _swiglu(swiglu_alpha, swiglu_beta, swiglu_limit, E)
    elif any(v is not None for v in (swiglu_alpha, swiglu_beta, swiglu_limit)):
        fail("swiglu_alpha/swiglu_beta/swiglu_limit", "values", f"None for activation_type={act_type.name}")
    gated = act in _GATED + ("swiglu_oai",)
    tensor_arg("fc1_expert_biases", fc1_expert_biases, 2, optional=True)
    tensor_arg("fc2_expert_biases", fc2_expert_biases, 2, optional=True)
    kw["w13_bias"] = cached("w31", swap_halves, fc1_expert_biases) if gated else fc1_expert_biases
    kw["w2_bias"] = fc2_expert_biases if tp_rank == 0 else None
    x = input
    w1_dtype = fc1_expert_weights.dtype
    if use_w4_group_scaling:
        if input.dtype not in _HIDDEN:
            fail("use_w4_group_scaling", f"True with input dtype {input.dtype}", "bf16/fp16 input (W4A16): "
                 "W4A8 (FP8 activations) has no kernels", NotImplementedError)
        if w1_dtype != torch.uint8:
            fail("fc1_expert_weights", f"dtype {w1_dtype}", "torch.uint8 MXFP4 (INT4 group scaling has no "
                 "mapping; moe_kernels.fused_moe takes INT4 with quant='w4a16_int4')", NotImplementedError)
        for name, w in (("fc1_expert_weights", fc1_expert_weights), ("fc2_expert_weights", fc2_expert_weights)):
            tensor_arg(name, w, dtype=torch.uint8)
            if w.dim() != 4:
                fail(name, f"shape {tuple(w.shape)}", "MXFP4 weights in the prepared layout uint8 [E, ceil(K/128), "
                     "N/16, 1024], as moe_kernels.prepare.interleave_moe_weights_for_sm90_mixed_gemm returns them "
                     "from the checkpoint's [E, N, K/2] (call it once at load time, instead of FlashInfer's)")
        s1, s2 = (_w4_scale(f"quant_scales[{i}]", s, input.dtype)
                  for i, s in enumerate(_scales(quant_scales, 2, "MXFP4 (use_w4_group_scaling)")))
        kw["quant"] = "w4a16_mxfp4"
        kw["w13_scale"] = cached("w31_cols", lambda t: swap_halves(t, 2), s1) if gated else s1
        kw["w2_scale"] = s2
    elif use_deepseek_fp8_block_scale:
        if input.dtype not in _HIDDEN:
            fail("input", f"dtype {input.dtype}", "bf16/fp16 with use_deepseek_fp8_block_scale (the kernels "
                 "quantize it per 128 columns)", TypeError)
        tensor_arg("fc1_expert_weights", fc1_expert_weights, 3, FP8)
        s1, s2 = (tensor_arg(f"quant_scales[{i}]", s, 3, torch.float32)
                  for i, s in enumerate(_scales(quant_scales, 2, "FP8 blocks (use_deepseek_fp8_block_scale)")))
        if gated and (fc1_expert_weights.shape[1] // 2) % 128:
            fail("fc1_expert_weights", f"shape {tuple(fc1_expert_weights.shape)}",
                 "an intermediate size (half the rows) that is a multiple of 128 (whole scale blocks per half)")
        kw["quant"] = "fp8_block"
        kw["w13_scale"] = cached("w31", swap_halves, s1) if gated else s1
        kw["w2_scale"] = s2
    elif w1_dtype == FP8:
        fc1_dq, fc2_q, fc2_dq, fc1_in = (tensor_arg(f"quant_scales[{i}]", s, dtype=torch.float32) for i, s in
                                         enumerate(_scales(quant_scales, 4, "FP8 per tensor")))
        for i, s in ((0, fc1_dq), (2, fc2_dq)):
            if tuple(s.shape) != (E,):
                fail(f"quant_scales[{i}]", f"shape {tuple(s.shape)}", f"({E},): one per local expert")
        if fc1_in.numel() != 1:
            fail("quant_scales[3]", f"shape {tuple(fc1_in.shape)}", "a scalar (the input's scale)")
        if fc2_q.numel() != 1:
            fail("quant_scales[1]", f"shape {tuple(fc2_q.shape)}", "a scalar: GEMM2's input takes one static "
                 "scale (per-expert ones have no kernel)", NotImplementedError)
        a1 = fc1_in.reshape(1)
        kw["quant"] = "fp8"
        kw["a13_scale"] = a1
        kw["a2_scale"] = cached("fp8_recip", torch.reciprocal, fc2_q.reshape(1))
        kw["w13_scale"] = cached("fp8_w13_scale", lambda d, a: (d / a).contiguous(), fc1_dq, a1)
        kw["w2_scale"] = cached("fp8_w2_scale", lambda d, q: (d * q.reshape(())).contiguous(), fc2_dq, fc2_q)
        if input.dtype == FP8:  # FlashInfer's pre-quantized input, dequantized: the kernels quantize again
            x = (input.float() * a1).to(output_dtype)
    else:
        if input.dtype not in _HIDDEN:
            fail("input", f"dtype {input.dtype}", f"bf16/fp16 with {w1_dtype} weights (FP8 input takes "
                 "float8_e4m3fn weights and their quant_scales)", TypeError)
        if w1_dtype not in _HIDDEN:
            fail("fc1_expert_weights", f"dtype {w1_dtype}", "bf16/fp16, float8_e4m3fn, or uint8 MXFP4 with "
                 "use_w4_group_scaling=True", TypeError)
        if quant_scales is not None and (not isinstance(quant_scales, (list, tuple)) or len(quant_scales)):
            fail("quant_scales", "scales", f"None or [] for {w1_dtype} weights")
    if x.dtype != output_dtype:
        fail("output_dtype", repr(output_dtype), f"the input's dtype {x.dtype} (the kernels write out in it)")
    kw = {k: v for k, v in kw.items() if v is not None}
    if (ep_size, ep_rank) != (1, 0):
        kw.update(ep_rank=ep_rank, ep_size=ep_size)
    if output is not None:
        tensor_arg("output", output, 2, output_dtype)
        if tuple(output.shape) != tuple(input.shape):  # [T, H]; the core checks the weights' H
            fail("output", f"shape {tuple(output.shape)}", f"{tuple(input.shape)}")
        if output.data_ptr() != x.data_ptr():  # the core's out must not alias its input
            kw["out"] = output
    # w31 -> [gate; up] once the weights are checked: N is dim 1 of [E, N, K] weights, dim 2 (in
    # 16-row blocks) of prepared 4-bit ones
    rows = 2 if fc1_expert_weights.dim() == 4 else 1
    w13 = cached("w31", lambda t: swap_halves(t, rows), fc1_expert_weights, extra=(rows,)) if gated \
        else fc1_expert_weights
    res = _common.core_fused_moe(x, w13, fc2_expert_weights, token_final_scales, token_selected_experts,
                                 activation=act, **kw)
    if output is not None and res is not output:
        output.copy_(res)
        res = output
    return [res]
