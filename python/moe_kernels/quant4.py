"""4-bit weights (INT4 and MXFP4): the one definition that `prepare`, `reference` and the
tests follow, as fp8.py is for E4M3.

Storage (the weight formats `int4` and `mxfp4` of moe_kernels.modes): expert weights
[E, N, K] as uint8 [E, N, K/2], two values per byte along K, the even k in the low nibble.

- INT4: signed values -8..7 (two's complement nibbles), one scale per group of g along K
  ([E, K/g, N], N contiguous, in the hidden dtype) and, for asymmetric checkpoints, an
  additive zero term in the same layout and dtype: dequantized = q * scale + zero. A checkpoint's unsigned
  nibble u with integer zero point z becomes q = u - 8 and zero = (8 - z) * scale.
- MXFP4 (OCP MX): E2M1 values (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one
  E8M0 exponent per 32 along K ([E, N, K/32] uint8): dequantized = e2m1 * 2^(e - 127);
  e = 255 is NaN and is refused by `prepare`. The kernels take the scales as 16-bit powers
  of two in INT4's layout ([E, K/32, N], `mxfp4_scales`), which `prepare_weights` makes.
"""
from __future__ import annotations

import torch

from . import fp8

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
MX_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def _lut(device) -> torch.Tensor:
    """The 16 E2M1 codes as float32 (codes 8..15 are the negatives of 0..7)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


# ---- nibbles ------------------------------------------------------------------------------

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> uint8 [..., K/2], the even k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: got K={codes.shape[-1]}, expected an even K")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes 0..15 as uint8 [..., K]."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ---- INT4 ---------------------------------------------------------------------------------

def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """Signed INT4 values (-8..7) of packed weights, as int8 [..., K]."""
    codes = unpack_nibbles(packed).to(torch.int8)
    return torch.where(codes >= 8, codes - 16, codes)


def expand_groups(s: torch.Tensor, K: int) -> torch.Tensor:
    """Per-group [..., K/g] values repeated along K to [..., K] (fp8.expand_groups, the group
    taken from the shape)."""
    return fp8.expand_groups(s, K, K // s.shape[-1])


def dequantize_int4(packed, scale, zero=None) -> torch.Tensor:
    """float32 [..., N, K] = q * scale (+ zero), scale/zero [..., K/g, N]. With 16-bit scales
    the result is rounded once to the scales' type, as the kernels compute it (a multiply, or
    a fused multiply-add with zero terms)."""
    q = int4_values(packed).float()
    K = q.shape[-1]
    w = q * expand_groups(scale.float().transpose(-1, -2), K)
    if zero is not None:
        w = w + expand_groups(zero.float().transpose(-1, -2), K)
    return w.to(scale.dtype).float() if scale.dtype in (torch.bfloat16, torch.float16) else w


def quantize_int4(w: torch.Tensor, group: int = 128, symmetric: bool = True, scale_dtype=torch.bfloat16):
    """INT4 weights of [..., N, K] in groups of `group` along K: (packed uint8 [..., N, K/2],
    scale [..., K/g, N], zero [..., K/g, N] or None). Symmetric: scale = amax / 7, values
    rounded to nearest and clamped to -8..7. Asymmetric (AWQ): a range of 15 steps from the
    group's min to its max with an integer zero point; the zero term is (8 - zp) * scale.
    Scales are rounded to `scale_dtype` before the values are, so q * scale is what the
    kernels compute."""
    *lead, N, K = w.shape
    if K % group:
        raise ValueError(f"w: got K={K}, expected a multiple of group={group}")
    if w.dim() > 2 and w.shape[0] > 1:  # one matrix at a time: the float32 temporaries are 4-8x the weights
        parts = [quantize_int4(m, group, symmetric, scale_dtype) for m in w]
        return (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                None if symmetric else torch.stack([p[2] for p in parts]))
    g = w.float().reshape(*lead, N, K // group, group)
    if symmetric:
        amax = g.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(scale_dtype)
        q = torch.round(g / scale.float()).clamp(-8, 7)
        zero = None
    else:
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        rng = hi - lo
        scale = torch.where(rng > 0, rng / 15.0, torch.ones_like(rng)).to(scale_dtype)
        zp = torch.round(-lo / scale.float()).clamp(0, 15)
        q = (torch.round(g / scale.float()) + zp).clamp(0, 15) - 8
        zero = ((8 - zp) * scale.float()).to(scale_dtype).squeeze(-1).transpose(-1, -2).contiguous()
    codes = (q.to(torch.int8) & 0x0F).reshape(*lead, N, K)
    return pack_nibbles(codes), scale.squeeze(-1).transpose(-1, -2).contiguous(), zero


# ---- MXFP4 --------------------------------------------------------------------------------

def dequantize_mxfp4(packed, scale) -> torch.Tensor:
    """float32 [..., N, K] = e2m1 * 2^(e - 127): from the checkpoint's E8M0 exponents (uint8
    [..., N, K/32]) or the kernels' 16-bit scales ([..., K/32, N], mxfp4_scales)."""
    v = _lut(packed.device)[unpack_nibbles(packed).long()]
    if scale.dtype != torch.uint8:
        return v * expand_groups(scale.float().transpose(-1, -2), v.shape[-1])
    exp = scale.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(v, expand_groups(exp, v.shape[-1]).float())


