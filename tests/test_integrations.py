"""moe_kernels.integrations: the vLLM, SGLang and FlashInfer entry points.

CPU tests replace the core forward (moe_kernels.api.fused_moe) with a recorder that runs
moe_kernels.reference, and check each wrapper against the stack's own semantics written out
below (gate/up order, interleaving, scale layouts) and every refusal. GPU tests (marked gpu)
check the wrappers against the core on the device.
"""
import enum
import inspect
import types

import pytest
import torch
import torch.nn.functional as F

import moe_kernels
from moe_kernels import api, fp8, quant4, reference
from moe_kernels.integrations import _common, cache_info, clear_cache, set_cache_size
from moe_kernels.integrations import flashinfer as fi
from moe_kernels.integrations import sglang as sg
from moe_kernels.integrations import vllm as vl

BF16 = torch.bfloat16


# ---- a recording core: moe_kernels.reference with the core's routing options -------------

class Core:
    """Stands in for moe_kernels.api.fused_moe on CPU: records each call, computes it with
    moe_kernels.reference (expert_map, routed_scaling_factor, apply_router_weight_on_input,
    ep_rank/ep_size and out= as the core defines them)."""

    def __init__(self):
        self.calls = []

    @property
    def last(self):
        return self.calls[-1]

    def __call__(self, x, w13, w2, topk_weights, topk_ids, *, expert_map=None, routed_scaling_factor=None,
                 apply_router_weight_on_input=False, expert_offset=None, ep_rank=None, ep_size=None,
                 num_experts=None, out=None, workspace=None, tactic=None, **kw):
        self.calls.append(dict(kw, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                               expert_map=expert_map, routed_scaling_factor=routed_scaling_factor,
                               apply_router_weight_on_input=apply_router_weight_on_input,
                               expert_offset=expert_offset, ep_rank=ep_rank, ep_size=ep_size, out=out,
                               keys=set(kw) | {k for k, v in (("expert_map", expert_map),
                                                              ("routed_scaling_factor", routed_scaling_factor),
                                                              ("ep_rank", ep_rank), ("ep_size", ep_size),
                                                              ("expert_offset", expert_offset), ("out", out))
                                               if v is not None}
                               | ({"apply_router_weight_on_input"} if apply_router_weight_on_input else set())))
        ids = topk_ids.long()
        E = w13.shape[0]
        offset = 0
        if expert_map is not None:
            inside = (ids >= 0) & (ids < expert_map.numel())
            ids = torch.where(inside, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
        elif ep_rank is not None:
            offset = ep_rank * E
        elif expert_offset is not None:
            offset = expert_offset
        xin, wts = x.float(), topk_weights
        if apply_router_weight_on_input:
            xin, wts = xin * topk_weights, torch.ones_like(topk_weights)
        y = reference.fused_moe(xin, w13, w2, wts, ids, expert_offset=offset, **kw)
        if routed_scaling_factor is not None:
            y = y * routed_scaling_factor
        y = y.to(x.dtype)
        if out is not None:
            out.copy_(y)
            return out
        return y


@pytest.fixture
def core(monkeypatch):
    c = Core()
    monkeypatch.setattr(api, "fused_moe", c)
    clear_cache()
    yield c
    clear_cache()


# ---- the stacks' semantics, written out -------------------------------------------------

def silu_mul(h):  # vLLM/SGLang "silu": [gate | up]
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def oai_interleaved(h, alpha=1.702, limit=7.0):  # vLLM swigluoai / SGLang swiglu_with_alpha_and_limit
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def w31_swiglu(h):  # FlashInfer Swiglu: [up | gate]
    d = h.shape[-1] // 2
    return F.silu(h[..., d:]) * h[..., :d]


def w31_swiglu_bias(alpha, beta, limit):
    def act(h):
        d = h.shape[-1] // 2
        up, gate = h[..., :d].clamp(min=-limit, max=limit), h[..., d:].clamp(max=limit)
        return gate * torch.sigmoid(alpha * gate) * (up + beta)
    return act


def moe(x, w1, w2, wts, ids, act, b1=None, b2=None, expert_map=None, offset=0, scale=1.0, on_input=False,
        combine=True):
    """The stacks' MoE in float32, one (token, slot) at a time: w1/w2 dequantized [E, N, K]."""
    T, k = ids.shape
    E, H = w1.shape[0], w2.shape[1]
    out = torch.zeros(T, k, H)
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < expert_map.numel() else -1
            else:
                e -= offset
            if not 0 <= e < E:
                continue
            xin = x[t].float() * (float(wts[t, s]) if on_input else 1.0)
            h = xin @ w1[e].float().t()
            if b1 is not None:
                h = h + b1[e].float()
            y = act(h) @ w2[e].float().t()
            if b2 is not None:
                y = y + b2[e].float()
            out[t, s] = y * (1.0 if on_input else float(wts[t, s]))
    return out.sum(1) * scale if combine else out


def close(out, ref, tol=1e-2):
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.3e}"


def problem(T=6, E=4, k=2, H=64, I=32, gated=True, dtype=BF16, bias=False, seed=0, global_experts=None):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * I if gated else I

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    ids = torch.rand(T, global_experts or E, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=g) + 0.1
    p = dict(x=randn(T, H), w1=randn(E, n1, H, scale=H ** -0.5), w2=randn(E, H, I, scale=I ** -0.5),
             wts=(w / w.sum(1, keepdim=True)).float(), ids=ids)
    if bias:
        p.update(b1=randn(E, n1, scale=0.5), b2=randn(E, H, scale=0.5))
    return p


# ---- the shared helpers -----------------------------------------------------------------

def test_deinterleave_and_swap_halves():
    t = torch.arange(12).reshape(1, 6, 2)
    d = _common.deinterleave_gate_up(t, 1)
    assert d[0, :, 0].tolist() == [0, 4, 8, 2, 6, 10]
    assert _common.deinterleave_gate_up(t.transpose(1, 2).contiguous(), 2)[0, 0].tolist() == [0, 4, 8, 2, 6, 10]
    s = _common.swap_halves(t, 1)
    assert s[0, :, 0].tolist() == [6, 8, 10, 0, 2, 4]
    assert fi.w31_to_w13(t).equal(s)
    for fn in (_common.deinterleave_gate_up, _common.swap_halves):
        with pytest.raises(ValueError, match="expected an even number"):
            fn(torch.zeros(1, 5, 2))


