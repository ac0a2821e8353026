"""What the three stack wrappers share: the one call into the core forward, argument checks
in the stacks' own names, the layout conversions, and the cache that makes each conversion
once per source tensor.

The layout cache: a conversion (gate/up rows de-interleaved or swapped, 4-bit weights
repacked into the prepared layout the kernels read, scales transposed) is computed the first
time a source tensor is seen and kept, keyed by the source's data pointer, shape, strides,
dtype, device and version counter. An entry holds the converted copy (as large as the part of
the source it converts) and a reference to its sources, so a source's memory is never reused
while its entry can still be hit. The cache
holds at most `set_cache_size(n)` entries (least recently used first out); `clear_cache()`
frees them all. A source changed in place without bumping its version counter (through
`.data`, or an inference-mode tensor, which has none) is not seen: call `clear_cache()`.
For no copy at all, convert the weights once at load time (the helpers below are public)
and call `moe_kernels.fused_moe` with them.
"""
from __future__ import annotations

import collections
import threading

import torch

from .. import api, quant4
from ..problem import check_kind, fail

GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
# "No clamp" as a finite number (FlashInfer's DEFAULT_SWIGLU_LIMIT): the kernels take a float.
NO_LIMIT = float(torch.finfo(torch.float32).max)


def core_fused_moe(*args, **kwargs):
    """The one call into the core forward; looked up at call time so tests can patch
    moe_kernels.api.fused_moe."""
    return api.fused_moe(*args, **kwargs)


# ---- argument checks in the caller's names -----------------------------------------------

def tensor_arg(name, t, ndim=None, dtype=None, optional=False):
    """t as a torch.Tensor of `ndim` dimensions (and one of `dtype`), else TypeError/ValueError."""
    if t is None and optional:
        return None
    return check_kind(name, t, dtype=dtype, ndim=ndim)


