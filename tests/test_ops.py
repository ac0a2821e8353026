"""The registered op torch.ops.moe_kernels.fused_moe and the forward's options (CPU: run in CI).

torch.compile is checked here with a CPU kernel for the op that this test registers (the
reference), so tracing, the fake implementation and dynamic shapes are covered without a GPU;
tests/test_gpu.py runs the library's own kernel under torch.compile and opcheck.
"""
import pytest
import torch

import moe_kernels
from moe_kernels import fused_moe, ops, reference


def problem(T=5, E=4, k=2, H=64, I=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(T, H, generator=g).to(dtype),
        w13=(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype),
        w2=(torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype),
        topk_weights=torch.rand(T, k, generator=g),
        topk_ids=torch.randint(0, E, (T, k), dtype=torch.int32, generator=g),
    )


def call(p, **kw):
    return fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"], **kw)


def test_op_is_registered_with_out_and_workspace_mutated():
    schema = str(torch.ops.moe_kernels.fused_moe.default._schema)
    assert "Tensor(a!) out" in schema and "Tensor(b!)? workspace" in schema
    assert schema.endswith("-> ()")
    assert schema.count("Tensor") == 16


@pytest.fixture
def cpu_reference_kernel():
    """A CPU kernel for the op that writes the reference into out (the library has none)."""
    lib = torch.library.Library("moe_kernels", "IMPL")
    calls = []

    def kernel(x, w13, w2, wts, ids, b13, b2, s13, s2, a13, a2, z13, z2, emap, out, workspace, quant,
               activation, experts, alpha, limit, on_input, scaling, tactic, last_step):
        calls.append(x.shape[0])
        offset = max(experts[0], 0)
        out.copy_(reference.fused_moe(x, w13, w2, wts, ids, activation=activation, expert_offset=offset,
                                      w13_bias=b13, w2_bias=b2, expert_map=emap,
                                      apply_router_weight_on_input=on_input,
                                      routed_scaling_factor=scaling).to(out.dtype))

    lib.impl("fused_moe", kernel, "CPU")
    yield calls
    lib._destroy()


@pytest.mark.parametrize("kw", [{}, {"fullgraph": True, "dynamic": True}], ids=["default", "fullgraph-dynamic"])
def test_torch_compile_traces_the_op(kw, cpu_reference_kernel):
    torch._dynamo.reset()
    p = problem()
    w13, w2 = p["w13"], p["w2"]

    def layer(x, w, ids):
        return fused_moe(x, w13, w2, w, ids, routed_scaling_factor=2.0) * 2

    compiled = torch.compile(layer, backend="aot_eager", **kw)
    for T in (5, 9, 3):
        q = problem(T=T, seed=T)
        out = compiled(q["hidden_states"], q["topk_weights"], q["topk_ids"])
        ref = 4 * reference.fused_moe(q["hidden_states"], w13, w2, q["topk_weights"], q["topk_ids"])
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert cpu_reference_kernel == [5, 9, 3]


def test_fake_implementation_validates_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    p = {n: mode.from_tensor(t) for n, t in problem(T=4).items()}
    bad_w2 = mode.from_tensor(torch.empty(4, 64, 16, dtype=torch.bfloat16))
    with mode:
        out = call(p)  # valid: no error, no data touched
        assert out.shape == (4, 64)
        with pytest.raises(ValueError, match=r"w13: got shape \(4, 64, 64\), expected shape \(4, 32, 64\)"):
            call({**p, "w2": bad_w2})


