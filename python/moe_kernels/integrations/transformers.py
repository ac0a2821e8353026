"""A Hugging Face transformers experts backend named "moe_kernels" (transformers 5.x, whose
`ExpertsInterface` dispatches the experts modules of MoE models).

    import moe_kernels.integrations.transformers   # registers "moe_kernels"
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda",
                                                 experts_implementation="moe_kernels")
    model.set_experts_implementation("moe_kernels")  # or switch a loaded model

The backend replaces the experts computation only: the model's own router picks the top-k
ids and weights (DeepSeek-V3's routed_scaling_factor is already in them) and shared experts
stay the model's. Each experts module's parameters are mapped once to this package's layout
(`to_moe_kernels_layout`) and the result is kept on the module, keyed by each source
parameter's identity, data pointer, shape, dtype, device and version counter: a
`load_state_dict`, `.to()` or re-assigned parameter makes the next forward map them again.
A parameter changed in place without bumping its version counter (through `.data`) is not
seen: delete the module's `_moe_kernels_layout` attribute.

Mapped:
- 16-bit experts (bf16/fp16) with fused `gate_up_proj` [E, 2I, H] (gate rows, then up rows:
  Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, OLMoE) are used as they are, no copy;
  transposed [E, H, 2I] / [E, I, H] ones (gpt-oss) are transposed once (a copy of the experts'
  weights); gpt-oss's interleaved gate/up columns and their bias are de-interleaved; non-gated
  experts (`up_proj`) too. Activations from the module's own act_fn: SiLU, GELU (erf), GELU
  with the tanh approximation, ReLU, ReLU squared, identity; gpt-oss's clamped SwiGLU
  (module.alpha, module.limit) is `swiglu_oai`.
- FP8 experts as transformers' finegrained-fp8 quantizer keeps them (`FP8Experts`: E4M3
  `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] with `*_scale_inv` per 128x128 block,
  float32 or UE8M0): quant="fp8_block", dynamic activations only, H and I multiples of 128.
- Llama 4 text experts (transposed, routing weight applied to the input): mapped with
  apply_router_weight_on_input=True, one call per top-k slot. transformers 5.17 does not
  dispatch `Llama4TextExperts` through the experts interface, so there the backend is not
  reached and the model runs its own experts.

Not reached: gpt-oss MXFP4 kept quantized by transformers' Mxfp4 quantizer. Its
`Mxfp4GptOssExperts` holds Triton-swizzled tensors and is called by a patched MLP forward
with Triton routing data, never through the experts interface; load such checkpoints with
this package's own `moe_kernels.prepare.from_gpt_oss` instead (README).

Fallback: anything else (a device that is not a CUDA GPU this build has kernels for, float32
hidden states, an activation or custom gate with no kernel, a quantization that is not FP8
128x128 blocks, sizes off the mode's alignment) runs transformers' default experts backend
("grouped_mm" of the module's own interface) and logs one warning per module and reason,
naming why. Weights are never converted to a mode the checkpoint does not hold.
"""
from __future__ import annotations

import logging

import torch

from .. import _native
from ..modes import QuantMode
from ..problem import DTYPE_NAMES, MAX_TOP_K
from . import _common

__all__ = ["NAME", "UnsupportedExperts", "moe_kernels_experts_forward", "register", "to_moe_kernels_layout"]

NAME = "moe_kernels"
FALLBACK = "grouped_mm"  # transformers' default experts implementation
CACHE_ATTR = "_moe_kernels_layout"
WARNED_ATTR = "_moe_kernels_warned"
FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128

logger = logging.getLogger(__name__)


class UnsupportedExperts(NotImplementedError):
    """An experts module (or a call) the kernels cannot run; the message says why."""


# ---- the module's parameters -> this package's layout (pure, CPU-testable) ----------------

def _act_classes(*names) -> tuple:
    """transformers.activations classes by name, those this version has."""
    from transformers import activations
    return tuple(c for c in (getattr(activations, n, None) for n in names) if isinstance(c, type))


def _activation_of(act_fn, gated: bool) -> str:
    """The package's activation for a transformers activation module (ACT2FN's classes)."""
    kinds = (("silu", _act_classes("SiLUActivation") + (torch.nn.SiLU,)),
             ("gelu", _act_classes("GELUActivation")),
             ("gelu_tanh", _act_classes("GELUTanh", "PytorchGELUTanh", "NewGELUActivation")),
             ("relu", (torch.nn.ReLU,)),
             ("relu2", _act_classes("ReLUSquaredActivation")),
             ("identity", _act_classes("LinearActivation") + (torch.nn.Identity,)))
    kind = next((k for k, classes in kinds if type(act_fn) in classes), None)
    table = ({"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"} if gated else
             {"silu": "silu", "gelu": "gelu", "relu": "relu", "relu2": "relu2", "identity": "identity"})
    if kind not in table:
        raise UnsupportedExperts(f"activation {type(act_fn).__name__} has no {'gated' if gated else 'non-gated'} "
                                 f"kernel (kernels: {sorted(table)})")
    return table[kind]