def test_int4_conversions_keep_every_value():
    g = torch.Generator().manual_seed(1)
    E, N, K, G = 2, 8, 64, 32
    u = torch.randint(0, 16, (E, N, K), generator=g)
    packed = quant4.pack_nibbles(u)                                 # vLLM: unsigned, even k low
    q = quant4.int4_values(_common.int4_from_unsigned(packed))      # the core: signed
    assert q.equal((u - 8).to(q.dtype))
    scale = torch.rand(E, N, K // G, generator=g) + 0.5             # float32: the algebra exactly
    zp = torch.randint(0, 16, (E, N, K // G), generator=g)
    zp_packed = (zp[:, 0::2] | (zp[:, 1::2] << 4)).to(torch.uint8)  # two along N per byte, even n low
    zero = _common.int4_zero_from_packed_zp(zp_packed, scale)
    s = _common.int4_scale_from_nk(scale)
    assert s.shape == (E, K // G, N) and zero.shape == (E, K // G, N)
    vllm_w = (u.float() - zp.float().repeat_interleave(G, -1)) * scale.repeat_interleave(G, -1)
    core_w = quant4.dequantize_int4(_common.int4_from_unsigned(packed), s, zero)
    assert torch.allclose(core_w, vllm_w, atol=1e-5)
    assert _common.int4_zero_from_packed_zp(zp_packed, scale.to(BF16)).dtype == BF16


def test_layout_cache_converts_once_per_source_version():
    clear_cache()
    made = []

    def make(t):
        made.append(1)
        return t * 2
    w = torch.ones(4, 4)
    a = _common.cached("test", make, w)
    assert _common.cached("test", make, w) is a and len(made) == 1
    assert _common.cached("test", make, w.detach()) is a and len(made) == 1  # same memory, same version counter
    w.add_(1)                                     # a new version: converted again
    b = _common.cached("test", make, w)
    assert b is not a and b[0, 0] == 4 and len(made) == 2
    other = torch.ones(4, 4)
    assert _common.cached("test", make, other) is not b and len(made) == 3
    assert _common.cached("test", make, None) is None
    info = cache_info()
    assert info["entries"] == 3 and info["bytes"] == 3 * 16 * 4
    set_cache_size(1)
    assert cache_info()["entries"] == 1
    _common.cached("test", make, w)               # evicted: made again
    assert len(made) == 4
    set_cache_size(1024)
    clear_cache()
    assert cache_info()["entries"] == 0
    with pytest.raises(ValueError, match="entries: got -1"):
        set_cache_size(-1)
    with torch.inference_mode():                  # no version counter: keyed without one
        t = torch.ones(2)
        assert _common.cached("test", make, t) is _common.cached("test", make, t)
    clear_cache()


# ---- vLLM ---------------------------------------------------------------------------------

def vllm_call(p, **kw):
    return vl.fused_experts(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], **kw)


@pytest.mark.parametrize("name,core_act,gated", [
    ("silu", "swiglu", True), ("gelu", "geglu", True), ("gelu_tanh", "geglu_tanh", True),
    ("swigluoai", "swiglu_oai", True), ("silu_no_mul", "silu", False), ("gelu_no_mul", "gelu", False),
    ("relu2_no_mul", "relu2", False)])
def test_vllm_activation_names(core, name, core_act, gated):
    p = problem(gated=gated)
    vllm_call(p, activation=name)
    assert core.last["activation"] == core_act
    MoEActivation = enum.Enum("MoEActivation", {"X": name})  # vLLM's enum members are taken too
    vllm_call(p, activation=MoEActivation.X)
    assert core.last["activation"] == core_act


@pytest.mark.parametrize("name,exc,match", [
    ("relu2", NotImplementedError, "gated relu2"), ("swiglustep", NotImplementedError, "SwiGLU-step"),
    ("gelu_tanh_no_mul", NotImplementedError, "non-gated tanh"), ("swiglu", ValueError, "vLLM's names"),
    (3, TypeError, "activation: got 3")])
def test_vllm_refused_activations(core, name, exc, match):
    with pytest.raises(exc, match=match):
        vllm_call(problem(), activation=name)
    assert not core.calls


def test_vllm_silu_matches_vllm(core):
    p = problem(bias=True)
    out = vllm_call(p, w1_bias=p["b1"], w2_bias=p["b2"])
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], silu_mul, p["b1"], p["b2"]))
    c = core.last
    assert c["w13"] is p["w1"] and c["w13_bias"] is p["b1"] and "quant" not in c
    assert c["keys"] == {"activation", "w13_bias", "w2_bias"}  # nothing the core does not have yet


def test_vllm_swigluoai_interleaved_rows(core):
    p = problem(bias=True)
    out = vllm_call(p, activation="swigluoai", w1_bias=p["b1"], w2_bias=p["b2"])
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], oai_interleaved, p["b1"], p["b2"]))
    c = core.last
    assert (c["swiglu_alpha"], c["swiglu_limit"]) == (1.702, 7.0)
    assert c["w13"].equal(torch.cat([p["w1"][:, 0::2], p["w1"][:, 1::2]], 1))
    assert c["w13_bias"].equal(torch.cat([p["b1"][:, 0::2], p["b1"][:, 1::2]], 1))
    w13 = c["w13"]
    vllm_call(p, activation="swigluoai", w1_bias=p["b1"], w2_bias=p["b2"])
    assert core.last["w13"] is w13  # converted once
    cfg = types.SimpleNamespace(gemm1_alpha=1.5, gemm1_clamp_limit=3.0)
    out = vllm_call(p, activation="swigluoai", quant_config=cfg)
    assert (core.last["swiglu_alpha"], core.last["swiglu_limit"]) == (1.5, 3.0)
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], lambda h: oai_interleaved(h, 1.5, 3.0)))
    with pytest.raises(ValueError, match="gemm1_alpha/gemm1_clamp_limit"):
        vllm_call(p, activation="silu", quant_config=cfg)


def test_vllm_expert_map(core):
    p = problem(E=3, global_experts=8, k=3)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[torch.tensor([5, 1, 6])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = vllm_call(p, global_num_experts=8, expert_map=expert_map)
    assert core.last["expert_map"] is expert_map and core.last["expert_offset"] is None
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], silu_mul, expert_map=expert_map))
    vllm_call(p, global_num_experts=8)  # no map: every expert local, ids >= 3 contribute nothing
    assert "expert_map" not in core.last["keys"] and "expert_offset" not in core.last["keys"]
    with pytest.raises(ValueError, match=r"expert_map: got shape \(8,\), expected \(16,\)"):
        vllm_call(p, global_num_experts=16, expert_map=expert_map)
    with pytest.raises(TypeError, match="expert_map: got dtype torch.int64"):
        vllm_call(p, expert_map=expert_map.long())
    with pytest.raises(ValueError, match="global_num_experts: got 2"):
        vllm_call(p, global_num_experts=2)


def test_vllm_inplace_and_router_weight_on_input(core):
    p = problem(k=1)
    x = p["x"].clone()
    ref = moe(x, p["w1"], p["w2"], p["wts"], p["ids"], silu_mul)
    res = vllm_call(p, inplace=True)
    assert res is p["x"]
    close(p["x"], ref)
    p["x"] = x
    out = vllm_call(p, apply_router_weight_on_input=True)
    assert core.last["apply_router_weight_on_input"] is True
    close(out, moe(x, p["w1"], p["w2"], p["wts"], p["ids"], silu_mul, on_input=True))
    with pytest.raises(ValueError, match="apply_router_weight_on_input: got True with top_k=2"):
        vllm_call(problem(k=2), apply_router_weight_on_input=True)
    p = problem(k=1, bias=True)
    with pytest.raises(NotImplementedError, match="apply_router_weight_on_input: got True with w1_bias"):
        vllm_call(p, apply_router_weight_on_input=True, w1_bias=p["b1"])
    with pytest.raises(NotImplementedError, match="apply_router_weight_on_input: got True with b1"):
        sg_call(p, sg.MoeRunnerConfig(inplace=False, apply_router_weight_on_input=True), b1=p["b1"])


