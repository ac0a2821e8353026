"""Plain PyTorch ground truth, in float32, for every mode this package knows.

Slow on purpose: a loop over experts with dense matmuls, no fusion, no tricks. Tests and
the profiler compare kernels with this. Works on CPU and GPU tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .modes import Activation, QuantMode

_REFERENCE_MODES = (QuantMode.BF16, QuantMode.FP16)


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


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
              activation="swiglu", w13_bias=None, w2_bias=None, expert_offset: int = 0,
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """The fused MoE forward of `moe_kernels.fused_moe`, in float32. Returns [T, H] float32."""
    if quant is not None and QuantMode.parse(quant) not in _REFERENCE_MODES:
        raise NotImplementedError(f"reference for quant={quant!r} is not written yet")
    act = Activation.parse(activation)
    x = hidden_states.float()
    ids = topk_ids.long()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == e + expert_offset, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ w13[e].float().t()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = apply_activation(h, act, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        y = y @ w2[e].float().t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out