def check_routing(hidden_states, w1, w2, topk_weights, topk_ids, names, weight_ndim=3):
    """The shapes every stack's forward agrees on, checked in the stack's argument names
    (names: hidden, w1, w2, weights, ids); the core checks the rest. weight_ndim: the weights'
    dimensions (None: not checked here, for a caller that takes 3-D and 4-D ones)."""
    n_x, n_w1, n_w2, n_wt, n_id = names
    tensor_arg(n_x, hidden_states, 2)
    tensor_arg(n_w1, w1, weight_ndim)
    tensor_arg(n_w2, w2, weight_ndim)
    tensor_arg(n_wt, topk_weights, 2)
    tensor_arg(n_id, topk_ids, 2)
    if w1.shape[0] != w2.shape[0]:
        fail(n_w2, f"shape {tuple(w2.shape)}", f"{w1.shape[0]} experts, as {n_w1} {tuple(w1.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        fail(n_wt, f"shape {tuple(topk_weights.shape)}", f"the shape of {n_id} {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] != hidden_states.shape[0]:
        fail(n_id, f"shape {tuple(topk_ids.shape)}", f"{hidden_states.shape[0]} rows, one per token of {n_x}")


def flag(name, value):
    if not isinstance(value, bool):
        fail(name, repr(value), "a bool", TypeError)
    return value


def optional_float(name, value):
    """A float (or an int), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, repr(value), "a float or None", TypeError)
    return float(value)


def core_options(*, apply_router_weight_on_input=False, routed_scaling_factor=None, expert_map=None):
    """The core's routing options, passed only when they change something, so a forward that
    uses none of them makes the same call as before they existed."""
    kw = {}
    if apply_router_weight_on_input:
        kw["apply_router_weight_on_input"] = True
    if routed_scaling_factor is not None and routed_scaling_factor != 1.0:
        kw["routed_scaling_factor"] = float(routed_scaling_factor)
    if expert_map is not None:
        kw["expert_map"] = expert_map
    return kw


def check_router_weight_on_input(name, apply, topk_ids, w1_bias=None, bias_name="w1_bias"):
    """The core scales the input by the router weight; the stacks' Triton kernels scale GEMM1's
    output after its bias: the same only without a GEMM1 bias (Llama 4 has none)."""
    if not flag(name, apply):
        return
    if topk_ids.shape[1] != 1:
        fail(name, f"True with top_k={topk_ids.shape[1]}",
             "top_k == 1 (the router weight scales the input, as Llama 4 does)")
    if w1_bias is not None:
        fail(name, f"True with {bias_name}", f"{bias_name}=None: the Triton kernels scale GEMM1's output "
             "including its bias, the core scales the input", NotImplementedError)


# ---- the layout cache --------------------------------------------------------------------

def _tensor_key(t):
    if t is None:
        return None
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), version)


class LayoutCache:
    """Converted tensors keyed by their sources (see the module docstring)."""

    def __init__(self, maxsize: int = 1024):
        self.maxsize = maxsize
        self._entries = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, sources: tuple, make, extra: tuple = ()):
        key = (kind, tuple(_tensor_key(s) for s in sources), extra)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[1]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"moe_kernels.integrations: the {kind} conversion of these weights is not cached yet and "
                "cannot run inside a CUDA graph capture; run one forward before capturing")
        with torch.no_grad():
            value = make()
        with self._lock:
            self._entries[key] = (sources, value)
            while len(self._entries) > max(self.maxsize, 0):
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def info(self) -> dict:
        """Entries held and the bytes of their converted tensors."""
        with self._lock:
            values = [v for _, v in self._entries.values()]

        def nbytes(v):
            if isinstance(v, torch.Tensor):
                return v.numel() * v.element_size()
            if isinstance(v, (tuple, list)):
                return sum(nbytes(x) for x in v)
            return 0
        return {"entries": len(values), "bytes": sum(nbytes(v) for v in values), "maxsize": self.maxsize}


CACHE = LayoutCache()


def clear_cache() -> None:
    """Free every converted tensor the integrations hold."""
    CACHE.clear()


def set_cache_size(entries: int) -> None:
    """At most `entries` conversions kept (a few per MoE layer: weights, biases, scales)."""
    if not isinstance(entries, int) or isinstance(entries, bool) or entries < 0:
        fail("entries", repr(entries), "a non-negative int", ValueError)
    CACHE.maxsize = entries
    with CACHE._lock:
        while len(CACHE._entries) > entries:
            CACHE._entries.popitem(last=False)


def cache_info() -> dict:
    return CACHE.info()


def cached(kind, make, *sources, extra=()):
    """make(*sources) once per set of sources; None when the first source is None."""
    if sources[0] is None:
        return None
    return CACHE.get(kind, sources, lambda: make(*sources), extra)


def deinterleaved(t, dim=1):
    """deinterleave_gate_up(t, dim), once per source (None stays None)."""
    return cached("deinterleave", lambda s: deinterleave_gate_up(s, dim), t, extra=(dim,))


# ---- layout conversions (public: for load-time use) --------------------------------------

def deinterleave_gate_up(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Rows (g0, u0, g1, u1, ...) along `dim` -> (g0, g1, ..., u0, u1, ...): gpt-oss's
    interleaved gate/up projection as the core's [gate; up]."""
    if t.shape[dim] % 2:
        raise ValueError(f"got {t.shape[dim]} rows along dim {dim}, expected an even number (gate, up pairs)")
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order).contiguous()


