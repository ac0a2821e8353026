"""Weight preparation, once at load time: validate, and lay weights out as the kernels need.

For the 16-bit modes the kernels read nn.Linear-style [out, in] weights as they are, so
preparing means validating shapes and dtypes and making them contiguous on the device.
Quantized modes add their own functions here (quantize, interleave, scale re-layout).
"""
from __future__ import annotations

import torch

from .modes import Activation, QuantMode

_DTYPES = {QuantMode.BF16: torch.bfloat16, QuantMode.FP16: torch.float16}


def _check(name, t, dtype, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {tuple(shape)}")


def prepare_weights(w13, w2, *, quant="bf16", activation="swiglu", w13_bias=None, w2_bias=None,
                    device=None) -> dict:
    """Validate 16-bit expert weights and return them contiguous on `device`.

    w13 [E, 2I, H] (gate rows, then up rows; [E, I, H] for non-gated activations),
    w2 [E, H, I], optional w13_bias [E, 2I or I] and w2_bias [E, H]. Returns a dict with
    keys w13, w2, w13_bias, w2_bias ready for `moe_kernels.fused_moe`.
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
    if w13_bias is not None:
        _check("w13_bias", w13_bias, dtype, (E, n1))
    if w2_bias is not None:
        _check("w2_bias", w2_bias, dtype, (E, H))
    if H % 8 or I % 8:
        raise ValueError(f"w2: hidden_size={H}, intermediate_size={I}; expected both multiples of 8")
    device = torch.device(device) if device is not None else w13.device

    def place(t):
        return None if t is None else t.to(device=device).contiguous()

    return {"w13": place(w13), "w2": place(w2), "w13_bias": place(w13_bias), "w2_bias": place(w2_bias)}