def fp8_weights(p, granularity="channel"):
    q1, s1 = fp8.quantize_weight(p["w1"].float(), granularity)
    q2, s2 = fp8.quantize_weight(p["w2"].float(), granularity)
    return q1, s1, q2, s2


def test_vllm_fp8_mapping(core):
    p = problem(H=128, I=128)
    q1, s1, q2, s2 = fp8_weights(p, "tensor")
    a1 = torch.tensor([0.02])
    vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, a1_scale=a1)
    c = core.last
    assert c["quant"] == "fp8" and c["w13_scale"] is s1 and c["w2_scale"] is s2 and c["a13_scale"] is a1
    vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], w1_scale=s1, w2_scale=s2)  # the dtype implies the flag
    assert core.last["quant"] == "fp8"
    q1, s1, q2, s2 = fp8_weights(p, "channel")
    out = vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], activation="swigluoai", per_channel_quant=True,
                           w1_scale=s1[..., None], w2_scale=s2)
    c = core.last
    assert c["w13"].view(torch.uint8).equal(torch.cat([q1[:, 0::2], q1[:, 1::2]], 1).view(torch.uint8))
    assert c["w13_scale"].equal(torch.cat([s1[:, 0::2], s1[:, 1::2]], 1)[..., None])
    assert torch.isfinite(out).all()
    q1, s1, q2, s2 = fp8_weights(p, "block")
    vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_fp8_w8a8=True, block_shape=[128, 128],
                     w1_scale=s1, w2_scale=s2)
    assert core.last["quant"] == "fp8_block" and core.last["w13_scale"] is s1


def test_vllm_fp8_refusals(core):
    p = problem(H=128, I=128)
    q1, s1, q2, s2 = fp8_weights(p, "block")
    kw = dict(use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2)
    with pytest.raises(NotImplementedError, match=r"block_shape: got \[64, 64\]"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], block_shape=[64, 64], **kw)
    with pytest.raises(NotImplementedError, match="would split the 128-row scale blocks"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], block_shape=[128, 128], activation="swigluoai", **kw)
    q1, s1, q2, s2 = fp8_weights(p, "channel")
    with pytest.raises(ValueError, match="a1_scale/a2_scale: got static activation scales with per_channel"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_fp8_w8a8=True, per_channel_quant=True,
                         w1_scale=s1, w2_scale=s2, a1_scale=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="w1: got dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        vllm_call(p, use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2)
    with pytest.raises(TypeError, match="w1_scale: got dtype torch.bfloat16, expected torch.float32"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], w1_scale=s1.to(BF16), w2_scale=s2)
    with pytest.raises(ValueError, match="w1_zp: got zero points, expected None for use_fp8_w8a8"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], w1_scale=s1, w2_scale=s2, w1_zp=s1)
    assert not core.calls


@pytest.mark.parametrize("kw,exc,match", [
    (dict(use_int8_w8a8=True), NotImplementedError, "use_int8_w8a8: got True, expected False: INT8"),
    (dict(use_int8_w8a16=True), NotImplementedError, "use_int8_w8a16: got True"),
    (dict(use_fp8_w8a8=True, use_int4_w4a16=True), ValueError, "at most one True"),
    (dict(w1_scale=torch.ones(4)), ValueError, "w1_scale: got a tensor, expected None for 16-bit weights"),
    (dict(block_shape=[128, 128]), ValueError, r"block_shape: got \[128, 128\], expected None for 16-bit"),
    (dict(per_channel_quant=True), ValueError, "per_channel_quant: got True"),
    (dict(inplace=1), TypeError, "inplace: got 1, expected a bool"),
    (dict(quant_config=types.SimpleNamespace(use_int8_w8a8=True)), NotImplementedError,
     "quant_config: got use_int8_w8a8=True"),
    (dict(quant_config=types.SimpleNamespace(use_mxfp4_w4a4=True)), NotImplementedError, "use_mxfp4_w4a4"),
    (dict(w1_bias=torch.zeros(4, 64, dtype=BF16), quant_config=types.SimpleNamespace(
        w1_bias=torch.zeros(4, 64, dtype=BF16))), ValueError, "w1_bias: got a value here and in quant_config"),
])
def test_vllm_option_errors(core, kw, exc, match):
    with pytest.raises(exc, match=match):
        vllm_call(problem(), **kw)
    assert not core.calls


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda p: p.update(w1=p["w1"].tolist()), TypeError, "w1: got list, expected a torch.Tensor"),
    (lambda p: p.update(w1=p["w1"][0]), ValueError, r"w1: got shape \(64, 64\), expected a 3-D tensor"),
    (lambda p: p.update(w2=p["w2"][:3]), ValueError, r"w2: got shape \(3, 64, 32\), expected 4 experts"),
    (lambda p: p.update(wts=p["wts"][:, :1]), ValueError, r"topk_weights: got shape \(6, 1\)"),
    (lambda p: p.update(ids=p["ids"][:5], wts=p["wts"][:5]), ValueError, r"topk_ids: got shape \(5, 2\)"),
    (lambda p: p.update(x=p["x"][None]), ValueError, "hidden_states: got shape"),
    (lambda p: p.update(w1=p["w1"].to(torch.uint8)), TypeError, "w1: got dtype torch.uint8, expected 16-bit"),
])
def test_vllm_shape_and_type_errors(core, mutate, exc, match):
    p = problem()
    mutate(p)
    with pytest.raises(exc, match=match):
        vllm_call(p)


