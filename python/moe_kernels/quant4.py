"""4-bit weights (INT4 and MXFP4): the one definition that `prepare`, `reference` and the
tests follow, as fp8.py is for E4M3.

Two layouts of the weights [E, N, K] (the weight formats `int4` and `mxfp4` of moe_kernels.modes):
- Storage, the checkpoint packing (what the importers return and `prepare_weights` takes):
  uint8 [E, N, K/2], row n's byte b holding k = 2b in its low nibble and k = 2b + 1 in its high.
- Prepared, the fragment layout (what `prepare_weights` returns and `fused_moe` takes):
  `prepare_packed` pads K with zero bytes to a multiple of 128 (gpt-oss's 2880 -> 2944) and
  tiles it, uint8 [E, ceil(K/128), N/16, 1024]: per expert, 1 KB atoms of 16 rows x 128 k,
  atom (row block n/16, K slice k/128) at [k/128, n/16]; inside one, lane 4g + t (g = n % 8,
  t = (k % 8) / 2) owns bytes 32 lane .. 32 lane + 31, its word j (bytes 32 lane + 4j ..,
  j = (k % 128) / 16) holding its m16n8k16 A registers a0..a3 (rows g and g + 8, k 2t, 2t + 1 and + 8),
  a_i in nibbles i and i + 4 for INT4 (CUTLASS's value shuffle), 2i and 2i + 1 for MXFP4
  (the format's `fragment_shuffle`). Why: each GPU thread's 16-byte loads are exactly its
  MMA A-fragment registers, and a 64-row block's K step of 128 is 4 KB in one piece.
  `unprepare` is the inverse; the layout's details are below. MXFP4 weights for 16-bit tokens
  (w4a16_mxfp4) go one step further, each word's codes placed bit by bit for a mask-and-shift
  conversion (PLACED, `place_e2m1`, below), their scales folded; `prepared_layout` names a
  mode's.
The 3-D storage and the 4-D prepared shape are what tell the two apart (`is_prepared`).

Values and scales (scales and zero terms are not repacked, and count the unpadded K):
- INT4: signed values -8..7 (two's complement nibbles), one scale per group of g along K
  ([E, K/g, N], N contiguous, in the hidden dtype) and, for asymmetric checkpoints, an
  additive zero term in the same layout and dtype: dequantized = q * scale + zero. A checkpoint's unsigned
  nibble u with integer zero point z becomes q = u - 8 and zero = (8 - z) * scale.
- MXFP4 (OCP MX): E2M1 values (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one
  E8M0 exponent per 32 along K ([E, N, K/32] uint8): dequantized = e2m1 * 2^(e - 127);
  e = 255 is NaN and is refused by `prepare`. The kernels take the scales as 16-bit powers
  of two in INT4's layout ([E, K/32, N], `mxfp4_scales`), which `prepare_weights` makes
  (w4a16_mxfp4: times 2^126 for bf16, 2^14 for fp16, PLACED_FOLD).
"""
from __future__ import annotations

import torch

from . import fp8
from .modes import WEIGHT_FORMATS, WeightFormat

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

def dequantize_mxfp4(packed, scale, placed: bool = False) -> torch.Tensor:
    """float32 [..., N, K] = e2m1 * 2^(e - 127): from the checkpoint's E8M0 exponents (uint8
    [..., N, K/32]) or the kernels' 16-bit scales ([..., K/32, N], mxfp4_scales; placed: those
    of the placed layout, times 2^PLACED_FOLD)."""
    v = _lut(packed.device)[unpack_nibbles(packed).long()]
    if scale.dtype != torch.uint8:
        s = scale.float() * 2.0 ** -PLACED_FOLD[scale.dtype] if placed else scale.float()
        return v * expand_groups(s.transpose(-1, -2), v.shape[-1])
    exp = scale.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(v, expand_groups(exp, v.shape[-1]).float())