def _gate_of(module, gated: bool):
    """(activation, swiglu_alpha, swiglu_limit) for the module's gate function."""
    from transformers.integrations import moe
    name = type(module).__name__
    if not gated:
        return _activation_of(getattr(module, "act_fn", None), False), None, None
    custom = getattr(type(module), "_apply_gate", moe._default_apply_gate) is not moe._default_apply_gate
    if _is_fp8_experts(module):  # FP8Experts' own gate: clamped SwiGLU when the config has swiglu_alpha
        if getattr(module, "swiglu_alpha", None) is not None:
            limit = getattr(module, "swiglu_limit", None)
            return "swiglu_oai", float(module.swiglu_alpha), _common.NO_LIMIT if limit is None else float(limit)
        if getattr(module, "limit", None) is not None:
            raise UnsupportedExperts(f"{name} clamps gate and up with limit={module.limit} without swiglu_alpha: "
                                     "no kernel for a clamped act(gate) * up")
        custom = False
    if custom:
        if name == "GptOssExperts":  # gate * sigmoid(alpha * gate) * (up + 1), both clamped
            return "swiglu_oai", float(module.alpha), float(module.limit)
        raise UnsupportedExperts(f"{name} has its own gate function (_apply_gate) with no kernel")
    return _activation_of(getattr(module, "act_fn", None), True), None, None


def _is_fp8_experts(module) -> bool:
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return False
    return isinstance(module, FP8Experts)


def _is_llama4(module) -> bool:
    return type(module).__name__ == "Llama4TextExperts"


def _sources(module) -> dict:
    """The module's parameters the layout is made from, by role (None where absent)."""
    gated = getattr(module, "has_gate", True)
    up = "gate_up_proj" if gated else "up_proj"
    bias = bool(getattr(module, "has_bias", False))
    return {"w13": getattr(module, up, None), "w2": getattr(module, "down_proj", None),
            "w13_bias": getattr(module, up + "_bias", None) if bias else None,
            "w2_bias": getattr(module, "down_proj_bias", None) if bias else None,
            "w13_scale": getattr(module, up + "_scale_inv", None),
            "w2_scale": getattr(module, "down_proj_scale_inv", None)}


def to_moe_kernels_layout(module) -> dict:
    """An experts module's parameters as `moe_kernels.fused_moe`'s arguments.

    Returns a dict with w13 [E, 2I, H] (gate rows, then up rows; [E, I, H] non-gated), w2
    [E, H, I], w13_bias/w2_bias (or None), quant ("bf16"/"fp16" for 16-bit weights,
    "fp8_block" for FP8), w13_scale/w2_scale (fp8_block), activation, swiglu_alpha and
    swiglu_limit (swiglu_oai only, else None) and apply_router_weight_on_input. Tensors are
    the module's own where the layout matches (detached views), converted copies otherwise.
    Raises UnsupportedExperts naming what cannot run.
    """
    name = type(module).__name__
    llama4 = _is_llama4(module)
    if not llama4 and not hasattr(module, "is_transposed"):
        raise UnsupportedExperts(f"{name} is not an experts module transformers dispatches "
                                 "(no use_experts_implementation attributes)")
    gated = bool(getattr(module, "has_gate", True))
    transposed = True if llama4 else bool(module.is_transposed)
    interleaved = not getattr(module, "is_concatenated", True)
    src = _sources(module)
    w13, w2 = src["w13"], src["w2"]
    up = "gate_up_proj" if gated else "up_proj"
    for role, t in ((up, w13), ("down_proj", w2)):
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dim() != 3:
            raise UnsupportedExperts(f"{name}.{role} is {type(t).__name__}"
                                     f"{'' if not isinstance(t, torch.Tensor) else ' ' + str(tuple(t.shape))}, "
                                     "expected a plain 3-D tensor [E, N, K]")
    w13, w2 = w13.detach(), w2.detach()
    fp8 = w13.dtype == FP8
    if fp8:
        quant = "fp8_block"
        if transposed or interleaved:
            raise UnsupportedExperts(f"{name}: FP8 experts with transposed or interleaved gate/up weights "
                                     "(the 128x128 scale blocks would not follow them)")
    elif w13.dtype in DTYPE_NAMES:
        quant = DTYPE_NAMES[w13.dtype]
    else:
        raise UnsupportedExperts(f"{name}.{up} has dtype {w13.dtype}: the kernels take bf16, fp16 "
                                 "or FP8 (E4M3, 128x128 blocks) expert weights")
    if w2.dtype != w13.dtype:
        raise UnsupportedExperts(f"{name}.down_proj has dtype {w2.dtype}, {name}.{up} {w13.dtype}: "
                                 "expected one dtype")
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    E, n1, H = w13.shape
    I = w2.shape[2]
    if tuple(w2.shape[:2]) != (E, H) or n1 != (2 * I if gated else I):
        raise UnsupportedExperts(f"{name}: weights {tuple(w13.shape)} and {tuple(w2.shape)} (as [E, N, K]) are not "
                                 f"[E, {'2I' if gated else 'I'}, H] and [E, H, I]")
    act, alpha, limit = _gate_of(module, gated)
    if interleaved and not gated:
        raise UnsupportedExperts(f"{name}: interleaved gate/up rows without a gate")
    spec = QuantMode.parse(quant).spec
    if H % spec.align or I % spec.align:
        raise UnsupportedExperts(f"{name}: hidden size {H} and intermediate size {I} must be multiples of "
                                 f"{spec.align} for quant={quant!r} ({spec.why_align})")
    out = {"quant": quant, "activation": act, "swiglu_alpha": alpha, "swiglu_limit": limit,
           "apply_router_weight_on_input": llama4, "w13_scale": None, "w2_scale": None}
    if fp8:
        out.update(_fp8_block_scales(module, src, E, n1, H, I))
    if interleaved:
        w13 = _common.deinterleave_gate_up(w13, 1)
    out["w13"], out["w2"] = w13.contiguous(), w2.contiguous()
    if fp8 and (src["w13_bias"] is not None or src["w2_bias"] is not None):
        raise UnsupportedExperts(f"{name}: FP8 experts with biases")
    for role, want in (("w13_bias", (E, n1)), ("w2_bias", (E, H))):
        b = src[role]
        if b is not None:
            if tuple(b.shape) != want:
                raise UnsupportedExperts(f"{name}: {role} shape {tuple(b.shape)}, expected {want}")
            b = b.detach()
            if role == "w13_bias" and interleaved:
                b = _common.deinterleave_gate_up(b, 1)
            b = b.to(w13.dtype).contiguous()  # the kernels take biases in the hidden dtype
        out[role] = b
    return out


