"""A forward's arguments, validated once: the one place that checks what a caller passes.

Everything is checked on the host before anything is launched; an error names the argument,
what it got and what was expected. The rules come from the mode table (modes.py): the
dtypes, the scale tensors and their shapes, the H/I alignment. `c_shape` is the one place
the C ABI's shape (moek_shape) is built.
"""
from __future__ import annotations

import math

import torch

from . import _native, quant4
from .modes import MODES, Activation, Mode, QuantMode, ScaleSpec, WeightFormat

WORKSPACE_ALIGNMENT = 256
MAX_TOP_K = 1024  # the kernels keep a token's slots in shared memory (src/runner.cu kMaxTopK)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
_DTYPE_CODE = {"bf16": 0, "fp16": 1}  # moek_dtype
_INDEX_CODE = {torch.int32: 0, torch.int64: 1}


def fail(argument: str, got, expected: str, exc=ValueError):
    raise exc(f"{argument}: got {got}, expected {expected}")


def check_kind(name, t, *, dtype=None, ndim=None, device=None):
    """t is a torch.Tensor (on `device`, of one of `dtype`, with `ndim` dimensions where given)."""
    if not isinstance(t, torch.Tensor):
        fail(name, type(t).__name__, "a torch.Tensor", TypeError)
    if device is not None and t.device != device:
        fail(name, f"device {t.device}", f"device {device} (all tensors on one GPU)")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            fail(name, f"dtype {t.dtype}", " or ".join(str(d) for d in allowed), TypeError)
    if ndim is not None and t.dim() != ndim:
        fail(name, f"shape {tuple(t.shape)}", f"a {ndim}-D tensor")
    return t


def check_tensor(name, t, *, dtype=None, ndim=None, shape=None, device=None, align=16):
    check_kind(name, t, dtype=dtype, ndim=ndim, device=device)
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                fail(name, f"shape {tuple(t.shape)}",
                     "shape (" + ", ".join("*" if s is None else str(s) for s in shape) + f") "
                     f"(dimension {i} must be {want})")
    if not t.is_contiguous():
        fail(name, f"strides {t.stride()} for shape {tuple(t.shape)}", "a contiguous tensor")
    if align and t.numel() and not _is_fake(t) and t.data_ptr() % align:
        fail(name, f"data pointer {t.data_ptr():#x}", f"{align}-byte alignment")
    return t


def _is_fake(t) -> bool:
    """A tensor without data (torch.compile's fake tensors, meta tensors): no pointer to check."""
    return t.device.type == "meta" or type(t).__name__ == "FakeTensor"


# ---- the mode table, applied ------------------------------------------------------------------

def built_modes() -> set:
    """Modes this build has kernels for (in any of its per-arch libraries)."""
    return {k.mode for lib in _native.libraries() for k in lib["kernels"]}


def require_built(mode: QuantMode, device=None) -> None:
    """NotImplementedError for a mode without kernels: the modes this build runs first, then
    each library's modes and GPUs, and where the mode's kernels are built."""
    built = built_modes()
    if mode.value in built:
        return
    where = ""
    if isinstance(device, torch.device) and device.type == "cuda":
        info = _native.device_info(device.index if device.index is not None else torch.cuda.current_device())
        where = f" for {info['name']} (compute capability {info['major']}.{info['minor']})"
    libs = "; ".join(f"{lib['arch']} on {_native.arch_gpus(lib['arch'])}: "
                     + ", ".join(m for m in MODES if m in {k.mode for k in lib["kernels"]})
                     for lib in _native.libraries())
    archs = mode.spec.archs
    planned = (f"its kernels are built for {', '.join('sm' + a for a in archs)} (MOE_KERNELS_ARCHS)" if archs
               else "its kernels are not written yet")
    raise NotImplementedError(
        f"quant={mode.value!r} has no kernels{where} in this build of moe_kernels; it supports "
        f"{[m for m in MODES if m in built]} ({libs}); {planned}")


