"""The public forward: validation on the host, then one call into the per-arch library.

Every argument is checked before anything is launched; an error names the argument, what
it got and what was expected. With `workspace=` and `out=` given, a forward allocates
nothing and never waits on the device, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import os
import sys

import torch

from . import _native
from .modes import Activation, QuantMode
from .tactic import ONE_TOKEN, Tactic, default_tactic



class _ModeSpec:
    """How a supported mode maps to tensors and to the C ABI."""

    def __init__(self, hidden, weight, quant_code, align, why_align):
        self.hidden = hidden          # torch dtypes hidden_states may have (out and biases: the same)
        self.weight = weight          # torch dtype of w13/w2
        self.quant_code = quant_code  # moek_quant
        self.align = align            # H and I multiple
        self.why_align = why_align


_16BIT = (torch.bfloat16, torch.float16)
# Modes this release has kernels for (a kernel's KernelInfo.quant names the mode it serves).
# The FP8 modes take bf16 or fp16 hidden states and write the same type (kernels whose
# KernelInfo.out_dtype says which).
_SUPPORTED = {
    QuantMode.BF16: _ModeSpec((torch.bfloat16,), torch.bfloat16, 0, 8, "16-byte rows for TMA"),
    QuantMode.FP16: _ModeSpec((torch.float16,), torch.float16, 0, 8, "16-byte rows for TMA"),
    QuantMode.FP8: _ModeSpec(_16BIT, torch.float8_e4m3fn, 1, 16, "16-byte rows for TMA"),
    QuantMode.FP8_BLOCK: _ModeSpec(_16BIT, torch.float8_e4m3fn, 2, 128, "whole 128-wide scale blocks"),
}
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}  # moek_dtype
_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_INDEX_CODE = {torch.int32: 0, torch.int64: 1}
WORKSPACE_ALIGNMENT = 256
MAX_TOP_K = 1024  # the kernels keep a token's slots in shared memory (src/runner.cu kMaxTopK)


def _fail(argument: str, got, expected: str, exc=ValueError):
    raise exc(f"{argument}: got {got}, expected {expected}")


def _out_dtype(mode: QuantMode, out_dtype=None) -> str:
    """The output type name ("bf16"/"fp16") of `mode`'s kernels: the 16-bit modes' own; for the
    FP8 modes `out_dtype` (a name or torch dtype), by default bf16."""
    if mode in (QuantMode.BF16, QuantMode.FP16):
        if out_dtype is not None and _out_dtype(QuantMode.FP8, out_dtype) != mode.value:
            _fail("out_dtype", repr(out_dtype), f"{mode.value!r} (or None) for quant={mode.value!r}")
        return mode.value
    if out_dtype is None:
        return "bf16"
    name = _DTYPE_NAME.get(out_dtype, out_dtype)
    if name not in ("bf16", "fp16"):
        _fail("out_dtype", repr(out_dtype), "'bf16', 'fp16', torch.bfloat16 or torch.float16")
    return name


def _tensor(name, t, *, dtype=None, ndim=None, shape=None, device=None, align=16):
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor", TypeError)
    if device is not None and t.device != device:
        _fail(name, f"device {t.device}", f"device {device} (all tensors on one GPU)")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            _fail(name, f"dtype {t.dtype}", " or ".join(str(d) for d in allowed), TypeError)
    if ndim is not None and t.dim() != ndim:
        _fail(name, f"shape {tuple(t.shape)}", f"a {ndim}-D tensor")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                _fail(name, f"shape {tuple(t.shape)}",
                      "shape (" + ", ".join("*" if s is None else str(s) for s in shape) + f") "
                      f"(dimension {i} must be {want})")
    if not t.is_contiguous():
        _fail(name, f"strides {t.stride()} for shape {tuple(t.shape)}", "a contiguous tensor")
    if t.numel() and t.data_ptr() % align:
        _fail(name, f"data pointer {t.data_ptr():#x}", f"{align}-byte alignment")
    return t


def _quant(quant, hidden_states, w13=None, w13_scale=None) -> QuantMode:
    if quant is None:
        if isinstance(w13, torch.Tensor) and w13.dtype == torch.float8_e4m3fn:
            # 128x128 block scales are 3-D; per-tensor/per-channel ones are not.
            blocks = isinstance(w13_scale, torch.Tensor) and w13_scale.dim() == 3
            return QuantMode.FP8_BLOCK if blocks else QuantMode.FP8
        by_dtype = {torch.bfloat16: QuantMode.BF16, torch.float16: QuantMode.FP16}
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dtype not in by_dtype:
            got = hidden_states.dtype if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            _fail("hidden_states", f"dtype {got}", "torch.bfloat16 or torch.float16 (or pass quant=)",
                  TypeError)
        return by_dtype[hidden_states.dtype]
    mode = QuantMode.parse(quant)
    if mode not in _SUPPORTED:
        where = ""
        if isinstance(hidden_states, torch.Tensor) and hidden_states.is_cuda:
            info = _native.device_info(hidden_states.device.index)
            where = f" for {info['name']} (compute capability {info['major']}.{info['minor']})"
        built = sorted({(lib["arch"], k.quant) for lib in _native.libraries() for k in lib["kernels"]})
        raise NotImplementedError(
            f"quant={mode.value!r} has no kernels{where} in this build of moe_kernels; it supports "
            f"{[m.value for m in _SUPPORTED]} (built (arch, mode): {built})")
    return mode


class _Problem:
    """A validated forward: shapes, the C ABI shape dict, and the tensors to pass."""

    def __init__(self, hidden_states, w13, w2, topk_weights, topk_ids, *, quant, activation,
                 w13_bias, w2_bias, expert_offset, ep_rank, ep_size, num_experts,
                 swiglu_alpha, swiglu_limit, w13_scale=None, w2_scale=None, a13_scale=None,
                 a2_scale=None):
        self.quant = _quant(quant, hidden_states, w13, w13_scale)
        self.activation = Activation.parse(activation)
        mode = self.mode = _SUPPORTED[self.quant]
        x = _tensor("hidden_states", hidden_states, dtype=mode.hidden, ndim=2)
        dtype = x.dtype  # of out and the biases too
        self.out_dtype = _DTYPE_NAME[dtype]
        self.device = x.device
        T, H = x.shape
        w13 = _tensor("w13", w13, dtype=mode.weight, ndim=3, device=self.device)
        w2 = _tensor("w2", w2, dtype=mode.weight, ndim=3, device=self.device)
        E = w13.shape[0]
        if E == 0:
            _fail("w13", f"shape {tuple(w13.shape)}", "at least one expert")
        I = w2.shape[2]
        n1 = 2 * I if self.activation.gated else I
        _tensor("w13", w13, shape=(E, n1, H))
        _tensor("w2", w2, shape=(E, H, I))
        if H % mode.align or I % mode.align:
            _fail("hidden_states/w2", f"hidden_size={H}, intermediate_size={I}",
                  f"both multiples of {mode.align} for quant={self.quant.value!r} ({mode.why_align})")
        self.scales = (None, None, None, None)
        self.per_channel = (0, 0)
        if self.quant is QuantMode.FP8_BLOCK:
            s13 = _block_scale("w13_scale", w13_scale, E, n1, H, self.device)
            s2 = _block_scale("w2_scale", w2_scale, E, H, I, self.device)
            for name, t in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
                if t is not None:
                    _fail(name, "a static scale", "None: fp8_block quantizes activations "
                          "dynamically per token per 128 columns")
            self.scales = (s13, s2, None, None)
        elif mode.quant_code:
            s13 = _weight_scale("w13_scale", w13_scale, E, n1, self.device)
            s2 = _weight_scale("w2_scale", w2_scale, E, H, self.device)
            a13 = _act_scale("a13_scale", a13_scale, self.device)
            a2 = _act_scale("a2_scale", a2_scale, self.device)
            self.scales = (s13, s2, a13, a2)
            self.per_channel = (int(s13.dim() == 2), int(s2.dim() == 2))
        elif any(t is not None for t in (w13_scale, w2_scale, a13_scale, a2_scale)):
            _fail("w13_scale/w2_scale/a13_scale/a2_scale", "scales",
                  f"none for quant={self.quant.value!r} (scales are for fp8)")
        ids = _tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2,
                      device=self.device, align=topk_ids.element_size() if isinstance(topk_ids, torch.Tensor) else 4)
        k = ids.shape[1]
        _tensor("topk_ids", ids, shape=(T, None))
        if not 1 <= k <= MAX_TOP_K:
            _fail("topk_ids", f"shape {tuple(ids.shape)}", f"1 <= top_k <= {MAX_TOP_K}")
        wts = _tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2,
                      shape=(T, k), device=self.device, align=4)
        if w13_bias is not None:
            _tensor("w13_bias", w13_bias, dtype=dtype, ndim=2, shape=(E, n1), device=self.device)
        if w2_bias is not None:
            _tensor("w2_bias", w2_bias, dtype=dtype, ndim=2, shape=(E, H), device=self.device)
        if T * k >= 2**31:
            _fail("topk_ids", f"T*k = {T * k}", "fewer than 2**31 (token, slot) pairs")
        self.expert_offset = _expert_offset(expert_offset, ep_rank, ep_size, num_experts, E)
        if not (swiglu_alpha > 0 and swiglu_limit > 0):
            _fail("swiglu_alpha/swiglu_limit", (swiglu_alpha, swiglu_limit), "positive numbers")
        self.tensors = (x, ids, wts, w13, w2, w13_bias, w2_bias)
        self.T, self.H, self.I, self.E, self.k, self.n1 = T, H, I, E, k, n1
        self.shape = {
            "num_tokens": T, "hidden_size": H, "inter_size": I, "num_experts": E, "top_k": k,
            "expert_offset": self.expert_offset,
            "activation": self.activation.code, "index_dtype": _INDEX_CODE[ids.dtype],
            "act_alpha": float(swiglu_alpha), "act_limit": float(swiglu_limit),
            "dtype": _DTYPE_CODE[dtype], "quant": mode.quant_code,
            "w13_scale_per_channel": self.per_channel[0], "w2_scale_per_channel": self.per_channel[1],
        }


def _weight_scale(name, scale, E, N, device):
    """fp8 weight scales: per tensor [E] or per output channel [E, N] float32 (trailing
    singleton dimensions, as checkpoints store them, are accepted)."""
    per_channel = isinstance(scale, torch.Tensor) and scale.numel() != E
    # Per-channel scales: 16-byte aligned, as when the activation and finalize kernels read them
    # 8 at a time (the GEMM epilogues that read them now need 4; not relaxed until tested).
    t = _tensor(name, scale, dtype=torch.float32, device=device, align=16 if per_channel else 4)
    if tuple(t.shape) in ((E,), (E, 1), (E, 1, 1)):
        return t.reshape(E)
    if tuple(t.shape) in ((E, N), (E, N, 1)):
        return t.reshape(E, N)
    _fail(name, f"shape {tuple(t.shape)}", f"[E] = ({E},) per tensor or [E, N] = ({E}, {N}) per channel")


def _block_scale(name, scale, E, N, K, device):
    """fp8_block weight scales: float32 [E, N/128, K/128], one per 128x128 block (DeepSeek-V3's
    weight_scale_inv as stored)."""
    if scale is None:
        _fail(name, "None", f"float32 block scales of shape ({E}, {N // 128}, {K // 128})")
    return _tensor(name, scale, dtype=torch.float32, ndim=3, shape=(E, N // 128, K // 128),
                   device=device, align=4)


def _act_scale(name, scale, device):
    """A static per-tensor activation scale (a one-element float32 tensor), or None: dynamic."""
    if scale is None:
        return None
    t = _tensor(name, scale, dtype=torch.float32, device=device, align=4)
    if t.numel() != 1:
        _fail(name, f"shape {tuple(t.shape)}", "one element (a per-tensor scale), or None for per-token")
    return t


def _expert_offset(expert_offset, ep_rank, ep_size, num_experts, e_local) -> int:
    if ep_rank is not None or ep_size is not None:
        if expert_offset is not None:
            _fail("expert_offset", expert_offset, "None when ep_rank/ep_size are given")
        if ep_rank is None or ep_size is None:
            _fail("ep_rank/ep_size", (ep_rank, ep_size), "both given, or neither")
        if not (isinstance(ep_size, int) and ep_size >= 1 and isinstance(ep_rank, int) and 0 <= ep_rank < ep_size):
            _fail("ep_rank/ep_size", (ep_rank, ep_size), "integers with 0 <= ep_rank < ep_size")
        if num_experts is not None and num_experts != e_local * ep_size:
            _fail("num_experts", num_experts, f"ep_size * local experts = {ep_size} * {e_local}")
        return ep_rank * e_local
    offset = 0 if expert_offset is None else expert_offset
    if not isinstance(offset, int) or offset < 0:
        _fail("expert_offset", expert_offset, "a non-negative int")
    if num_experts is not None and offset + e_local > num_experts:
        _fail("expert_offset", offset, f"expert_offset + {e_local} local experts <= num_experts={num_experts}")
    return offset


def _device_index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        _fail("device", device, "a CUDA device")
    return device.index if device.index is not None else torch.cuda.current_device()


def workspace_size(num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                   intermediate_size: int, *, quant="bf16", activation="swiglu",
                   device=None) -> int:
    """Bytes of workspace a forward with these sizes needs on `device` (num_experts is local).

    A workspace sized for T tokens serves every forward with at most T tokens (for the FP8
    modes, with bf16 or fp16 hidden states alike).
    """
    mode = QuantMode.parse(quant)
    if mode not in _SUPPORTED:
        _quant(mode, None)
    spec = _SUPPORTED[mode]
    act = Activation.parse(activation)
    for name, v in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts),
                    ("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not isinstance(v, int) or v < (0 if name == "num_tokens" else 1):
            _fail(name, v, "a positive int")
    if top_k > MAX_TOP_K:
        _fail("top_k", top_k, f"at most {MAX_TOP_K}")
    shape = {"num_tokens": num_tokens, "hidden_size": hidden_size, "inter_size": intermediate_size,
             "num_experts": num_experts, "top_k": top_k, "expert_offset": 0,
             "dtype": _DTYPE_CODE[spec.hidden[0]], "quant": spec.quant_code, "activation": act.code,
             "index_dtype": 0, "act_alpha": 1.0, "act_limit": 1.0, "w13_scale_per_channel": 0,
             "w2_scale_per_channel": 0}
    return int(_native.C().workspace_size(_device_index(device), shape))


@functools.lru_cache(maxsize=None)
def _usable(device: int, quant, out_dtype) -> dict:
    """{name: KernelInfo} of the kernels that can run on `device` (all when quant is None, else
    one QuantMode value's with output out_dtype). Cached: the forward path looks it up on every call."""
    return {k.name: k for k in _native.library_for(device)["kernels"]
            if not _native.kernel_problem(device, k.name) and quant in (None, k.quant)
            and (quant is None or k.out_dtype == out_dtype)}


def list_kernels(device=None, quant=None, out_dtype=None) -> list:
    """The grouped-GEMM kernels usable on `device` (default: current): all of them, or one
    mode's. For the FP8 modes, those writing `out_dtype` ("bf16" by default, or "fp16": the
    type of hidden_states and out)."""
    if quant is None:
        return list(_usable(_device_index(device), None, None).values())
    mode = QuantMode.parse(quant)
    out = _out_dtype(mode, out_dtype)
    return list(_usable(_device_index(device), mode.value, out).values())


_logged: set = set()


def _log_choice(spec, num_tokens, tactic, source):
    """MOE_KERNELS_LOG_TACTIC=1 prints the chosen tactic once per problem and token count."""
    if os.environ.get("MOE_KERNELS_LOG_TACTIC") and (spec, num_tokens) not in _logged:
        _logged.add((spec, num_tokens))
        print(f"moe_kernels: {spec.signature} T={num_tokens}: {tactic} ({source})", file=sys.stderr)
    return tactic


def _resolve_tactic(p: _Problem, tactic) -> Tactic:
    dev = p.device.index
    usable = _usable(dev, p.quant.value, p.out_dtype)
    what = p.quant.value + (f" ({p.out_dtype} out)" if p.quant.value != p.out_dtype else "")
    if tactic is None:
        if not usable:
            raise NotImplementedError(
                f"no {what} kernels can run on {_native.device_info(dev)['name']} in this build")
        from .tuning import ProblemSpec, cached_tactic
        spec = ProblemSpec(p.quant.value, p.activation.value, p.E, p.k, p.H, p.I,
                           out_dtype=p.out_dtype if p.out_dtype != _out_dtype(p.quant) else "")
        whole = Tactic(ONE_TOKEN, ONE_TOKEN)
        one_token = (p.T == 1 and p.quant in (QuantMode.FP8, QuantMode.FP8_BLOCK)
                     and (p.quant is QuantMode.FP8 or p.scales[0].data_ptr() % 16 == 0)  # bulk copies
                     and not _native.C().one_token_check(dev, p.shape))
        tuned = cached_tactic(spec, p.T, dev, one_token=one_token)
        if tuned is not None and ((one_token and tuned == whole) or
                                  (tuned.gemm1 in usable and tuned.gemm2 in usable)):
            return _log_choice(spec, p.T, tuned, "tuned")
        if one_token:
            return _log_choice(spec, p.T, whole, "one token")
        return _log_choice(spec, p.T, default_tactic(
            list(usable.values()), num_tokens=p.T, top_k=p.k, num_experts=p.E, hidden_size=p.H,
            gemm1_n=p.n1, sm_count=_native.device_info(dev)["sm_count"]), "default rule")
    if not isinstance(tactic, Tactic):
        _fail("tactic", repr(tactic), "a moe_kernels.Tactic", TypeError)
    if ONE_TOKEN in (tactic.gemm1, tactic.gemm2):
        if tactic.gemm1 != tactic.gemm2:
            _fail("tactic", str(tactic), f"{ONE_TOKEN!r} as both gemm1 and gemm2 (it is the whole forward)")
        why = _native.C().one_token_check(dev, p.shape)
        if why:
            _fail("tactic", str(tactic), f"a problem {ONE_TOKEN!r} runs: {why}")
        if p.quant is QuantMode.FP8_BLOCK and p.scales[0].data_ptr() % 16:
            _fail("w13_scale", f"at address {p.scales[0].data_ptr():#x}",
                  f"16-byte aligned for the {ONE_TOKEN!r} tactic (it copies the scale rows in bulk)")
        return tactic
    for which in ("gemm1", "gemm2"):
        name = getattr(tactic, which)
        if name not in usable:
            k = next((k for k in _native.library_for(dev)["kernels"] if k.name == name), None)
            why = ("not in this build" if k is None else _native.kernel_problem(dev, name)
                   or f"it is a {k.quant} kernel with {k.out_dtype} out")
            _fail(f"tactic.{which}", repr(name),
                  f"a {what} kernel usable on this GPU ({why}); usable: {sorted(usable)}")
    return tactic


def choose_tactic(hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
                  activation="swiglu", w13_scale=None, w2_scale=None) -> Tactic:
    """The tactic a fused_moe call with these arguments would use by default."""
    p = _Problem(hidden_states, w13, w2, topk_weights, topk_ids, quant=quant, activation=activation,
                 w13_bias=None, w2_bias=None, expert_offset=None, ep_rank=None, ep_size=None,
                 num_experts=None, swiglu_alpha=1.702, swiglu_limit=7.0, w13_scale=w13_scale,
                 w2_scale=w2_scale)
    _require_cuda(p)
    return _resolve_tactic(p, None)


def _require_cuda(p: _Problem) -> None:
    if p.device.type != "cuda":
        _fail("hidden_states", f"device {p.device}", "a CUDA tensor")


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, quant=None,
              activation="swiglu", w13_bias=None, w2_bias=None, expert_offset=None,
              ep_rank=None, ep_size=None, num_experts=None, swiglu_alpha: float = 1.702,
              swiglu_limit: float = 7.0, w13_scale=None, w2_scale=None, a13_scale=None,
              a2_scale=None, workspace=None, out=None, tactic=None,
              _last_step: int = 0) -> torch.Tensor:
    """Fused MoE forward: out[t] = sum_slot topk_weights[t, slot] * expert(topk_ids[t, slot])(x[t]).

    hidden_states [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows; [E_local, I, H] for
    non-gated activations); w2 [E_local, H, I]; topk_weights [T, k] float32; topk_ids [T, k]
    int32/int64 global expert ids. Ids outside [expert_offset, expert_offset + E_local)
    (including -1) contribute nothing. quant defaults to the dtype of hidden_states (fp8
    when the weights are torch.float8_e4m3fn; fp8_block when w13_scale is 3-D as well).

    fp8: bf16 or fp16 hidden_states (out in the same type), float8_e4m3fn weights with float32 w13_scale /
    w2_scale per tensor [E] or per output channel [E, N]; the GEMM inputs are quantized on
    the device, per token unless a static per-tensor a13_scale / a2_scale is given.
    fp8_block (DeepSeek-V3): float8_e4m3fn weights with float32 scales per 128x128 block,
    w13_scale [E, N1/128, H/128] and w2_scale [E, H/128, I/128] (checkpoints'
    weight_scale_inv as stored); GEMM inputs are quantized per token per 128 columns on the
    device; H and I must be multiples of 128.
    `_last_step` is for the benchmark's step breakdown only (out is then not written).
    """
    p = _Problem(hidden_states, w13, w2, topk_weights, topk_ids, quant=quant,
                 activation=activation, w13_bias=w13_bias, w2_bias=w2_bias,
                 expert_offset=expert_offset, ep_rank=ep_rank, ep_size=ep_size,
                 num_experts=num_experts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                 w13_scale=w13_scale, w2_scale=w2_scale, a13_scale=a13_scale, a2_scale=a2_scale)
    x, ids, wts, w13, w2, b13, b2 = p.tensors
    if out is None:
        out = torch.empty_like(x)
    else:
        _tensor("out", out, dtype=x.dtype, ndim=2, shape=(p.T, p.H), device=p.device)
    _require_cuda(p)
    if p.T == 0:
        return out
    dev = p.device.index
    tactic = _resolve_tactic(p, tactic)
    need = _native.C().workspace_size(dev, p.shape)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=p.device)
    else:
        _tensor("workspace", workspace, dtype=torch.uint8, ndim=1, device=p.device,
                align=WORKSPACE_ALIGNMENT)
        if workspace.numel() < need:
            _fail("workspace", f"{workspace.numel()} bytes",
                  f"at least {need} bytes (moe_kernels.workspace_size(...))")
    stream = torch.cuda.current_stream(p.device).cuda_stream
    def ptr(t):
        return t.data_ptr() if t is not None else 0
    s13, s2, a13, a2 = p.scales
    _native.C().run(dev, p.shape, x.data_ptr(), ids.data_ptr(), wts.data_ptr(), w13.data_ptr(),
                    w2.data_ptr(), ptr(b13), ptr(b2), ptr(s13), ptr(s2), ptr(a13), ptr(a2),
                    out.data_ptr(), workspace.data_ptr(), workspace.numel(), tactic.gemm1,
                    tactic.gemm2, stream, _last_step)
    return out
