"""Weight preparation, once at load time: validate, and lay weights out as the kernels need.

For the 16-bit modes the kernels read nn.Linear-style [out, in] weights as they are, so
preparing means validating shapes and dtypes and making them contiguous on the device.
FP8 checkpoints (`fp8`, `fp8_block`) are validated as they are stored, with their scales;
`quantize_weights` makes them from 16-bit weights (moe_kernels.fp8 defines the numerics).
"""
from __future__ import annotations

import torch

from . import fp8
from .modes import Activation, QuantMode

_DTYPES = {QuantMode.BF16: torch.bfloat16, QuantMode.FP16: torch.float16,
           QuantMode.FP8: torch.float8_e4m3fn, QuantMode.FP8_BLOCK: torch.float8_e4m3fn}
_FP8 = (QuantMode.FP8, QuantMode.FP8_BLOCK)


def _check(name, t, dtype, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected {' or '.join(map(str, allowed))}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_scale(name, scale, mode, E, N, K):
    """Weight scales as checkpoints store them: fp8 per tensor [E] (or [E, 1]) or per output
    channel [E, N] (or [E, N, 1]); fp8_block [E, ceil(N/128), ceil(K/128)]. float32, > 0."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: got {type(scale).__name__}, expected a float32 torch.Tensor "
                        f"(quant={mode.value!r} needs weight scales)")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: got dtype {scale.dtype}, expected torch.float32")
    if mode is QuantMode.FP8_BLOCK:
        allowed = [(E, -(-N // fp8.BLOCK), -(-K // fp8.BLOCK))]
    else:
        allowed = [(E,), (E, 1), (E, 1, 1), (E, N), (E, N, 1)]
    if tuple(scale.shape) not in allowed:
        raise ValueError(f"{name}: got shape {tuple(scale.shape)}, expected one of {allowed}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{name}: got non-positive or non-finite values, expected scales > 0")
    if mode is QuantMode.FP8_BLOCK:
        return scale
    return scale.reshape(E) if scale.numel() == E else scale.reshape(E, N)


def _check_act_scale(name, scale, mode, E):
    """A static activation scale (fp8 only): one element, or one per expert ([E] or [E, 1], a
    checkpoint's input_scale), reduced to their max: the kernels quantize each GEMM input with
    one scale, and the largest one saturates no expert's inputs (vLLM does the same)."""
    if scale is None:
        return None
    if mode is not QuantMode.FP8:
        raise ValueError(f"{name}: got a static activation scale, expected None for quant={mode.value!r} "
                         "(only fp8 takes static scales; fp8_block quantizes per token per 128 columns)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name}: got {got}, expected a float32 torch.Tensor")
    if scale.numel() not in (1, E) or (scale.numel() == E and tuple(scale.shape) not in ((E,), (E, 1))):
        raise ValueError(f"{name}: got shape {tuple(scale.shape)}, expected one element or one per "
                         f"expert ({E},)")
    bad = scale[~(torch.isfinite(scale) & (scale > 0))]
    if bad.numel():
        raise ValueError(f"{name}: got {bad.numel()} non-positive or non-finite value(s), first "
                         f"{bad.flatten()[0].item()}, expected finite scales > 0")
    return scale.max().reshape(1)


def prepare_weights(w13, w2, *, quant="bf16", activation="swiglu", w13_bias=None, w2_bias=None,
                    w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
                    device=None) -> dict:
    """Validate expert weights and return them contiguous on `device`.

    w13 [E, 2I, H] (gate rows, then up rows; [E, I, H] for non-gated activations),
    w2 [E, H, I], optional w13_bias [E, 2I or I] and w2_bias [E, H] (in the 16-bit type; for
    the FP8 modes that of the hidden states the layer will take, bfloat16 or float16). For
    `fp8` and `fp8_block`, the weights are torch.float8_e4m3fn with their float32 scales (see `_check_scale`; dequantized weight =
    q * scale). `fp8` may also take static activation scales a13_scale / a2_scale (see
    `_check_act_scale`); without them the GEMM inputs are quantized per token. Returns a dict
    with keys w13, w2, w13_bias, w2_bias (and w13_scale, w2_scale, a13_scale, a2_scale for
    FP8; the activation scales None when dynamic) ready for `moe_kernels.fused_moe`.
    """
    mode = QuantMode.parse(quant)
    if mode not in _DTYPES:
        raise NotImplementedError(f"prepare_weights: quant={mode.value!r} is not supported yet; "
                                  f"supported: {[m.value for m in _DTYPES]}")
    act = Activation.parse(activation)
    dtype = _DTYPES[mode]
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise ValueError(f"w2: got {getattr(w2, 'shape', type(w2).__name__)}, expected a 3-D tensor [E, H, I]")
    E, H, I = w2.shape
    n1 = 2 * I if act.gated else I
    _check("w13", w13, dtype, (E, n1, H))
    _check("w2", w2, dtype, (E, H, I))
    bias_dtype = (torch.bfloat16, torch.float16) if mode in _FP8 else dtype
    if w13_bias is not None:
        _check("w13_bias", w13_bias, bias_dtype, (E, n1))
    if w2_bias is not None:
        _check("w2_bias", w2_bias, w13_bias.dtype if w13_bias is not None else bias_dtype, (E, H))
    if H % 8 or I % 8:
        raise ValueError(f"w2: hidden_size={H}, intermediate_size={I}; expected both multiples of 8")
    scales = {}
    if mode in _FP8:
        scales = {"w13_scale": _check_scale("w13_scale", w13_scale, mode, E, n1, H),
                  "w2_scale": _check_scale("w2_scale", w2_scale, mode, E, H, I),
                  "a13_scale": _check_act_scale("a13_scale", a13_scale, mode, E),
                  "a2_scale": _check_act_scale("a2_scale", a2_scale, mode, E)}
    elif any(t is not None for t in (w13_scale, w2_scale, a13_scale, a2_scale)):
        raise ValueError(f"w13_scale/w2_scale/a13_scale/a2_scale: got scales, expected none for "
                         f"quant={mode.value!r}")
    device = torch.device(device) if device is not None else w13.device

    def place(t):
        return None if t is None else t.to(device=device).contiguous()

    out = {"w13": place(w13), "w2": place(w2), "w13_bias": place(w13_bias), "w2_bias": place(w2_bias)}
    out.update({k: place(v) for k, v in scales.items()})
    return out


def quantize_weights(w13, w2, *, quant="fp8", granularity=None, activation="swiglu", w13_bias=None,
                     w2_bias=None, device=None) -> dict:
    """Quantize 16-bit (or float32) expert weights for an FP8 mode and prepare them.

    granularity: for `fp8`, "channel" (default) or "tensor"; `fp8_block` is always 128x128."""
    mode = QuantMode.parse(quant)
    if mode not in _FP8:
        raise ValueError(f"quant={mode.value!r}: quantize_weights makes fp8 or fp8_block weights")
    if mode is QuantMode.FP8_BLOCK:
        if granularity not in (None, "block"):
            raise ValueError(f"granularity={granularity!r}: fp8_block is always 'block' (128x128)")
        granularity = "block"
    elif granularity is None:
        granularity = "channel"
    elif granularity not in ("tensor", "channel"):
        raise ValueError(f"granularity={granularity!r}: expected 'tensor' or 'channel' for fp8")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
            raise ValueError(f"{name}: got {getattr(w, 'shape', type(w).__name__)}, expected a 3-D float tensor")
    q13, s13 = fp8.quantize_weight(w13, granularity)
    q2, s2 = fp8.quantize_weight(w2, granularity)
    return prepare_weights(q13, q2, quant=mode, activation=activation, w13_bias=w13_bias,
                           w2_bias=w2_bias, w13_scale=s13, w2_scale=s2, device=device)