def parse_quant(quant, argument: str = "quant") -> QuantMode:
    """QuantMode.parse, whose error for an unknown name lists the modes this build runs first,
    then those declared without kernels in it."""
    try:
        return QuantMode.parse(quant, argument)
    except ValueError:
        built = built_modes()
        others = [m for m in MODES if m not in built]
        raise ValueError(f"{argument}={quant!r} is not a quantization mode; this build runs "
                         f"{[m for m in MODES if m in built]}"
                         + (f" (declared, without kernels in this build: {others})" if others else "")) from None


def out_dtype_name(mode: QuantMode, out_dtype=None) -> str:
    """The hidden/output dtype name of a mode's kernels: `out_dtype` (a name or torch dtype)
    if the mode takes it, by default the mode's first hidden dtype."""
    spec = mode.spec
    if out_dtype is None:
        return spec.hidden[0]
    name = DTYPE_NAMES.get(out_dtype, out_dtype)
    if name not in spec.hidden:
        fail("out_dtype", repr(out_dtype), f"one of {list(spec.hidden)} (or None) for quant={mode.value!r}")
    return name


def weight_dtype(spec: Mode, hidden: torch.dtype) -> torch.dtype:
    storage = spec.weight_format.storage
    return getattr(torch, storage) if storage else hidden


