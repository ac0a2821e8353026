"""The registered operator `torch.ops.moe_kernels.fused_moe`, through which every forward runs.

It mutates `out` (and `workspace`, when given) and returns nothing, so it works eagerly, in CUDA
graphs and under torch.compile (its fake implementation validates the arguments and touches no
data). The implementation validates a forward once per signature (shapes, dtypes, contiguity,
devices, options), resolves its tactic and caches both; a later call with that signature only
reads the tensors' pointers and calls the library, which checks their alignment itself.

The op runs on the current CUDA stream of the tensors' device. Tactic resolution and the plan
cache are guarded by a lock; one workspace serves one stream at a time.
"""
from __future__ import annotations

import enum
import threading

import torch

from . import _native, cache
from .problem import WORKSPACE_ALIGNMENT, Problem, check_tensor, fail
from .tactic import Tactic, resolve

SCHEMA = (
    "fused_moe(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "Tensor? w13_bias, Tensor? w2_bias, Tensor? w13_scale, Tensor? w2_scale, Tensor? a13_scale, "
    "Tensor? a2_scale, Tensor? w13_zero, Tensor? w2_zero, Tensor? expert_map, Tensor(a!) out, "
    "Tensor(b!)? workspace, str quant, str activation, int[] experts, float swiglu_alpha, "
    "float swiglu_limit, bool apply_router_weight_on_input, float routed_scaling_factor, str tactic, "
    "int last_step) -> ()")

_lib = torch.library.Library("moe_kernels", "DEF")
_lib.define(SCHEMA)

_MAX_PLANS = 4096  # signatures kept; more (a new T every call) start the cache afresh


def _none_if_negative(v):
    return None if v < 0 else v


def problem(tensors, quant, activation, experts, swiglu_alpha, swiglu_limit,
            apply_router_weight_on_input, routed_scaling_factor) -> Problem:
    """The op's arguments as a validated Problem (out and workspace are checked by the caller)."""
    (x, w13, w2, wts, ids, b13, b2, s13, s2, a13, a2, z13, z2, emap) = tensors[:14]
    offset, rank, size, num = (_none_if_negative(v) for v in experts)
    return Problem(x, w13, w2, wts, ids, quant=quant or None, activation=activation, w13_bias=b13,
                   w2_bias=b2, expert_offset=offset, ep_rank=rank, ep_size=size, num_experts=num,
                   swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, w13_scale=s13, w2_scale=s2,
                   a13_scale=a13, a2_scale=a2, w13_zero=z13, w2_zero=z2, expert_map=emap,
                   apply_router_weight_on_input=apply_router_weight_on_input,
                   routed_scaling_factor=routed_scaling_factor)


class Plan:
    """What a forward's signature fixes: the C shape (converted once for the native call), the
    tactic and the workspace it needs (no tactic for T = 0: nothing runs)."""

    __slots__ = ("shape", "tactic", "need", "device", "T", "generation")

    def __init__(self, p: Problem, tactic: Tactic, need: int, generation: int):
        self.shape = _native.C().Shape(p.shape) if tactic is not None else None
        self.tactic, self.need = tactic, need
        self.device, self.T, self.generation = p.device.index, p.T, generation


_plans: dict = {}
_lock = threading.Lock()


def _signature(tensors, options):
    """A hashable key of everything validation depends on, or None for a non-tensor argument
    (the slow path then raises the error that names it)."""
    key = list(options)
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key += (t.shape, t.dtype, t.device, t.is_contiguous())
        else:
            return None
    return tuple(key)


def _make_plan(tensors, options) -> Plan:
    (quant, activation, experts, alpha, limit, on_input, scaling, tactic, _) = options
    p = problem(tensors, quant, activation, experts, alpha, limit, on_input, scaling)
    x = p.tensors[0]
    out, workspace = tensors[14], tensors[15]
    check_tensor("out", out, dtype=x.dtype, ndim=2, shape=(p.T, p.H), device=p.device)
    p.require_cuda()
    generation = cache.generation
    if p.T == 0:
        return Plan(p, None, 0, generation)
    requested = Tactic.parse(tactic) if tactic else None
    chosen = resolve(p, requested)
    need = _native.C().workspace_size(p.device.index, p.shape)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.uint8, ndim=1, device=p.device,
                     align=WORKSPACE_ALIGNMENT)
        if workspace.numel() < need:
            fail("workspace", f"{workspace.numel()} bytes", f"at least {need} bytes (moe_kernels.workspace_size(...))")
    # A tuned choice may change inside autotune(); the caller's never does.
    return Plan(p, chosen, need, -1 if requested is not None else generation)


