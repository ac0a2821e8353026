"""Kernel correctness on the GPU against moe_kernels.reference (skips without a GPU)."""
import itertools
import os

import pytest
import torch

import moe_kernels
from moe_kernels import Activation, FusedMoE, Tactic, fused_moe, reference
from helpers import (TOLERANCE, W4, fill_w13_rows, make_problem, poisoned_out, reference_out, rel_error, scale_kwargs,
                     worst_row_error)

pytestmark = pytest.mark.gpu


def run(p, **kw):
    out = poisoned_out(p)
    if p.get("quant"):
        kw.setdefault("quant", p["quant"])
    res = fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"],
                    w13_bias=p.get("w13_bias"), w2_bias=p.get("w2_bias"), out=out,
                    **scale_kwargs(p), **kw)
    assert res.data_ptr() == out.data_ptr()
    return res


def check(p, error_log, label, dtype="bf16", ref_kw=None, rows=False, **kw):
    """The forward against the reference; with `rows`, also each row within twice the tolerance."""
    out = run(p, **kw)
    ref = reference_out(p, **(ref_kw or {}))
    err = rel_error(out, ref)
    error_log.add(label, err)
    assert err < TOLERANCE[dtype], f"{label}: relative error {err:.3e}"
    if rows:
        assert worst_row_error(out, ref) < 2 * TOLERANCE[dtype], f"{label}: a row past twice the tolerance"
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", [a.value for a in Activation])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_activations(act, bias, dtype, error_log):
    gated = Activation(act).gated
    p = make_problem(T=130, E=8, k=2, H=256, I=192, dtype=dtype, gated=gated, bias=bias)
    kw = {"swiglu_alpha": 1.5, "swiglu_limit": 1.0} if act == "swiglu_oai" else {}
    check(p, error_log, f"{dtype}/{act}", dtype, activation=act, ref_kw=dict(activation=act, **kw), **kw)


SHAPES = [(T, E, k) for T, E, k in itertools.product([1, 7, 128, 1000, 4096], [1, 8, 128], [1, 2, 8])
          if k <= E]


@pytest.mark.parametrize("T,E,k", SHAPES)
def test_shapes(T, E, k, error_log):
    p = make_problem(T=T, E=E, k=k, H=512, I=256)
    check(p, error_log, "bf16/shapes")


@pytest.mark.parametrize("H,I", [(264, 200), (1032, 8), (8, 136), (7168, 256)])
def test_sizes_not_multiple_of_tile(H, I, error_log):
    p = make_problem(T=37, E=6, k=3, H=H, I=I, bias=True)
    check(p, error_log, "bf16/odd_sizes")


def test_experts_with_zero_tokens(error_log):
    ids = torch.tensor([[3, 5], [5, 3], [3, 60]] * 5, dtype=torch.int32)
    p = make_problem(T=15, E=64, k=2, H=256, I=128, ids=ids)
    check(p, error_log, "bf16/zero_token_experts")


def test_all_tokens_on_one_expert(error_log):
    T = 777
    ids = torch.full((T, 1), 6, dtype=torch.int32)
    p = make_problem(T=T, E=8, k=1, H=512, I=256, ids=ids)
    check(p, error_log, "bf16/one_expert")


def test_out_of_range_ids_contribute_nothing(error_log):
    ids = torch.tensor([[-1, 2], [9, 1], [1000, -7], [0, 3]], dtype=torch.int64)
    p = make_problem(T=4, E=4, k=2, H=256, I=128, ids=ids, ids_dtype=torch.int64)
    out = check(p, error_log, "bf16/out_of_range")
    assert torch.all(out[2] == 0), "a token with no local expert must get zeros"


def test_int64_ids_and_fp16(error_log):
    p = make_problem(T=300, E=16, k=4, H=384, I=256, dtype="fp16", ids_dtype=torch.int64)
    check(p, error_log, "fp16/int64_ids", "fp16")


def test_expert_parallel_split_sums_to_unsplit(error_log):
    E, ep = 16, 4
    p = make_problem(T=200, E=E, k=4, H=256, I=128, bias=True)
    full = run(p).float()
    local = E // ep
    total = torch.zeros_like(full)
    for r in range(ep):
        q = dict(p)
        for name in ("w13", "w2", "w13_bias", "w2_bias"):
            q[name] = p[name][r * local:(r + 1) * local].contiguous()
        part = run(q, ep_rank=r, ep_size=ep, num_experts=E)
        ref = reference_out(q, expert_offset=r * local)
        assert rel_error(part, ref) < TOLERANCE["bf16"]
        total += part.float()
    err = rel_error(total, full)
    error_log.add("bf16/ep_split", err)
    assert err < TOLERANCE["bf16"]