def mxfp4_scales(scale_e8m0: torch.Tensor, dtype, name: str = "scale", placed: bool = False) -> torch.Tensor:
    """The kernels' MXFP4 scales: E8M0 uint8 [..., N, K/32] -> 2^(e - 127) in `dtype` (bfloat16
    or float16, the hidden states'), [..., K/32, N] like INT4's; placed (weights in the placed
    layout): 2^(e - 127 + PLACED_FOLD[dtype]). Exact: every E8M0 value is a bfloat16; a float16
    holds 2^-24 .. 2^15 only; other exponents, and folded ones past 2^1, are refused."""
    exp = scale_e8m0.to(torch.int32) - E8M0_BIAS
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: got {dtype}, expected torch.bfloat16 or torch.float16")
    fold = PLACED_FOLD[dtype] if placed else 0
    top = 15 if dtype == torch.float16 else 127  # the largest power of two of the dtype
    if exp.numel():
        lo, hi = int(exp.min()) + fold, int(exp.max()) + fold
        if hi > top or (dtype == torch.float16 and lo < -24):
            held = f"2^{-24 - fold} .. 2^{top - fold}" if dtype == torch.float16 else f"at most 2^{top - fold}"
            why = (f" (the placed layout's scales are stored times 2^{fold}; w4a8_mxfp4 takes others)" if placed
                   else " (a float16 scale holds no other power of two); use bfloat16")
            raise ValueError(f"{name}: got E8M0 exponents 2^{lo - fold} .. 2^{hi - fold}, expected {held} for "
                             f"{'bfloat16' if dtype == torch.bfloat16 else 'float16'} hidden states{why}")
    exp = exp + fold
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


# ---- the fragment layout ------------------------------------------------------------------
# The weights once more, ordered so that a thread's bytes are the A operand of its MMAs: the
# layout CUTLASS's SM90 mixed-input GEMM reads as a per-group CuTe layout (its example 69), with
# the atom of compute_memory_reordering_atom<bf16, Layout<Shape<_1,_8>>, Layout<Shape<_2,_4>,
# Stride<_4,_1>>> tiled over (N, K), or with Layout<_1> in place of the value shuffle (every
# nibble's place of both checked equal on the CPU against CuTe's offsets for a 32 x 256 weight,
# CUTLASS 4.2). Per expert, atoms of 16 rows x 128 k (1 KB),
# atom (row block a, K slice s) at byte 1024 (a + N/16 s), so the 64 rows x 128 k of a decode
# block's K step are 4 KB in one piece. Inside an atom, lane 4g + t (g = row % 8, t = (k % 8) / 2)
# owns 32 bytes, one 32-bit word per 16-deep K block j: nibbles i and i + 4 of word j (without
# the value shuffle: 2i and 2i + 1) are the pair of the m16n8k16 / register-sourced wgmma A
# register a_i (a0: row g, k 2t and 2t + 1; a1:
# row g + 8, the same k; a2, a3: k + 8), so a conversion that takes nibbles i and i + 4 into
# the low and high halves of a 32-bit register gives the operand in place.

FRAGMENT_ROWS, FRAGMENT_K = 16, 128
FRAGMENT_BYTES = FRAGMENT_ROWS * FRAGMENT_K // 2  # one atom: 1 KB