def plan_for(tensors, options) -> Plan:
    """The cached plan of this signature, made (validated, resolved) on first use."""
    key = _signature(tensors, options)
    plan = _plans.get(key) if key is not None else None
    # Inside autotune() a forward may tune its bucket: no cached plan there.
    if plan is not None and not cache.tuners and plan.generation in (-1, cache.generation):
        return plan
    with _lock:
        plan = _make_plan(tensors, options)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return plan


def _stream(device: int) -> int:
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device) if get is not None else torch.cuda.current_stream(device).cuda_stream


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0


def traced(x) -> bool:
    """Whether a forward on `x` must go through the dispatcher: torch.compile, a dispatch mode
    (fake tensors, make_fx) or a tensor subclass. Else the implementation is called directly,
    which saves the dispatcher's boxing of 25 arguments on every eager call."""
    return (type(x) is not torch.Tensor or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() > 0)


def forward(*args):
    """The op's implementation: validated and resolved once per signature, then one library call."""
    tensors, options = args[:16], args[16:]
    if type(options[2]) is list:  # through the dispatcher: int[] arrives as a list
        options = options[:2] + (tuple(options[2]),) + options[3:]
    plan = plan_for(tensors, options)
    if plan.T == 0:
        return
    x, w13, w2, wts, ids, b13, b2, s13, s2, a13, a2, z13, z2, emap, out, workspace = tensors
    if options[5]:  # apply_router_weight_on_input (top_k 1): the row weighted, the library sums unweighted
        x = (x.float() * wts).to(x.dtype)
    if workspace is None:
        workspace = torch.empty(plan.need, dtype=torch.uint8, device=x.device)
    t = plan.tactic
    _native.C().run(plan.device, plan.shape, x.data_ptr(), ids.data_ptr(), wts.data_ptr(), w13.data_ptr(),
                    w2.data_ptr(), _ptr(b13), _ptr(b2), _ptr(s13), _ptr(s2), _ptr(a13), _ptr(a2),
                    _ptr(z13), _ptr(z2), _ptr(emap), out.data_ptr(), workspace.data_ptr(),
                    workspace.numel(), t.forward, t.gemm1, t.gemm2, _stream(plan.device), options[-1])


def _fake(*args):
    """Under torch.compile (fake tensors): the same validation, no pointers, no tactic (the
    device is checked when it runs)."""
    tensors, options = args[:16], args[16:]
    p = problem(tensors, *options[:7])
    check_tensor("out", tensors[14], dtype=p.tensors[0].dtype, ndim=2, shape=(p.T, p.H), device=p.device)
    if tensors[15] is not None:
        check_tensor("workspace", tensors[15], dtype=torch.uint8, ndim=1, device=p.device,
                     align=WORKSPACE_ALIGNMENT)


# Registered for every backend, so that a CPU tensor gets the library's own error.
_lib.impl("fused_moe", forward, "CompositeExplicitAutograd")
_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract
_register_fake("moe_kernels::fused_moe", _fake, lib=_lib)


def op_options(quant, activation, expert_offset, ep_rank, ep_size, num_experts, swiglu_alpha,
               swiglu_limit, apply_router_weight_on_input, routed_scaling_factor, tactic, last_step) -> tuple:
    """fused_moe's keyword arguments as the op's non-tensor arguments (None as "" or -1)."""
    def code(name, v):
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, enum.Enum):
            return v.value
        fail(name, repr(v), "a name (str) or its enum member", TypeError)
    experts = []
    for name, v in (("expert_offset", expert_offset), ("ep_rank", ep_rank), ("ep_size", ep_size),
                    ("num_experts", num_experts)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            fail(name, repr(v), "a non-negative int or None")
        experts.append(-1 if v is None else v)
    if isinstance(tactic, Tactic):
        tactic = str(tactic)
    elif tactic is not None:
        fail("tactic", repr(tactic), "a moe_kernels.Tactic", TypeError)
    if not isinstance(apply_router_weight_on_input, bool):
        fail("apply_router_weight_on_input", repr(apply_router_weight_on_input), "a bool", TypeError)
    for name, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit),
                    ("routed_scaling_factor", routed_scaling_factor)):
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            fail(name, repr(v), "a float", TypeError)
    return (code("quant", quant), code("activation", activation), tuple(experts), float(swiglu_alpha), float(swiglu_limit),
            apply_router_weight_on_input, 1.0 if routed_scaling_factor is None else float(routed_scaling_factor),
            tactic or "", int(last_step))