def vllm_int4(p, group=32, zp=False, seed=3):
    """Random vLLM use_int4_w4a16 weights: (w1, w2, s1, s2, z1, z2) and their dequantized values."""
    g = torch.Generator().manual_seed(seed)
    out, deq = [], []
    for w in (p["w1"], p["w2"]):
        E, N, K = w.shape
        u = torch.randint(0, 16, (E, N, K), generator=g)
        s = ((torch.rand(E, N, K // group, generator=g) + 0.5) * 0.05).to(BF16)
        z = torch.randint(0, 16, (E, N, K // group), generator=g) if zp else torch.full((E, N, K // group), 8)
        zpk = (z[:, 0::2] | (z[:, 1::2] << 4)).to(torch.uint8) if zp else None
        out.append((quant4.pack_nibbles(u), s, zpk))
        deq.append((u.float() - z.float().repeat_interleave(group, -1)) * s.float().repeat_interleave(group, -1))
    (w1, s1, z1), (w2, s2, z2) = out
    return dict(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2), deq


@pytest.mark.parametrize("zp", [False, True], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize("act", ["silu", "swigluoai"])
def test_vllm_int4_layouts(core, zp, act):
    p = problem(H=128, I=64)
    q, (d1, d2) = vllm_int4(p, zp=zp)
    out = vl.fused_experts(p["x"], q.pop("w1"), q.pop("w2"), p["wts"], p["ids"], activation=act,
                           use_int4_w4a16=True, block_shape=[0, 32], **q)
    act_fn = oai_interleaved if act == "swigluoai" else silu_mul
    close(out, moe(p["x"], d1, d2, p["wts"], p["ids"], act_fn))
    c = core.last
    assert c["quant"] == "w4a16_int4" and c["w13_scale"].shape == (4, 4, 128)
    assert (c["w13_zero"] is not None) == zp
    # the core gets the weights prepared (repacked once, cached): [E, ceil(K/128), N/16, 1024]
    assert c["w13"].shape == (4, 1, 8, 1024) and c["w2"].shape == (4, 1, 8, 1024)


def test_vllm_int4_errors(core):
    p = problem(H=128, I=64)
    q, _ = vllm_int4(p, zp=True)
    w1, w2 = q.pop("w1"), q.pop("w2")
    with pytest.raises(ValueError, match=r"block_shape: got \[0, 64\], expected None or \[0, 32\]"):
        vl.fused_experts(p["x"], w1, w2, p["wts"], p["ids"], use_int4_w4a16=True, block_shape=[0, 64], **q)
    with pytest.raises(ValueError, match=r"w1_zp: got shape \(4, 128, 4\), expected \[E, N/2, K/g\]"):
        vl.fused_experts(p["x"], w1, w2, p["wts"], p["ids"], use_int4_w4a16=True,
                         **dict(q, w1_zp=q["w1_zp"].repeat(1, 2, 1)))
    with pytest.raises(ValueError, match=r"w1_scale: got shape \(4, 64, 4\), expected \[E, N, K/g\]"):
        vl.fused_experts(p["x"], w1, w2, p["wts"], p["ids"], use_int4_w4a16=True,
                         **dict(q, w1_scale=q["w1_scale"][:, :64]))
    with pytest.raises(ValueError, match="a1_scale: got a static activation scale"):
        vl.fused_experts(p["x"], w1, w2, p["wts"], p["ids"], use_int4_w4a16=True, a1_scale=torch.ones(1), **q)
    with pytest.raises(TypeError, match="w1: got dtype torch.bfloat16, expected torch.uint8"):
        vl.fused_experts(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], use_int4_w4a16=True, **q)
    assert not core.calls


@pytest.mark.parametrize("act", ["silu", "swigluoai"])
def test_vllm_mxfp4(core, act):
    p = problem(H=128, I=64)
    (q1, e1), (q2, e2) = quant4.quantize_mxfp4(p["w1"]), quant4.quantize_mxfp4(p["w2"])
    out = vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], activation=act, use_mxfp4_w4a16=True,
                           w1_scale=e1, w2_scale=e2)
    act_fn = oai_interleaved if act == "swigluoai" else silu_mul
    close(out, moe(p["x"], quant4.dequantize_mxfp4(q1, e1), quant4.dequantize_mxfp4(q2, e2), p["wts"], p["ids"],
                   act_fn))
    assert core.last["quant"] == "w4a16_mxfp4" and core.last["w13_scale"].dtype == BF16
    assert quant4.is_prepared(core.last["w13"]) and core.last["w2"].shape == (4, 1, 8, 1024)
    with pytest.raises(ValueError, match=r"block_shape: got \[0, 32\], expected None for use_mxfp4_w4a16"):
        vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_mxfp4_w4a16=True, w1_scale=e1, w2_scale=e2,
                         block_shape=[0, 32])


def test_vllm_quant_config(core):
    p = problem(H=128, I=128)
    q1, s1, q2, s2 = fp8_weights(p, "channel")
    cfg = types.SimpleNamespace(use_fp8_w8a8=True, per_act_token_quant=True, w1_scale=s1, w2_scale=s2,
                                a1_scale=None, a2_scale=None, block_shape=None, use_int8_w8a8=False)
    vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], quant_config=cfg)
    c = core.last
    assert c["quant"] == "fp8" and c["w13_scale"] is s1 and c["w2_scale"] is s2 and c["a13_scale"] is None

    class Asserting:  # vLLM's config properties assert on fields they do not hold
        @property
        def w1_precision(self):
            raise AssertionError

        use_fp8_w8a8 = False
    vllm_call(p, quant_config=Asserting())
    assert "quant" not in core.last


# ---- SGLang -------------------------------------------------------------------------------

def sg_call(p, cfg=None, **kw):
    cfg = cfg if cfg is not None else sg.MoeRunnerConfig(inplace=False)
    return sg.fused_experts(p["x"], p["w1"], p["w2"], sg.StandardTopKOutput(p["wts"], p["ids"], None), cfg, **kw)


def test_sglang_routed_scaling_factor(core):
    p = problem(bias=True)
    out = sg_call(p, sg.MoeRunnerConfig(inplace=False, routed_scaling_factor=2.5), b1=p["b1"], b2=p["b2"])
    assert core.last["routed_scaling_factor"] == 2.5
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], silu_mul, p["b1"], p["b2"], scale=2.5))
    sg_call(p, sg.MoeRunnerConfig(inplace=False, routed_scaling_factor=1.0))
    assert "routed_scaling_factor" not in core.last["keys"]


@pytest.mark.parametrize("interleaved", [True, False])
def test_sglang_gemm1_alpha_and_limit(core, interleaved):
    p = problem(bias=True)
    cfg = sg.MoeRunnerConfig(inplace=False, gemm1_alpha=1.702, gemm1_clamp_limit=7.0,
                             gate_up_interleaved=interleaved)
    out = sg_call(p, cfg, b1=p["b1"], b2=p["b2"])
    c = core.last
    assert (c["activation"], c["swiglu_alpha"], c["swiglu_limit"]) == ("swiglu_oai", 1.702, 7.0)
    if interleaved:
        act = oai_interleaved
    else:
        def act(h):
            d = h.shape[-1] // 2
            return oai_interleaved(torch.stack([h[..., :d], h[..., d:]], -1).flatten(-2))
        assert c["w13"] is p["w1"]
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], act, p["b1"], p["b2"]))
    sg_call(p, sg.MoeRunnerConfig(inplace=False, gemm1_alpha=1.0))
    assert core.last["swiglu_limit"] == _common.NO_LIMIT


def test_sglang_no_combine(core):
    p = problem(k=3, E=5)
    out = sg_call(p, sg.MoeRunnerConfig(inplace=False, no_combine=True, routed_scaling_factor=2.0))
    assert out.shape == (6, 3, 64) and len(core.calls) == 3
    assert all(c["topk_ids"].shape == (6, 1) and "routed_scaling_factor" not in c["keys"] for c in core.calls)
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], silu_mul, combine=False))
    with pytest.raises(ValueError, match="inplace=True with no_combine=True"):
        sg_call(p, sg.MoeRunnerConfig(inplace=True, no_combine=True))