def swap_halves(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """(a; b) along `dim` -> (b; a): FlashInfer/TensorRT-LLM's w31 [up; gate] as [gate; up]."""
    if t.shape[dim] % 2:
        raise ValueError(f"got {t.shape[dim]} rows along dim {dim}, expected an even number (two halves)")
    a, b = t.chunk(2, dim=dim)
    return torch.cat([b, a], dim=dim).contiguous()


def int4_from_unsigned(w: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] of unsigned nibbles u (0..15, value u - 8: vLLM's and SGLang's
    use_int4_w4a16 layout, the even k in the low nibble) as the core's two's complement
    nibbles of u - 8 (moe_kernels.quant4): (u - 8) mod 16 = u ^ 8, in both nibbles."""
    return (w ^ 0x88).contiguous()


def int4_scale_from_nk(s: torch.Tensor) -> torch.Tensor:
    """Group scales [E, N, K/g] (vLLM's and SGLang's) as the core's [E, K/g, N]."""
    return s.transpose(1, 2).contiguous()


def int4_zero_from_packed_zp(zp: torch.Tensor, scale_nk: torch.Tensor) -> torch.Tensor:
    """vLLM's and SGLang's INT4 zero points, uint8 [E, N/2, K/g] with two along N per byte (the
    even n in the low nibble), with their scales [E, N, K/g], as the core's additive zero
    terms [E, K/g, N]: (u - zp) * s = (u - 8) * s + (8 - zp) * s."""
    E, n2, G = zp.shape
    z = torch.stack([zp & 0x0F, zp >> 4], dim=2).reshape(E, 2 * n2, G)  # [E, N, K/g]
    zero = (8.0 - z.float()) * scale_nk.float()
    return zero.to(scale_nk.dtype).transpose(1, 2).contiguous()


def mxfp4_kernel_scales(s: torch.Tensor, dtype) -> torch.Tensor:
    """MXFP4 E8M0 scales uint8 [E, N, K/32] as the core's 16-bit [E, K/32, N] for w4a16_mxfp4
    (the placed layout's, quant4.mxfp4_scales)."""
    return quant4.mxfp4_scales(s, dtype, placed=True)


def prepared_4bit(w: torch.Tensor, layout: str) -> torch.Tensor:
    """4-bit weights in the core's checkpoint packing uint8 [E, N, K/2] (signed INT4 nibbles or
    E2M1) in the prepared layout the kernels read (moe_kernels.quant4.prepare_packed; layout:
    "int4", or quant4.PLACED for w4a16_mxfp4)."""
    return quant4.prepare_packed(w.contiguous(), layout)


# ---- the Triton-style quantization arguments (vLLM's and SGLang's fused_experts) ---------

FP8 = torch.float8_e4m3fn
TRITON_SUPPORTED = ("16-bit (bf16/fp16), use_fp8_w8a8 (per tensor, per channel, or block_shape=[128, 128]), "
                    "use_int4_w4a16, use_mxfp4_w4a16")


def _block_group(name, block_shape, K, scale_nk):
    """The INT4 group along K that block_shape ([0, g]) names, checked against the scales'."""
    g = K // scale_nk.shape[-1] if scale_nk.shape[-1] and K % scale_nk.shape[-1] == 0 else None
    if block_shape is not None:
        if (not isinstance(block_shape, (list, tuple)) or len(block_shape) != 2
                or block_shape[0] not in (0, None) or block_shape[1] != g):
            fail(name, repr(block_shape), f"None or [0, {g}] (the scales' group along K) for use_int4_w4a16")


def triton_weights(hidden_states, w1, w2, *, w1_scale, w2_scale, a1_scale, a2_scale, w1_zp, w2_zp,
                   w1_bias, w2_bias, block_shape, use_fp8_w8a8, use_int4_w4a16, use_mxfp4_w4a16,
                   per_channel_quant, interleaved, names=("w1_bias", "w2_bias")) -> dict:
    """The weights and scales of a Triton-style fused_experts call (vLLM's layouts, which
    SGLang's share) as the core's keyword arguments: quant (for quantized modes), w13/w2,
    biases, scales and zero terms. interleaved: w1's gate/up rows alternate (gpt-oss) and
    are de-interleaved, with every tensor indexed by them."""
    b1_name, b2_name = names
    tensor_arg(b1_name, w1_bias, 2, optional=True)
    tensor_arg(b2_name, w2_bias, 2, optional=True)
    for n, v in (("use_fp8_w8a8", use_fp8_w8a8), ("use_int4_w4a16", use_int4_w4a16),
                 ("use_mxfp4_w4a16", use_mxfp4_w4a16), ("per_channel_quant", per_channel_quant)):
        flag(n, v)
    if use_fp8_w8a8 + use_int4_w4a16 + use_mxfp4_w4a16 > 1:
        fail("use_fp8_w8a8/use_int4_w4a16/use_mxfp4_w4a16", (use_fp8_w8a8, use_int4_w4a16, use_mxfp4_w4a16),
             "at most one True")
    if w1.dtype == FP8 and not (use_int4_w4a16 or use_mxfp4_w4a16):
        use_fp8_w8a8 = True  # the weights say so, as the core infers it
    if per_channel_quant and not use_fp8_w8a8:
        fail("per_channel_quant", True, "False unless use_fp8_w8a8 (per-token activations, per-channel weights)")
    if use_fp8_w8a8:
        return _triton_fp8(w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, w1_zp, w2_zp, w1_bias, w2_bias,
                           block_shape, per_channel_quant, interleaved)
    if not (use_int4_w4a16 or use_mxfp4_w4a16):
        if w1.dtype == torch.uint8:
            fail("w1", "dtype torch.uint8", "16-bit weights, or use_int4_w4a16=True / use_mxfp4_w4a16=True for "
                 "4-bit ones", TypeError)
        for n, v in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale),
                     ("a2_scale", a2_scale), ("w1_zp", w1_zp), ("w2_zp", w2_zp), ("block_shape", block_shape)):
            if v is not None:
                fail(n, repr(v) if n == "block_shape" else "a tensor",
                     f"None for 16-bit weights (modes: {TRITON_SUPPORTED})")
        if interleaved:
            return {"w13": deinterleaved(w1), "w2": w2, "w13_bias": deinterleaved(w1_bias), "w2_bias": w2_bias}
        return {"w13": w1, "w2": w2, "w13_bias": w1_bias, "w2_bias": w2_bias}

    for n, v in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if v is not None:
            fail(n, "a static activation scale", "None for 16-bit activations (use_int4_w4a16, use_mxfp4_w4a16)")
    tensor_arg("w1", w1, 3, torch.uint8)
    tensor_arg("w2", w2, 3, torch.uint8)
    _check_4bit_sizes(hidden_states, w1, w2)
    hidden = hidden_states.dtype
    # Each source converted in one step, de-interleaved too where asked: one copy per tensor.
    rows = _deint(1) if interleaved else _same
    cols = _deint(2) if interleaved else _same  # the N of the core's [E, K/g, N] scales and zero terms
    if use_int4_w4a16:
        s1 = tensor_arg("w1_scale", w1_scale, 3)
        s2 = tensor_arg("w2_scale", w2_scale, 3)
        for n, s, w in (("w1_scale", s1, w1), ("w2_scale", s2, w2)):
            if s.shape[:2] != w.shape[:2]:
                fail(n, f"shape {tuple(s.shape)}", f"[E, N, K/g] with [E, N] = {tuple(w.shape[:2])} (as {n[:2]})")
        _block_group("block_shape", block_shape, 2 * w1.shape[2], s1)
        _block_group("block_shape", block_shape, 2 * w2.shape[2], s2)
        z1 = tensor_arg("w1_zp", w1_zp, 3, torch.uint8, optional=True)
        z2 = tensor_arg("w2_zp", w2_zp, 3, torch.uint8, optional=True)
        for n, z, s in (("w1_zp", z1, s1), ("w2_zp", z2, s2)):
            if z is not None and (z.shape[0], 2 * z.shape[1], z.shape[2]) != tuple(s.shape):
                fail(n, f"shape {tuple(z.shape)}", f"[E, N/2, K/g] = ({s.shape[0]}, {s.shape[1] // 2}, {s.shape[2]})")
        return {"quant": "w4a16_int4",
                "w13": cached("int4_w", lambda t: prepared_4bit(rows(int4_from_unsigned(t)), "int4"), w1,
                              extra=(interleaved,)),
                "w2": cached("int4_w", lambda t: prepared_4bit(int4_from_unsigned(t), "int4"), w2, extra=(False,)),
                "w13_scale": cached("int4_scale", lambda t: cols(int4_scale_from_nk(t)), s1, extra=(interleaved,)),
                "w2_scale": cached("int4_scale", int4_scale_from_nk, s2, extra=(False,)),
                "w13_zero": cached("int4_zero", lambda z, s: cols(int4_zero_from_packed_zp(z, s)), z1, s1,
                                   extra=(interleaved,)),
                "w2_zero": cached("int4_zero", int4_zero_from_packed_zp, z2, s2, extra=(False,)),
                "w13_bias": deinterleaved(w1_bias) if interleaved else w1_bias, "w2_bias": w2_bias}
    for n, v in (("w1_zp", w1_zp), ("w2_zp", w2_zp)):
        if v is not None:
            fail(n, "zero points", "None for use_mxfp4_w4a16 (MXFP4 has none)")
    if block_shape is not None:
        fail("block_shape", repr(block_shape), "None for use_mxfp4_w4a16 (its groups are 32 along K)")
    s1 = tensor_arg("w1_scale", w1_scale, 3, torch.uint8)
    s2 = tensor_arg("w2_scale", w2_scale, 3, torch.uint8)
    return {"quant": "w4a16_mxfp4",
            "w13": cached("mxfp4_w", lambda t: prepared_4bit(rows(t), quant4.PLACED), w1, extra=(interleaved,)),
            "w2": cached("mxfp4_w", lambda t: prepared_4bit(t, quant4.PLACED), w2, extra=(False,)),
            "w13_scale": cached("mxfp4_scale", lambda t: cols(mxfp4_kernel_scales(t, hidden)), s1,
                                extra=(hidden, interleaved)),
            "w2_scale": cached("mxfp4_scale", lambda t: mxfp4_kernel_scales(t, hidden), s2, extra=(hidden, False)),
            "w13_bias": deinterleaved(w1_bias) if interleaved else w1_bias, "w2_bias": w2_bias}


