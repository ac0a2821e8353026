"""Plain PyTorch ground truth, in float32, for every mode this package knows.

Slow on purpose: a loop over experts with dense matmuls, no fusion, no tricks. Tests and
the profiler compare kernels with this. Works on CPU and GPU tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8, quant4
from .modes import MODES as _ALL_MODES
from .modes import WEIGHT_FORMATS as _WEIGHT_FORMATS_ALL
from .modes import Activation, QuantMode

# The formats written here; MODES: the modes made of them.
_ACT_FORMATS = ("a16", "fp8_row", "fp8_row128")
_WEIGHT_FORMATS = ("w16", "e4m3", "e4m3_block128", "int4", "mxfp4")
MODES = {name: m for name, m in _ALL_MODES.items() if m.act in _ACT_FORMATS and m.weight in _WEIGHT_FORMATS}


def apply_activation(x: torch.Tensor, act, *, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """Apply `act` to GEMM1's output rows (float32). Gated ones take [gate | up] halves."""
    act = Activation.parse(act)
    if act.gated:
        gate, up = x.chunk(2, dim=-1)
        if act is Activation.SWIGLU:
            return F.silu(gate) * up
        if act is Activation.GEGLU:
            return F.gelu(gate) * up
        if act is Activation.GEGLU_TANH:
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return gate * torch.sigmoid(swiglu_alpha * gate) * (up + 1)
    if act is Activation.SILU:
        return F.silu(x)
    if act is Activation.GELU:
        return F.gelu(x)
    if act is Activation.RELU2:
        return F.relu(x).square()
    if act is Activation.RELU:
        return F.relu(x)
    return x


def gemm_input(x, act_format: str, static_scale=None):
    """A GEMM input as the kernels feed it, dequantized: as is (a16), E4M3 with a static
    per-tensor scale if given, else dynamic per token (fp8_row) or per token per 128 columns
    (fp8_row128)."""
    if act_format == "a16":
        return x
    if static_scale is not None:
        return fp8.dequantize(fp8.quantize(x, static_scale.float()), static_scale.float())
    if act_format == "fp8_row128":
        q, scale = fp8.quantize_per_token_group(x)
        return fp8.dequantize(q, fp8.expand_groups(scale, x.shape[-1]))
    q, scale = fp8.quantize_per_token(x)
    return fp8.dequantize(q, scale)


def dequantize_weight(w, weight_format: str, scale=None, zero=None, K=None):
    """One expert's weight [N, K] in float32, as its format defines it, from the form fused_moe
    takes: 4-bit weights (int4, mxfp4, or quant4.PLACED: w4a16_mxfp4's) prepared, uint8
    [ceil(K/128), N/16, 1024], with K their unpadded size (quant4.unprepare gives back the
    checkpoint packing, the padding cut off); scales and zero terms as prepare_weights returns
    them."""
    if weight_format == "w16":
        return w.float()
    if weight_format == quant4.PLACED or _WEIGHT_FORMATS_ALL[weight_format].fragment_layout:
        if K is None:
            raise ValueError(f"K: got None, expected the unpadded K of the prepared {weight_format} weight "
                             f"{tuple(w.shape)}")
        w = quant4.unprepare(w[None], K, weight_format)[0]
        if weight_format == "int4":
            return quant4.dequantize_int4(w, scale, zero)
        return quant4.dequantize_mxfp4(w, scale, placed=weight_format == quant4.PLACED)
    return w.float() * fp8.weight_scale_full(scale[None], *w.shape)[0]  # e4m3, e4m3_block128


def check_prepared(weight_format: str, **weights) -> None:
    """4-bit weights (by name) are in the prepared layout fused_moe takes, else a ValueError
    that names the argument and says how to prepare them."""
    for name, w in weights.items():
        if not quant4.is_prepared(w):
            got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name}: got {got}, expected {weight_format} weights in the prepared layout uint8 "
                             "[E, ceil(K/128), N/16, 1024]: pass them through moe_kernels.prepare.prepare_weights "
                             "(or moe_kernels.prepare.interleave_moe_weights_for_sm90_mixed_gemm) once")


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
              activation="swiglu", w13_bias=None, w2_bias=None, expert_offset: int = 0,
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, w13_scale=None,
              w2_scale=None, a13_scale=None, a2_scale=None, w13_zero=None, w2_zero=None,
              expert_map=None, apply_router_weight_on_input: bool = False,
              routed_scaling_factor=None) -> torch.Tensor:
    """The fused MoE forward of `moe_kernels.fused_moe`, in float32. Returns [T, H] float32.

    Quantized modes: weights and w13_scale/w2_scale (and int4's w13_zero/w2_zero) as
    `moe_kernels.prepare` returns them (4-bit weights in the prepared layout, unprepared to
    the unpadded K: H for w13, I for w2), dequantized as moe_kernels.fp8 and moe_kernels.quant4
    define; FP8 GEMM inputs are quantized with the static per-tensor a13_scale/a2_scale when
    given, else dynamically, exactly where the kernels quantize. expert_map: global id ->
    local expert or -1 (instead of expert_offset). apply_router_weight_on_input: each input
    row times its router weight, rounded to the hidden dtype, and the outputs summed
    unweighted. routed_scaling_factor: multiplies the output."""
    spec = QuantMode.parse(quant).spec if quant is not None else None
    if spec is not None and spec.name not in MODES:
        raise NotImplementedError(f"reference for quant={spec.name!r} is not written yet "
                                  f"(weight format {spec.weight!r}, activation format {spec.act!r})")
    act_format, weight_format = (spec.act, spec.weight) if spec else ("a16", "w16")
    if weight_format != "w16" and (w13_scale is None or w2_scale is None):
        raise ValueError(f"quant={spec.name!r}: w13_scale and w2_scale are required")
    act = Activation.parse(activation)
    K13 = K2 = None
    layout = quant4.prepared_layout(spec) if spec else weight_format  # 4-bit: how the weights are prepared
    if _WEIGHT_FORMATS_ALL[weight_format].fragment_layout:  # K of each GEMM: H, and I from w13's N
        check_prepared(weight_format, w13=w13, w2=w2)
        n1 = quant4.FRAGMENT_ROWS * w13.shape[2]
        K13, K2 = hidden_states.shape[-1], n1 // 2 if act.gated else n1
    ids = topk_ids.long()
    if expert_map is None:
        local = ids - expert_offset
    else:
        inside = (ids >= 0) & (ids < expert_map.shape[0])
        local = torch.where(inside, expert_map.long()[ids.clamp(0, expert_map.shape[0] - 1)], -1)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(local == e, as_tuple=True)
        if token.numel() == 0:
            continue
        weight = topk_weights[token, slot].float()[:, None]
        rows = hidden_states[token]
        if apply_router_weight_on_input:
            rows = (rows.float() * weight).to(hidden_states.dtype)
            weight = torch.ones_like(weight)
        rows = gemm_input(rows.float(), act_format, a13_scale)
        def pick(t):
            return None if t is None else t[e]
        g13 = dequantize_weight(w13[e], layout, pick(w13_scale), pick(w13_zero), K13)
        g2 = dequantize_weight(w2[e], layout, pick(w2_scale), pick(w2_zero), K2)
        h = rows @ g13.t()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = apply_activation(h, act, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        y = gemm_input(y, act_format, a2_scale) @ g2.t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, token, y * weight)
    return out if routed_scaling_factor is None else out * routed_scaling_factor