def _symbols(E, N, K, group) -> dict:
    return {"E": E, "N": N, "K": K, "N/128": -(-N // 128), "K/128": -(-K // 128),
            "K/g": K // group if group else None, 1: 1}


def accepted_scale_shapes(fmt: WeightFormat, E, N, K, group=None, spec: ScaleSpec | None = None) -> list:
    """The shapes a weight format's scale tensor may have for [E, N, K] weights. spec: which
    of its scale forms, by default the checkpoint's (fmt.scale; fused_moe takes
    fmt.kernel_scale)."""
    sym = _symbols(E, N, K, group or (fmt.groups[0] if fmt.groups else 0))
    return [tuple(sym[d] for d in shape) for shape in (spec or fmt.scale).shapes]


def scale_group(fmt: WeightFormat, scale, K: int, spec: ScaleSpec | None = None) -> int:
    """The group along K that a scale tensor's shape implies (its K/g dimension), where the
    format takes several; else the format's own (0: none)."""
    group = fmt.groups[0] if fmt.groups else 0
    spec = spec or fmt.scale
    if len(fmt.groups) > 1 and isinstance(scale, torch.Tensor):
        dim = spec.shapes[0].index("K/g")
        n = scale.shape[dim] if scale.dim() == len(spec.shapes[0]) else 0
        if n and K % n == 0 and K // n in fmt.groups:
            group = K // n
    return group


def weight_scale(name, scale, fmt: WeightFormat, E, N, K, device=None, values=False, align=None,
                 dtype=None, spec: ScaleSpec | None = None):
    """A weight scale tensor checked against its format's accepted shapes, as the canonical
    form: the first accepted shape with as many elements (checkpoints' trailing ones dropped).
    A format with several groups along K takes the one the tensor's last dimension implies.
    values: also check that every scale is usable (finite and positive; E8M0: not NaN) at
    load time. align: the data pointer's alignment, by default what the kernels need.
    dtype: the torch dtype(s) the format's "hidden" scales may have. spec: which of the
    format's scale forms (accepted_scale_shapes)."""
    spec = spec or fmt.scale
    scale_dtype = {"float32": torch.float32, "e8m0": torch.uint8}.get(spec.dtype, dtype)
    group = scale_group(fmt, scale, K, spec)
    shapes = accepted_scale_shapes(fmt, E, N, K, group, spec)
    if scale is None:
        fail(name, "NoneType", f"a torch.Tensor of {spec.dtype} scales {spec.what}, shape {shapes[0]}",
             TypeError)
    per_channel = isinstance(scale, torch.Tensor) and scale.numel() not in (E,)
    t = check_tensor(name, scale, dtype=scale_dtype, device=device,
                     # Per-channel float scales: 16-byte aligned, as the kernels that read them 8
                     # at a time once needed; not relaxed until tested. Group scales: TMA reads them.
                     align=align or (16 if (per_channel and len(shapes) > 1) or fmt.groups and
                                     spec.dtype == "hidden" else 4))
    if tuple(t.shape) not in shapes:
        groups = f"; groups along K: {list(fmt.groups)}" if len(fmt.groups) > 1 else ""
        fail(name, f"shape {tuple(t.shape)}", f"one of {shapes} ({spec.what}{groups})")
    if values:
        bad = (t == 255) if spec.dtype == "e8m0" else ~(torch.isfinite(t.float()) & (t.float() > 0))
        if bool(bad.any()):
            fail(name, "NaN (E8M0 255)" if spec.dtype == "e8m0" else "non-positive or non-finite values",
                 "usable scales" if spec.dtype == "e8m0" else "finite scales > 0")
    canonical = next(s for s in shapes if _numel(s) == t.numel())
    return t.reshape(canonical)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def static_act_scale(name, scale, mode: Mode, device=None):
    """A static per-tensor activation scale (a one-element float32 tensor) for formats that
    take one, else None is required."""
    if scale is None:
        return None
    if not mode.act_format.static_scale:
        fail(name, "a static activation scale", f"None for quant={mode.name!r} (its activation format "
             f"{mode.act!r} quantizes dynamically: {mode.act_format.doc})")
    t = check_tensor(name, scale, dtype=torch.float32, device=device, align=4)
    if t.numel() != 1:
        fail(name, f"shape {tuple(t.shape)}", "one element (a per-tensor scale), or None for per-token")
    return t


def check_alignment(mode: Mode, H: int, I: int, argument="hidden_states/w2") -> None:
    if H % mode.align or I % mode.align:
        fail(argument, f"hidden_size={H}, intermediate_size={I}",
             f"both multiples of {mode.align} for quant={mode.name!r} ({mode.why_align})")


def _prepared_dims(E, N, K) -> tuple:
    """quant4.prepared_shape without its check of N (for error messages of any sizes)."""
    return (E, -(-K // quant4.FRAGMENT_K), N // quant4.FRAGMENT_ROWS, quant4.FRAGMENT_BYTES)


def expert_weight_sizes(mode: Mode, gated: bool, H: int, w13, w2, *, dtype, device=None) -> tuple:
    """(E, I, n1) of the expert weights for hidden size H, after checking their dtype (the
    format's storage, or `dtype` for 16-bit weights), device, contiguity, alignment and shapes:
    w13 [E, n1, H] and w2 [E, H, I] (n1 = 2I for gated activations, else I; K divided by the
    values per byte where packed), or, for formats fused_moe takes in the fragment layout
    (4-bit), the prepared [E, ceil(H/128), n1/16, 1024] and [E, ceil(I/128), H/16, 1024] with
    I from w13 and checked against w2. 4-bit weights in the checkpoint packing (3-D) are
    refused with the way to prepare them."""
    wdtype = weight_dtype(mode, dtype)
    fmt = mode.weight_format
    if not fmt.fragment_layout:
        w13 = check_tensor("w13", w13, dtype=wdtype, ndim=3, device=device)
        w2 = check_tensor("w2", w2, dtype=wdtype, ndim=3, device=device)
        E = w13.shape[0]
        if E == 0:
            fail("w13", f"shape {tuple(w13.shape)}", "at least one expert")
        per = fmt.per_byte
        I = w2.shape[2] * per
        n1 = 2 * I if gated else I
        check_tensor("w13", w13, shape=(E, n1, H // per))
        check_tensor("w2", w2, shape=(E, H, I // per))
        check_alignment(mode, H, I)
        return E, I, n1
    for name, t in (("w13", w13), ("w2", w2)):
        check_kind(name, t, dtype=wdtype, device=device)
        if t.dim() == 3:  # the checkpoint packing [E, N, K/2]: the kernels read the prepared layout only
            fail(name, f"shape {tuple(t.shape)} (4-bit weights in the checkpoint packing [E, N, K/2])",
                 f"the prepared layout {_prepared_dims(t.shape[0], t.shape[1], 2 * t.shape[2])} = "
                 "[E, ceil(K/128), N/16, 1024]: pass the weights through moe_kernels.prepare.prepare_weights "
                 "(or moe_kernels.prepare.interleave_moe_weights_for_sm90_mixed_gemm) once at load time")
    w13 = check_tensor("w13", w13, ndim=4)
    w2 = check_tensor("w2", w2, ndim=4)
    E = w13.shape[0]
    if E == 0:
        fail("w13", f"shape {tuple(w13.shape)}", "at least one expert")
    n1 = quant4.FRAGMENT_ROWS * w13.shape[2]
    I = n1 // 2 if gated else n1
    check_alignment(mode, H, I, "hidden_states/w13")
    check_tensor("w13", w13, shape=_prepared_dims(E, n1, H))
    check_tensor("w2", w2, shape=_prepared_dims(E, H, I))
    return E, I, n1


def infer_mode(hidden_states, w13=None, w13_scale=None) -> QuantMode:
    """quant=None: the mode whose weight storage is w13's dtype (the scale's rank tells the
    E4M3 formats apart), else the 16-bit mode of the hidden states."""
    if isinstance(w13, torch.Tensor) and w13.dtype == torch.float8_e4m3fn:
        blocks = isinstance(w13_scale, torch.Tensor) and w13_scale.dim() == 3
        return QuantMode.FP8_BLOCK if blocks else QuantMode.FP8
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dtype not in DTYPE_NAMES:
        got = hidden_states.dtype if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        fail("hidden_states", f"dtype {got}", "torch.bfloat16 or torch.float16 (or pass quant=)", TypeError)
    return QuantMode.parse(DTYPE_NAMES[hidden_states.dtype])


def c_shape(*, T, H, I, E, k, dtype: str, mode: Mode, activation: Activation, index_dtype=torch.int32,
            expert_offset=0, alpha=1.0, limit=1.0, per_channel=(0, 0), weight_group=None, weight_zero=False,
            router_weight_on_input=False, routed_scaling_factor=1.0, expert_map_size=0) -> dict:
    """The C ABI's moek_shape, as a dict for the native module (src/python/module.cpp)."""
    return {"num_tokens": T, "hidden_size": H, "inter_size": I, "num_experts": E, "top_k": k,
            "expert_offset": expert_offset, "dtype": _DTYPE_CODE[dtype], "act_format": mode.act_code,
            "weight_format": mode.weight_code, "activation": activation.code,
            "index_dtype": _INDEX_CODE[index_dtype], "act_alpha": float(alpha), "act_limit": float(limit),
            "w13_scale_per_channel": int(per_channel[0]), "w2_scale_per_channel": int(per_channel[1]),
            # 4-bit formats: the scale group (by default the format's); the C ABI's 0 for others
            "weight_group": (weight_group or mode.weight_format.groups[0]) if mode.weight_format.group_scales16
            else 0,
            "weight_zero": int(weight_zero), "router_weight_on_input": int(router_weight_on_input),
            "routed_scaling_factor": float(routed_scaling_factor), "expert_map_size": expert_map_size}


def resolve_expert_offset(expert_offset, ep_rank, ep_size, num_experts, e_local) -> int:
    if ep_rank is not None or ep_size is not None:
        if expert_offset is not None:
            fail("expert_offset", expert_offset, "None when ep_rank/ep_size are given")
        if ep_rank is None or ep_size is None:
            fail("ep_rank/ep_size", (ep_rank, ep_size), "both given, or neither")
        if not (isinstance(ep_size, int) and ep_size >= 1 and isinstance(ep_rank, int) and 0 <= ep_rank < ep_size):
            fail("ep_rank/ep_size", (ep_rank, ep_size), "integers with 0 <= ep_rank < ep_size")
        if num_experts is not None and num_experts != e_local * ep_size:
            fail("num_experts", num_experts, f"ep_size * local experts = {ep_size} * {e_local}")
        return ep_rank * e_local
    offset = 0 if expert_offset is None else expert_offset
    if not isinstance(offset, int) or offset < 0:
        fail("expert_offset", expert_offset, "a non-negative int")
    if num_experts is not None and offset + e_local > num_experts:
        fail("expert_offset", offset, f"expert_offset + {e_local} local experts <= num_experts={num_experts}")
    return offset


def zero_terms(fmt: WeightFormat, quant: QuantMode, zeros, scales) -> tuple:
    """Additive zero terms (dequantized = q * scale + zero) of formats that take them, checked
    against their scales: both given or neither, the scales' shape, dtype and layout."""
    given = [z is not None for z in zeros]
    if not any(given):
        return (None, None)
    if not fmt.zero_point:
        fail("w13_zero/w2_zero", "zero terms", f"None for quant={quant.value!r} (its weights have no zero points)")
    if not all(given):
        fail("w13_zero/w2_zero", "only one of them", "both (asymmetric checkpoints have zero points in both GEMMs)")
    return tuple(check_tensor(name, z, dtype=s.dtype, shape=tuple(s.shape), ndim=s.dim(), device=s.device)
                 for name, z, s in (("w13_zero", zeros[0], scales[0]), ("w2_zero", zeros[1], scales[1])))


def check_expert_map(expert_map, expert_offset, ep_rank, ep_size, num_experts, device) -> None:
    """A global-to-local expert map: int32 [global experts], -1 for experts held elsewhere. Its
    values are not read on the host (a device sync); ids it maps outside the local experts
    contribute nothing, as absent ones do."""
    check_tensor("expert_map", expert_map, dtype=torch.int32, ndim=1, device=device, align=4)
    if expert_offset is not None or ep_rank is not None or ep_size is not None:
        fail("expert_offset/ep_rank/ep_size", (expert_offset, ep_rank, ep_size),
             "None with expert_map (the map says which experts are local)")
    n = expert_map.shape[0]
    if n == 0:
        fail("expert_map", "shape (0,)", "one entry per global expert")
    if num_experts is not None and num_experts != n:
        fail("num_experts", num_experts, f"expert_map's length {n}")


def device_index(device, caller: str | None = None) -> int:
    """The CUDA device index `device` names (default: torch's current device, or 0 where torch
    has no CUDA). `caller`: the public call that needs the GPU, for a clear error where the CUDA
    runtime sees none (native calls would fail with the runtime's misleading driver message)."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            fail("device", device, "a CUDA device")
    if caller is not None and _native.C().device_count() == 0:
        driver = _native.C().driver_version()
        if driver:  # a driver too old for this build says so; else it sees no GPU
            for lib in _native.libraries():
                _native.check_driver(lib["cuda_version"])
        why = (f"the NVIDIA driver (CUDA {_native.cuda_string(driver)}) reports no GPU" if driver
               else "no NVIDIA driver is loaded")
        raise RuntimeError(f"{caller} needs a CUDA GPU and none is visible: {why} "
                           f"(torch.cuda.is_available() is {torch.cuda.is_available()}). "
                           "`python -m moe_kernels info` shows what this build holds and the GPUs it runs on")
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class Problem:
    """A validated forward: its mode, sizes, the C ABI shape and the tensors to pass."""

    def __init__(self, hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
                 activation="swiglu", w13_bias=None, w2_bias=None, expert_offset=None,
                 ep_rank=None, ep_size=None, num_experts=None, swiglu_alpha=1.702,
                 swiglu_limit=7.0, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
                 w13_zero=None, w2_zero=None, expert_map=None, apply_router_weight_on_input=False,
                 routed_scaling_factor=None):
        self.quant = infer_mode(hidden_states, w13, w13_scale) if quant is None else parse_quant(quant)
        spec = self.mode = self.quant.spec
        require_built(self.quant, getattr(hidden_states, "device", None))
        self.activation = Activation.parse(activation)
        hidden = tuple(DTYPES[d] for d in spec.hidden)
        x = check_tensor("hidden_states", hidden_states, dtype=hidden, ndim=2)
        dtype = x.dtype  # of out and the biases too
        self.out_dtype = DTYPE_NAMES[dtype]
        self.device = x.device
        T, H = x.shape
        E, I, n1 = expert_weight_sizes(spec, self.activation.gated, H, w13, w2, dtype=dtype, device=self.device)
        self.scales = (None, None, None, None)
        self.per_channel = (0, 0)
        self.weight_group = None
        fmt = spec.weight_format
        self.zeros = (None, None)
        if fmt.scale is not None:
            kspec = fmt.kernel_scale
            s13 = weight_scale("w13_scale", w13_scale, fmt, E, n1, H, self.device, dtype=dtype, spec=kspec)
            s2 = weight_scale("w2_scale", w2_scale, fmt, E, H, I, self.device, dtype=dtype, spec=kspec)
            a13 = static_act_scale("a13_scale", a13_scale, spec, self.device)
            a2 = static_act_scale("a2_scale", a2_scale, spec, self.device)
            self.scales = (s13, s2, a13, a2)
            if len(kspec.shapes) > 1:  # per tensor or per channel: the C ABI's flags
                self.per_channel = (int(s13.dim() == 2), int(s2.dim() == 2))
            if fmt.group_scales16:  # the group the scales imply, the same in both GEMMs
                self.weight_group = scale_group(fmt, s13, H, kspec)
                if scale_group(fmt, s2, I, kspec) != self.weight_group:
                    fail("w2_scale", f"groups of {scale_group(fmt, s2, I, kspec)} along K",
                         f"groups of {self.weight_group}, as w13_scale's")
            self.zeros = zero_terms(fmt, self.quant, (w13_zero, w2_zero), (s13, s2))
        elif any(t is not None for t in (w13_scale, w2_scale, a13_scale, a2_scale, w13_zero, w2_zero)):
            fail("w13_scale/w2_scale/a13_scale/a2_scale/w13_zero/w2_zero", "scales",
                 f"none for quant={self.quant.value!r} (its weights are unscaled)")
        ids = check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2, device=self.device,
                           align=topk_ids.element_size() if isinstance(topk_ids, torch.Tensor) else 4)
        k = ids.shape[1]
        check_tensor("topk_ids", ids, shape=(T, None))
        if not 1 <= k <= MAX_TOP_K:
            fail("topk_ids", f"shape {tuple(ids.shape)}", f"1 <= top_k <= {MAX_TOP_K}")
        wts = check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2,
                           shape=(T, k), device=self.device, align=4)
        if w13_bias is not None:
            check_tensor("w13_bias", w13_bias, dtype=dtype, ndim=2, shape=(E, n1), device=self.device)
        if w2_bias is not None:
            check_tensor("w2_bias", w2_bias, dtype=dtype, ndim=2, shape=(E, H), device=self.device)
        if T * k >= 2**31:
            fail("topk_ids", f"T*k = {T * k}", "fewer than 2**31 (token, slot) pairs")
        if expert_map is None:
            self.expert_offset = resolve_expert_offset(expert_offset, ep_rank, ep_size, num_experts, E)
        else:
            check_expert_map(expert_map, expert_offset, ep_rank, ep_size, num_experts, self.device)
            self.expert_offset = 0
        self.expert_map = expert_map
        if not isinstance(apply_router_weight_on_input, bool):
            fail("apply_router_weight_on_input", repr(apply_router_weight_on_input), "a bool", TypeError)
        if apply_router_weight_on_input and k != 1:
            fail("apply_router_weight_on_input", f"True with top_k={k}",
                 "top_k 1 (the weight scales the token's one input row, as Llama 4 routes)")
        self.router_weight_on_input = apply_router_weight_on_input
        scaling = 1.0 if routed_scaling_factor is None else routed_scaling_factor
        if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
            fail("routed_scaling_factor", repr(routed_scaling_factor), "a finite float or None")
        if not (swiglu_alpha > 0 and swiglu_limit > 0):
            fail("swiglu_alpha/swiglu_limit", (swiglu_alpha, swiglu_limit), "positive numbers")
        self.tensors = (x, ids, wts, w13, w2, w13_bias, w2_bias)
        self.T, self.H, self.I, self.E, self.k, self.n1 = T, H, I, E, k, n1
        self.shape = c_shape(T=T, H=H, I=I, E=E, k=k, dtype=self.out_dtype, mode=spec,
                             activation=self.activation, index_dtype=ids.dtype,
                             expert_offset=self.expert_offset, alpha=swiglu_alpha, limit=swiglu_limit,
                             per_channel=self.per_channel, weight_group=self.weight_group,
                             weight_zero=self.zeros[0] is not None,
                             router_weight_on_input=apply_router_weight_on_input,
                             routed_scaling_factor=scaling,
                             expert_map_size=0 if expert_map is None else expert_map.shape[0])

    def require_cuda(self) -> None:
        if self.device.type != "cuda":
            fail("hidden_states", f"device {self.device}", "a CUDA tensor")