def _check_4bit_sizes(hidden_states, w1, w2):
    """The stack's 4-bit weights w1 [E, N1, H/2] and w2 [E, H, I/2] against the hidden size, in
    the stack's names, before they are repacked for the core (which checks the mode's alignment):
    the prepared layout takes rows in blocks of 16."""
    H = hidden_states.shape[1]
    for name, t, want in (("w1", w1, (w1.shape[0], w1.shape[1], H // 2)), ("w2", w2, (w1.shape[0], H, w2.shape[2]))):
        if tuple(t.shape) != want:
            fail(name, f"shape {tuple(t.shape)}", f"{want} (uint8 [E, N, K/2], two 4-bit values per byte along K)")
        if t.shape[1] % quant4.FRAGMENT_ROWS:
            fail(name, f"shape {tuple(t.shape)}", f"a multiple of {quant4.FRAGMENT_ROWS} rows (N)")


def _same(t):
    return t


def _deint(dim):
    return lambda t: deinterleave_gate_up(t, dim)


def _triton_fp8(w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, w1_zp, w2_zp, w1_bias, w2_bias, block_shape,
                per_channel_quant, interleaved) -> dict:
    tensor_arg("w1", w1, 3, FP8)
    tensor_arg("w2", w2, 3, FP8)
    for n, v in (("w1_zp", w1_zp), ("w2_zp", w2_zp)):
        if v is not None:
            fail(n, "zero points", "None for use_fp8_w8a8")
    s1 = tensor_arg("w1_scale", w1_scale, dtype=torch.float32)
    s2 = tensor_arg("w2_scale", w2_scale, dtype=torch.float32)
    if block_shape is not None:
        if not isinstance(block_shape, (list, tuple)) or list(block_shape) != [128, 128]:
            fail("block_shape", repr(block_shape), "None (per tensor / per channel) or [128, 128] (DeepSeek-V3 "
                 "blocks): the only FP8 block size with kernels", NotImplementedError)
        if per_channel_quant:
            fail("per_channel_quant", True, "False with block_shape (activations are quantized per 128 columns)")
        if interleaved:
            fail("activation", "'swigluoai' (interleaved gate/up rows) with block_shape=[128, 128]",
                 "contiguous gate/up halves: de-interleaving rows would split the 128-row scale blocks",
                 NotImplementedError)
        return {"quant": "fp8_block", "w13": w1, "w2": w2, "w13_scale": s1, "w2_scale": s2,
                "a13_scale": a1_scale, "a2_scale": a2_scale, "w13_bias": w1_bias, "w2_bias": w2_bias}
    if per_channel_quant and (a1_scale is not None or a2_scale is not None):
        fail("a1_scale/a2_scale", "static activation scales with per_channel_quant=True",
             "None: per_channel_quant quantizes activations per token, dynamically")
    out = {"quant": "fp8", "w13": w1, "w2": w2, "w13_scale": s1, "w2_scale": s2, "a13_scale": a1_scale,
           "a2_scale": a2_scale, "w13_bias": w1_bias, "w2_bias": w2_bias}
    if interleaved:
        out["w13"] = deinterleaved(w1)
        out["w13_bias"] = deinterleaved(w1_bias)
        if s1.dim() > 1 and s1.shape[1] > 1:  # per channel [E, 2I] or [E, 2I, 1]; per tensor stays
            out["w13_scale"] = deinterleaved(s1)
    return out
