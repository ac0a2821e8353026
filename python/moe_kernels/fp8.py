"""FP8 (E4M3) quantization: the one definition that the kernels, `prepare` and `reference`
follow, so tests compare like with like.

- Values are multiplied by the float32 reciprocal of their scale (x * (1 / scale), as the
  kernels do: a correctly rounded reciprocal per 8 values, not a division per value),
  saturated to +-448 (never inf/NaN), and rounded to nearest-even E4M3. Dequantization
  multiplies back: x ~= q * scale.
- A dynamic scale is amax / 448 over its group (a token row, a 128-wide slice of one, a
  weight tensor, channel or 128x128 block); a group of zeros gets scale 1.0, so it
  quantizes to zeros and never divides by zero.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 128  # fp8_block: activations 1x128, weights 128x128 (DeepSeek-V3 checkpoints)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 of x * (1 / scale), saturating; `scale` broadcasts against x."""
    inv = 1.0 / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def quantize_per_token(x: torch.Tensor):
    """Dynamic per-row quantization of [T, K]: (q [T, K], scale [T, 1])."""
    scale = scale_from_amax(x.float().abs().amax(dim=-1, keepdim=True))
    return quantize(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int = BLOCK):
    """Dynamic per-row, per-`group`-columns quantization of [T, K]: (q, scale [T, ceil(K/group)])."""
    T, K = x.shape
    g = -(-K // group)
    padded = torch.nn.functional.pad(x.float(), (0, g * group - K)).view(T, g, group)
    scale = scale_from_amax(padded.abs().amax(dim=-1))
    return quantize(x, expand_groups(scale, K, group)), scale


def expand_groups(scale: torch.Tensor, size: int, group: int = BLOCK, dim: int = -1) -> torch.Tensor:
    """Repeat per-group scales along `dim` to cover `size` elements."""
    return scale.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


def quantize_weight(w: torch.Tensor, granularity: str):
    """Quantize expert weights [E, N, K]. granularity: "tensor" (scale [E]), "channel"
    (scale [E, N]) or "block" (scale [E, ceil(N/128), ceil(K/128)], DeepSeek's weight_scale_inv).
    One expert at a time, so the float32 temporaries stay the size of one expert."""
    if granularity not in ("tensor", "channel", "block"):
        raise ValueError(f"granularity={granularity!r}: expected 'tensor', 'channel' or 'block'")
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = [_quantize_expert(w[e], q[e], granularity) for e in range(w.shape[0])]
    return q, torch.stack(scales) if scales else torch.empty(0, device=w.device)


def _quantize_expert(w: torch.Tensor, q: torch.Tensor, granularity: str) -> torch.Tensor:
    """Quantize one expert's [N, K] into q; returns its scale ([], [N] or [N/128, K/128])."""
    w = w.float()
    N, K = w.shape
    if granularity == "tensor":
        scale = scale_from_amax(w.abs().amax())
        q.copy_(quantize(w, scale))
    elif granularity == "channel":
        scale = scale_from_amax(w.abs().amax(dim=1))
        q.copy_(quantize(w, scale[:, None]))
    else:
        gn, gk = -(-N // BLOCK), -(-K // BLOCK)
        padded = torch.nn.functional.pad(w, (0, gk * BLOCK - K, 0, gn * BLOCK - N))
        scale = scale_from_amax(padded.view(gn, BLOCK, gk, BLOCK).abs().amax(dim=(1, 3)))
        q.copy_(quantize(w, expand_groups(expand_groups(scale, N, dim=0), K, dim=1)))
    return scale


def weight_scale_full(scale: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Any weight scale ([E], [E, N] or [E, N/128, K/128] blocks) as a broadcastable [E, N|1, K|1]."""
    if scale.dim() == 1:
        return scale[:, None, None]
    if scale.dim() == 2:
        return scale[:, :, None]
    return expand_groups(expand_groups(scale, N, dim=1), K, dim=2)
