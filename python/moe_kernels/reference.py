"""Plain PyTorch ground truth, in float32, for every mode this package knows.

Slow on purpose: a loop over experts with dense matmuls, no fusion, no tricks. Tests and
the profiler compare kernels with this. Works on CPU and GPU tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8
from .modes import Activation, QuantMode

_REFERENCE_MODES = (QuantMode.BF16, QuantMode.FP16, QuantMode.FP8, QuantMode.FP8_BLOCK)


def apply_activation(x: torch.Tensor, act, *, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """Apply `act` to GEMM1's output rows (float32). Gated ones take [gate | up] halves."""
    act = Activation.parse(act)
    if act.gated:
        gate, up = x.chunk(2, dim=-1)
        if act is Activation.SWIGLU:
            return F.silu(gate) * up
        if act is Activation.GEGLU:
            return F.gelu(gate) * up
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return gate * torch.sigmoid(swiglu_alpha * gate) * (up + 1)
    if act is Activation.SILU:
        return F.silu(x)
    if act is Activation.GELU:
        return F.gelu(x)
    if act is Activation.RELU2:
        return F.relu(x).square()
    return x


def _fp8_input(x, mode, static_scale):
    """Dequantized GEMM input as the kernels quantize it: a static per-tensor scale if given,
    else dynamic per token (fp8) or per token per 128 columns (fp8_block)."""
    if static_scale is not None:
        return fp8.dequantize(fp8.quantize(x, static_scale.float()), static_scale.float())
    if mode is QuantMode.FP8_BLOCK:
        q, scale = fp8.quantize_per_token_group(x)
        return fp8.dequantize(q, fp8.expand_groups(scale, x.shape[-1]))
    q, scale = fp8.quantize_per_token(x)
    return fp8.dequantize(q, scale)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
              activation="swiglu", w13_bias=None, w2_bias=None, expert_offset: int = 0,
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, w13_scale=None,
              w2_scale=None, a13_scale=None, a2_scale=None) -> torch.Tensor:
    """The fused MoE forward of `moe_kernels.fused_moe`, in float32. Returns [T, H] float32.

    FP8 modes: weights are float8_e4m3fn with w13_scale/w2_scale as `moe_kernels.prepare`
    accepts them; GEMM inputs are quantized with the static per-tensor a13_scale/a2_scale
    when given, else dynamically (moe_kernels.fp8), exactly where the kernels quantize."""
    mode = QuantMode.parse(quant) if quant is not None else None
    if mode is not None and mode not in _REFERENCE_MODES:
        raise NotImplementedError(f"reference for quant={mode.value!r} is not written yet")
    quantized = mode in (QuantMode.FP8, QuantMode.FP8_BLOCK)
    if quantized and (w13_scale is None or w2_scale is None):
        raise ValueError(f"quant={mode.value!r}: w13_scale and w2_scale are required")
    act = Activation.parse(activation)
    x = hidden_states.float()
    if quantized:
        x = _fp8_input(x, mode, a13_scale)
    ids = topk_ids.long()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == e + expert_offset, as_tuple=True)
        if token.numel() == 0:
            continue
        g13, g2 = w13[e].float(), w2[e].float()
        if quantized:
            g13 = g13 * fp8.weight_scale_full(w13_scale[e:e + 1], *g13.shape)[0]
            g2 = g2 * fp8.weight_scale_full(w2_scale[e:e + 1], *g2.shape)[0]
        h = x[token] @ g13.t()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = apply_activation(h, act, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        if quantized:
            y = _fp8_input(y, mode, a2_scale)
        y = y @ g2.t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out
