"""Weight preparation, once at load time: validate, and lay weights out as the kernels need.

For the 16-bit modes the kernels read nn.Linear-style [out, in] weights as they are, so
preparing means validating shapes and dtypes and making them contiguous on the device.
Quantized checkpoints are validated as they are stored, with their scales, by the rules of
their weight format (moe_kernels.modes); `quantize_weights` makes FP8 ones from 16-bit
weights (moe_kernels.fp8 defines the numerics).
"""
from __future__ import annotations

import torch

from . import fp8, reference
from .modes import Activation, QuantMode
from .problem import DTYPES, check_alignment, weight_dtype, weight_scale

def _check(name, t, dtype, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected {' or '.join(map(str, allowed))}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_act_scale(name, scale, mode, E):
    """A static activation scale (formats that take one: fp8): one element, or one per expert
    ([E] or [E, 1], a checkpoint's input_scale), reduced to their max: the kernels quantize
    each GEMM input with one scale, and the largest one saturates no expert's inputs (vLLM
    does the same)."""
    if scale is None:
        return None
    if not mode.spec.act_format.static_scale:
        raise ValueError(f"{name}: got a static activation scale, expected None for quant={mode.value!r} "
                         f"(only fp8 takes static scales; its activations are {mode.spec.act_format.doc})")
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
    modes with several hidden dtypes that of the hidden states the layer will take, bfloat16
    or float16). Quantized weights come in their format's storage dtype with their scales as
    moe_kernels.modes.WEIGHT_FORMATS declares them (fp8: per tensor [E] or per channel [E, N];
    fp8_block: [E, N/128, K/128]; dequantized weight = q * scale). `fp8` may also take static
    activation scales a13_scale / a2_scale (see `_check_act_scale`); without them the GEMM
    inputs are quantized per token. Returns a dict with keys w13, w2, w13_bias, w2_bias (and
    w13_scale, w2_scale, a13_scale, a2_scale for scaled formats; the activation scales None
    when dynamic) ready for `moe_kernels.fused_moe`.
    """
    mode = QuantMode.parse(quant)
    spec = mode.spec
    if mode.value not in reference.MODES:
        raise NotImplementedError(f"prepare_weights: quant={mode.value!r} is not supported yet; "
                                  f"supported: {list(reference.MODES)}")
    act = Activation.parse(activation)
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise ValueError(f"w2: got {getattr(w2, 'shape', type(w2).__name__)}, expected a 3-D tensor [E, H, I]")
    hidden = tuple(DTYPES[d] for d in spec.hidden)
    dtype = weight_dtype(spec, hidden[0])
    E, H, I = w2.shape
    n1 = 2 * I if act.gated else I
    _check("w13", w13, dtype, (E, n1, H))
    _check("w2", w2, dtype, (E, H, I))
    if w13_bias is not None:
        _check("w13_bias", w13_bias, hidden, (E, n1))
    if w2_bias is not None:
        _check("w2_bias", w2_bias, w13_bias.dtype if w13_bias is not None else hidden, (E, H))
    check_alignment(spec, H, I, "w2")
    scales = {}
    fmt = spec.weight_format
    if fmt.scale is not None:
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"{name}: got {type(scale).__name__}, expected a {fmt.scale.dtype} torch.Tensor "
                                f"(quant={mode.value!r} needs weight scales: {fmt.scale.what})")
        scales = {"w13_scale": weight_scale("w13_scale", w13_scale.contiguous(), fmt, E, n1, H, values=True, align=1),
                  "w2_scale": weight_scale("w2_scale", w2_scale.contiguous(), fmt, E, H, I, values=True, align=1),
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
    if mode not in (QuantMode.FP8, QuantMode.FP8_BLOCK):
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