def test_sglang_inplace_default_and_topk_forms(core):
    p = problem()
    x = p["x"].clone()
    res = sg.fused_experts(p["x"], p["w1"], p["w2"], (p["wts"], p["ids"], None), sg.MoeRunnerConfig())
    assert res is p["x"]  # SGLang's MoeRunnerConfig defaults to inplace=True
    close(res, moe(x, p["w1"], p["w2"], p["wts"], p["ids"], silu_mul))
    duck = types.SimpleNamespace(topk_weights=p["wts"], topk_ids=p["ids"])
    sg.fused_experts(x, p["w1"], p["w2"], duck, types.SimpleNamespace(inplace=False))  # missing fields: defaults
    assert core.last["activation"] == "swiglu"
    with pytest.raises(TypeError, match="topk_output: got Tensor"):
        sg.fused_experts(x, p["w1"], p["w2"], p["ids"], sg.MoeRunnerConfig())
    with pytest.raises(TypeError, match="moe_runner_config: got None"):
        sg.fused_experts(x, p["w1"], p["w2"], duck, None)


@pytest.mark.parametrize("cfg,gated,core_act", [
    (dict(activation="gelu"), True, "geglu"), (dict(activation="silu", is_gated=False), False, "silu"),
    (dict(activation="gelu", is_gated=False), False, "gelu"),
    (dict(activation="relu2", is_gated=False), False, "relu2")])
def test_sglang_activations(core, cfg, gated, core_act):
    sg_call(problem(gated=gated), sg.MoeRunnerConfig(inplace=False, **cfg))
    assert core.last["activation"] == core_act


@pytest.mark.parametrize("cfg,exc,match", [
    (dict(activation="relu2"), ValueError, r"activation: got 'relu2' with is_gated=True"),
    (dict(activation="gelu", gemm1_alpha=1.0), ValueError, "gemm1_alpha/gemm1_clamp_limit"),
    (dict(gemm1_clamp_limit=7.0), ValueError, "gemm1_alpha/gemm1_clamp_limit"),
    (dict(swiglu_limit=10.0), NotImplementedError, "swiglu_limit: got 10.0"),
    (dict(gemm1_alpha=1.702, gemm1_beta=2.0), NotImplementedError, "gemm1_beta: got 2.0"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor: got '2'"),
    (dict(apply_router_weight_on_input=True), ValueError, "apply_router_weight_on_input: got True with top_k=2"),
])
def test_sglang_config_errors(core, cfg, exc, match):
    base = dict(activation="silu", is_gated=True, inplace=False, no_combine=False, apply_router_weight_on_input=False,
                routed_scaling_factor=None, gemm1_alpha=None, gemm1_clamp_limit=None)
    with pytest.raises(exc, match=match):
        sg_call(problem(), types.SimpleNamespace(**dict(base, **cfg)))
    assert not core.calls


def test_sglang_quant_and_bias_names(core):
    p = problem(H=128, I=128)
    q1, s1, q2, s2 = fp8_weights(p, "block")
    sg.fused_experts(p["x"], q1, q2, (p["wts"], p["ids"]), sg.MoeRunnerConfig(inplace=False), use_fp8_w8a8=True,
                     w1_scale=s1, w2_scale=s2, block_shape=[128, 128])
    assert core.last["quant"] == "fp8_block"
    with pytest.raises(ValueError, match=r"b1: got shape \(4, 1, 256\), expected a 2-D tensor"):
        sg_call(p, b1=torch.zeros(4, 1, 256, dtype=BF16))
    with pytest.raises(NotImplementedError, match="use_int8_w8a16: got True"):
        sg_call(p, use_int8_w8a16=True)


# ---- FlashInfer ---------------------------------------------------------------------------

def w31(w13):
    return _common.swap_halves(w13, 1)


def fi_call(p, **kw):
    kw.setdefault("quant_scales", None)
    return fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], p["w1"], p["w2"], p["x"].dtype, **kw)


def test_flashinfer_bf16_w31(core):
    p = problem(bias=True)
    out = fi_call(p, fc1_expert_biases=p["b1"], fc2_expert_biases=p["b2"])
    assert isinstance(out, list) and len(out) == 1
    close(out[0], moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], w31_swiglu, p["b1"], p["b2"]))
    c = core.last
    assert c["w13"].equal(w31(p["w1"])) and c["w13_bias"].equal(w31(p["b1"])) and c["activation"] == "swiglu"
    output = torch.empty_like(p["x"])
    res = fi_call(p, fc1_expert_biases=p["b1"], fc2_expert_biases=p["b2"], output=output, tune_max_num_tokens=64, enable_pdl=True, use_fused_finalize=False,
                  profile_ids=[0, 0], workspace_buffer=torch.empty(16, dtype=torch.uint8))
    assert res[0] is output and core.last["out"] is output
    close(output, out[0], 1e-6)
    with pytest.raises(ValueError, match=r"output: got shape \(6, 32\)"):
        fi_call(p, output=torch.empty(6, 32, dtype=BF16))
    with pytest.raises(ValueError, match="output_dtype: got torch.float16, expected the input's dtype"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], p["w1"], p["w2"], torch.float16, None)
    with pytest.raises(ValueError, match="quant_scales: got scales, expected None or"):
        fi_call(p, quant_scales=[torch.ones(1)])


@pytest.mark.parametrize("act,core_act,gated", [
    (fi.ActivationType.Gelu, "gelu", False), (fi.ActivationType.Relu, "relu", False),
    (fi.ActivationType.Silu, "silu", False), (fi.ActivationType.Relu2, "relu2", False),
    (fi.ActivationType.Identity, "identity", False), (fi.ActivationType.Geglu, "geglu", True),
    (fi.ActivationType.GegluTanh, "geglu_tanh", True), (3, "swiglu", True), ("Geglu", "geglu", True),
    (fi.ActivationType.SwigluBias, "swiglu", True)])
def test_flashinfer_activations(core, act, core_act, gated):
    p = problem(gated=gated)
    fi_call(p, activation_type=act)
    c = core.last
    assert c["activation"] == core_act
    assert c["w13"].equal(w31(p["w1"]) if gated else p["w1"])


@pytest.mark.parametrize("act,exc,match", [
    (fi.ActivationType.SwigluStep, NotImplementedError, "no kernel for SwigluStep"),
    (fi.ActivationType.Situ, NotImplementedError, "no kernel for Situ"),
    (42, ValueError, "activation_type: got 42"), ("swish", ValueError, "activation_type: got 'swish'")])
def test_flashinfer_refused_activations(core, act, exc, match):
    with pytest.raises(exc, match=match):
        fi_call(problem(), activation_type=act)


