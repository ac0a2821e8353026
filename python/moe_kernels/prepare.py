"""Weight preparation, once at load time: validate, and lay weights out as the kernels need.

For the 16-bit modes the kernels read nn.Linear-style [out, in] weights as they are, so
preparing means validating shapes and dtypes and making them contiguous on the device.
Quantized checkpoints are validated as they are stored, with their scales, by the rules of
their weight format (moe_kernels.modes); 4-bit weights are then repacked from the checkpoint
packing into the prepared (fragment) layout the kernels read (moe_kernels.quant4).
`quantize_weights` makes quantized ones from 16-bit weights (moe_kernels.fp8 and
moe_kernels.quant4 define the numerics).
"""
from __future__ import annotations

import torch

from . import fp8, quant4, reference
from .modes import Activation, QuantMode
from .problem import DTYPES, check_alignment, parse_quant, weight_dtype, weight_scale

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
                    w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, w13_zero=None,
                    w2_zero=None, dtype=None, device=None) -> dict:
    """Validate expert weights and return them contiguous on `device`.

    w13 [E, 2I, H] (gate rows, then up rows; [E, I, H] for non-gated activations),
    w2 [E, H, I], optional w13_bias [E, 2I or I] and w2_bias [E, H] (in the 16-bit type; for
    modes with several hidden dtypes that of the hidden states the layer will take, bfloat16
    or float16). Quantized weights come in their format's storage dtype with their scales as
    moe_kernels.modes.WEIGHT_FORMATS declares them:
    - fp8: float8_e4m3fn, float32 scales per tensor [E] or per channel [E, N]; fp8_block:
      [E, N/128, K/128]; dequantized weight = q * scale. `fp8` may also take static activation
      scales a13_scale / a2_scale (see `_check_act_scale`); without them the GEMM inputs are
      quantized per token.
    - int4 (w4a16_int4, w4a8_int4): uint8 [E, N, K/2] in the checkpoint packing
      (moe_kernels.quant4), scales in the hidden dtype [E, K/g, N] with g in 128, 64, 32,
      optional zero terms w13_zero/w2_zero in the same layout (dequantized = q * scale + zero).
    - mxfp4 (w4a16_mxfp4, w4a8_mxfp4): uint8 [E, N, K/2] E2M1, E8M0 uint8 scales [E, N, K/32],
      returned as the kernels take them: 2^(e - 127) in `dtype` (the hidden states' dtype:
      torch.bfloat16 by default, or the biases'), [E, K/32, N] (quant4.mxfp4_scales), for
      w4a16_mxfp4 times 2^126 (bfloat16) or 2^14 (float16), which holds scales up to 2.
    4-bit weights are returned in the prepared layout, uint8 [E, ceil(K/128), N/16, 1024]
    (quant4.prepare_packed: K zero-padded to a multiple of 128, then the fragment layout;
    w4a16_mxfp4's words then placed bit by bit for its conversion, quant4.place_e2m1),
    which is what fused_moe takes; weights already in it (4-D, of exactly that shape, as
    returned here or by interleave_moe_weights_for_sm90_mixed_gemm) are taken as they are.
    Scales and zero terms are not repacked. Checkpoints' own layouts go through the
    importers below (from_gpt_oss, from_awq, from_gptq, from_compressed_tensors) first.
    Returns a dict with keys w13, w2, w13_bias, w2_bias (and w13_scale, w2_scale, a13_scale,
    a2_scale for scaled formats, w13_zero, w2_zero for int4) ready for `moe_kernels.fused_moe`.
    """
    mode = parse_quant(quant)
    spec = mode.spec
    if mode.value not in reference.MODES:
        raise NotImplementedError(f"prepare_weights: quant={mode.value!r} is not supported yet; "
                                  f"supported: {list(reference.MODES)}")
    act = Activation.parse(activation)
    hidden = tuple(DTYPES[d] for d in spec.hidden)
    wdtype = weight_dtype(spec, hidden[0])
    fmt = spec.weight_format
    prepared = fmt.fragment_layout and (quant4.is_prepared(w13) or quant4.is_prepared(w2))
    if prepared:  # already in the fragment layout: sizes from N = 16 * shape[2], K checked as ceil(K/128)
        E, H, I, n1 = _prepared_sizes(w13, w2, wdtype, act.gated)
    else:
        if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
            raise ValueError(f"w2: got {getattr(w2, 'shape', type(w2).__name__)}, expected a 3-D tensor [E, H, I]")
        per = fmt.per_byte
        E, H, I = w2.shape[0], w2.shape[1], w2.shape[2] * per
        n1 = 2 * I if act.gated else I
        _check("w13", w13, wdtype, (E, n1, H // per))
        _check("w2", w2, wdtype, (E, H, I // per))
    if w13_bias is not None:
        _check("w13_bias", w13_bias, hidden, (E, n1))
    if w2_bias is not None:
        _check("w2_bias", w2_bias, w13_bias.dtype if w13_bias is not None else hidden, (E, H))
    check_alignment(spec, H, I, "w2")
    scales = {}
    if fmt.scale is not None:
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"{name}: got {type(scale).__name__}, expected a {fmt.scale.dtype} torch.Tensor "
                                f"(quant={mode.value!r} needs weight scales: {fmt.scale.what})")
        kw = dict(values=True, align=1, dtype=hidden)
        scales = {"w13_scale": weight_scale("w13_scale", w13_scale.contiguous(), fmt, E, n1, H, **kw),
                  "w2_scale": weight_scale("w2_scale", w2_scale.contiguous(), fmt, E, H, I, **kw),
                  "a13_scale": _check_act_scale("a13_scale", a13_scale, mode, E),
                  "a2_scale": _check_act_scale("a2_scale", a2_scale, mode, E)}
        if fmt.prepared_scale is not None:  # mxfp4: E8M0 -> the kernels' 16-bit powers of two
            hidden_dtype = dtype or (w13_bias.dtype if w13_bias is not None else torch.bfloat16)
            if hidden_dtype not in hidden:
                raise TypeError(f"dtype: got {hidden_dtype}, expected one of {list(hidden)}")
            for name in ("w13_scale", "w2_scale"):
                scales[name] = quant4.mxfp4_scales(scales[name], hidden_dtype, name, placed=spec.e2m1_placed)
        elif dtype is not None:
            raise ValueError(f"dtype: got {dtype}, expected None for quant={mode.value!r} (only MXFP4's "
                             f"scales are converted to the hidden dtype)")
        if fmt.group_scales16 and scales["w13_scale"].dtype != scales["w2_scale"].dtype:
            raise TypeError(f"w2_scale: got dtype {scales['w2_scale'].dtype}, expected "
                            f"{scales['w13_scale'].dtype} (as w13_scale: the hidden states' dtype)")
    elif any(t is not None for t in (w13_scale, w2_scale, a13_scale, a2_scale)):
        raise ValueError(f"w13_scale/w2_scale/a13_scale/a2_scale: got scales, expected none for "
                         f"quant={mode.value!r}")
    for name, zero, scale_name in (("w13_zero", w13_zero, "w13_scale"), ("w2_zero", w2_zero, "w2_scale")):
        if zero is None:
            continue
        if not fmt.zero_point:
            raise ValueError(f"{name}: got zero points, expected None for quant={mode.value!r} "
                             f"(weight format {spec.weight!r} has none)")
        _check(name, zero, scales[scale_name].dtype, tuple(scales[scale_name].shape))
        scales[name] = zero
    device = torch.device(device) if device is not None else w13.device

    def place(t):
        return None if t is None else t.to(device=device).contiguous()

    out = {"w13": place(w13), "w2": place(w2), "w13_bias": place(w13_bias), "w2_bias": place(w2_bias)}
    if fmt.fragment_layout and not prepared:  # repacked on the device, once
        out["w13"], out["w2"] = (quant4.prepare_packed(out[k], quant4.prepared_layout(spec)) for k in ("w13", "w2"))
    out.update({k: place(v) for k, v in scales.items()})
    return out


def _prepared_sizes(w13, w2, wdtype, gated) -> tuple:
    """(E, H, I, n1) of 4-bit weights given in the prepared layout, both checked to be exactly
    quant4.prepared_shape of those sizes: N is 16 * shape[2]; each GEMM's unpadded K is the
    other's N (w2's H for w13; w13's n1 / 2 gated, or n1, for w2), its shape[1] ceil(K/128)."""
    for name, t, other in (("w13", w13, w2), ("w2", w2, w13)):
        if not quant4.is_prepared(t):
            raise ValueError(f"{name}: got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}, "
                             f"expected the prepared layout uint8 [E, ceil(K/128), N/16, 1024] as the other weight "
                             f"{tuple(other.shape)} (both prepared, or both in the checkpoint packing [E, N, K/2])")
    E, H, n1 = w13.shape[0], quant4.FRAGMENT_ROWS * w2.shape[2], quant4.FRAGMENT_ROWS * w13.shape[2]
    I = n1 // 2 if gated else n1
    _check("w13", w13, wdtype, quant4.prepared_shape(E, n1, H))
    _check("w2", w2, wdtype, quant4.prepared_shape(E, H, I))
    return E, H, I, n1


def quantize_weights(w13, w2, *, quant="fp8", granularity=None, activation="swiglu", w13_bias=None,
                     w2_bias=None, group_size=128, symmetric=True, scale_dtype=torch.bfloat16,
                     device=None) -> dict:
    """Quantize 16-bit (or float32) expert weights for a quantized mode and prepare them
    (tests, the benchmark and the tuner's inputs; checkpoints come quantized): what
    prepare_weights returns, 4-bit weights in the prepared layout.

    granularity: for `fp8`, "channel" (default) or "tensor"; `fp8_block` is always 128x128.
    int4 modes: groups of `group_size` along K, symmetric (GPTQ) or not (AWQ, with zero
    terms), scales in `scale_dtype` (the hidden states' dtype). mxfp4 modes: OCP MX blocks of 32,
    their scales made for `scale_dtype` hidden states."""
    mode = parse_quant(quant)
    weight = mode.spec.weight
    if weight not in ("e4m3", "e4m3_block128", "int4", "mxfp4") or mode.value not in reference.MODES:
        raise ValueError(f"quant={mode.value!r}: quantize_weights makes fp8, fp8_block, int4 or mxfp4 weights")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
            raise ValueError(f"{name}: got {getattr(w, 'shape', type(w).__name__)}, expected a 3-D float tensor")
    kw = dict(quant=mode, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, device=device)
    if weight == "int4":
        if group_size not in mode.spec.weight_format.groups:
            raise ValueError(f"group_size={group_size!r}: expected one of {list(mode.spec.weight_format.groups)}")
        check_alignment(mode.spec, w2.shape[1], w2.shape[2], "w2")
        (q13, s13, z13), (q2, s2, z2) = (quant4.quantize_int4(w, group_size, symmetric, scale_dtype) for w in (w13, w2))
        return prepare_weights(q13, q2, w13_scale=s13, w2_scale=s2, w13_zero=z13, w2_zero=z2, **kw)
    if weight == "mxfp4":
        check_alignment(mode.spec, w2.shape[1], w2.shape[2], "w2")
        (q13, s13), (q2, s2) = (quant4.quantize_mxfp4(w) for w in (w13, w2))
        return prepare_weights(q13, q2, w13_scale=s13, w2_scale=s2, dtype=scale_dtype, **kw)
    if mode is QuantMode.FP8_BLOCK:
        if granularity not in (None, "block"):
            raise ValueError(f"granularity={granularity!r}: fp8_block is always 'block' (128x128)")
        granularity = "block"
    elif granularity is None:
        granularity = "channel"
    elif granularity not in ("tensor", "channel"):
        raise ValueError(f"granularity={granularity!r}: expected 'tensor' or 'channel' for fp8")
    q13, s13 = fp8.quantize_weight(w13, granularity)
    q2, s2 = fp8.quantize_weight(w2, granularity)
    return prepare_weights(q13, q2, w13_scale=s13, w2_scale=s2, **kw)


# ---- checkpoint importers: what checkpoints store -> the layouts prepare_weights takes --------
# Each takes one projection stacked over experts ([E, ...]); for w13 import gate and up and
# concatenate them along N (dim 1), gate first (from_gpt_oss does both GEMMs at once). The
# weights come out in the checkpoint packing uint8 [E, N, K/2]; prepare_weights repacks them.

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_PACK_ORDER[i]


def _int32_nibbles(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> [..., C, 8] nibbles (0..15), nibble i = bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, device=x.device, dtype=torch.int32)
    return (x[..., None] >> shifts) & 0xF


def _importer_tensor(name, t, dtype, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name}: got dtype {t.dtype}, expected {dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected a {ndim}-D tensor (experts first)")
    return t


def _importer_scales(name, t, layout):
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float16, torch.bfloat16) or t.dim() != 3:
        raise TypeError(f"{name}: got {getattr(t, 'dtype', type(t).__name__)}, expected a 3-D float16 or "
                        f"bfloat16 tensor {layout}")


def _int4_canonical(u, zp, scale):
    """Unsigned nibbles u [E, N, K], integer zero points zp [E, K/g, N] (None: symmetric, 8)
    and scales [E, K/g, N] -> (packed, scale, zero) as prepare_weights takes them."""
    q = (u.to(torch.int16) - 8).to(torch.int8)
    zero = None if zp is None else ((8 - zp.float()) * scale.float()).to(scale.dtype).contiguous()
    return quant4.pack_nibbles(q & 0x0F), scale.contiguous(), zero


def _check_groups(name, n_groups, K):
    g = K // n_groups if n_groups and K % n_groups == 0 else None
    groups = QuantMode.W4A16_INT4.spec.weight_format.groups
    if g not in groups:
        raise ValueError(f"{name}: got {n_groups} groups along K={K}, expected K/g for g in {list(groups)}")
    return g


def from_awq(qweight, qzeros, scales) -> tuple:
    """AWQ (GEMM layout): qweight int32 [E, K, N/8] (nibble order 0,4,1,5,2,6,3,7), qzeros int32
    [E, K/g, N/8] (the same packing), scales [E, K/g, N] (fp16/bf16) -> (w uint8 [E, N, K/2],
    scale [E, K/g, N], zero [E, K/g, N])."""
    _importer_tensor("qweight", qweight, torch.int32, 3)
    _importer_tensor("qzeros", qzeros, torch.int32, 3)
    _importer_scales("scales", scales, "[E, K/g, N]")
    E, K, n8 = qweight.shape
    N = 8 * n8
    if tuple(scales.shape[::2]) != (E, N) or tuple(qzeros.shape) != (E, scales.shape[1], n8):
        raise ValueError(f"scales/qzeros: got {tuple(scales.shape)} and {tuple(qzeros.shape)}, expected [E, K/g, N] = "
                         f"({E}, K/g, {N}) and [E, K/g, N/8] = ({E}, K/g, {n8}) for qweight {tuple(qweight.shape)}")
    _check_groups("scales", scales.shape[1], K)
    inverse = torch.tensor([AWQ_PACK_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(x):  # [E, R, N/8] -> [E, R, N] in column order
        return _int32_nibbles(x)[..., inverse].flatten(-2)
    return _int4_canonical(unpack(qweight).transpose(1, 2), unpack(qzeros), scales)


def from_gptq(qweight, scales, qzeros=None, g_idx=None, *, zeros_offset=1) -> tuple:
    """GPTQ: qweight int32 [E, K/8, N] (8 rows of K per int32, in order), scales [E, K/g, N],
    qzeros int32 [E, K/g, N/8] or None for symmetric checkpoints (zero point 8). zeros_offset:
    what to add to the stored zero points (1 for the original GPTQ format, which stores zp - 1;
    0 for gptq_v2). An act-order g_idx is taken only if it is the plain one (k // g): a
    permuted one would need the activations permuted too, which the kernels do not do.
    Returns (w uint8 [E, N, K/2], scale [E, K/g, N], zero [E, K/g, N] or None)."""
    _importer_tensor("qweight", qweight, torch.int32, 3)
    _importer_scales("scales", scales, "[E, K/g, N]")
    E, k8, N = qweight.shape
    K = 8 * k8
    if tuple(scales.shape[::2]) != (E, N):
        raise ValueError(f"scales: got shape {tuple(scales.shape)}, expected [E, K/g, N] = ({E}, K/g, {N})")
    g = _check_groups("scales", scales.shape[1], K)
    if g_idx is not None:
        plain = torch.arange(K, device=g_idx.device) // g
        if tuple(g_idx.shape[-1:]) != (K,) or not bool((g_idx.long() == plain).all()):
            raise ValueError("g_idx: got an act-order (desc_act) permutation, expected None or k // group_size "
                             "(re-quantize without desc_act; permuted groups are not supported)")
    u = _int32_nibbles(qweight).permute(0, 1, 3, 2).reshape(E, K, N).transpose(1, 2)
    zp = None
    if qzeros is not None:
        _importer_tensor("qzeros", qzeros, torch.int32, 3)
        if tuple(qzeros.shape) != (E, scales.shape[1], N // 8):
            raise ValueError(f"qzeros: got shape {tuple(qzeros.shape)}, expected [E, K/g, N/8] = "
                             f"({E}, {scales.shape[1]}, {N // 8})")
        zp = _int32_nibbles(qzeros).flatten(-2) + zeros_offset
        if bool((zp > 15).any()):
            raise ValueError(f"qzeros: zero points past 15 with zeros_offset={zeros_offset}; expected "
                             "zeros_offset=0 for gptq_v2 checkpoints")
    return _int4_canonical(u, zp, scales)


def from_compressed_tensors(weight_packed, weight_scale, weight_zero_point=None) -> tuple:
    """compressed-tensors pack-quantized INT4: weight_packed int32 [E, N, K/8] (8 values along K
    per int32, in order, stored as q + 8), weight_scale [E, N, K/g], and for asymmetric
    checkpoints weight_zero_point: int32 [E, N/8, K/g] packed along N (8 rows per int32, stored
    as z + 8, as compressed-tensors writes it) or int8 [E, N, K/g] unpacked; w = (q - z) * scale.
    Returns (w uint8 [E, N, K/2], scale [E, K/g, N], zero [E, K/g, N] or None)."""
    _importer_tensor("weight_packed", weight_packed, torch.int32, 3)
    _importer_scales("weight_scale", weight_scale, "[E, N, K/g]")
    E, N, k8 = weight_packed.shape
    K = 8 * k8
    if tuple(weight_scale.shape[:2]) != (E, N):
        raise ValueError(f"weight_scale: got shape {tuple(weight_scale.shape)}, expected [E, N, K/g] = ({E}, {N}, K/g)")
    _check_groups("weight_scale", weight_scale.shape[-1], K)
    u = _int32_nibbles(weight_packed).flatten(-2)
    zp = None
    if weight_zero_point is not None:
        groups = weight_scale.shape[-1]
        zp_t = weight_zero_point
        if not isinstance(zp_t, torch.Tensor) or zp_t.dtype not in (torch.int32, torch.int8):
            raise TypeError(f"weight_zero_point: got {getattr(zp_t, 'dtype', type(zp_t).__name__)}, expected "
                            f"int32 [E, N/8, K/g] (packed) or int8 [E, N, K/g]")
        packed = zp_t.dtype == torch.int32
        want = (E, N // 8, groups) if packed else (E, N, groups)
        if tuple(zp_t.shape) != want or (packed and N % 8):
            raise ValueError(f"weight_zero_point: got shape {tuple(zp_t.shape)} ({zp_t.dtype}), expected "
                             f"{list(want)} for weight_packed {tuple(weight_packed.shape)}")
        if packed:  # [E, N/8, G] -> nibbles [E, N/8, G, 8] -> [E, N, G]
            zp = _int32_nibbles(zp_t).permute(0, 1, 3, 2).reshape(E, N, groups)
        else:
            if bool(((zp_t < -8) | (zp_t > 7)).any()):
                raise ValueError(f"weight_zero_point: int8 zero points from {int(zp_t.min())} to {int(zp_t.max())}, "
                                 "expected signed INT4 values in [-8, 7]")
            zp = zp_t.long() + 8
        zp = zp.transpose(1, 2)  # [E, K/g, N]
    return _int4_canonical(u, zp, weight_scale.transpose(1, 2))


def from_gpt_oss(gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None,
                 down_bias=None) -> dict:
    """gpt-oss MXFP4 experts as stored: *_blocks uint8 [E, N, K/32, 16] (two E2M1 per byte),
    *_scales uint8 E8M0 [E, N, K/32], bf16 biases, gate/up rows interleaved (even rows gate,
    odd rows up). Returns prepare_weights' arguments (w13 [gate; up], w2, scales, biases) for
    quant="w4a16_mxfp4" and activation="swiglu_oai" (alpha 1.702, limit 7.0 as gpt-oss)."""
    out = {}
    for which, blocks, scales in (("w13", gate_up_blocks, gate_up_scales), ("w2", down_blocks, down_scales)):
        name = "gate_up" if which == "w13" else "down"
        _importer_tensor(f"{name}_blocks", blocks, torch.uint8, 4)
        _importer_tensor(f"{name}_scales", scales, torch.uint8, 3)
        E, N, G, B = blocks.shape
        if B != 16 or tuple(scales.shape) != (E, N, G):
            raise ValueError(f"{name}_blocks/{name}_scales: got {tuple(blocks.shape)} and {tuple(scales.shape)}, "
                             f"expected [E, N, K/32, 16] and [E, N, K/32]")
        out[which], out[f"{which}_scale"] = blocks.reshape(E, N, G * 16), scales
    if gate_up_bias is not None:
        _check("gate_up_bias", gate_up_bias, (torch.bfloat16, torch.float16), tuple(out["w13"].shape[:2]))
    if down_bias is not None:
        _check("down_bias", down_bias, (torch.bfloat16, torch.float16), tuple(out["w2"].shape[:2]))
    if out["w13"].shape[1] % 2:
        raise ValueError(f"gate_up_blocks: got {out['w13'].shape[1]} rows, expected an even number (gate, up pairs)")

    def deinterleave(t):  # rows (g0, u0, g1, u1, ...) -> (g0, g1, ..., u0, u1, ...)
        return None if t is None else torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    return {"w13": deinterleave(out["w13"]), "w13_scale": deinterleave(out["w13_scale"]),
            "w2": out["w2"].contiguous(), "w2_scale": out["w2_scale"].contiguous(),
            "w13_bias": deinterleave(gate_up_bias), "w2_bias": down_bias}


# ---- FlashInfer-named helpers (its SM90 mixed-input MoE), for users switching from it --------

_INTERLEAVE_QUANT_TYPES = {"fp4": "w4a16_mxfp4", "fp4_fp8": "w4a8_mxfp4", "int4": "w4a16_int4"}


def interleave_moe_weights_for_sm90_mixed_gemm(weight, quant_type: str = "fp4") -> torch.Tensor:
    """4-bit expert weights in the checkpoint packing, uint8 [E, N, K/2] (two values per byte
    along K, the even k in the low nibble), repacked into the prepared layout this package's
    W4A16 and W4A8 kernels read: uint8 [E, ceil(K/128), N/16, 1024], K zero-padded to a
    multiple of 128 (moe_kernels.quant4.prepare_packed; what prepare_weights returns).

    FlashInfer's kernels read its own interleaved layout and these the fragment layout, so
    pass the checkpoint's weights here (not FlashInfer's output) once at load time.
    quant_type: "fp4" (MXFP4 x 16-bit, w4a16_mxfp4: the placed layout) and "fp4_fp8" (MXFP4 x
    FP8, w4a8_mxfp4), repacked without a value shuffle, or "int4" (INT4, with 16-bit or FP8
    activations), with CUTLASS's. Weights already prepared (4-D) are returned as they are."""
    if quant_type not in _INTERLEAVE_QUANT_TYPES:
        raise ValueError(f"quant_type: got {quant_type!r}, expected one of {list(_INTERLEAVE_QUANT_TYPES)}")
    mode = QuantMode.parse(_INTERLEAVE_QUANT_TYPES[quant_type]).spec
    if quant4.is_prepared(weight):  # prepared once already: N is 16 * shape[2], K was checked then
        N = quant4.FRAGMENT_ROWS * weight.shape[2]
        if N % mode.align:
            raise ValueError(f"weight: got prepared weights of N={N} rows, expected a multiple of {mode.align} "
                             f"for quant_type={quant_type!r} ({mode.why_align})")
        return weight.contiguous()
    _importer_tensor("weight", weight, torch.uint8, 3)
    N, K = weight.shape[1], weight.shape[2] * 2
    if N % mode.align or K % mode.align:
        raise ValueError(f"weight: got N={N} rows and K={K} values per row, expected both multiples of "
                         f"{mode.align} for quant_type={quant_type!r} ({mode.why_align})")
    return quant4.prepare_packed(weight.contiguous(), quant4.prepared_layout(mode))


def interleave_moe_scales_for_sm90_mixed_gemm(scales, group_size: int = 32, dtype=torch.bfloat16, *,
                                              quant_type: str = "fp4") -> torch.Tensor:
    """MXFP4 E8M0 scales uint8 [E, N, K/group_size] (as checkpoints store them) as this package's
    kernels read them: 2^(e - 127) in the hidden dtype `dtype`, [E, K/32, N], for quant_type
    "fp4" (w4a16_mxfp4) times 2^126 (bfloat16) or 2^14 (float16), for "fp4_fp8" (w4a8_mxfp4)
    as they are (what prepare_weights returns; quant4.mxfp4_scales). group_size must be 32
    (OCP MX)."""
    if group_size != quant4.MX_GROUP:  # checked before anything is computed from it
        raise ValueError(f"group_size: got {group_size!r}, expected {quant4.MX_GROUP} (MXFP4's scale group)")
    if quant_type not in ("fp4", "fp4_fp8"):
        raise ValueError(f"quant_type: got {quant_type!r}, expected 'fp4' or 'fp4_fp8' (MXFP4's)")
    _importer_tensor("scales", scales, torch.uint8, 3)
    if bool((scales == quant4.E8M0_NAN).any()):
        raise ValueError(f"scales: got NaN (E8M0 {quant4.E8M0_NAN}), expected usable scales")
    placed = QuantMode.parse(_INTERLEAVE_QUANT_TYPES[quant_type]).spec.e2m1_placed
    return quant4.mxfp4_scales(scales, dtype, "scales", placed=placed)