def mxfp4_scales(scale_e8m0: torch.Tensor, dtype, name: str = "scale") -> torch.Tensor:
    """The kernels' MXFP4 scales: E8M0 uint8 [..., N, K/32] -> 2^(e - 127) in `dtype` (bfloat16
    or float16, the hidden states'), [..., K/32, N] like INT4's. Exact: every E8M0 value is a
    bfloat16; float16 holds 2^-24 .. 2^15 only, and other exponents are refused."""
    exp = scale_e8m0.to(torch.int32) - E8M0_BIAS
    if dtype == torch.float16 and exp.numel():
        lo, hi = int(exp.min()), int(exp.max())
        if lo < -24 or hi > 15:
            raise ValueError(f"{name}: got E8M0 exponents 2^{lo} .. 2^{hi}, expected 2^-24 .. 2^15 for float16 "
                             f"hidden states (a float16 scale holds no other power of two); use bfloat16")
    elif dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: got {dtype}, expected torch.bfloat16 or torch.float16")
    ones = torch.ones((), dtype=torch.float32, device=scale_e8m0.device)
    return torch.ldexp(ones, exp.float()).to(dtype).transpose(-1, -2).contiguous()


def quantize_mxfp4(w: torch.Tensor):
    """MXFP4 weights of [..., N, K] (K % 32 == 0): (packed uint8 [..., N, K/2], e8m0 uint8
    [..., N, K/32]). The OCP MX rule: each block's exponent is floor(log2(amax)) - 2 (E2M1's
    largest exponent), values divided by it and rounded to the nearest E2M1 value (ties to
    the even code), saturating at 6."""
    *lead, N, K = w.shape
    if K % MX_GROUP:
        raise ValueError(f"w: got K={K}, expected a multiple of {MX_GROUP}")
    if w.dim() > 2 and w.shape[0] > 1:  # one matrix at a time: the rounding's temporaries are 8x the weights
        parts = [quantize_mxfp4(m) for m in w]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    g = w.float().reshape(*lead, N, K // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -E8M0_BIAS))
    exp = exp.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    x = (g / torch.exp2(exp)).clamp(-E2M1_MAX, E2M1_MAX)
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    dist = (x.abs()[..., None] - pos).abs()
    # nearest magnitude; a tie goes to the even code (0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2, 5 -> 4)
    best = dist.min(dim=-1, keepdim=True).values
    ties = (dist == best) & (torch.arange(8, device=w.device) % 2 == 0)
    idx = torch.where(ties.any(dim=-1), ties.float().argmax(dim=-1), dist.argmin(dim=-1))
    codes = (idx + 8 * (x < 0)).to(torch.uint8).reshape(*lead, N, K)
    codes = torch.where(idx.reshape(*lead, N, K) == 0, torch.zeros_like(codes), codes)  # +0 for -0
    e8m0 = (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return pack_nibbles(codes), e8m0