def test_fused_moe_layer_module(error_log):
    E, H, I = 8, 256, 128
    p = make_problem(T=50, E=E, k=2, H=H, I=I, bias=True)
    layer = FusedMoE(E, H, I, quant="bf16", activation="swiglu", ep_rank=1, ep_size=2)
    layer.load_weights(p["w13"], p["w2"], p["w13_bias"], p["w2_bias"])  # all experts: sliced
    out = layer(p["hidden_states"], p["topk_weights"], p["topk_ids"])
    q = {**p, **{n: p[n][4:8] for n in ("w13", "w2", "w13_bias", "w2_bias")}}
    err = rel_error(out, reference_out(q, expert_offset=4))
    error_log.add("bf16/layer", err)
    assert err < TOLERANCE["bf16"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_built_kernel(dtype, error_log):
    kernels = [k for k in moe_kernels.list_kernels(quant=dtype) if k.gemm]
    assert kernels, f"no {dtype} kernels usable on this GPU"
    p = make_problem(T=333, E=8, k=2, H=520, I=264, dtype=dtype)
    ref = reference_out(p)
    for k in kernels:
        out = run(p, tactic=Tactic(k.name, k.name))
        err = rel_error(out, ref)
        error_log.add(f"{dtype}/kernel/{k.name}", err)
        assert err < TOLERANCE[dtype], f"{k.name}: relative error {err:.3e}"
    # mixed pair: the smallest and largest tiles for the two GEMMs
    a, b = kernels[0], kernels[-1]
    assert rel_error(run(p, tactic=Tactic(a.name, b.name)), ref) < TOLERANCE[dtype]


def test_external_workspace_and_too_small():
    p = make_problem(T=64, E=8, k=2, H=256, I=128)
    need = moe_kernels.workspace_size(128, 2, 8, 256, 128)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    a = run(p, workspace=ws)
    b = run(p)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="workspace"):
        run(p, workspace=ws[: need // 4])


def test_cuda_graph_capture_and_replay():
    T, E, k, H, I = 96, 8, 2, 256, 128
    p = make_problem(T=T, E=E, k=k, H=H, I=I)
    static = {n: t.clone() for n, t in p.items()}
    ws = torch.empty(moe_kernels.workspace_size(T, k, E, H, I), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(p["hidden_states"])

    def step():
        fused_moe(static["hidden_states"], static["w13"], static["w2"], static["topk_weights"],
                  static["topk_ids"], workspace=ws, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up (tactic choice, attribute setup) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fresh = make_problem(T=T, E=E, k=k, H=H, I=I)
        for n in ("hidden_states", "topk_weights", "topk_ids"):
            static[n].copy_(fresh[n])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = run({**p, **{n: static[n] for n in ("hidden_states", "topk_weights", "topk_ids")}})
        assert torch.equal(out, eager), "graph replay differs from eager on the same inputs"
        assert rel_error(out, reference_out(static)) < TOLERANCE["bf16"]


@pytest.mark.parametrize("T", [1, 4, 300])
@pytest.mark.parametrize("mode,schedule", [(m, s) for m in ("bf16", "fp8", "fp8_block") for s in ("default", "decode")]
                         + [("fp8_block", "contig"), ("bf16", "ring"), ("fp8", "ring"), ("fp8_block", "ring")])
def test_back_to_back_forwards_one_workspace(mode, schedule, T, error_log):
    """Four forwards with one workspace, each with its own routing, replayed as one CUDA graph
    so that the GPU runs them back to back. Kernels read routing's lists before their wait for
    the previous kernel (PDL, launch.cuh); one that read them before they were written would
    take the previous forward's rows, experts and scales."""
    E, k, H, I = 16, 4, 512, 256
    base = make_problem(T=T, E=E, k=k, H=H, I=I, dtype=mode)
    tactic = None
    if schedule != "default":
        kernels = [kn for kn in moe_kernels.list_kernels(quant=mode) if kn.schedule == schedule]
        if not kernels:
            pytest.skip(f"no {schedule} kernel for {mode} in this build")
        tactic = Tactic(kernels[0].name, kernels[0].name)
    ws = torch.empty(moe_kernels.workspace_size(T, k, E, H, I, quant=mode), dtype=torch.uint8,
                     device="cuda")
    routed = ("hidden_states", "topk_ids", "topk_weights")
    problems = [{**base, **{n: make_problem(T=T, E=E, k=k, H=H, I=I)[n] for n in routed}}
                for _ in range(4)]
    outs = [torch.empty_like(base["hidden_states"]) for _ in problems]

    def forwards():
        for p, out in zip(problems, outs):
            fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"],
                      quant=p.get("quant"), workspace=ws, out=out, tactic=tactic, **scale_kwargs(p))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        forwards()  # tactic choice and attribute setup outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forwards()
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for i, (p, out) in enumerate(zip(problems, outs)):
        err = rel_error(out, reference_out(p))
        error_log.add(f"{mode}/back_to_back", err)
        assert err < TOLERANCE[mode], f"forward {i} of 4: relative error {err:.3e}"


def test_bitwise_deterministic():
    p = make_problem(T=2048, E=32, k=8, H=512, I=256)
    first = run(p)
    for _ in range(4):
        assert torch.equal(run(p), first)


def test_zero_tokens_returns_empty():
    p = make_problem(T=1, E=4, k=2, H=64, I=64)
    p["hidden_states"] = p["hidden_states"][:0]
    p["topk_ids"] = p["topk_ids"][:0]
    p["topk_weights"] = p["topk_weights"][:0]
    assert run(p).shape == (0, 64)


def test_quant_mode_without_kernels_names_what_exists():
    p = make_problem(T=4, E=4, k=2, H=64, I=64)
    with pytest.raises(NotImplementedError, match="bf16"):
        run(p, quant="mxfp8")


# ---- the decode kernels (our mma.sync grouped GEMM for a few rows per expert) ------------------

# (T, E, k, H, I) per mode: one row per expert; most experts empty; 20 rows per expert (several
# passes of 8 or 16 tokens); N not a multiple of the 16-row tile and K tails (16-bit only).
DECODE_CASES = {
    "bf16": [(1, 8, 2, 512, 256), (5, 64, 8, 1032, 136), (40, 4, 2, 256, 384)],
    "fp16": [(1, 8, 2, 512, 256), (5, 64, 8, 1032, 136), (40, 4, 2, 256, 384)],
    "fp8": [(1, 8, 2, 512, 256), (5, 64, 8, 1040, 144), (40, 4, 2, 272, 400)],
    "fp8_block": [(1, 8, 2, 512, 256), (5, 64, 8, 1152, 384), (40, 4, 2, 256, 384)],
}


@pytest.mark.parametrize("mode", list(DECODE_CASES))
def test_decode_kernels(mode, error_log):
    """Every decode-kind kernel (the mma.sync tiles and the ring form) in either GEMM slot."""
    kernels = [k for k in moe_kernels.list_kernels(quant=mode) if k.kind == "decode"]
    assert kernels, f"no {mode} decode kernels usable on this GPU"
    assert {k.schedule for k in kernels} == {"decode", "ring"}, kernels
    other = next(k for k in moe_kernels.list_kernels(quant=mode) if k.kind != "decode")
    for T, E, k, H, I in DECODE_CASES[mode]:
        p = make_problem(T=T, E=E, k=k, H=H, I=I, dtype=mode, bias=True)
        ref = reference_out(p)
        for kern in kernels:
            for tactic in (Tactic(kern.name, kern.name), Tactic(kern.name, other.name),
                           Tactic(other.name, kern.name)):
                err = rel_error(run(p, tactic=tactic), ref)
                error_log.add(f"{mode}/decode/{kern.name}", err)
                assert err < TOLERANCE[mode], f"{tactic} T={T} E={E}: relative error {err:.3e}"


# ---- fp8 and fp8_block (E4M3 x E4M3, bf16 in and out) -----------------------------------------

FP8_MODES = ["fp8", "fp8_block"]
FP8_SHAPES = [(T, E, k) for T, E, k in itertools.product([1, 7, 128, 1000, 4096], [8, 128], [2, 8])
              if k <= E]


@pytest.mark.parametrize("mode", FP8_MODES)
@pytest.mark.parametrize("T,E,k", FP8_SHAPES)
def test_fp8_shapes(T, E, k, mode, error_log):
    p = make_problem(T=T, E=E, k=k, H=512, I=256, dtype=mode)
    check(p, error_log, f"{mode}/shapes", mode)


# ---- one token as one kernel (the "one_token" tactic: fp8 and fp8_block, gated activations) ----

def one_token(p):
    """The whole-forward kernel (kind "forward") of p's mode and output type, as a tactic."""
    out = "fp16" if p["hidden_states"].dtype == torch.float16 else "bf16"
    return Tactic(forward=next(k.name for k in moe_kernels.list_kernels(quant=p["quant"], out_dtype=out)
                               if k.kind == "forward"))


# (E, k, H, I): Qwen3-30B-A3B's shape (three GEMM1 units per CTA on 132 SMs); two GEMM2 units per
# CTA (H = 4096); a top-k of 1. All also fit fp8_block (H % 512, I % 128). Those hold their w2
# share in shared memory; the stream shapes stream w2 through the ring after w13 (8 rows of
# w13 per ring entry): DeepSeek-V3's H and I (eight GEMM1 and four GEMM2 units per CTA on 132
# SMs), Qwen3-235B-A22B's, and a top-k of 2 (most CTAs without a GEMM1 unit).
ONE_TOKEN_SHAPES = [(128, 8, 2048, 768), (16, 8, 4096, 256), (8, 1, 512, 1024)]
ONE_TOKEN_STREAM_SHAPES = [(8, 8, 7168, 2048), (16, 8, 4096, 1536), (8, 2, 7168, 512)]


def chosen_tactic(p, **kw):
    return moe_kernels.api.choose_tactic(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"],
                                         p["topk_ids"], quant=p["quant"], w13_scale=p["w13_scale"],
                                         w2_scale=p["w2_scale"], **kw)


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
@pytest.mark.parametrize("E,k,H,I", ONE_TOKEN_SHAPES + ONE_TOKEN_STREAM_SHAPES)
def test_one_token_shapes(E, k, H, I, quant, act_dtype, error_log):
    p = make_problem(T=1, E=E, k=k, H=H, I=I, dtype=quant, act_dtype=act_dtype)
    assert chosen_tactic(p).forward
    out = check(p, error_log, f"{quant}/{act_dtype}/one_token/E{E}k{k}H{H}I{I}", quant)
    assert out.dtype == p["hidden_states"].dtype
    # The grouped path: the same numerics (scales applied before the one rounding to 16 bits).
    for name in {k.name for k in [x for x in moe_kernels.list_kernels(quant=quant, out_dtype=act_dtype) if x.gemm][:2]}:
        grouped = run(p, tactic=Tactic(name, name))
        error_log.add(f"{quant}/{act_dtype}/one_token/E{E}k{k}H{H}I{I}/vs {name}", rel_error(out, grouped))
        assert rel_error(out, grouped) < TOLERANCE[quant]


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("act", ["swiglu", "geglu", "swiglu_oai"])
def test_one_token_activations_and_scales(act, static, granularity, error_log):
    p = make_problem(T=1, E=16, k=4, H=320, I=192, dtype="fp8", granularity=granularity, bias=True)
    if static:
        p["a13_scale"] = (p["hidden_states"].float().abs().max() / 448).reshape(1)
        p["a2_scale"] = torch.full((1,), 0.02, device="cuda")
    kw = {"swiglu_alpha": 1.5, "swiglu_limit": 1.0} if act == "swiglu_oai" else {}
    assert chosen_tactic(p, activation=act).forward
    check(p, error_log, f"fp8/one_token/{granularity}/{'static' if static else 'dynamic'}/{act}", "fp8",
          activation=act, ref_kw=dict(activation=act, **kw), **kw)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_one_token_stream_scales_and_bias(static, granularity, error_log):
    # w2 streamed (Qwen3-235B-A22B's shape): GEMM2's per-channel scales and biases per pair.
    p = make_problem(T=1, E=16, k=8, H=4096, I=1536, dtype="fp8", granularity=granularity, bias=True)
    if static:
        p["a13_scale"] = (p["hidden_states"].float().abs().max() / 448).reshape(1)
        p["a2_scale"] = torch.full((1,), 0.02, device="cuda")
    kw = {"swiglu_alpha": 1.5, "swiglu_limit": 1.0}
    assert chosen_tactic(p, activation="swiglu_oai").forward
    check(p, error_log, f"fp8/one_token/stream/{granularity}/{'static' if static else 'dynamic'}", "fp8",
          activation="swiglu_oai", ref_kw=dict(activation="swiglu_oai", **kw), **kw)


@pytest.mark.parametrize("act", ["swiglu", "geglu", "swiglu_oai"])
def test_one_token_fp8_block_activations_and_bias(act, error_log):
    p = make_problem(T=1, E=16, k=4, H=1024, I=384, dtype="fp8_block", bias=True)
    kw = {"swiglu_alpha": 1.5, "swiglu_limit": 1.0} if act == "swiglu_oai" else {}
    assert chosen_tactic(p, activation=act).forward
    out = check(p, error_log, f"fp8_block/one_token/bias/{act}", "fp8_block", activation=act,
                ref_kw=dict(activation=act, **kw), **kw)
    name = moe_kernels.list_kernels(quant="fp8_block")[0].name
    grouped = run(p, tactic=Tactic(name, name), activation=act, **kw)
    assert rel_error(out, grouped) < TOLERANCE["fp8_block"]
    # w2 streamed (DeepSeek-V3's H and I), with biases.
    p = make_problem(T=1, E=8, k=8, H=7168, I=2048, dtype="fp8_block", bias=True)
    assert chosen_tactic(p, activation=act).forward
    check(p, error_log, f"fp8_block/one_token/stream/bias/{act}", "fp8_block", activation=act,
          ref_kw=dict(activation=act, **kw), **kw)


def test_one_token_fp8_block_extreme_rows(error_log):
    # One 128-column group of the token 1000x the rest, another all zeros: per-group scales.
    p = make_problem(T=1, E=16, k=4, H=1024, I=256, dtype="fp8_block")
    p["hidden_states"][0, :128] *= 1000
    p["hidden_states"][0, 128:256] = 0
    assert chosen_tactic(p).forward
    check(p, error_log, "fp8_block/one_token/extreme", "fp8_block")


@pytest.mark.parametrize("H,I", [(512, 256), (7168, 2048)], ids=["share", "stream"])
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_one_token_expert_parallel_and_int64_ids(quant, H, I, error_log):
    E, ep = 16, 2
    p = make_problem(T=1, E=E, k=8, H=H, I=I, dtype=quant, ids_dtype=torch.int64, bias=True)
    assert chosen_tactic(p).forward
    full = check(p, error_log, f"{quant}/one_token/int64/H{H}", quant).float()
    total = torch.zeros_like(full)
    for r in range(ep):  # each rank holds some of the token's experts
        q = dict(p)
        for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
            q[name] = p[name][r * E // ep:(r + 1) * E // ep].contiguous()
        total += run(q, ep_rank=r, ep_size=ep).float()
    assert rel_error(total, full) < TOLERANCE[quant]
    # A rank that holds none of the token's experts writes zeros.
    p["topk_ids"] = torch.arange(8, device="cuda", dtype=torch.int64).reshape(1, 8)
    q = dict(p)
    for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
        q[name] = p[name][E // ep:].contiguous()
    assert torch.equal(run(q, ep_rank=1, ep_size=ep), torch.zeros_like(p["hidden_states"]))


@pytest.mark.parametrize("E,H,I", [(128, 2048, 768), (8, 7168, 2048)], ids=["share", "stream"])
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_one_token_graph_replay(quant, E, H, I, error_log):
    p = make_problem(T=1, E=E, k=8, H=H, I=I, dtype=quant)
    ws = torch.empty(moe_kernels.workspace_size(1, 8, E, H, I, quant=quant), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(p["hidden_states"])
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    kw = dict(w13_scale=p["w13_scale"], w2_scale=p["w2_scale"], workspace=ws, out=out, quant=quant)
    assert chosen_tactic(p).forward
    fused_moe(*args, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):  # back to back, one workspace
            fused_moe(*args, **kw)
    fresh = make_problem(T=1, E=E, k=8, H=H, I=I)
    p["hidden_states"].copy_(fresh["hidden_states"])
    p["topk_ids"].copy_(fresh["topk_ids"])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(p))  # deterministic: the same bits as a plain call
    error_log.add(f"{quant}/one_token/graph", rel_error(out, reference_out(p)))
    assert rel_error(out, reference_out(p)) < TOLERANCE[quant]


def test_one_token_tactic_errors():
    p = make_problem(T=2, E=8, k=2, H=256, I=128, dtype="fp8")
    with pytest.raises(ValueError, match="one_token runs 1 token, not 2"):
        run(p, tactic=one_token(p))
    q = make_problem(T=1, E=8, k=2, H=256, I=128, dtype="fp8")
    other = moe_kernels.list_kernels(quant="fp8")[0].name
    with pytest.raises(ValueError, match="expected a GEMM kernel"):
        run(q, tactic=Tactic(one_token(q).forward, other))
    r = make_problem(T=1, E=8, k=2, H=256, I=128, dtype="fp8", gated=False)
    with pytest.raises(ValueError, match="gated activation"):
        run(r, tactic=one_token(r), activation="silu")
    assert not chosen_tactic(r, activation="silu").forward
    # fp8_block: hidden_size a multiple of 512, and w13_scale 16-byte aligned (bulk copies).
    b = make_problem(T=1, E=8, k=2, H=384, I=128, dtype="fp8_block")
    assert not chosen_tactic(b).forward
    with pytest.raises(ValueError, match="multiple of 512"):
        run(b, tactic=one_token(b))
    # A w2 share too large for shared memory streams only where a pair's 16 rows fit a ring entry
    # of 8 w13 rows (I <= H / 2); gpt-oss's I = H (two entries per pair) was slower than decode.
    big = make_problem(T=1, E=8, k=4, H=2048, I=2048, dtype="fp8")
    assert not chosen_tactic(big).forward
    with pytest.raises(ValueError, match="intermediate_size <= hidden_size / 2"):
        run(big, tactic=one_token(big))
    # fp8_block: the token's K-block scales are held for at most 64 blocks (H <= 8192).
    h = make_problem(T=1, E=8, k=2, H=8704, I=128, dtype="fp8_block")
    assert not chosen_tactic(h).forward
    with pytest.raises(ValueError, match="hidden_size <= 8192, not 8704"):
        run(h, tactic=one_token(h))
    c = make_problem(T=1, E=8, k=2, H=512, I=128, dtype="fp8_block")
    assert chosen_tactic(c).forward
    shifted = torch.empty(c["w13_scale"].numel() + 1, device="cuda")[1:].view_as(c["w13_scale"])
    c["w13_scale"] = shifted.copy_(c["w13_scale"])  # 4 bytes past a 16-byte boundary
    assert not chosen_tactic(c).forward
    with pytest.raises(ValueError, match="16-byte aligned"):
        run(c, tactic=one_token(c))
    run(c)  # the grouped path takes it


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_fp8_block_activations_bias_and_long_k(act, error_log):
    # H = 7168 is DeepSeek-V3's: 56 k-blocks of GEMM1, each with its own scales.
    gated = Activation(act).gated
    p = make_problem(T=200, E=16, k=4, H=7168, I=384, dtype="fp8_block", gated=gated, bias=True)
    check(p, error_log, f"fp8_block/{act}/bias/H7168", "fp8_block", activation=act,
          ref_kw=dict(activation=act))


def test_fp8_block_rejects_static_activation_scales():
    p = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="fp8_block")
    with pytest.raises(ValueError, match="a13_scale"):
        run(p, a13_scale=torch.ones(1, device="cuda"))
    q = make_problem(T=8, E=4, k=2, H=272, I=128, dtype="fp8")
    q.update(quant="fp8_block", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    with pytest.raises(ValueError, match="multiples of 128"):
        run(q)


# T = 1100 at top-4: 4400 rows, past the 4096 from which FP8 with per-channel scales or a bias
# takes the activation kernel's column form (a thread per 8 columns over a run of rows).
@pytest.mark.parametrize("T", [300, 1100])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_fp8_scales(granularity, static, act, T, error_log):
    gated = Activation(act).gated
    p = make_problem(T=T, E=16, k=4, H=272, I=208, dtype="fp8", granularity=granularity,
                     gated=gated, bias=True)
    if static:
        p["a13_scale"] = (p["hidden_states"].float().abs().max() / 448).reshape(1)
        p["a2_scale"] = torch.full((1,), 0.02, device="cuda")
    check(p, error_log, f"fp8/{granularity}/{'static' if static else 'dynamic'}/{act}/T{T}", "fp8",
          activation=act, ref_kw=dict(activation=act))


def test_fp8_column_activation_expert_parallel(error_log):
    # The column form with fewer rows than allocated (this rank's experts) and int64 ids: the
    # two ranks' outputs add up to the whole layer's.
    E, ep = 16, 2
    p = make_problem(T=1100, E=E, k=4, H=256, I=208, dtype="fp8", ids_dtype=torch.int64, bias=True)
    full = check(p, error_log, "fp8/column_activation/int64", "fp8").float()
    total = torch.zeros_like(full)
    for r in range(ep):
        q = dict(p)
        for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
            q[name] = p[name][r * E // ep:(r + 1) * E // ep].contiguous()
        total += run(q, ep_rank=r, ep_size=ep).float()
    assert rel_error(total, full) < TOLERANCE["fp8"]


@pytest.mark.parametrize("T", [3, 512, 1024])
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-static", "fp8_block"])
def test_long_rows_and_wide_hidden(mode, T, error_log):
    # I = 1280: past the 1024 columns a warp holds at once. A block per row for few rows (12
    # and 2048) and a warp per row, in two rounds, from 4096 rows on (T = 1024, top-4; FP8 with
    # a dynamic scale per row computes the last 256 columns twice). H = 1152: expand splits each
    # token's columns over blocks of 1024, the last one 128 wide (not FP8 with dynamic scales,
    # which needs the whole row).
    dtype = mode.split("-")[0]
    p = make_problem(T=T, E=8, k=4, H=1152, I=1280, dtype=dtype, bias=True)
    if mode == "fp8-static":
        p["a13_scale"] = (p["hidden_states"].float().abs().max() / 448).reshape(1)
        p["a2_scale"] = torch.full((1,), 0.02, device="cuda")
    check(p, error_log, f"{mode}/long_rows/T{T}", dtype)


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", FP8_MODES)
def test_fused_moe_layer_module_fp8(mode, act_dtype, error_log):
    # The layer with checkpoint-style FP8 weights and scales for all experts: it keeps its
    # expert-parallel slice of weights, scales and biases (in the hidden states' type).
    E, H, I = 8, 256, 128
    p = make_problem(T=50, E=E, k=2, H=H, I=I, dtype=mode, bias=True, act_dtype=act_dtype)
    layer = FusedMoE(E, H, I, quant=mode, activation="swiglu", ep_rank=1, ep_size=2)
    layer.load_weights(p["w13"], p["w2"], p["w13_bias"], p["w2_bias"], w13_scale=p["w13_scale"],
                       w2_scale=p["w2_scale"])
    out = layer(p["hidden_states"], p["topk_weights"], p["topk_ids"])
    q = {**p, **{n: p[n][4:8] for n in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale")}}
    assert out.dtype == p["hidden_states"].dtype
    err = rel_error(out, reference_out(q, expert_offset=4))
    error_log.add(f"{mode}/{act_dtype}/layer", err)
    assert err < TOLERANCE[mode]


def test_fused_moe_layer_static_activation_scales(error_log):
    # fp8 with checkpoint-style per-expert input scales: the layer quantizes with the max over
    # its own experts.
    E, H, I = 8, 256, 128
    p = make_problem(T=50, E=E, k=2, H=H, I=I, dtype="fp8", bias=True)
    a13 = (p["hidden_states"].float().abs().max() / 448) * torch.linspace(1, 2, E, device="cuda")
    a2 = torch.linspace(0.02, 0.03, E, device="cuda")
    layer = FusedMoE(E, H, I, quant="fp8", activation="swiglu", ep_rank=1, ep_size=2)
    layer.load_weights(p["w13"], p["w2"], p["w13_bias"], p["w2_bias"], w13_scale=p["w13_scale"],
                       w2_scale=p["w2_scale"], a13_scale=a13, a2_scale=a2)
    out = layer(p["hidden_states"], p["topk_weights"], p["topk_ids"])
    q = {**p, **{n: p[n][4:8] for n in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale")},
         "a13_scale": a13[4:8].max().reshape(1), "a2_scale": a2[4:8].max().reshape(1)}
    err = rel_error(out, reference_out(q, expert_offset=4))
    error_log.add("fp8/layer/static", err)
    assert err < TOLERANCE["fp8"]


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_every_built_kernel(mode, error_log):
    kernels = [k for k in moe_kernels.list_kernels(quant=mode) if k.gemm]
    assert kernels, f"no {mode} kernels usable on this GPU"
    H, I = (528, 272) if mode == "fp8" else (768, 384)  # fp8_block: N multiples of 256 (wide tiles)
    # ~175 rows per expert: every tile (up to 128 rows, or 64 tokens swapped) is full at least once and partial once.
    p = make_problem(T=700, E=8, k=2, H=H, I=I, dtype=mode)
    ref = reference_out(p)
    for kern in kernels:
        err = rel_error(run(p, tactic=Tactic(kern.name, kern.name)), ref)
        error_log.add(f"{mode}/kernel/{kern.name}", err)
        assert err < TOLERANCE[mode], f"{kern.name}: relative error {err:.3e}"


# The contiguous fp8_block kernel (schedule "contig") finds its tiles from the experts' row
# offsets on the device: rows that end mid-tile (in either 64-row half), experts with no rows,
# one expert with all rows, ids of other ranks, long K, and both GEMM slots beside another kernel.
# The scales arrive by TMA in sets of 4 K blocks where K / 128 is a multiple of 4 (H or I of 512,
# 7168), else by per-row copies (256, 384, 128): both ways are here, in either GEMM. The kernel
# comes in both output types (bf16 and fp16 hidden states).
CONTIG_CASES = [  # T, E, k, H, I, ids, expert_offset
    (1, 8, 2, 256, 128, None, 0),
    (37, 64, 8, 512, 256, None, 0),
    (1000, 8, 8, 512, 256, None, 0),     # 1000 rows per expert: 7 full tiles + 104 rows
    (300, 16, 4, 7168, 256, None, 0),    # 56 K blocks
    (777, 8, 1, 384, 128, "one", 0),     # every row on expert 6
    (15, 64, 2, 256, 128, "sparse", 0),  # three experts with rows
    (200, 8, 4, 256, 384, "ep", 8),      # global experts 0..15, this rank holds 8..15
    (642, 8, 1, 512, 256, "counts", 0),  # SPLIT_COUNTS rows per expert
    (1091, 8, 1, 512, 256, "tails", 0),  # TAIL_COUNTS rows per expert
    (1091, 8, 1, 512, 512, "tails", 0),  # the same, GEMM2's scales by TMA sets too (K / 128 = 4)
    (3, 8, 2, 512, 512, None, 0),        # scale sets over 6 rows: fewer than a scale box's 128
]
# Tiles of at most 64 rows are split by columns between the warpgroups: exactly 64 (TMA
# stores), 1, 63; after full tiles; and 65 and 129 (both halves).
SPLIT_COUNTS = [64, 192, 1, 65, 0, 128, 63, 129]
# Up to 16 rows past a full tile ride along with it as swap-AB wgmmas: 8, 9, 16 (the most) and
# 17 past (a split tile of its own), 5 past two full tiles, 12 past.
TAIL_COUNTS = [136, 137, 144, 145, 261, 128, 0, 140]


def counts_ids(counts):
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return ids[torch.randperm(len(ids))].to(torch.int32)[:, None]


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("T,E,k,H,I,ids,offset", CONTIG_CASES)
def test_fp8_block_contiguous_kernel(T, E, k, H, I, ids, offset, out_dtype, error_log):
    kernels = moe_kernels.list_kernels(quant="fp8_block", out_dtype=out_dtype)
    contig = [x for x in kernels if x.schedule == "contig"]
    if not contig:
        pytest.skip("no contiguous fp8_block kernel in this build")
    other = kernels[0]
    if ids == "one":
        ids = torch.full((T, k), 6, dtype=torch.int32)
    elif ids == "sparse":
        ids = torch.tensor([[3, 5], [5, 3], [3, 60]] * (T // 3), dtype=torch.int32)
    elif ids == "ep":
        ids = torch.rand(T, 2 * E).argsort(dim=1)[:, :k].to(torch.int32)
    elif ids in ("counts", "tails"):
        ids = counts_ids(SPLIT_COUNTS if ids == "counts" else TAIL_COUNTS)
    p = make_problem(T=T, E=E, k=k, H=H, I=I, dtype="fp8_block", ids=ids, act_dtype=out_dtype)
    ref = reference_out(p, expert_offset=offset)
    kw = dict(ep_rank=1, ep_size=2, num_experts=2 * E) if offset else {}
    for kern in contig:
        for tactic in (Tactic(kern.name, kern.name), Tactic(kern.name, other.name),
                       Tactic(other.name, kern.name)):
            n = [2 * I if tactic.gemm1 == kern.name else 0, H if tactic.gemm2 == kern.name else 0]
            if any(x % kern.tile[1] for x in n):  # a tile wider than N's multiple: a clear error,
                # before anything is launched (the workspace keeps its poison)
                ws = torch.full((moe_kernels.workspace_size(T, k, E, H, I, quant="fp8_block"),), 0xA5,
                                dtype=torch.uint8, device="cuda")
                with pytest.raises(RuntimeError, match=f"multiple of {kern.tile[1]}"):
                    run(p, tactic=tactic, workspace=ws, **kw)
                torch.cuda.synchronize()
                assert bool((ws == 0xA5).all()), f"{tactic}: refused, but wrote the workspace"
                continue
            out = run(p, tactic=tactic, **kw)
            err, row_err = rel_error(out, ref), worst_row_error(out, ref)
            error_log.add(f"fp8_block/contig/{out_dtype}/T{T}/E{E}/H{H}/{n[0] > 0:d}{n[1] > 0:d}", err)
            assert err < TOLERANCE["fp8_block"], f"{tactic} T={T} E={E}: relative error {err:.3e}"
            assert row_err < 2 * TOLERANCE["fp8_block"], f"{tactic} T={T} E={E}: a row's relative error {row_err:.3e}"


# With a gated activation, the 256-column contiguous kernel in GEMM1 applies the activation
# (+ bias) and GEMM2's per-128-column quantization in its epilogue; non-gated ones take the
# activation kernel. Rows end mid-tile, one expert has none; 3 intermediate tiles per expert;
# or (tails) the experts have TAIL_COUNTS rows.
@pytest.mark.parametrize("tails", [False, True], ids=["random", "tails"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ["swiglu", "geglu", "swiglu_oai", "silu"])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_fp8_block_contiguous_fused_activation(out_dtype, act, bias, tails, error_log):
    kernels = moe_kernels.list_kernels(quant="fp8_block", out_dtype=out_dtype)
    wide = [x for x in kernels if x.schedule == "contig" and x.tile[1] == 256]
    if not wide:
        pytest.skip("no 256-column contiguous fp8_block kernel in this build")
    gated = Activation(act).gated
    I = 384 if gated else 256  # N1 = 768 or 256: multiples of the tile
    if tails:
        ids = counts_ids(TAIL_COUNTS)
    else:
        ids = torch.rand(333, 7).argsort(dim=1)[:, :4]
        ids[ids >= 5] += 1  # expert 5 gets no rows
    p = make_problem(T=len(ids), E=8, k=ids.shape[1], H=512, I=I, dtype="fp8_block", gated=gated, bias=bias,
                     ids=ids, act_dtype=out_dtype)
    kw = {"swiglu_alpha": 1.5, "swiglu_limit": 1.0} if act == "swiglu_oai" else {}
    ref = reference_out(p, activation=act, **kw)
    for gemm2 in (wide[0].name, kernels[0].name):
        out = run(p, tactic=Tactic(wide[0].name, gemm2), activation=act, **kw)
        err, row_err = rel_error(out, ref), worst_row_error(out, ref)
        error_log.add(f"fp8_block/contig_act/{out_dtype}/{act}/{bias}/{tails}", err)
        assert err < TOLERANCE["fp8_block"], f"{act} bias={bias} gemm2={gemm2}: relative error {err:.3e}"
        assert row_err < 2 * TOLERANCE["fp8_block"], f"{act} bias={bias} gemm2={gemm2}: a row's error {row_err:.3e}"


def test_fp8_block_extreme_rows(error_log):
    p = make_problem(T=64, E=8, k=2, H=256, I=128, dtype="fp8_block")
    p["hidden_states"][0, :128] = 3e4   # one huge group: its own scale, the rest unaffected
    p["hidden_states"][1] = 0           # a zero row: safe scales, zero output
    p["hidden_states"][2, ::2] = 1e-30
    out = check(p, error_log, "fp8_block/extreme_rows", "fp8_block")
    assert torch.all(out[1] == 0)


def test_fp8_extreme_rows(error_log):
    p = make_problem(T=64, E=8, k=2, H=256, I=128, dtype="fp8")
    p["hidden_states"][0] = 3e4     # far beyond E4M3 with a static scale: saturates, no inf
    p["hidden_states"][1] = 0       # a zero row: safe scale, zero output
    p["hidden_states"][2, ::2] = 1e-30
    p["a13_scale"] = torch.full((1,), 0.01, device="cuda")
    out = check(p, error_log, "fp8/extreme_rows", "fp8")
    assert torch.all(out[1] == 0)
    q = dict(p)
    del q["a13_scale"]  # dynamic: the huge row gets its own scale
    check(q, error_log, "fp8/extreme_rows_dynamic", "fp8")


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_graph_replay_and_expert_parallel(mode, act_dtype, error_log):
    E, ep = 16, 2
    p = make_problem(T=96, E=E, k=4, H=256, I=128, dtype=mode, act_dtype=act_dtype)
    full = run(p).float()
    total = torch.zeros_like(full)
    for r in range(ep):
        q = dict(p)
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            q[name] = p[name][r * E // ep:(r + 1) * E // ep].contiguous()
        total += run(q, ep_rank=r, ep_size=ep).float()
    assert rel_error(total, full) < TOLERANCE[mode]
    ws = torch.empty(moe_kernels.workspace_size(96, 4, E, 256, 128, quant=mode), dtype=torch.uint8,
                     device="cuda")
    out = torch.empty_like(p["hidden_states"])
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    kw = dict(w13_scale=p["w13_scale"], w2_scale=p["w2_scale"], workspace=ws, out=out, quant=mode)
    fused_moe(*args, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(*args, **kw)
    fresh = make_problem(T=96, E=E, k=4, H=256, I=128)
    p["hidden_states"].copy_(fresh["hidden_states"])
    p["topk_ids"].copy_(fresh["topk_ids"])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(p))
    error_log.add(f"{mode}/{act_dtype}/graph", rel_error(out, reference_out(p)))


# ---- fp8 and fp8_block with fp16 hidden states and output -------------------------------------
# The fp16-output kernels (catalog: every FP8 tile has both output types) with the same expand,
# activation and finalize kernels as the 16-bit fp16 mode. T = 1 is one_token.

FP16_OUT_SHAPES = [(1, 128, 8), (7, 8, 2), (128, 128, 8), (1000, 8, 2), (4096, 128, 8)]


@pytest.mark.parametrize("mode", FP8_MODES)
@pytest.mark.parametrize("T,E,k", FP16_OUT_SHAPES)
def test_fp8_fp16_out_shapes(T, E, k, mode, error_log):
    p = make_problem(T=T, E=E, k=k, H=512, I=256, dtype=mode, act_dtype="fp16", bias=True)
    out = check(p, error_log, f"{mode}/fp16/shapes", mode)
    assert out.dtype == torch.float16
    fp16_kernels = {x.name for x in moe_kernels.list_kernels(quant=mode, out_dtype="fp16")}
    tactic = chosen_tactic(p)
    assert set(tactic.kernels) <= fp16_kernels, tactic


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_fp16_out_every_built_kernel(mode, error_log):
    kernels = [x for x in moe_kernels.list_kernels(quant=mode, out_dtype="fp16") if x.gemm]
    assert kernels, f"no {mode} kernels with fp16 output usable on this GPU"
    assert all(x.out_dtype == "fp16" for x in kernels)
    assert {x.schedule for x in kernels} >= {"decode"} and any(x.schedule != "decode" for x in kernels)
    H, I = (528, 272) if mode == "fp8" else (768, 384)
    for T in (5, 700):  # a few rows per expert, and ~175: full and partial tiles of every kernel
        p = make_problem(T=T, E=8, k=2, H=H, I=I, dtype=mode, act_dtype="fp16", bias=True)
        ref = reference_out(p)
        for kern in kernels:
            err = rel_error(run(p, tactic=Tactic(kern.name, kern.name)), ref)
            error_log.add(f"{mode}/fp16/kernel/{kern.name}", err)
            assert err < TOLERANCE[mode], f"{kern.name} T={T}: relative error {err:.3e}"


@pytest.mark.parametrize("T", [300, 1100])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_fp16_out_scales(granularity, static, T, error_log):
    # As test_fp8_scales: expand quantizing fp16 rows (static or per-token scales), the activation
    # kernel's row and column forms writing GEMM2's E4M3 input from fp16 GEMM1 outputs.
    p = make_problem(T=T, E=16, k=4, H=272, I=208, dtype="fp8", granularity=granularity, bias=True,
                     act_dtype="fp16")
    if static:
        p["a13_scale"] = (p["hidden_states"].float().abs().max() / 448).reshape(1)
        p["a2_scale"] = torch.full((1,), 0.02, device="cuda")
    check(p, error_log, f"fp8/fp16/{granularity}/{'static' if static else 'dynamic'}/T{T}", "fp8")


def test_fp8_fp16_out_refuses_other_kernels():
    p = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="fp8", act_dtype="fp16")
    bf16_out = moe_kernels.list_kernels(quant="fp8")[0].name
    with pytest.raises(ValueError, match=r"tactic.gemm1: .* a fp8 \(fp16 out\) kernel usable on this GPU "
                                         r"\(it is a fp8 kernel with bf16 out\)"):
        run(p, tactic=Tactic(bf16_out, bf16_out))
    b = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="fp8", act_dtype="fp16", bias=True)
    b["w13_bias"] = b["w13_bias"].bfloat16()
    with pytest.raises(TypeError, match=r"w13_bias: got dtype torch.bfloat16, expected torch.float16"):
        run(b)


# ---- W4A16 (INT4, MXFP4): CUTLASS's mixed-input mainloop and our decode kernel ------------

W4_SHAPES = [(0, 8, 2), (1, 8, 2), (2, 8, 2), (7, 16, 4), (64, 128, 8), (1000, 8, 2), (4096, 128, 8)]


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("T,E,k", W4_SHAPES)
@pytest.mark.parametrize("quant", W4)
def test_w4a16_shapes(quant, T, E, k, act_dtype, error_log):
    p = make_problem(T=T, E=E, k=k, H=512, I=256, dtype=quant, act_dtype=act_dtype, bias=True,
                     group=32 if quant.endswith("mxfp4") else 128)
    if T == 0:
        assert run(p).shape == (0, 512)
        return
    out = check(p, error_log, f"{quant}/{act_dtype}/T{T}", quant, rows=True)
    assert out.dtype == (torch.float16 if act_dtype == "fp16" else torch.bfloat16)


@pytest.mark.parametrize("quant,group", [("w4a16_int4", 32), ("w4a16_int4", 64), ("w4a16_int4", 128),
                                         ("w4a16_mxfp4", 32), ("w4a8_int4", 128), ("w4a8_mxfp4", 32)])
@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
def test_w4a16_every_built_kernel(quant, group, act_dtype, error_log):
    kernels = [x for x in moe_kernels.list_kernels(quant=quant, out_dtype=act_dtype) if x.gemm]
    assert kernels, f"no {quant} kernels usable on this GPU"
    assert any(x.kind == "decode" for x in kernels)
    # H, I not multiples of the 128-row weight tile (MXFP4: nor of the decode kernel's 128-value
    # K step); ~170 rows per expert: full and partial tiles, several decode passes
    H, I = (608, 352) if quant.endswith("mxfp4") else (640, 384)
    p = make_problem(T=333, E=4, k=2, H=H, I=I, dtype=quant, act_dtype=act_dtype, group=group)
    ref = reference_out(p)
    ran = 0
    for kern in kernels:
        if kern.kind == "grouped" and group % kern.tile[2]:  # refused: see test_w4a16_refusals
            continue
        out = run(p, tactic=Tactic(kern.name, kern.name))
        err = rel_error(out, ref)
        error_log.add(f"{quant}/{act_dtype}/g{group}/kernel/{kern.name}", err)
        assert err < TOLERANCE[quant], f"{kern.name} g={group}: relative error {err:.3e}"
        ran += 1
    assert ran


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
def test_w4a16_mxfp4_placed_scales_at_the_top_of_their_range(act_dtype, error_log):
    """w4a16_mxfp4 reads the placed layout with its scales stored times 2^126 (bf16) or 2^14
    (fp16): E8M0 exponents up to 128 (scales up to 2), every code, every built kernel."""
    from moe_kernels import quant4
    from moe_kernels.prepare import prepare_weights
    g = torch.Generator().manual_seed(5)
    E, H, I, T, k = 4, 608, 352, 200, 2
    dt = torch.bfloat16 if act_dtype == "bf16" else torch.float16
    codes13, codes2 = torch.randint(0, 16, (E, 2 * I, H), generator=g), torch.randint(0, 16, (E, H, I), generator=g)
    codes13[:, :, :16] = torch.arange(16)  # every code in every row
    # exponents 120-128 (2^-7 .. 2^1); the inputs scaled so that the outputs stay O(1)-O(100)
    e13 = torch.randint(120, 129, (E, 2 * I, H // 32), generator=g).to(torch.uint8)
    e2 = torch.randint(120, 129, (E, H, I // 32), generator=g).to(torch.uint8)
    e13[0, 0, 0] = e2[0, 0, 0] = 128
    w = prepare_weights(quant4.pack_nibbles(codes13), quant4.pack_nibbles(codes2), quant="w4a16_mxfp4",
                        w13_scale=e13, w2_scale=e2, dtype=dt, device="cuda")
    assert w["w13_scale"].float().max().item() == 2.0 ** (1 + quant4.PLACED_FOLD[dt])
    p = {"hidden_states": (torch.randn(T, H, generator=g) * 0.05).to(device="cuda", dtype=dt),
         "topk_ids": torch.rand(T, E, generator=g).argsort(1)[:, :k].to(device="cuda", dtype=torch.int32),
         "topk_weights": torch.full((T, k), 0.5, device="cuda"), "quant": "w4a16_mxfp4",
         "w13": w["w13"], "w2": w["w2"], "w13_scale": w["w13_scale"], "w2_scale": w["w2_scale"]}
    ref = reference_out(p)
    kernels = [x for x in moe_kernels.list_kernels(quant="w4a16_mxfp4", out_dtype=act_dtype) if x.gemm]
    assert kernels
    for kern in kernels:
        out = run(p, tactic=Tactic(kern.name, kern.name))
        err = rel_error(out, ref)
        error_log.add(f"w4a16_mxfp4/{act_dtype}/placed-range/{kern.name}", err)
        assert err < TOLERANCE["w4a16_mxfp4"], f"{kern.name}: relative error {err:.3e}"


@pytest.mark.parametrize("quant", ["w4a8_int4", "w4a8_mxfp4"])
def test_w4a8_decode_reads_widened_inputs(quant, error_log):
    """The 4-bit decode GEMM reads W4A8's E4M3 inputs as 16-bit values, which routing's expand
    and the activation write so only for it: beside a kernel that reads E4M3 bytes in the other
    GEMM (both ways round), with dynamic and static input scales, and on the activation's
    many-rows path (a bias, 4096+ rows)."""
    kernels = [x for x in moe_kernels.list_kernels(quant=quant, out_dtype="bf16") if x.gemm]
    decode = next(x.name for x in kernels if x.kind == "decode")
    other = next(x.name for x in kernels if x.kind != "decode" and (x.kind != "grouped" or 128 % x.tile[2] == 0))
    cases = [(dict(T=40, E=8, k=2, H=256, I=128), False), (dict(T=40, E=8, k=2, H=256, I=128), True),
             (dict(T=2048, E=4, k=2, H=256, I=128, bias=True), False)]
    for shape, static in cases:
        p = make_problem(dtype=quant, group=128, **shape)
        kw = {}
        if static:
            kw = dict(a13_scale=(p["hidden_states"].float().abs().max() / 448).reshape(1),
                      a2_scale=torch.tensor([0.05], device="cuda"))
        ref = reference_out(p, **kw)
        for tactic in (Tactic(decode, other), Tactic(other, decode), Tactic(decode, decode)):
            err = rel_error(run(p, tactic=tactic, **kw), ref)
            error_log.add(f"{quant}/widened/{shape['T']}/{'static' if static else 'dynamic'}/{tactic}", err)
            assert err < TOLERANCE[quant], f"{tactic} T={shape['T']} static={static}: relative error {err:.3e}"


@pytest.mark.parametrize("quant", W4)
def test_w4a16_experts_without_tokens_and_expert_parallel(quant, error_log):
    E, T, k = 16, 96, 2
    ids = torch.rand(T, 2 * E).argsort(dim=1)[:, :k].to(torch.int32)  # half the ids on the other rank
    p = make_problem(T=T, E=E, k=k, H=256, I=128, dtype=quant, ids=ids, global_experts=2 * E)
    out = run(p, ep_rank=1, ep_size=2, num_experts=2 * E)
    err = rel_error(out, reference_out(p, expert_offset=E))
    error_log.add(f"{quant}/ep", err)
    assert err < TOLERANCE[quant]


@pytest.mark.parametrize("T", [5, 48])
@pytest.mark.parametrize("quant", W4)
def test_w4a16_graph_replay_and_determinism(quant, T, error_log):
    E, k, H, I = 8, 2, 256, 128
    p = make_problem(T=T, E=E, k=k, H=H, I=I, dtype=quant, bias=True)
    ws = torch.empty(moe_kernels.workspace_size(T, k, E, H, I, quant=quant), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(p["hidden_states"])
    kw = dict(quant=quant, w13_scale=p["w13_scale"], w2_scale=p["w2_scale"], w13_bias=p["w13_bias"],
              w2_bias=p["w2_bias"], workspace=ws, out=out)
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    fused_moe(*args, **kw)
    first = out.clone()
    fused_moe(*args, **kw)
    assert torch.equal(out, first), "two runs differ"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(*args, **kw)
    p["topk_ids"].copy_(torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k].int())  # new routing
    p["hidden_states"].copy_(torch.randn_like(p["hidden_states"]))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    err = rel_error(out, reference_out(p))
    error_log.add(f"{quant}/graph/T{T}", err)
    assert err < TOLERANCE[quant]


def test_w4a16_mxfp4_gpt_oss_shapes(error_log):
    # gpt-oss's K = 2880: 22.5 decode K steps; swiglu_oai and biases as gpt-oss runs them
    p = make_problem(T=6, E=8, k=4, H=2880, I=2880, dtype="w4a16_mxfp4", bias=True)
    out = run(p, activation="swiglu_oai")
    err = rel_error(out, reference_out(p, activation="swiglu_oai"))
    error_log.add("w4a16_mxfp4/gpt-oss", err)
    assert err < TOLERANCE["w4a16_mxfp4"]


def test_w4a16_refusals():
    p = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="w4a16_int4", group=32)
    grouped = [x for x in moe_kernels.list_kernels(quant="w4a16_int4") if x.kind == "grouped"]
    # CUTLASS's mainloop needs the scale group to be a multiple of its K tile (64): a clear error
    # when asked for by name; the default choice takes the decode kernel instead
    with pytest.raises((RuntimeError, ValueError), match="groups of 32"):
        run(p, tactic=Tactic(grouped[0].name, grouped[0].name))
    assert rel_error(run(p), reference_out(p)) < TOLERANCE["w4a16_int4"]
    q = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="w4a16_int4")
    with pytest.raises(ValueError, match=r"w2_scale: got shape"):
        run({**q, "w2_scale": q["w2_scale"][..., :128].contiguous()})
    m = make_problem(T=8, E=4, k=2, H=256, I=128, dtype="w4a16_mxfp4")
    with pytest.raises(TypeError, match=r"w13_scale: got dtype torch.uint8"):  # E8M0 as stored: prepare first
        run({**m, "w13_scale": torch.zeros(4, 256, 8, dtype=torch.uint8, device="cuda")})
    with pytest.raises(ValueError, match=r"w13: got shape \(4, 256, 128\) \(4-bit weights in the checkpoint packing.*"
                                         r"prepare_weights"):  # the checkpoint packing: prepare first
        run({**m, "w13": moe_kernels.quant4.unprepare(m["w13"], 256, moe_kernels.quant4.PLACED)})


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
def test_w4a16_int4_zero_points(T, act_dtype, error_log):
    """AWQ-style asymmetric INT4: additive zero terms, by default and on every kernel that takes
    them (the decode and tiled kernels); CUTLASS's mixed-input kernels refuse them."""
    p = make_problem(T=T, E=8, k=2, H=512, I=256, dtype="w4a16_int4", act_dtype=act_dtype, bias=True,
                     symmetric=False)
    assert p.get("w13_zero") is not None
    check(p, error_log, f"w4a16_int4/zero/{act_dtype}/T{T}", "w4a16_int4", rows=True)
    kernels = [x for x in moe_kernels.list_kernels(quant="w4a16_int4", out_dtype=act_dtype) if x.gemm]
    ref = reference_out(p)
    for kern in kernels:
        if kern.kind == "grouped":
            with pytest.raises((RuntimeError, ValueError), match="zero points"):
                run(p, tactic=Tactic(kern.name, kern.name))
            continue
        err = rel_error(run(p, tactic=Tactic(kern.name, kern.name)), ref)
        error_log.add(f"w4a16_int4/zero/{act_dtype}/T{T}/{kern.name}", err)
        assert err < TOLERANCE["w4a16_int4"], f"{kern.name}: relative error {err:.3e}"


def test_expert_map_routed_scaling_and_router_weight_on_input(error_log):
    """A general global-to-local expert map (not a contiguous range), DeepSeek's routed scaling
    factor and Llama 4's router weight on the input, against the reference."""
    E_global, E, H, I = 24, 8, 256, 128
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    local = torch.randperm(E_global)[:E]
    emap[local] = torch.arange(E, dtype=torch.int32)
    emap = emap.cuda()
    for T, k in ((1, 4), (40, 4), (300, 2)):
        p = make_problem(T=T, E=E, k=k, H=H, I=I, global_experts=E_global, bias=True)
        check(p, error_log, f"bf16/expert_map/T{T}", ref_kw=dict(expert_map=emap), expert_map=emap)
        check(p, error_log, f"bf16/routed_scaling/T{T}", ref_kw=dict(expert_map=emap, routed_scaling_factor=2.5),
              expert_map=emap, routed_scaling_factor=2.5)
    for quant in ("bf16", "fp8"):
        p = make_problem(T=50, E=E, k=1, H=H, I=I, dtype=quant)
        check(p, error_log, f"{quant}/router_weight_on_input", quant,
              ref_kw=dict(apply_router_weight_on_input=True), apply_router_weight_on_input=True)
    fp8 = make_problem(T=1, E=E, k=4, H=H, I=I, dtype="fp8", global_experts=E_global)
    check(fp8, error_log, "fp8/expert_map/T1", "fp8", ref_kw=dict(expert_map=emap, routed_scaling_factor=0.5),
          expert_map=emap, routed_scaling_factor=0.5)


def test_torch_compile_and_opcheck(error_log):
    """The registered op: torch.compile (default and fullgraph, dynamic T) gives the reference
    result, and torch.library.opcheck passes."""
    p = make_problem(T=33, E=8, k=2, H=256, I=128)
    w13, w2 = p["w13"], p["w2"]

    def layer(x, w, ids):
        return moe_kernels.fused_moe(x, w13, w2, w, ids) * 2

    for kw in ({}, {"fullgraph": True, "dynamic": True}):
        compiled = torch.compile(layer, **kw)
        for T in (33, 5, 70):
            q = make_problem(T=T, E=8, k=2, H=256, I=128)
            out = compiled(q["hidden_states"], q["topk_weights"], q["topk_ids"])
            ref = 2 * reference.fused_moe(q["hidden_states"], w13, w2, q["topk_weights"], q["topk_ids"])
            err = rel_error(out, ref)
            error_log.add(f"bf16/compile/{sorted(kw)}/T{T}", err)
            assert err < TOLERANCE["bf16"]
    out = torch.empty_like(p["hidden_states"])
    args = (p["hidden_states"], w13, w2, p["topk_weights"], p["topk_ids"], None, None, None, None, None, None,
            None, None, None, out, None, "", "swiglu", [-1, -1, -1, -1], 1.702, 7.0, False, 1.0, "", 0)
    torch.library.opcheck(torch.ops.moe_kernels.fused_moe.default, args)


@pytest.mark.parametrize("T", [3, 200])
@pytest.mark.parametrize("quant", ["w4a8_int4", "w4a8_mxfp4"])
def test_w4a8_static_activation_scales_and_extremes(quant, T, error_log):
    """W4A8 with static per-tensor input scales (the max over the rank's experts), rows that
    saturate at +-448 and all-zero rows, and the weights' extreme codes."""
    p = make_problem(T=T, E=8, k=2, H=256, I=128, dtype=quant, group=32 if quant.endswith("mxfp4") else 128)
    x = p["hidden_states"]
    x[0] = 0
    x[1 % T] *= 1e4  # saturates against a static scale made for the other rows
    a13 = (x[2 % T:].float().abs().max() / 448).reshape(1)
    a2 = torch.tensor([0.05], device="cuda")
    fill_w13_rows(p, slice(0, 4), 0x88 if quant.endswith("int4") else 0x77)  # INT4 -8, E2M1 +6
    fill_w13_rows(p, slice(4, 8), 0x77 if quant.endswith("int4") else 0xFF)  # INT4 7, E2M1 -6
    out = run(p, a13_scale=a13, a2_scale=a2)
    ref = reference_out(p, a13_scale=a13, a2_scale=a2)
    err = rel_error(out, ref)
    error_log.add(f"{quant}/static/T{T}", err)
    assert err < TOLERANCE[quant]


def _contiguous(quant, act_dtype):
    kernels = [x for x in moe_kernels.list_kernels(quant=quant, out_dtype=act_dtype) if x.kind == "contiguous"]
    assert kernels, f"the catalog builds a contiguous {quant} kernel in every subset"
    return Tactic(kernels[0].name, kernels[0].name)


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 512, 256), (40, 8, 2, 512, 256), (333, 4, 2, 512, 256),
                                       (2048, 16, 4, 1024, 512), (200, 4, 2, 640, 384)])
@pytest.mark.parametrize("quant", W4)
def test_four_bit_contiguous(quant, T, E, k, H, I, act_dtype, error_log):
    """4-bit weights on wgmma (our contiguous kernel, the weights converted in shared memory:
    to the 16-bit type for W4A16, to E4M3 for W4A8) in both GEMMs: one row, a few rows per
    expert (a tile split by columns), a full tile plus a partial one, several tiles and K
    blocks, a partial last N tile (640 = 2.5 x 256); both output types."""
    tactic = _contiguous(quant, act_dtype)
    p = make_problem(T=T, E=E, k=k, H=H, I=I, dtype=quant, act_dtype=act_dtype, bias=True,
                     group=32 if quant.endswith("mxfp4") else 128)
    check(p, error_log, f"{quant}/contig/{act_dtype}/T{T}", quant, rows=True, tactic=tactic)


@pytest.mark.parametrize("rows", [64, 40])
@pytest.mark.parametrize("quant", W4)
def test_four_bit_contiguous_split_tiles_at_the_n_edge(quant, rows, error_log):
    """Experts of exactly `rows` rows (tiles split by columns between the warpgroups) with GEMM2's
    N = 640 = 2.5 x 256: in the last N tile the second warpgroup's 128 columns start at N, so
    its TMA store box (64 rows) or its row-by-row copy (fewer) lies wholly past the edge."""
    tactic = _contiguous(quant, "bf16")
    E, k = 4, 2
    T = rows * E // k
    t = torch.arange(T)
    ids = torch.stack([t % E, (t + 1) % E], dim=1).to(torch.int32)  # every expert exactly `rows` rows
    p = make_problem(T=T, E=E, k=k, H=640, I=384, dtype=quant, ids=ids,
                     group=32 if quant.endswith("mxfp4") else 128)
    check(p, error_log, f"{quant}/contig/split-edge/rows{rows}", quant, rows=True, tactic=tactic)


# Rows per expert around the tail limits (W4A16: 16 rows past a full tile ride along, W4A8: 8):
# 129-136 and 261 (on its second tile) attached in both, 137-144 in W4A16 only (a tile of their
# own in W4A8), 145 never; the last expert's tail box reaches past the rows in both.
W4_TAIL_COUNTS = [129, 136, 137, 144, 145, 261, 128, 0, 140, 1, 133]


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("quant", W4)
def test_four_bit_contiguous_tail_rows(quant, act_dtype, error_log):
    """An expert's few rows past a full tile multiplied in that tile (swap-AB wgmmas on the
    converted weight block, stored from registers), at the limits and past them, with GEMM2's
    N = 640 (the tail's columns past N in the last N tile are not stored)."""
    if os.environ.get("MOE_KERNELS_CONTIG_TAIL"):
        pytest.skip("MOE_KERNELS_CONTIG_TAIL is set: the tails may be off")
    tactic = _contiguous(quant, act_dtype)
    ids = counts_ids(W4_TAIL_COUNTS)
    p = make_problem(T=len(ids), E=len(W4_TAIL_COUNTS), k=1, H=640, I=384, dtype=quant, ids=ids,
                     act_dtype=act_dtype, bias=True, group=32 if quant.endswith("mxfp4") else 128)
    check(p, error_log, f"{quant}/contig/tails/{act_dtype}", quant, rows=True, tactic=tactic)


@pytest.mark.parametrize("group,symmetric", [(32, True), (64, True), (128, False), (32, False)])
def test_w4a16_int4_contiguous_groups_and_zero_points(group, symmetric, error_log):
    """The contiguous W4A16 kernel with INT4 groups of 32 and 64 (two and one per K block of 64)
    and AWQ's zero terms (which CUTLASS's mixed-input GEMM cannot take)."""
    tactic = _contiguous("w4a16_int4", "bf16")
    p = make_problem(T=300, E=8, k=2, H=512, I=256, dtype="w4a16_int4", group=group, symmetric=symmetric)
    out = run(p, tactic=tactic)
    err = rel_error(out, reference_out(p))
    error_log.add(f"w4a16_int4/contig/g{group}/{'sym' if symmetric else 'zero'}", err)
    assert err < TOLERANCE["w4a16_int4"]


@pytest.mark.parametrize("T", [3, 300])
@pytest.mark.parametrize("quant", ["w4a16_mxfp4", "w4a8_mxfp4"])
def test_mxfp4_contiguous_gpt_oss_shapes(quant, T, error_log):
    """gpt-oss's H = I = 2880 on the contiguous kernel: partial last N tiles (5760 and 2880
    columns) and, for W4A8, a partial last K block (2880 = 22.5 x 128), with swiglu_oai and biases."""
    tactic = _contiguous(quant, "bf16")
    p = make_problem(T=T, E=4, k=2, H=2880, I=2880, dtype=quant, bias=True, group=32)
    out = run(p, activation="swiglu_oai", tactic=tactic)
    err = rel_error(out, reference_out(p, activation="swiglu_oai"))
    error_log.add(f"{quant}/contig/gpt-oss/T{T}", err)
    assert err < TOLERANCE[quant]


def test_w4a8_mxfp4_contiguous_scale_spread(error_log):
    """MXFP4's scales folded into the E4M3 weights: each group's values times 2^(e - e_max) of
    its column's K block. Group exponents spread over 0-12 below their block's largest (past 8
    the smaller groups' values round in E4M3, at under 2^-9 of the block's scale)."""
    tactic = _contiguous("w4a8_mxfp4", "bf16")
    p = make_problem(T=300, E=4, k=2, H=512, I=256, dtype="w4a8_mxfp4", group=32)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for name in ("w13_scale", "w2_scale"):
        s = p[name]
        shift = torch.randint(-12, 1, s.shape, device="cuda", generator=gen).float()
        p[name] = (s.float() * torch.exp2(shift)).to(s.dtype)
    out = run(p, tactic=tactic)
    err = rel_error(out, reference_out(p))
    error_log.add("w4a8_mxfp4/contig/scale-spread", err)
    assert err < TOLERANCE["w4a8_mxfp4"]


def test_w4a8_int4_contiguous_experts_statics_and_refusals(error_log):
    """The contiguous W4A8 kernel with experts of the other rank and empty ones, static input
    scales with saturating and zero rows and the extreme INT4 codes, graph replay; and what it
    refuses (INT4 groups other than 128, zero points) before any launch."""
    tactic = _contiguous("w4a8_int4", "bf16")
    E, T, k = 16, 300, 2
    ids = torch.rand(T, 2 * E).argsort(dim=1)[:, :k].to(torch.int32)  # half the ids on the other rank
    p = make_problem(T=T, E=E, k=k, H=512, I=256, dtype="w4a8_int4", ids=ids, global_experts=2 * E, group=128)
    out = run(p, ep_rank=1, ep_size=2, num_experts=2 * E, tactic=tactic)
    err = rel_error(out, reference_out(p, expert_offset=E))
    error_log.add("w4a8_int4/contig/ep", err)
    assert err < TOLERANCE["w4a8_int4"]

    p = make_problem(T=200, E=8, k=2, H=512, I=256, dtype="w4a8_int4", group=128)
    x = p["hidden_states"]
    x[0] = 0
    x[1] *= 1e4
    a13 = (x[2:].float().abs().max() / 448).reshape(1)
    a2 = torch.tensor([0.05], device="cuda")
    fill_w13_rows(p, slice(0, 4), 0x88)  # INT4 -8
    fill_w13_rows(p, slice(4, 8), 0x77)  # INT4 7
    out = run(p, a13_scale=a13, a2_scale=a2, tactic=tactic)
    err = rel_error(out, reference_out(p, a13_scale=a13, a2_scale=a2))
    error_log.add("w4a8_int4/contig/static", err)
    assert err < TOLERANCE["w4a8_int4"]

    ws = torch.empty(moe_kernels.workspace_size(200, 2, 8, 512, 256, quant="w4a8_int4"), dtype=torch.uint8,
                     device="cuda")
    out = torch.empty_like(p["hidden_states"])
    kw = dict(quant="w4a8_int4", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"], workspace=ws, out=out,
              tactic=tactic)
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    fused_moe(*args, **kw)
    first = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(*args, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first), "graph replay differs from the eager run"

    for bad, why in ((dict(group=64), "scale groups of 128"), (dict(symmetric=False), "zero points")):
        kw = dict(T=8, E=4, k=2, H=512, I=256, group=128) | bad
        q = make_problem(dtype="w4a8_int4", **kw)
        with pytest.raises(RuntimeError, match=why):
            run(q, tactic=tactic)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "w4a16_int4", "w4a8_mxfp4"])
def test_routed_rows_times_hidden_past_int32(quant, error_log):
    """Routed rows x hidden size past 2**32 elements (524,621 tokens, top 8 of 64 experts,
    H = 1024): every index into the expanded activations, GEMM outputs and the sum must be
    64-bit. The whole forward runs, every output row must be written; tokens are independent,
    so the first, last and a random sample of them are checked against the reference."""
    E, k, H, I = 64, 8, 1024, 128
    T = (1 << 32) // (k * H) + 333
    p = make_problem(T=1, E=E, k=k, H=H, I=I, dtype=quant, group=32 if quant.endswith("mxfp4") else 64)
    gen = torch.Generator(device="cuda").manual_seed(7)
    p["hidden_states"] = torch.randn(T, H, device="cuda", generator=gen).to(p["hidden_states"].dtype)
    p["topk_ids"] = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, device="cuda", generator=gen) + 0.1
    p["topk_weights"] = w / w.sum(dim=1, keepdim=True)
    out = run(p)
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison) or overflowed"
    idx = torch.cat([torch.arange(64), torch.randint(0, T, (192,)), torch.arange(T - 64, T)]).cuda()
    sub = {**p, "hidden_states": p["hidden_states"][idx], "topk_ids": p["topk_ids"][idx],
           "topk_weights": p["topk_weights"][idx]}
    err = rel_error(out[idx], reference_out(sub))
    error_log.add(f"{quant}/int32-overflow/T{T}", err)
    assert err < TOLERANCE[quant]
    del out, p
    torch.cuda.empty_cache()