def test_fake_implementation_takes_prepared_four_bit_weights():
    """The out shape [T, H] comes from the hidden states (the prepared weights pad H to 128);
    checkpoint-packed 4-bit weights are refused at trace time, naming prepare_weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from moe_kernels import quant4
    from moe_kernels.prepare import prepare_weights
    E, H, I, T = 2, 2880, 64, 3  # gpt-oss's hidden size: w13's K padded to 2944
    g = torch.Generator().manual_seed(4)
    (q13, e13), (q2, e2) = (quant4.quantize_mxfp4(torch.randn(*s, generator=g)) for s in ((E, 2 * I, H), (E, H, I)))
    w = prepare_weights(q13, q2, quant="w4a16_mxfp4", w13_scale=e13, w2_scale=e2)
    mode = FakeTensorMode()
    fake = {n: mode.from_tensor(t) for n, t in (("x", torch.randn(T, H).bfloat16()), ("q2", q2),
                                                 ("ids", torch.zeros(T, 2, dtype=torch.int32)),
                                                 ("wts", torch.ones(T, 2))) + tuple(w.items()) if t is not None}
    kw = dict(quant="w4a16_mxfp4", w13_scale=fake["w13_scale"], w2_scale=fake["w2_scale"])
    with mode:
        out = fused_moe(fake["x"], fake["w13"], fake["w2"], fake["wts"], fake["ids"], **kw)
        assert out.shape == (T, H)
        with pytest.raises(ValueError, match=r"w2: got shape \(2, 2880, 32\) \(4-bit weights in the checkpoint "
                                             r"packing .*prepare_weights"):
            fused_moe(fake["x"], fake["w13"], fake["q2"], fake["wts"], fake["ids"], **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(quant=3), TypeError, r"quant: got 3, expected a name"),
    (dict(activation=1.0), TypeError, r"activation: got 1.0"),
    (dict(expert_offset=-1), ValueError, r"expert_offset: got -1, expected a non-negative int"),
    (dict(ep_rank=True), ValueError, r"ep_rank: got True"),
    (dict(tactic="a+b"), TypeError, r"tactic: got 'a\+b', expected a moe_kernels.Tactic"),
    (dict(apply_router_weight_on_input=1), TypeError, r"apply_router_weight_on_input: got 1, expected a bool"),
    (dict(apply_router_weight_on_input=True), ValueError, r"apply_router_weight_on_input: got True with top_k=2"),
    (dict(routed_scaling_factor="2"), TypeError, r"routed_scaling_factor: got '2', expected a float"),
    (dict(routed_scaling_factor=float("nan")), ValueError, r"routed_scaling_factor: got nan"),
    (dict(expert_map=torch.zeros(8, dtype=torch.int64)), TypeError, r"expert_map: got dtype torch.int64"),
    (dict(expert_map=torch.zeros(8, 1, dtype=torch.int32)), ValueError, r"expert_map: got shape \(8, 1\)"),
    (dict(expert_map=torch.zeros(8, dtype=torch.int32), expert_offset=0), ValueError,
     r"expert_offset/ep_rank/ep_size: got \(0, None, None\), expected None with expert_map"),
    (dict(expert_map=torch.zeros(8, dtype=torch.int32), num_experts=16), ValueError,
     r"num_experts: got 16, expected expert_map's length 8"),
    (dict(w13_zero=torch.zeros(4, 1, 64)), ValueError, r"w13_zero/w2_zero: got scales, expected none"),
    (dict(out=[1]), TypeError, r"out: got list"),
])
def test_options_are_validated(kw, exc, match):
    with pytest.raises(exc, match=match):
        call(problem(), **kw)


def test_valid_options_reach_the_device_check():
    p = problem(k=1)
    emap = torch.tensor([2, -1, 0, 1, 3, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden_states: got device cpu, expected a CUDA tensor"):
        call(p, expert_map=emap, routed_scaling_factor=2.5, apply_router_weight_on_input=True)


def test_zero_terms_are_checked_against_the_scales():
    from moe_kernels.prepare import quantize_weights
    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 4, 256, 128, 3, 2
    q = quantize_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g),
                         quant="w4a16_int4", group_size=64, symmetric=False)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.zeros(T, k, dtype=torch.int32)
    wts = torch.ones(T, k)
    kw = dict(quant="w4a16_int4", w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    with pytest.raises(ValueError, match="hidden_states: got device cpu"):  # valid: zero terms accepted
        fused_moe(x, q["w13"], q["w2"], wts, ids, w13_zero=q["w13_zero"], w2_zero=q["w2_zero"], **kw)
    with pytest.raises(ValueError, match="w13_zero/w2_zero: got only one of them"):
        fused_moe(x, q["w13"], q["w2"], wts, ids, w13_zero=q["w13_zero"], **kw)
    with pytest.raises(TypeError, match="w2_zero: got dtype torch.float16, expected torch.bfloat16"):
        fused_moe(x, q["w13"], q["w2"], wts, ids, w13_zero=q["w13_zero"], w2_zero=q["w2_zero"].half(), **kw)
    with pytest.raises(ValueError, match=r"w2_zero: got shape \(4, 1, 256\)"):
        fused_moe(x, q["w13"], q["w2"], wts, ids, w13_zero=q["w13_zero"], w2_zero=q["w2_zero"][:, :1].contiguous(),
                  **kw)


def test_reference_expert_map_scaling_and_router_weight_on_input():
    p = problem(T=6, E=4, k=2)
    x, w13, w2, wts, ids = (p[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids"))
    base = reference.fused_moe(x, w13, w2, wts, ids, expert_offset=4)
    global_ids = ids + 4
    emap = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, wts, global_ids, expert_map=emap),
                               reference.fused_moe(x, w13, w2, wts, global_ids, expert_offset=4))
    assert base.abs().sum() == 0  # ids 0..3 are not local at offset 4
    # a permuted map is the same as permuting the experts: global id g runs local expert emap2[g]
    perm = torch.tensor([2, 0, 3, 1])
    emap2 = torch.full((8,), -1, dtype=torch.int32)
    emap2[perm] = torch.arange(4, dtype=torch.int32)
    order = emap2[:4].long()
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, wts, ids, expert_map=emap2),
                               reference.fused_moe(x, w13[order], w2[order], wts, ids))
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, wts, ids, routed_scaling_factor=2.5),
                               2.5 * reference.fused_moe(x, w13, w2, wts, ids))
    one = problem(T=6, E=4, k=1)
    x1, w1 = one["hidden_states"], one["topk_weights"]
    on_input = reference.fused_moe(x1, w13, w2, w1, one["topk_ids"], apply_router_weight_on_input=True)
    weighted = (x1.float() * w1).to(x1.dtype)
    torch.testing.assert_close(on_input, reference.fused_moe(weighted, w13, w2, torch.ones_like(w1), one["topk_ids"]))


def test_op_options_map_none_to_the_schema_defaults():
    opts = ops.op_options(None, moe_kernels.Activation.SWIGLU, None, 1, 2, 8, 1.702, 7.0, False, None,
                          moe_kernels.Tactic("a", "b"), 0)
    assert opts == ("", "swiglu", (-1, 1, 2, 8), 1.702, 7.0, False, 1.0, "a+b", 0)


def test_the_shape_dict_is_what_the_native_module_reads():
    """moe_kernels.problem.c_shape builds the dict that src/python/module.cpp's make_shape reads
    key by key into moek_shape: the same keys, so no forward fails on a missing one, and every
    moek_shape field is set."""
    import pathlib
    import re
    from moe_kernels import modes, problem
    root = pathlib.Path(__file__).resolve().parent.parent
    source = (root / "src" / "python" / "module.cpp").read_text()
    read = set(re.findall(r's\["([a-z_0-9]+)"\]', source))
    shape = problem.c_shape(T=1, H=128, I=128, E=2, k=1, dtype="bf16", mode=modes.MODES["bf16"],
                            activation=modes.Activation.SWIGLU)
    assert read == set(shape)
    header = (root / "include" / "moe_kernels" / "c_api.h").read_text()
    struct = header.split("typedef struct {", 1)[1].split("} moek_shape;", 1)[0]
    fields = set(re.findall(r"^\s*\w+\s+(\w+);", struct, flags=re.M))
    assert fields == read, f"moek_shape fields not read: {fields - read}, read but not fields: {read - fields}"