def _fp8_block_scales(module, src, E, n1, H, I) -> dict:
    """FP8Experts' block scales as fp8_block's w13_scale [E, N1/128, H/128], w2_scale [E, H/128, I/128]."""
    name = type(module).__name__
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        raise UnsupportedExperts(f"{name}: FP8 weight_block_size {block}, expected [128, 128] (fp8_block); "
                                 "per-tensor FP8 experts have no mapping here")
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedExperts(f"{name}: activation_scheme={scheme!r}, expected 'dynamic' (fp8_block quantizes "
                                 "activations per token per 128 columns)")
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    scales = {}
    for role, n, k in (("w13_scale", n1, H), ("w2_scale", H, I)):
        s = src[role]
        want = (E, n // FP8_BLOCK, k // FP8_BLOCK)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
            raise UnsupportedExperts(f"{name}: {role} {getattr(s, 'shape', None)}, expected {want} "
                                     "(one scale per 128x128 block)")
        s = s.detach()
        if s.dtype == e8m0:  # UE8M0 powers of two are exact in float32
            s = s.float()
        if s.dtype != torch.float32:
            raise UnsupportedExperts(f"{name}: {role} dtype {s.dtype}, expected float32 or float8_e8m0fnu")
        scales[role] = s.contiguous()
    return scales


# ---- the cache on the module ------------------------------------------------------------

def _tensor_key(t):
    if t is None:
        return None
    version = None if t.is_inference() else t._version
    return (id(t), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), version)


def _cache_key(module) -> tuple:
    return tuple((role, _tensor_key(t) if isinstance(t, torch.Tensor) else repr(type(t)))
                 for role, t in _sources(module).items())


@torch.compiler.disable  # host bookkeeping (identities, version counters): not for dynamo to trace or guard on
def _layout(module):
    """The module's layout (or the UnsupportedExperts for it), once per set of sources."""
    key = _cache_key(module)
    hit = module.__dict__.get(CACHE_ATTR)
    if hit is not None and hit[0] == key:
        return hit[1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"moe_kernels: the layout of {type(module).__name__}'s weights is not made yet and "
                           "cannot be made inside a CUDA graph capture; run one forward before capturing")
    try:
        with torch.no_grad():
            value = to_moe_kernels_layout(module)
    except UnsupportedExperts as e:
        value = e
    module.__dict__[CACHE_ATTR] = (key, value)  # not a registered attribute: stays out of state_dict
    return value


# ---- the device and the call --------------------------------------------------------------

_DEVICE_PROBLEMS = {}


