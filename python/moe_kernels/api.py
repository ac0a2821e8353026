"""The public forward, through the registered op (moe_kernels.ops): validation on the host
(moe_kernels.problem) and tactic resolution (moe_kernels.tactic), once per signature, then one
call into the per-arch library.

With `workspace=` and `out=` given, a forward allocates nothing and never waits on the
device, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from . import _native, ops
from .modes import Activation
from .problem import (WORKSPACE_ALIGNMENT, MAX_TOP_K, Problem, c_shape, check_alignment, check_tensor,
                      device_index, fail, out_dtype_name, parse_quant, require_built)
from .tactic import Tactic, resolve

__all__ = ["choose_tactic", "fused_moe", "list_kernels", "workspace_size", "WORKSPACE_ALIGNMENT"]


def workspace_size(num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                   intermediate_size: int, *, quant="bf16", activation="swiglu",
                   device=None) -> int:
    """Bytes of workspace a forward with these sizes needs on `device` (num_experts is local).

    A workspace sized for T tokens serves every forward with at most T tokens (for modes with
    several hidden dtypes, with any of them alike). The arguments are checked before a GPU is
    looked for; without one, a RuntimeError says so.
    """
    mode = parse_quant(quant)
    require_built(mode)
    act = Activation.parse(activation)
    for name, v in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts),
                    ("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not isinstance(v, int) or v < (0 if name == "num_tokens" else 1):
            fail(name, v, "a positive int")
    if top_k > MAX_TOP_K:
        fail("top_k", top_k, f"at most {MAX_TOP_K}")
    check_alignment(mode.spec, hidden_size, intermediate_size, "hidden_size/intermediate_size")
    shape = c_shape(T=num_tokens, H=hidden_size, I=intermediate_size, E=num_experts, k=top_k,
                    dtype=mode.spec.hidden[0], mode=mode.spec, activation=act)
    return int(_native.C().workspace_size(device_index(device, "workspace_size"), shape))


def list_kernels(device=None, quant=None, out_dtype=None) -> list:
    """The kernels usable on `device` (default: current): all of them, or one mode's (GEMM and
    whole-forward kernels; KernelInfo.kind tells them apart). For modes with several hidden
    dtypes, those writing `out_dtype` (by default the mode's first: bf16)."""
    if quant is None:
        dev = device_index(device, "list_kernels")
        return [k for k in _native.library_for(dev)["kernels"] if not _native.kernel_problem(dev, k.name)]
    mode = parse_quant(quant)
    out = out_dtype_name(mode, out_dtype)  # checked before any device is looked at
    return list(_native.usable_kernels(device_index(device, "list_kernels"), mode.value, out).values())


def choose_tactic(hidden_states, w13, w2, topk_weights, topk_ids, *, quant=None,
                  activation="swiglu", w13_scale=None, w2_scale=None, w13_zero=None,
                  w2_zero=None) -> Tactic:
    """The tactic a fused_moe call with these arguments would use by default."""
    quant = None if quant is None else parse_quant(quant)
    p = Problem(hidden_states, w13, w2, topk_weights, topk_ids, quant=quant, activation=activation,
                w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    p.require_cuda()
    return resolve(p)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, quant=None,
              activation="swiglu", w13_bias=None, w2_bias=None, expert_offset=None,
              ep_rank=None, ep_size=None, num_experts=None, expert_map=None,
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, w13_scale=None, w2_scale=None,
              a13_scale=None, a2_scale=None, w13_zero=None, w2_zero=None,
              apply_router_weight_on_input: bool = False, routed_scaling_factor=None,
              workspace=None, out=None, tactic=None, _last_step: int = 0) -> torch.Tensor:
    """Fused MoE forward: out[t] = sum_slot topk_weights[t, slot] * expert(topk_ids[t, slot])(x[t]).

    hidden_states [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows; [E_local, I, H] for
    non-gated activations); w2 [E_local, H, I]; topk_weights [T, k] float32; topk_ids [T, k]
    int32/int64 global expert ids. Ids outside [expert_offset, expert_offset + E_local)
    (including -1) contribute nothing; `expert_map` (int32 [global experts], the local index
    or -1) says instead which experts are local, in any order. quant defaults to the dtype of
    hidden_states (fp8 when the weights are torch.float8_e4m3fn; fp8_block when w13_scale is
    3-D as well).

    fp8: bf16 or fp16 hidden_states (out in the same type), float8_e4m3fn weights with float32 w13_scale /
    w2_scale per tensor [E] or per output channel [E, N]; the GEMM inputs are quantized on
    the device, per token unless a static per-tensor a13_scale / a2_scale is given.
    fp8_block (DeepSeek-V3): float8_e4m3fn weights with float32 scales per 128x128 block,
    w13_scale [E, N1/128, H/128] and w2_scale [E, H/128, I/128] (checkpoints'
    weight_scale_inv as stored); GEMM inputs are quantized per token per 128 columns on the
    device; H and I must be multiples of 128.
    w4a16_int4 / w4a16_mxfp4: 4-bit weights in the prepared layout, uint8 w13 [E, ceil(H/128),
    N1/16, 1024] and w2 [E, ceil(I/128), H/16, 1024] (moe_kernels.quant4; checkpoint-packed
    [E, N, K/2] weights go through moe_kernels.prepare.prepare_weights once at load time, and
    are refused here), with 16-bit scales [E, K/g, N] and, for asymmetric INT4 (AWQ), additive
    zero terms w13_zero/w2_zero in the scales' layout, as moe_kernels.prepare makes them
    (w4a16_mxfp4's weights in the placed form of that layout, its scales times 2^126 for bf16
    or 2^14 for fp16: prepared for that mode); w4a8_int4 / w4a8_mxfp4: the same weights (MXFP4
    prepared for w4a8_mxfp4, its scales as they are) with the GEMM inputs quantized to E4M3 as
    fp8's are. moe_kernels.modes.MODES lists every mode.

    apply_router_weight_on_input: top_k 1 only (Llama 4): the token's input row is multiplied
    by its router weight before GEMM1 (a [T, H] temporary) and the output is not weighted.
    routed_scaling_factor: the output is multiplied by it (DeepSeek-V3's 2.5).

    Runs as `torch.ops.moe_kernels.fused_moe` (moe_kernels.ops) on the current stream: under
    torch.compile and other tracing through the dispatcher, eagerly (and in CUDA graphs) its
    implementation directly. With `workspace=` and `out=` given, a forward allocates nothing
    and never waits on the device.
    `_last_step` is for the benchmark's step breakdown only (out is then not written).
    """
    options = ops.op_options(quant, activation, expert_offset, ep_rank, ep_size, num_experts,
                             swiglu_alpha, swiglu_limit, apply_router_weight_on_input,
                             routed_scaling_factor, tactic, _last_step)
    tensors = (hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, w13_scale, w2_scale,
               a13_scale, a2_scale, w13_zero, w2_zero, expert_map)
    if out is None and isinstance(hidden_states, torch.Tensor):
        out = torch.empty_like(hidden_states)
    if ops.traced(hidden_states):
        if not all(isinstance(t, torch.Tensor) for t in tensors[:5] + (out,)) or \
                not all(t is None or isinstance(t, torch.Tensor) for t in tensors[5:] + (workspace,)):
            # The op takes tensors only: the validation names the argument that is not one.
            ops.problem(tensors, *options[:7])
            for name, t in (("out", out), ("workspace", workspace)):
                if t is not None:
                    check_tensor(name, t)
        torch.ops.moe_kernels.fused_moe(*tensors, out, workspace, *options)
    else:  # eager: the op's implementation without the dispatcher's argument boxing
        ops.forward(*tensors, out, workspace, *options)
    return out