def test_flashinfer_swiglu_bias(core):
    p = problem(bias=True)
    E = 4
    kw = dict(swiglu_alpha=torch.full((E,), 1.702), swiglu_beta=torch.ones(E), swiglu_limit=torch.full((E,), 7.0))
    out = fi_call(p, fc1_expert_biases=p["b1"], fc2_expert_biases=p["b2"], **kw)[0]
    c = core.last
    assert (c["activation"], c["swiglu_alpha"], c["swiglu_limit"]) == ("swiglu_oai", pytest.approx(1.702), 7.0)
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], w31_swiglu_bias(1.702, 1.0, 7.0), p["b1"], p["b2"]))
    fi_call(p, swiglu_beta=1.0)  # floats too; no alpha: 1, no limit: none
    assert (core.last["swiglu_alpha"], core.last["swiglu_limit"]) == (1.0, _common.NO_LIMIT)
    fi_call(p, swiglu_beta=torch.zeros(E), swiglu_alpha=torch.ones(E))
    assert core.last["activation"] == "swiglu"
    with pytest.raises(NotImplementedError, match="swiglu_alpha: got values from 1.0 to 2.0"):
        fi_call(p, swiglu_alpha=torch.tensor([1.0, 2.0, 1.0, 1.0]), swiglu_beta=torch.ones(E))
    with pytest.raises(NotImplementedError, match=r"swiglu_alpha/swiglu_beta/swiglu_limit: got \(1.702, 0.5"):
        fi_call(p, swiglu_alpha=1.702, swiglu_beta=0.5)
    with pytest.raises(ValueError, match=r"swiglu_beta: got shape \(3,\), expected \(4,\)"):
        fi_call(p, swiglu_beta=torch.ones(3))
    with pytest.raises(ValueError, match="expected None for activation_type=Geglu"):
        fi_call(p, activation_type=fi.ActivationType.Geglu, swiglu_beta=torch.ones(E))


def test_flashinfer_expert_and_tensor_parallel(core):
    p = problem(E=2, global_experts=6, k=3, bias=True)
    out = fi_call(p, ep_size=3, ep_rank=1, fc1_expert_biases=p["b1"], fc2_expert_biases=p["b2"])[0]
    c = core.last
    assert (c["ep_rank"], c["ep_size"]) == (1, 3)
    close(out, moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], w31_swiglu, p["b1"], p["b2"], offset=2))
    fi_call(p, tp_size=2, tp_rank=1, fc1_expert_biases=p["b1"], fc2_expert_biases=p["b2"])
    assert core.last.get("w2_bias") is None and core.last["w13_bias"] is not None  # fc2's bias: tp_rank 0 only
    fi_call(p)
    assert "ep_rank" not in core.last["keys"]
    with pytest.raises(ValueError, match=r"ep_rank: got 3, expected an int in \[0, 3\)"):
        fi_call(p, ep_size=3, ep_rank=3)
    with pytest.raises(ValueError, match="tp_size: got 0"):
        fi_call(p, tp_size=0)


def flashinfer_fp8(p, a2=0.05):
    """FlashInfer's FP8 per-tensor arguments for problem p: (x_q, w31 q, w2 q, quant_scales),
    and the core's equivalents."""
    q1, s1, q2, s2 = fp8_weights(p, "tensor")
    a1 = fp8.scale_from_amax(p["x"].float().abs().amax()).reshape(())
    x_q = fp8.quantize(p["x"], a1)
    a2 = torch.tensor(a2, device=p["x"].device)
    scales = [(s1 * a1).float(), (1.0 / a2).float(), (s2 * a2).float(), a1.float()]
    return x_q, w31(q1.view(torch.uint8)).view(torch.float8_e4m3fn), q2, scales, (q1, s1, q2, s2, a1, a2)


def test_flashinfer_fp8_per_tensor(core):
    p = problem(H=128, I=128)
    x_q, f1, f2, scales, (q1, s1, q2, s2, a1, a2) = flashinfer_fp8(p)
    out = fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, BF16, quant_scales=scales)[0]
    c = core.last
    assert c["quant"] == "fp8" and c["x"].dtype == BF16
    assert c["x"].float().equal((x_q.float() * a1).to(BF16).float())
    assert torch.allclose(c["w13_scale"], s1) and torch.allclose(c["w2_scale"], s2)
    assert torch.allclose(c["a13_scale"], a1.reshape(1)) and torch.allclose(c["a2_scale"], a2.reshape(1))
    assert c["w13"].view(torch.uint8).equal(q1.view(torch.uint8))
    ref = reference.fused_moe((x_q.float() * a1).to(BF16), q1, q2, p["wts"], p["ids"], quant="fp8", w13_scale=s1,
                              w2_scale=s2, a13_scale=a1.reshape(1), a2_scale=a2.reshape(1).float())
    close(out, ref, 1e-2)
    fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], f1, f2, BF16, quant_scales=scales)  # 16-bit input too
    assert core.last["x"] is p["x"]
    bad = list(scales)
    bad[1] = torch.full((4,), 20.0)
    with pytest.raises(NotImplementedError, match=r"quant_scales\[1\]: got shape \(4,\), expected a scalar"):
        fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, BF16, quant_scales=bad)
    with pytest.raises(ValueError, match="quant_scales: got 2 tensors, expected a list of 4 tensors"):
        fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, BF16, quant_scales=scales[:2])
    with pytest.raises(ValueError, match=r"quant_scales\[0\]: got shape \(1,\), expected \(4,\)"):
        fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, BF16, quant_scales=[scales[1].reshape(1)] + scales[1:])
    with pytest.raises(ValueError, match="output_dtype: got torch.float32"):
        fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, torch.float32, quant_scales=scales)
    with pytest.raises(TypeError, match="input: got dtype torch.float8_e4m3fn, expected bf16/fp16 with torch.bfloat16"):
        fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], p["w1"], p["w2"], BF16, quant_scales=None)


def test_flashinfer_fp8_blocks(core):
    p = problem(H=128, I=128)
    q1, s1, q2, s2 = fp8_weights(p, "block")
    f1 = w31(q1.view(torch.uint8)).view(torch.float8_e4m3fn)
    fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], f1, q2, BF16, quant_scales=[w31(s1), s2],
                         use_deepseek_fp8_block_scale=True)
    c = core.last
    assert c["quant"] == "fp8_block" and c["w13_scale"].equal(s1) and c["w13"].view(torch.uint8).equal(
        q1.view(torch.uint8))
    with pytest.raises(TypeError, match="input: got dtype torch.float8_e4m3fn"):
        fi.cutlass_fused_moe(p["x"].to(torch.float8_e4m3fn), p["ids"], p["wts"], f1, q2, BF16,
                             quant_scales=[s1, s2], use_deepseek_fp8_block_scale=True)
    p = problem(H=128, I=64)
    q1, s1, q2, s2 = fp8_weights(p, "block")
    with pytest.raises(ValueError, match="a multiple of 128"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], q1, q2, BF16, quant_scales=[s1, s2],
                             use_deepseek_fp8_block_scale=True)