def _device_problem(device, quant: str) -> str | None:
    """Why this build cannot run `quant` on `device`, or None (cached per device and mode)."""
    if device.type != "cuda":
        return f"hidden states on {device}: the kernels run on CUDA GPUs"
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, quant)
    if key not in _DEVICE_PROBLEMS:
        try:
            lib = _native.library_for(index)
            modes = {k.mode for k in lib["kernels"]}
            _DEVICE_PROBLEMS[key] = None if quant in modes else (
                f"this build has no {quant} kernels for cuda:{index} (it has {sorted(modes)})")
        except Exception as e:  # not built, no library for this GPU, or a driver too old
            _DEVICE_PROBLEMS[key] = f"this build of moe_kernels cannot run on cuda:{index}: {e}"
    return _DEVICE_PROBLEMS[key]


def _call_problem(layout, hidden_states, top_k_index) -> str | None:
    spec = QuantMode.parse(layout["quant"]).spec
    dt = hidden_states.dtype
    if DTYPE_NAMES.get(dt) not in spec.hidden:
        return f"hidden states are {dt}: quant={layout['quant']!r} takes {' or '.join(spec.hidden)}"
    if layout["quant"] in ("bf16", "fp16") and layout["w13"].dtype != dt:
        return f"hidden states are {dt}, the expert weights {layout['w13'].dtype}"
    if hidden_states.dim() != 2 or hidden_states.shape[1] != layout["w13"].shape[2]:
        return f"hidden states {tuple(hidden_states.shape)}, expected [T, {layout['w13'].shape[2]}]"
    if top_k_index.shape[-1] > MAX_TOP_K:
        return f"top_k {top_k_index.shape[-1]} is past the kernels' {MAX_TOP_K}"
    return _device_problem(hidden_states.device, layout["quant"])


def _default_forward(module):
    """transformers' default experts backend for this module: grouped_mm of its interface."""
    if hasattr(module, "has_gate"):
        if _is_fp8_experts(module):
            from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS as interface
        else:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as interface
        return interface[FALLBACK]
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _fallback(module, reason, hidden_states, top_k_index, top_k_weights):
    warned = module.__dict__.setdefault(WARNED_ATTR, set())
    if reason not in warned:
        warned.add(reason)
        logger.warning("moe_kernels: %s runs transformers' default experts backend (%r) instead: %s",
                       type(module).__name__, FALLBACK, reason)
    return _default_forward(module)(module, hidden_states, top_k_index, top_k_weights)


def moe_kernels_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward transformers calls for experts_implementation="moe_kernels":
    hidden_states [T, H], top_k_index [T, k] and top_k_weights [T, k] from the model's router;
    returns [T, H] in the hidden states' dtype."""
    layout = _layout(self)
    reason = str(layout) if isinstance(layout, UnsupportedExperts) else \
        _call_problem(layout, hidden_states, top_k_index)
    if reason is not None:
        return _fallback(self, reason, hidden_states, top_k_index, top_k_weights)
    x = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    ids = top_k_index.contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    kw = {"activation": layout["activation"], "w13_bias": layout["w13_bias"], "w2_bias": layout["w2_bias"]}
    if layout["quant"] == "fp8_block":
        kw.update(quant="fp8_block", w13_scale=layout["w13_scale"], w2_scale=layout["w2_scale"])
    if layout["activation"] == "swiglu_oai":
        kw.update(swiglu_alpha=layout["swiglu_alpha"], swiglu_limit=layout["swiglu_limit"])
    w13, w2 = layout["w13"], layout["w2"]
    if not layout["apply_router_weight_on_input"]:
        return _common.core_fused_moe(x, w13, w2, weights, ids, **kw)
    # The router weight scales the input (Llama 4); the kernels take one slot per call there.
    out = None
    for slot in range(ids.shape[1]):
        y = _common.core_fused_moe(x, w13, w2, weights[:, slot:slot + 1].contiguous(),
                                   ids[:, slot:slot + 1].contiguous(), apply_router_weight_on_input=True, **kw)
        out = y if out is None else out.add_(y)
    return out


# ---- registration ---------------------------------------------------------------------------

def register() -> None:
    """Register "moe_kernels" in transformers' experts interfaces (the 16-bit one and the
    finegrained-fp8 one); calling it again changes nothing."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise ImportError("moe_kernels.integrations.transformers needs transformers>=5.0 with "
                          "transformers.integrations.moe.ExpertsInterface (pip install "
                          "'moe-kernels-cu13[transformers]')") from e
    ALL_EXPERTS_FUNCTIONS.register(NAME, moe_kernels_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the finegrained-fp8 experts
        return
    ALL_FP8_EXPERTS_FUNCTIONS.register(NAME, moe_kernels_experts_forward)


register()