def to_fragment_layout(packed: torch.Tensor, shuffle: bool = True) -> torch.Tensor:
    """uint8 [E, N, K/2] (the storage) -> uint8 [E, K/128, N/16, 1024], the fragment
    layout; N a multiple of 16 and K of 128. shuffle: CUTLASS's value shuffle (register a_i in
    nibbles i and i + 4 of its word, as CUTLASS's INT4 conversion takes them), else a_i in
    nibbles 2i and 2i + 1."""
    E, N, K = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    if N % FRAGMENT_ROWS or K % FRAGMENT_K:
        raise ValueError(f"packed: got N={N}, K={K}, expected multiples of {FRAGMENT_ROWS} and {FRAGMENT_K}")
    w = unpack_nibbles(packed)  # [E, N, K] codes
    # n = (row block a, h, g), k = (slice s, j, u, t, e); nibble order (s, a, g, t, j) then
    # (e, u, h) with the shuffle, (u, h, e) without
    w = w.reshape(E, N // 16, 2, 8, K // 128, 8, 2, 4, 2)  # e, a, h, g, s, j, u, t, e'
    w = w.permute(0, 4, 1, 3, 7, 5, *((8, 6, 2) if shuffle else (6, 2, 8)))
    return pack_nibbles(w.reshape(E, K // 128, N // 16, 2048))


def from_fragment_layout(tiled: torch.Tensor, shuffle: bool = True) -> torch.Tensor:
    """The inverse of to_fragment_layout: uint8 [E, K/128, N/16, 1024] -> [E, N, K/2]."""
    E, S, A = tiled.shape[0], tiled.shape[1], tiled.shape[2]
    w = unpack_nibbles(tiled).reshape(E, S, A, 8, 4, 8, 2, 2, 2)  # e, s, a, g, t, j, then 3 of (e', u, h)
    if shuffle:
        w = w.permute(0, 2, 8, 3, 1, 5, 7, 4, 6)  # from (e', u, h)
    else:
        w = w.permute(0, 2, 7, 3, 1, 5, 6, 4, 8)  # from (u, h, e')
    return pack_nibbles(w.reshape(E, 16 * A, 128 * S))


# ---- the placed layout: MXFP4 for 16-bit tensor cores --------------------------------------
# The fragment layout's MXFP4 words once more, each word's eight E2M1 codes stored bit by bit:
# register r's element e (nibble 2r + e of the fragment word) has its bits m, e0, e1, s at
# PLACED_BITS[r][e]. A mask (register 0), a shift left by 4 or a rotate left by 10 and a mask
# (registers 1, 2), or two shifts and two masks (register 3: left by 6 for m, e0, s, right by 2
# for e1) put a pair in bf16's sign, lowest two exponent bits and top mantissa bit, the bf16 of
# the E2M1 value times 2^-126 exactly (0.5 as a bf16 subnormal): 9 instructions a word instead
# of a 17-instruction byte lookup (decode_w4::E2M1Placed). For fp16 each such register shifted
# left by 3 and or-ed with itself, then masked, is the fp16 of the value times 2^-14 (two
# instructions more a register). The scales are stored times 2^PLACED_FOLD[dtype], which a
# bf16 and an fp16 hold for E8M0 exponents up to 128 (scales up to 2). The weights of the MXFP4
# modes with 16-bit tokens (modes.Mode.e2m1_placed: w4a16_mxfp4) are in it.

PLACED_BITS = (((6, 7, 8, 15), (22, 23, 24, 31)),
               ((2, 3, 4, 11), (18, 19, 20, 27)),
               ((28, 29, 30, 5), (12, 13, 14, 21)),
               ((0, 1, 10, 9), (16, 17, 26, 25)))
PLACED_FOLD = {torch.bfloat16: 126, torch.float16: 14}
PLACED = "mxfp4_placed"  # the prepared layout's name where a weight format's would be


def _words(t: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] -> its little-endian 32-bit words as int64 [..., n], 0 .. 2^32 - 1."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """The inverse of _words."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).view(torch.uint8)


def place_e2m1(tiled: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights in the fragment layout (uint8, last dimension a multiple of 4) -> the
    placed layout: each 32-bit word's codes moved to PLACED_BITS."""
    w, out = _words(tiled), None
    for r in range(4):
        for e in range(2):
            code = (w >> (4 * (2 * r + e))) & 15
            for b, pos in enumerate(PLACED_BITS[r][e]):
                bit = ((code >> b) & 1) << pos
                out = bit if out is None else out | bit
    return _bytes(out)


def unplace_e2m1(placed: torch.Tensor) -> torch.Tensor:
    """The inverse of place_e2m1."""
    w, out = _words(placed), None
    for r in range(4):
        for e in range(2):
            for b, pos in enumerate(PLACED_BITS[r][e]):
                bit = ((w >> pos) & 1) << (4 * (2 * r + e) + b)
                out = bit if out is None else out | bit
    return _bytes(out)


def prepared_layout(mode) -> str:
    """The prepared layout of a 4-bit mode's weights (a modes.Mode): its weight format's name
    ("int4", "mxfp4"), or PLACED."""
    return PLACED if mode.e2m1_placed else mode.weight


# ---- prepared weights: the fragment layout of a weight format, K padded -----------------------

def fragment_format(fmt) -> WeightFormat:
    """The weight format (a WeightFormat or its name in modes.WEIGHT_FORMATS, or PLACED: MXFP4's)
    whose weights fused_moe takes in the fragment layout, else ValueError."""
    spec = WEIGHT_FORMATS.get("mxfp4" if fmt == PLACED else fmt) if isinstance(fmt, str) else fmt
    if not isinstance(spec, WeightFormat) or not spec.fragment_layout:
        raise ValueError(f"fmt: got {fmt!r}, expected a weight format prepared in the fragment layout, one of "
                         f"{[n for n, f in WEIGHT_FORMATS.items() if f.fragment_layout] + [PLACED]}")
    return spec


def prepared_shape(E: int, N: int, K: int) -> tuple:
    """The prepared shape of 4-bit weights [E, N, K] (K unpadded): (E, ceil(K/128), N/16, 1024)."""
    if N % FRAGMENT_ROWS:
        raise ValueError(f"N: got {N}, expected a multiple of {FRAGMENT_ROWS} (the fragment layout's rows)")
    return (E, -(-K // FRAGMENT_K), N // FRAGMENT_ROWS, FRAGMENT_BYTES)


def is_prepared(t) -> bool:
    """t has the prepared form: a 4-D uint8 tensor of 1 KB atoms (not checked against sizes)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 4 and t.shape[-1] == FRAGMENT_BYTES


def pad_k(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] zero-padded along K to a multiple of 128 (zero nibbles: INT4 0, E2M1 +0)."""
    half = FRAGMENT_K // 2
    pad = -packed.shape[-1] % half
    return torch.nn.functional.pad(packed, (0, pad)) if pad else packed


def prepare_packed(packed: torch.Tensor, fmt) -> torch.Tensor:
    """Checkpoint-packed 4-bit weights uint8 [E, N, K/2] -> prepared uint8 [E, ceil(K/128), N/16,
    1024]: K zero-padded to a multiple of 128, then the fragment layout with the format's value
    shuffle (fmt: "int4" or "mxfp4", or the WeightFormat), or PLACED: MXFP4's words then placed
    (place_e2m1). N must be a multiple of 16."""
    spec = fragment_format(fmt)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 3:
        raise ValueError(f"packed: got {getattr(packed, 'dtype', type(packed).__name__)} "
                         f"{tuple(getattr(packed, 'shape', ()))}, expected uint8 [E, N, K/2]")
    E, N, K = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    out = packed.new_empty(prepared_shape(E, N, K))
    for e in range(E):  # one expert at a time: the unpacked, permuted temporaries are 4x its bytes
        out[e] = to_fragment_layout(pad_k(packed[e:e + 1]), shuffle=spec.fragment_shuffle)[0]
        if fmt == PLACED:
            out[e] = place_e2m1(out[e])
    return out


def unprepare(tiled: torch.Tensor, K: int, fmt) -> torch.Tensor:
    """The inverse of prepare_packed: prepared uint8 [E, ceil(K/128), N/16, 1024] -> the
    checkpoint packing uint8 [E, N, K/2], the padding cut off (K: the unpadded size)."""
    spec = fragment_format(fmt)
    if not is_prepared(tiled):
        raise ValueError(f"tiled: got {getattr(tiled, 'dtype', type(tiled).__name__)} "
                         f"{tuple(getattr(tiled, 'shape', ()))}, expected prepared uint8 [E, K/128, N/16, 1024]")
    if K % 2 or -(-K // FRAGMENT_K) != tiled.shape[1]:
        raise ValueError(f"K: got {K}, expected an even K with ceil(K/128) = {tiled.shape[1]} (the prepared "
                         f"tensor {tuple(tiled.shape)})")
    if fmt == PLACED:
        tiled = unplace_e2m1(tiled)
    return from_fragment_layout(tiled, shuffle=spec.fragment_shuffle)[..., :K // 2].contiguous()