@pytest.mark.parametrize("form", ["bf16", "int32", "e8m0"])
def test_flashinfer_mxfp4(core, form):
    from moe_kernels.prepare import interleave_moe_scales_for_sm90_mixed_gemm as il_scales
    from moe_kernels.prepare import interleave_moe_weights_for_sm90_mixed_gemm as il_weights
    p = problem(H=128, I=64)
    (q1, e1), (q2, e2) = quant4.quantize_mxfp4(w31(p["w1"])), quant4.quantize_mxfp4(p["w2"])
    scales = {"bf16": lambda e: il_scales(e), "int32": lambda e: il_scales(e).view(torch.int32),
              "e8m0": lambda e: e}[form]
    E = 4
    out = fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], il_weights(q1, "fp4"), il_weights(q2, "fp4"), BF16,
                               quant_scales=[scales(e1), scales(e2)], use_w4_group_scaling=True,
                               swiglu_alpha=torch.full((E,), 1.702), swiglu_beta=torch.ones(E),
                               swiglu_limit=torch.full((E,), 7.0))[0]
    c = core.last
    assert c["quant"] == "w4a16_mxfp4" and c["w13_scale"].dtype == BF16 and c["w13_scale"].shape == (E, 4, 128)
    close(out, moe(p["x"], quant4.dequantize_mxfp4(q1, e1), quant4.dequantize_mxfp4(q2, e2), p["wts"], p["ids"],
                   w31_swiglu_bias(1.702, 1.0, 7.0)))
    with pytest.raises(NotImplementedError, match="W4A8"):
        fi.cutlass_fused_moe(p["x"].to(torch.float8_e4m3fn), p["ids"], p["wts"], q1, q2, BF16,
                             quant_scales=[e1, e2], use_w4_group_scaling=True)
    with pytest.raises(NotImplementedError, match="INT4 group scaling has no mapping"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], q1.view(torch.int8), q2.view(torch.int8), BF16,
                             quant_scales=[e1, e2], use_w4_group_scaling=True)
    with pytest.raises(TypeError, match=r"quant_scales\[0\]: got dtype torch.float16"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], il_weights(q1), il_weights(q2), BF16,
                             quant_scales=[e1.half(), e2], use_w4_group_scaling=True)
    # the checkpoint packing (or FlashInfer's own interleaved bytes) is refused, naming the helper
    with pytest.raises(ValueError, match=r"fc1_expert_weights: got shape \(4, 128, 64\), expected MXFP4 weights in "
                                         r"the prepared layout .*interleave_moe_weights_for_sm90_mixed_gemm"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], q1, il_weights(q2), BF16, quant_scales=[e1, e2],
                             use_w4_group_scaling=True)
    with pytest.raises(TypeError, match="fc1_expert_weights: got dtype torch.uint8, expected bf16/fp16"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], q1, q2, BF16, quant_scales=None)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(min_latency_mode=True), NotImplementedError, "min_latency_mode: got True"),
    (dict(enable_alltoall=True), NotImplementedError, "enable_alltoall: got True"),
    (dict(use_mxfp8_act_scaling=True), NotImplementedError, "use_mxfp8_act_scaling"),
    (dict(use_packed_weights=True), NotImplementedError, "use_packed_weights"),
    (dict(use_wfp4afp8_humming=True), NotImplementedError, "use_wfp4afp8_humming"),
    (dict(input_sf=torch.ones(1)), NotImplementedError, "input_sf: got a tensor"),
    (dict(situ_beta=torch.ones(4)), NotImplementedError, "situ_beta"),
    (dict(cluster_size=2), NotImplementedError, "cluster_size/cluster_rank"),
    (dict(min_latency_mode=1), TypeError, "min_latency_mode: got 1, expected a bool"),
])
def test_flashinfer_refused_options(core, kw, exc, match):
    with pytest.raises(exc, match=match):
        fi_call(problem(), **kw)
    assert not core.calls


def test_flashinfer_argument_names_in_errors(core):
    p = problem()
    with pytest.raises(ValueError, match=r"token_final_scales: got shape \(6, 1\)"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"][:, :1], p["w1"], p["w2"], BF16, None)
    with pytest.raises(TypeError, match="fc1_expert_weights: got NoneType"):
        fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], None, p["w2"], BF16, None)


# ---- GPU: the wrappers against the core -------------------------------------------------

def _core_has(*names):
    params = inspect.signature(moe_kernels.fused_moe).parameters
    return all(n in params for n in names)


def needs_core(*names):
    return pytest.mark.skipif(not _core_has(*names), reason=f"the core fused_moe has no {', '.join(names)} yet")


def gpu_problem(**kw):
    kw.setdefault("T", 70)
    kw.setdefault("E", 8)
    kw.setdefault("H", 256)
    kw.setdefault("I", 128)
    p = problem(**kw)
    return {k: v.cuda() for k, v in p.items()}


def same(out, ref, tol=1e-3):
    close(out.float().cpu(), ref.float().cpu(), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "swigluoai", "gelu", "relu2_no_mul"])
def test_gpu_vllm_16bit(act):
    clear_cache()
    p = gpu_problem(bias=True, gated=act != "relu2_no_mul")
    core_act, interleaved = vl.ACTIVATIONS[act]
    w13 = _common.deinterleave_gate_up(p["w1"]) if interleaved else p["w1"]
    b13 = _common.deinterleave_gate_up(p["b1"]) if interleaved else p["b1"]
    ref = moe_kernels.fused_moe(p["x"], w13, p["w2"], p["wts"], p["ids"], activation=core_act, w13_bias=b13,
                                w2_bias=p["b2"])
    out = vllm_call(p, activation=act, w1_bias=p["b1"], w2_bias=p["b2"])
    same(out, ref)
    close(out.float().cpu(), reference.fused_moe(p["x"], w13, p["w2"], p["wts"], p["ids"], activation=core_act,
                                                 w13_bias=b13, w2_bias=p["b2"]).cpu(), 2e-2)
    x = p["x"].clone()
    assert vllm_call(dict(p, x=x), activation=act, w1_bias=p["b1"], w2_bias=p["b2"], inplace=True) is x
    same(x, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_gpu_vllm_fp8(granularity):
    p = gpu_problem()
    q1, s1, q2, s2 = fp8_weights(p, granularity)
    quant = "fp8_block" if granularity == "block" else "fp8"
    ref = moe_kernels.fused_moe(p["x"], q1, q2, p["wts"], p["ids"], quant=quant, w13_scale=s1, w2_scale=s2)
    out = vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2,
                           per_channel_quant=granularity == "channel",
                           block_shape=[128, 128] if granularity == "block" else None)
    same(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "swigluoai"])
def test_gpu_vllm_int4(act):
    clear_cache()
    p = gpu_problem(H=256, I=256)
    q, (d1, d2) = vllm_int4(p, group=128)
    q = {k: (v.cuda() if v is not None else None) for k, v in q.items()}
    out = vl.fused_experts(p["x"], q.pop("w1"), q.pop("w2"), p["wts"], p["ids"], activation=act,
                           use_int4_w4a16=True, **q)
    act_fn = oai_interleaved if act == "swigluoai" else silu_mul
    close(out.float().cpu(), moe(p["x"].cpu(), d1, d2, p["wts"].cpu(), p["ids"].cpu(), act_fn), 2e-2)


@pytest.mark.gpu
def test_gpu_vllm_mxfp4():
    p = gpu_problem(H=256, I=256)
    (q1, e1), (q2, e2) = quant4.quantize_mxfp4(p["w1"]), quant4.quantize_mxfp4(p["w2"])
    ref = moe_kernels.fused_moe(p["x"], quant4.prepare_packed(q1, quant4.PLACED),
                                quant4.prepare_packed(q2, quant4.PLACED), p["wts"], p["ids"], quant="w4a16_mxfp4",
                                w13_scale=quant4.mxfp4_scales(e1, BF16, placed=True),
                                w2_scale=quant4.mxfp4_scales(e2, BF16, placed=True))
    out = vl.fused_experts(p["x"], q1, q2, p["wts"], p["ids"], use_mxfp4_w4a16=True, w1_scale=e1, w2_scale=e2)
    same(out, ref)


@pytest.mark.gpu
@needs_core("expert_map")
def test_gpu_vllm_expert_map():
    p = gpu_problem(E=4, global_experts=16, k=4)
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[torch.tensor([3, 9, 12, 0])] = torch.arange(4, dtype=torch.int32)
    expert_map = expert_map.cuda()
    out = vllm_call(p, global_num_experts=16, expert_map=expert_map)
    ref = moe(p["x"].cpu(), p["w1"].cpu(), p["w2"].cpu(), p["wts"].cpu(), p["ids"].cpu(), silu_mul,
              expert_map=expert_map.cpu())
    close(out.float().cpu(), ref, 2e-2)


@pytest.mark.gpu
@needs_core("apply_router_weight_on_input")
def test_gpu_vllm_router_weight_on_input():
    p = gpu_problem(k=1)
    out = vllm_call(p, apply_router_weight_on_input=True)
    ref = moe(p["x"].cpu(), p["w1"].cpu(), p["w2"].cpu(), p["wts"].cpu(), p["ids"].cpu(), silu_mul, on_input=True)
    close(out.float().cpu(), ref, 2e-2)


@pytest.mark.gpu
def test_gpu_sglang_no_combine_and_gpt_oss():
    clear_cache()
    p = gpu_problem(bias=True, k=3)
    out = sg_call(p, sg.MoeRunnerConfig(inplace=False, no_combine=True), b1=p["b1"], b2=p["b2"])
    ref = moe(p["x"].cpu(), p["w1"].cpu(), p["w2"].cpu(), p["wts"].cpu(), p["ids"].cpu(), silu_mul,
              p["b1"].cpu(), p["b2"].cpu(), combine=False)
    close(out.float().cpu(), ref, 2e-2)
    cfg = sg.MoeRunnerConfig(inplace=False, gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    out = sg_call(p, cfg, b1=p["b1"], b2=p["b2"])
    ref = moe_kernels.fused_moe(p["x"], _common.deinterleave_gate_up(p["w1"]), p["w2"], p["wts"], p["ids"],
                                activation="swiglu_oai", w13_bias=_common.deinterleave_gate_up(p["b1"]),
                                w2_bias=p["b2"])
    same(out, ref)


@pytest.mark.gpu
@needs_core("routed_scaling_factor")
def test_gpu_sglang_routed_scaling_factor():
    p = gpu_problem()
    out = sg_call(p, sg.MoeRunnerConfig(inplace=False, routed_scaling_factor=2.5))
    ref = moe_kernels.fused_moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"])
    same(out, ref.float() * 2.5, 1e-2)


@pytest.mark.gpu
def test_gpu_flashinfer_16bit_and_ep():
    clear_cache()
    p = gpu_problem(bias=True, E=4, global_experts=8)
    f = dict(p, w1=w31(p["w1"]), b1=w31(p["b1"]))
    out = fi_call(f, fc1_expert_biases=f["b1"], fc2_expert_biases=f["b2"], ep_size=2, ep_rank=1)[0]
    ref = moe_kernels.fused_moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], w13_bias=p["b1"], w2_bias=p["b2"],
                                ep_rank=1, ep_size=2)
    same(out, ref)
    E = 4
    out = fi_call(f, fc1_expert_biases=f["b1"], swiglu_alpha=torch.full((E,), 1.702, device="cuda"),
                  swiglu_beta=torch.ones(E, device="cuda"), swiglu_limit=torch.full((E,), 7.0, device="cuda"))[0]
    ref = moe_kernels.fused_moe(p["x"], p["w1"], p["w2"], p["wts"], p["ids"], w13_bias=p["b1"],
                                activation="swiglu_oai")
    same(out, ref)


@pytest.mark.gpu
def test_gpu_flashinfer_fp8():
    clear_cache()
    p = gpu_problem()
    x_q, f1, f2, scales, (q1, s1, q2, s2, a1, a2) = flashinfer_fp8(p)
    out = fi.cutlass_fused_moe(x_q, p["ids"], p["wts"], f1, f2, BF16, quant_scales=scales)[0]
    x = (x_q.float() * a1).to(BF16)
    ref = moe_kernels.fused_moe(x, q1, q2, p["wts"], p["ids"], quant="fp8", w13_scale=s1, w2_scale=s2,
                                a13_scale=a1.reshape(1).float(), a2_scale=a2.reshape(1).float())
    same(out, ref, 1e-2)
    q1, s1, q2, s2 = fp8_weights(p, "block")
    f1 = w31(q1.view(torch.uint8)).view(torch.float8_e4m3fn)
    out = fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], f1, q2, BF16, quant_scales=[w31(s1), s2],
                               use_deepseek_fp8_block_scale=True)[0]
    ref = moe_kernels.fused_moe(p["x"], q1, q2, p["wts"], p["ids"], quant="fp8_block", w13_scale=s1, w2_scale=s2)
    same(out, ref)


@pytest.mark.gpu
def test_gpu_flashinfer_mxfp4():
    from moe_kernels.prepare import interleave_moe_scales_for_sm90_mixed_gemm as il_scales
    from moe_kernels.prepare import interleave_moe_weights_for_sm90_mixed_gemm as il_weights
    clear_cache()
    p = gpu_problem(H=256, I=256)
    (q1, e1), (q2, e2) = quant4.quantize_mxfp4(p["w1"]), quant4.quantize_mxfp4(p["w2"])
    f1 = il_weights(w31(q1))
    out = fi.cutlass_fused_moe(p["x"], p["ids"], p["wts"], f1, il_weights(q2), BF16, use_w4_group_scaling=True,
                               quant_scales=[il_scales(w31(e1)).view(torch.int32), il_scales(e2).view(torch.int32)])[0]
    ref = moe_kernels.fused_moe(p["x"], il_weights(q1), il_weights(q2), p["wts"], p["ids"], quant="w4a16_mxfp4",
                                w13_scale=il_scales(e1), w2_scale=il_scales(e2))
    same(out, ref)
