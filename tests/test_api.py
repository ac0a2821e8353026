"""Public API, validation and the reference (CPU only: run in CI)."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import moe_kernels
from moe_kernels import Activation, QuantMode, Tactic, fused_moe, reference
from moe_kernels._native import KernelInfo
from moe_kernels.tactic import default_tactic


def test_every_public_name_imports():
    for name in moe_kernels.__all__:
        assert getattr(moe_kernels, name) is not None, name


def problem(T=5, E=4, k=2, H=64, I=32, dtype=torch.bfloat16, gated=True):
    n1 = 2 * I if gated else I
    return dict(
        hidden_states=torch.randn(T, H, dtype=dtype),
        w13=torch.randn(E, n1, H, dtype=dtype),
        w2=torch.randn(E, H, I, dtype=dtype),
        topk_weights=torch.rand(T, k),
        topk_ids=torch.randint(0, E, (T, k), dtype=torch.int32),
    )


def call(p, **kw):
    return fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"], **kw)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda p: p.update(hidden_states=p["hidden_states"].float()), TypeError, r"hidden_states: got dtype torch.float32"),
    (lambda p: p.update(w13=p["w13"].half()), TypeError, r"w13: got dtype torch.float16, expected torch.bfloat16"),
    (lambda p: p.update(w2=p["w2"][:, :, :16].contiguous()), ValueError, r"w13: got shape \(4, 64, 64\)"),
    (lambda p: p.update(w13=p["w13"][:, :, :32].contiguous()), ValueError, r"w13: got shape \(4, 64, 32\)"),
    (lambda p: p.update(w13=p["w13"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, r"w13: got strides"),
    (lambda p: p.update(hidden_states=p["hidden_states"][:, :60].contiguous(), w13=p["w13"][..., :60].contiguous(),
                        w2=p["w2"][:, :60].contiguous()), ValueError, r"multiples of 8"),
    (lambda p: p.update(topk_ids=p["topk_ids"].float()), TypeError, r"topk_ids: got dtype torch.float32"),
    (lambda p: p.update(topk_ids=p["topk_ids"][:3]), ValueError, r"topk_ids: got shape \(3, 2\)"),
    (lambda p: p.update(topk_ids=torch.zeros(5, 1025, dtype=torch.int32)), ValueError, r"topk_ids: got shape \(5, 1025\).*top_k <= 1024"),
    (lambda p: p.update(topk_weights=p["topk_weights"].bfloat16()), TypeError, r"topk_weights: got dtype"),
    (lambda p: p.update(topk_weights=p["topk_weights"][:, :1].contiguous()), ValueError, r"topk_weights: got shape \(5, 1\)"),
    (lambda p: p.update(hidden_states=p["hidden_states"].float().tolist()), TypeError, r"hidden_states: got dtype list"),
])
def test_validation_errors_name_the_argument(mutate, exc, match):
    p = problem()
    mutate(p)
    with pytest.raises(exc, match=match):
        call(p)


def test_misaligned_pointer():
    p = problem()
    base = torch.randn(5 * 64 + 1, dtype=torch.bfloat16)
    p["hidden_states"] = base[1:].view(5, 64)
    with pytest.raises(ValueError, match="hidden_states: got data pointer .* 16-byte alignment"):
        call(p)


def test_bias_validation():
    p = problem()
    with pytest.raises(ValueError, match=r"w13_bias: got shape \(4, 32\)"):
        call(p, w13_bias=torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"w2_bias: got dtype torch.float32"):
        call(p, w2_bias=torch.zeros(4, 64))


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="hidden_states: got device cpu, expected a CUDA tensor"):
        call(problem())


def test_out_validation():
    p = problem()
    with pytest.raises(ValueError, match=r"out: got shape \(5, 32\)"):
        call(p, out=torch.empty(5, 32, dtype=torch.bfloat16))


def test_expert_parallel_arguments():
    p = problem()
    with pytest.raises(ValueError, match="expert_offset: got 3, expected None"):
        call(p, expert_offset=3, ep_rank=0, ep_size=2)
    with pytest.raises(ValueError, match="ep_rank/ep_size"):
        call(p, ep_rank=2, ep_size=2)
    with pytest.raises(ValueError, match="num_experts: got 9"):
        call(p, ep_rank=0, ep_size=2, num_experts=9)
    with pytest.raises(ValueError, match="expert_offset: got -1"):
        call(p, expert_offset=-1)


def test_quant_and_activation_names():
    assert QuantMode.parse("BF16") is QuantMode.BF16
    with pytest.raises(ValueError, match=r"quant='int3' is not a quantization mode"):
        call(problem(), quant="int3")
    with pytest.raises(ValueError, match=r"activation='tanh' is not an activation"):
        call(problem(), activation="tanh")
    with pytest.raises(TypeError, match="hidden_states: got dtype torch.float16, expected torch.bfloat16"):
        call(problem(dtype=torch.float16), quant="bf16")


def test_unsupported_mode_names_what_the_build_has():
    with pytest.raises(NotImplementedError, match=r"quant='mxfp8' has no kernels .* supports \['bf16', 'fp16', 'fp8', 'fp8_block', 'w4a16_int4', 'w4a16_mxfp4'(, 'w4a8_int4', 'w4a8_mxfp4')?\]"):
        call(problem(), quant="mxfp8")


def test_fp8_validation():
    from moe_kernels.prepare import quantize_weights
    p = problem(H=64, I=32)
    q = quantize_weights(p["w13"].float(), p["w2"].float())
    p.update(w13=q["w13"], w2=q["w2"])
    with pytest.raises(TypeError, match="w13_scale: got NoneType, expected a torch.Tensor"):
        call(p)  # quant inferred from the float8 weights
    with pytest.raises(ValueError, match=r"w2_scale: got shape \(4, 63\), expected one of \[\(4,\), .*\(4, 64\)"):
        call(p, w13_scale=q["w13_scale"], w2_scale=q["w2_scale"][:, :63].contiguous())
    with pytest.raises(ValueError, match="a13_scale: got shape \\(2,\\), expected one element"):
        call(p, w13_scale=q["w13_scale"], w2_scale=q["w2_scale"], a13_scale=torch.ones(2))
    with pytest.raises(ValueError, match="cpu, expected a CUDA tensor"):
        call(p, w13_scale=q["w13_scale"], w2_scale=q["w2_scale"], a2_scale=torch.ones(1))
    with pytest.raises(ValueError, match="expected none for quant='bf16'"):
        call(problem(), w13_scale=q["w13_scale"])
    r = problem(H=72, I=32)
    with pytest.raises(ValueError, match="multiples of 16"):  # prepare checks the mode's alignment too
        quantize_weights(r["w13"].float(), r["w2"].float())
    (q13, s13), (q2, s2) = (moe_kernels.fp8.quantize_weight(w.float(), "channel") for w in (r["w13"], r["w2"]))
    r.update(w13=q13, w2=q2)
    with pytest.raises(ValueError, match="multiples of 16"):
        call(r, w13_scale=s13, w2_scale=s2)


def test_fp8_takes_bf16_or_fp16_hidden_states():
    from moe_kernels.prepare import quantize_weights
    p = problem(H=64, I=32)
    q = quantize_weights(p["w13"].float(), p["w2"].float())
    p.update(w13=q["w13"], w2=q["w2"])
    kw = dict(w13_scale=q["w13_scale"], w2_scale=q["w2_scale"])
    with pytest.raises(TypeError, match=r"hidden_states: got dtype torch.float32, expected torch.bfloat16 or torch.float16"):
        call({**p, "hidden_states": p["hidden_states"].float()}, **kw)
    half = {**p, "hidden_states": p["hidden_states"].half()}  # out and biases: the same type
    with pytest.raises(TypeError, match=r"w13_bias: got dtype torch.bfloat16, expected torch.float16"):
        call(half, w13_bias=torch.zeros(4, 64, dtype=torch.bfloat16), **kw)
    with pytest.raises(TypeError, match=r"out: got dtype torch.bfloat16, expected torch.float16"):
        call(half, out=torch.empty(5, 64, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="hidden_states: got device cpu"):  # valid, but not on a GPU
        call(half, w13_bias=torch.zeros(4, 64, dtype=torch.float16), out=torch.empty(5, 64, dtype=torch.float16), **kw)
    # Kernel lists by output type: checked before any device is looked at.
    with pytest.raises(ValueError, match=r"out_dtype: got 'fp32', expected one of \['bf16', 'fp16'\]"):
        moe_kernels.list_kernels(quant="fp8", out_dtype="fp32")
    with pytest.raises(ValueError, match=r"out_dtype: got 'fp16', expected one of \['bf16'\] \(or None\) for quant='bf16'"):
        moe_kernels.list_kernels(quant="bf16", out_dtype="fp16")
    with pytest.raises(ValueError, match=r"out_dtype: got torch.float32"):
        moe_kernels.list_tactics("fp8_block", out_dtype=torch.float32)


def test_tactic_is_typed_by_name():
    with pytest.raises(TypeError, match="gemm1=3"):
        Tactic(3, "x")
    t = Tactic("a", "b")
    assert str(t) == "a+b" and Tactic.parse("a+b") == t and t.kernels == ("a", "b")
    with pytest.raises(Exception):
        t.gemm1 = "c"
    f = Tactic(forward="whole")
    assert str(f) == "whole" and Tactic.parse("whole") == f and f.kernels == ("whole",)
    for bad in (dict(gemm1="a"), dict(gemm1="a", gemm2="b", forward="c"), dict(forward="c", gemm2="b"), {}):
        with pytest.raises(TypeError, match="two GEMM kernel names, or one forward kernel name"):
            Tactic(**bad)


def test_no_integer_tactic_in_public_signatures():
    import inspect
    for name in moe_kernels.__all__:
        obj = getattr(moe_kernels, name)
        if callable(obj) and not isinstance(obj, type):
            sig = inspect.signature(obj)
            if "tactic" in sig.parameters:
                assert sig.parameters["tactic"].default is None


_KINDS = {"decode": ("decode", False), "ring": ("decode", False), "contig": ("contiguous", False), "coop_swapab": ("grouped", True),
          "one_token": ("forward", False), "tiled": ("tiled", False)}


def _info(name, mode, tile, sched, cluster=(1, 1), mainloop=""):
    """A registry entry as the library would describe it (no kernel behind it)."""
    kind, swap = _KINDS.get(sched, ("grouped", False))
    spec = QuantMode.parse(mode).spec
    return KernelInfo(name, "sm90a", mode, spec.act, spec.weight, "bf16", kind, sched, mainloop, swap, tile,
                      cluster, 1000)


def _k(name, tm, tn, sched="pingpong", cluster=(1, 1)):
    return _info(name, "bf16", (tm, tn, 64), sched, cluster)


def test_default_rule():
    ks = [_k("p64x64", 64, 64), _k("p64x128", 64, 128), _k("p64x256", 64, 256),
          _k("c128x128", 128, 128, "coop"), _k("c128x256", 128, 256, "coop"),
          _k("c128x256c", 128, 256, "coop", (2, 1))]
    # Mixtral decode: 2 experts hit, N=28672 for GEMM1, N=4096 for GEMM2
    t = default_tactic(ks, num_tokens=1, top_k=2, num_experts=8, hidden_size=4096,
                       gemm1_n=28672, sm_count=132)
    assert t.gemm1 == "p64x256"  # 112 tiles x 2 experts fills 132 SMs with the widest tile
    assert t.gemm2 == "p64x64"   # only 64 N-tiles per expert: go narrow
    # prefill: 4096 tokens over 8 experts
    t = default_tactic(ks, num_tokens=4096, top_k=2, num_experts=8, hidden_size=4096,
                       gemm1_n=28672, sm_count=132)
    assert t == Tactic("c128x256", "c128x256")
    # The M=128 switch: past 384 rows per expert for 16-bit (gpt-oss-120b: 128 experts, top 4)
    gpt_oss = dict(top_k=4, num_experts=128, hidden_size=2880, gemm1_n=5760, sm_count=132)
    assert default_tactic(ks, num_tokens=12288, **gpt_oss) == Tactic("p64x256", "p64x256")  # 384 rows
    assert default_tactic(ks, num_tokens=12320, **gpt_oss) == Tactic("c128x256", "c128x256")  # 385


def test_default_rule_four_bit():
    def k(name, tm, tn, sched, quant, tk=64):
        return _info(name, quant, (tm, tn, tk), sched)
    decode = [k(f"d{m}", m, 16, "decode", "w4a16_mxfp4", 128) for m in (8, 16)]
    tiled = [k(f"t{m}", m, 128, "tiled", "w4a16_mxfp4") for m in (32, 64)]
    gpt_oss = dict(top_k=4, num_experts=128, hidden_size=2880, gemm1_n=5760, sm_count=132)
    # W4A16 MXFP4 (no CUTLASS kernel takes groups of 32): decode up to 12 rows per expert, its
    # narrowest token tile that holds 1.5x the rows, then the narrowest tiled tile that holds them
    assert default_tactic(decode + tiled, num_tokens=160, **gpt_oss) == Tactic("d8", "d8")     # 5 rows
    assert default_tactic(decode + tiled, num_tokens=192, **gpt_oss) == Tactic("d16", "d16")   # 6
    assert default_tactic(decode + tiled, num_tokens=384, **gpt_oss) == Tactic("d16", "d16")   # 12
    assert default_tactic(decode + tiled, num_tokens=416, **gpt_oss) == Tactic("t32", "t32")   # 13
    assert default_tactic(decode + tiled, num_tokens=1024, **gpt_oss) == Tactic("t32", "t32")  # 32
    assert default_tactic(decode + tiled, num_tokens=4096, **gpt_oss) == Tactic("t64", "t64")  # 128
    assert default_tactic(decode, num_tokens=4096, **gpt_oss) == Tactic("d16", "d16")
    # INT4 with CUTLASS's kernels: those past the decode kernel, the tiled ones unused
    grouped = [k(f"c{m}", m, 128, "coop_swapab", "w4a16_int4") for m in (16, 64, 128)]
    int4 = [dataclasses.replace(x, mode="w4a16_int4", weight_format="int4") for x in decode + tiled] + grouped
    assert default_tactic(int4, num_tokens=4096, **gpt_oss) == Tactic("c128", "c128")
    assert default_tactic(int4, num_tokens=1024, **gpt_oss) == Tactic("c64", "c64")
    assert default_tactic(int4, num_tokens=512, **gpt_oss) == Tactic("d16", "d16")  # 16 rows
    assert default_tactic(int4, num_tokens=544, **gpt_oss) == Tactic("c64", "c64")  # 17
    # 64-column decode blocks in a GEMM whose K is at most 1024, else 16 columns with split K;
    # on SM90 (the 64-column block is the wgmma kernel) 64 columns past one row per expert (INT4
    # here), and for MXFP4 at any rows
    wide = [k(f"w{m}", m, 64, "decode", "w4a16_mxfp4", 128) for m in (8, 16)]
    mx = decode + wide + tiled
    i4 = [dataclasses.replace(x, mode="w4a16_int4", weight_format="int4") for x in mx]
    qwen3 = dict(top_k=8, num_experts=128, hidden_size=2048, gemm1_n=1536, sm_count=132, inter_size=768)
    assert default_tactic(i4, num_tokens=1, **qwen3) == Tactic("d8", "w8")
    assert default_tactic(i4, num_tokens=96, **qwen3) == Tactic("w16", "w16")  # 6 rows
    sm100 = [dataclasses.replace(x, arch="sm100a") for x in i4]
    assert default_tactic(sm100, num_tokens=96, **qwen3) == Tactic("d16", "w16")
    ds = dict(top_k=8, num_experts=256, hidden_size=7168, gemm1_n=4096, sm_count=132, inter_size=2048)
    assert default_tactic(i4, num_tokens=2, **ds) == Tactic("d8", "d8")
    assert default_tactic(i4, num_tokens=1, **gpt_oss) == Tactic("d8", "d8")  # K not given
    assert default_tactic(mx, num_tokens=1, **gpt_oss) == Tactic("w8", "w8")
    assert default_tactic(mx, num_tokens=16, **gpt_oss) == Tactic("w8", "w8")  # one row
    assert default_tactic(mx, num_tokens=96, **qwen3) == Tactic("w16", "w16")
    assert default_tactic([dataclasses.replace(x, arch="sm100a") for x in mx], num_tokens=1, **gpt_oss) == \
        Tactic("d8", "d8")
    assert default_tactic(wide + tiled, num_tokens=1, **gpt_oss) == Tactic("w8", "w8")   # only 64 built
    assert default_tactic(decode + wide, num_tokens=4096, **gpt_oss) == Tactic("d16", "d16")  # no prefill kernel
    # The contiguous wgmma kernel instead of the tiled one: W4A16 MXFP4 past 32 rows per expert,
    # W4A8 MXFP4 past 24, W4A8 INT4 past the decode kernel's 8; never where CUTLASS's kernels
    # serve (W4A16 INT4 g128)
    contig = [k("g", 128, 256, "contig", "w4a16_mxfp4")]
    assert default_tactic(decode + tiled + contig, num_tokens=1024, **gpt_oss) == Tactic("t32", "t32")  # 32 rows
    assert default_tactic(decode + tiled + contig, num_tokens=1056, **gpt_oss) == Tactic("g", "g")  # 33
    assert default_tactic(decode + tiled + contig, num_tokens=4096, **gpt_oss) == Tactic("g", "g")  # 128
    w4a8 = [dataclasses.replace(x, mode="w4a8_int4", act_format="fp8_row", weight_format="int4")
            for x in decode + tiled + contig]
    assert default_tactic(w4a8, num_tokens=256, **gpt_oss) == Tactic("d16", "d16")  # 8 rows
    assert default_tactic(w4a8, num_tokens=288, **gpt_oss) == Tactic("g", "g")  # 9
    w4a8_mx = [dataclasses.replace(x, mode="w4a8_mxfp4", act_format="fp8_row") for x in decode + tiled + contig]
    assert default_tactic(w4a8_mx, num_tokens=256, **gpt_oss) == Tactic("d16", "d16")  # 8 rows
    assert default_tactic(w4a8_mx, num_tokens=288, **gpt_oss) == Tactic("t32", "t32")  # 9
    assert default_tactic(w4a8_mx, num_tokens=768, **gpt_oss) == Tactic("t32", "t32")  # 24
    assert default_tactic(w4a8_mx, num_tokens=800, **gpt_oss) == Tactic("g", "g")  # 25
    # SM90's W4A8 block with 32 tokens a pass: W4A8 MXFP4 stays on the 64-column decode block
    # up to 64 rows per expert (the tile that holds 1.5x the rows, else 32); INT4 keeps its bound
    wide32 = [k(f"w{m}", m, 64, "decode", "w4a8_mxfp4", 128) for m in (8, 16, 32)]
    w4a8_mx32 = w4a8_mx + [dataclasses.replace(x, act_format="fp8_row") for x in wide32]
    assert default_tactic(w4a8_mx32, num_tokens=256, **gpt_oss) == Tactic("w16", "w16")  # 8 rows
    assert default_tactic(w4a8_mx32, num_tokens=288, **gpt_oss) == Tactic("w16", "w16")  # 9
    assert default_tactic(w4a8_mx32, num_tokens=352, **gpt_oss) == Tactic("w32", "w32")  # 11
    assert default_tactic(w4a8_mx32, num_tokens=2048, **gpt_oss) == Tactic("w32", "w32")  # 64
    assert default_tactic(w4a8_mx32, num_tokens=2080, **gpt_oss) == Tactic("g", "g")  # 65
    w4a8_i32 = [dataclasses.replace(x, mode="w4a8_int4", weight_format="int4") for x in w4a8_mx32]
    assert default_tactic(w4a8_i32, num_tokens=288, **gpt_oss) == Tactic("g", "g")  # 9
    int4_contig = int4 + [dataclasses.replace(contig[0], mode="w4a16_int4", weight_format="int4")]
    assert default_tactic(int4_contig, num_tokens=4096, **gpt_oss) == Tactic("c128", "c128")
    awq = [x for x in int4_contig if x.kind != "grouped"]  # CUTLASS's kernels filtered out: not yet measured
    assert default_tactic(awq, num_tokens=4096, **gpt_oss) == Tactic("t64", "t64")


def test_default_rule_fp8():
    def k(name, tm, tn, sched, quant, mainloop=""):
        return _info(name, quant, (tm, tn, 128), sched, mainloop=mainloop or ("blockwise" if quant == "fp8_block" else ""))
    fp8 = [k("p64x128", 64, 128, "pingpong", "fp8"), k("p64x128_fastaccum", 64, 128, "pingpong", "fp8", "fastaccum")]
    # Same tile: fast accumulation first, wherever it sits in the registry order.
    for ks in (fp8, fp8[::-1]):
        t = default_tactic(ks, num_tokens=16, top_k=8, num_experts=128, hidden_size=2048,
                           gemm1_n=1536, sm_count=132)
        assert t == Tactic("p64x128_fastaccum", "p64x128_fastaccum")
    # per-tensor fp8 keeps M=64 up to 384 rows per expert (Qwen3-30B-A3B: 128 experts, top 8)
    fp8 += [k("c128x128_fastaccum", 128, 128, "coop", "fp8", "fastaccum")]
    qwen3 = dict(top_k=8, num_experts=128, hidden_size=2048, gemm1_n=1536, sm_count=132)
    assert default_tactic(fp8, num_tokens=6144, **qwen3).gemm1 == "p64x128_fastaccum"  # 384 rows
    assert default_tactic(fp8, num_tokens=6160, **qwen3).gemm1 == "c128x128_fastaccum"  # 385
    block = [k("p64x128_blockwise", 64, 128, "pingpong", "fp8_block"),
             k("c128x128_blockwise", 128, 128, "coop", "fp8_block")]
    dsv3 = dict(top_k=8, num_experts=256, hidden_size=7168, gemm1_n=4096, sm_count=132)
    assert default_tactic(block, num_tokens=1024, **dsv3).gemm1 == "p64x128_blockwise"  # 32 rows/expert
    assert default_tactic(block, num_tokens=4096, **dsv3).gemm1 == "c128x128_blockwise"  # 128
    # Swap-AB up to 1 (GEMM1) and 4 (GEMM2) rows per expert, before decode, the narrowest tile
    # that holds 8x the rows, of the narrow (decode) tiles.
    swap = block + [k("s16", 16, 128, "coop_swapab", "fp8_block"), k("s8", 8, 128, "coop_swapab", "fp8_block"),
                    k("d8", 8, 16, "decode", "fp8_block"), k("s64", 64, 128, "coop_swapab", "fp8_block")]
    assert default_tactic(swap, num_tokens=1, **dsv3) == Tactic("s8", "s8")
    assert default_tactic(swap, num_tokens=32, **dsv3) == Tactic("s8", "s8")     # 1 row/expert
    assert default_tactic(swap, num_tokens=64, **dsv3) == Tactic("p64x128_blockwise", "s16")  # 2
    assert default_tactic(swap, num_tokens=128, **dsv3) == Tactic("p64x128_blockwise", "s16")  # 4
    assert default_tactic(swap, num_tokens=256, **dsv3) == Tactic("p64x128_blockwise", "p64x128_blockwise")
    assert default_tactic(swap, num_tokens=1024, **dsv3).gemm1 == "p64x128_blockwise"
    assert default_tactic(swap, num_tokens=4096, **dsv3).gemm1 == "c128x128_blockwise"
    # The 256-wide contiguous kernel past 64 rows per expert, where N is a multiple of 256.
    contig = swap + [k("g128x128", 128, 128, "contig", "fp8_block"), k("g128x256", 128, 256, "contig", "fp8_block")]
    assert default_tactic(contig, num_tokens=1024, **dsv3).gemm1 == "p64x128_blockwise"
    assert default_tactic(contig, num_tokens=4096, **dsv3) == Tactic("g128x256", "g128x256")
    assert default_tactic(contig, num_tokens=4096, **dict(dsv3, hidden_size=7040)) == Tactic("g128x256", "c128x128_blockwise")
    # FP8 decode: the tile by the rows' headroom in both widths, decode up to 64 pairs whatever K
    dec = fp8 + [k(f"d{m}{w}", m, n, "decode", "fp8") for m in (8, 16) for n, w in ((16, ""), (64, "w"))]
    mixtral = dict(top_k=2, num_experts=8, hidden_size=4096, gemm1_n=28672, sm_count=132)
    assert default_tactic(dec, num_tokens=8, **mixtral) == Tactic("d8w", "d8")     # 2 rows per expert
    assert default_tactic(dec, num_tokens=32, **mixtral) == Tactic("d16w", "d16")  # 8
    # A whole-forward kernel (the caller passes those that serve the problem): one token only.
    whole = dec + [k("fwd", 0, 0, "one_token", "fp8")]
    assert default_tactic(whole, num_tokens=1, **mixtral) == Tactic(forward="fwd")
    assert default_tactic(whole, num_tokens=2, **mixtral) == default_tactic(dec, num_tokens=2, **mixtral)


def test_default_rule_decode_kernels():
    ks = [_k("p64x128", 64, 128), _k("c128x256", 128, 256, "coop"),
          _k("d16", 16, 16, "decode"), _k("d8", 8, 16, "decode")]
    qwen3 = dict(top_k=8, num_experts=128, hidden_size=2048, gemm1_n=1536, sm_count=132)
    assert default_tactic(ks, num_tokens=1, **qwen3) == Tactic("d8", "d8")      # 8 pairs
    assert default_tactic(ks, num_tokens=4, **qwen3) == Tactic("d8", "d8")      # 32
    assert default_tactic(ks, num_tokens=8, **qwen3) == Tactic("d8", "d8")      # 64
    assert default_tactic(ks, num_tokens=16, **qwen3).gemm1 == "p64x128"       # 128: CUTLASS
    assert default_tactic(ks, num_tokens=16384, **qwen3) == Tactic("c128x256", "c128x256")
    # 20 rows on each of 2 experts: more than one 16-token pass, the widest decode tile (GEMM2;
    # GEMM1, 16-bit with K = 4096, leaves decode past 16 pairs)
    two = dict(top_k=1, num_experts=2, hidden_size=4096, gemm1_n=28672, sm_count=132)
    assert default_tactic(ks, num_tokens=40, **two) == Tactic("p64x128", "d16")
    # headroom: 16-token passes from 1.5x the mean rows per expert up (Mixtral: 8 experts, top-2)
    mixtral = dict(top_k=2, num_experts=8, hidden_size=4096, gemm1_n=28672, sm_count=132)
    assert default_tactic(ks, num_tokens=4, **dict(mixtral, hidden_size=2048)) == Tactic("d8", "d8")  # 1 row
    assert default_tactic(ks, num_tokens=24, **dict(mixtral, hidden_size=2048)) == Tactic("d16", "d16")  # 6
    # no CUTLASS kernel left after the decode ones are set aside: still a choice
    assert default_tactic(ks[2:], num_tokens=4096, **qwen3).gemm1 in ("d8", "d16")
    # 64-column blocks once there are 4 per SM: DeepSeek-V3 one token, GEMM2 (8 x 7168 / 64 =
    # 896 blocks) but not GEMM1 (8 x 4096 / 64 = 512 < 4 x 132)
    wide = ks + [_k("d8w", 8, 64, "decode"), _k("d16w", 16, 64, "decode")]
    dsv3 = dict(top_k=8, num_experts=256, hidden_size=7168, gemm1_n=4096, sm_count=132)
    # (16-bit: 64-column blocks take 16 tokens a pass whatever the rows)
    assert default_tactic(wide, num_tokens=1, **dsv3) == Tactic("d8", "d16w")
    assert default_tactic(wide, num_tokens=1, **qwen3) == Tactic("d8", "d8")
    # 16-bit GEMM1 with K >= 4096: decode up to 16 pairs, CUTLASS past them
    assert default_tactic(wide, num_tokens=8, **mixtral) == Tactic("d16w", "d8")     # 16 pairs
    assert default_tactic(wide, num_tokens=16, **mixtral) == Tactic("p64x128", "d8")  # 32
    assert default_tactic(wide, num_tokens=32, **mixtral) == Tactic("p64x128", "d16")  # 8 rows per expert
    assert default_tactic(wide, num_tokens=16, **dict(mixtral, hidden_size=2880)).gemm1 == "d16w"


def test_default_rule_ring_kernels():
    """The ring form's 16-token tile in both GEMMs from RING_MIN_TOKENS tokens while 1.5x the rows
    per expert fit one pass (bf16, fp16, fp8_block); else what a build without it picks."""
    base = [_k("p64x128", 64, 128), _k("c128x256", 128, 256, "coop"), _k("d8", 8, 16, "decode"),
            _k("d16", 16, 16, "decode"), _k("d16w", 16, 64, "decode")]
    ring = [_info("r16", "bf16", (16, 64, 128), "ring"), _info("r64", "bf16", (64, 64, 64), "ring")]
    dsv3 = dict(top_k=8, num_experts=256, hidden_size=7168, gemm1_n=4096, sm_count=132)
    mixtral = dict(top_k=2, num_experts=8, hidden_size=4096, gemm1_n=28672, sm_count=132)
    qwen3 = dict(top_k=8, num_experts=128, hidden_size=2048, gemm1_n=1536, sm_count=132)
    for shape in (dsv3, mixtral, qwen3):
        for T in (1, 2, 4, 8):  # below RING_MIN_TOKENS
            assert default_tactic(base + ring, num_tokens=T, **shape) == default_tactic(base, num_tokens=T, **shape)
    for T in (16, 64, 128):     # 1, 2, 4 rows per expert
        assert default_tactic(base + ring, num_tokens=T, **dsv3) == Tactic("r16", "r16")
    assert default_tactic(base + ring, num_tokens=16, **mixtral) == Tactic("r16", "r16")  # 4 rows
    assert default_tactic(base + ring, num_tokens=128, **qwen3) == Tactic("r16", "r16")   # 8 rows
    for shape, T in ((mixtral, 64), (dsv3, 512), (qwen3, 512), (dsv3, 4096)):  # 16+ rows: never the ring
        assert default_tactic(base + ring, num_tokens=T, **shape) == default_tactic(base, num_tokens=T, **shape)
    # fp8_block takes it before its swap-AB tiles; per-channel fp8 (it lost on the ring) does not.
    block = [_info("s8", "fp8_block", (8, 128, 128), "coop_swapab", mainloop="blockwise"),
             _info("b128", "fp8_block", (128, 128, 128), "coop", mainloop="blockwise"),
             _info("rb16", "fp8_block", (16, 64, 256), "ring", mainloop="blockwise")]
    assert default_tactic(block, num_tokens=64, **dsv3) == Tactic("rb16", "rb16")
    assert default_tactic(block, num_tokens=4, **dsv3) == default_tactic(block[:2], num_tokens=4, **dsv3)
    fp8 = [_info("f128", "fp8", (128, 128, 128), "coop"), _info("f8", "fp8", (8, 16, 128), "decode"),
           _info("fr16", "fp8", (16, 64, 256), "ring")]
    assert default_tactic(fp8, num_tokens=64, **dsv3) == default_tactic(fp8[:2], num_tokens=64, **dsv3)


def naive_moe(x, w13, w2, wts, ids, act, b13=None, b2=None):
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            if act == "swiglu":
                g, u = h.chunk(2)
                a = g * torch.sigmoid(g) * u
            else:  # relu2
                a = torch.relu(h) ** 2
            y = w2[e].double() @ a
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(wts[t, s]) * y
    return out


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_reference_matches_naive_loop(act):
    gated = act == "swiglu"
    p = problem(T=9, E=5, k=3, H=24, I=16, dtype=torch.float32, gated=gated)
    p["topk_ids"][0, 0] = -1  # not a local expert
    n1 = 32 if gated else 16
    b13, b2 = torch.randn(5, n1), torch.randn(5, 24)
    ref = reference.fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"],
                              p["topk_ids"], activation=act, w13_bias=b13, w2_bias=b2)
    naive = naive_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"],
                      act, b13, b2)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-4, atol=1e-4)


def test_reference_activations():
    x = torch.linspace(-10, 10, 64).reshape(2, 32)
    for act in Activation:
        y = reference.apply_activation(x, act)
        assert y.shape[-1] == (16 if act.gated else 32)
    g = torch.tensor([[9.0, 2.0]])  # gate 9 -> clamped to limit 7; up 2
    y = reference.apply_activation(g, "swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    assert torch.allclose(y, torch.tensor([[7 * torch.sigmoid(torch.tensor(1.702 * 7)) * 3]]))


def test_prepare_weights_validation():
    from moe_kernels.prepare import prepare_weights
    w13 = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    w2 = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    out = prepare_weights(w13, w2)
    assert out["w13"].is_contiguous() and out["w13_bias"] is None
    with pytest.raises(ValueError, match=r"w13: got shape \(2, 32, 16\), expected \(2, 16, 16\)"):
        prepare_weights(w13, w2, activation="relu2")
    with pytest.raises(NotImplementedError, match="nvfp4"):
        prepare_weights(w13, w2, quant="nvfp4")
    with pytest.raises(TypeError, match="w13: got dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        prepare_weights(w13, w2, quant="fp8")


def test_layer_validation():
    from moe_kernels import FusedMoE
    with pytest.raises(ValueError, match="num_experts: got 10, expected a multiple of ep_size=4"):
        FusedMoE(10, 64, 32, ep_size=4)
    with pytest.raises(ValueError, match=r"hidden_size=7168, intermediate_size=1000, expected both multiples of 128 for quant='fp8_block'"):
        FusedMoE(8, 7168, 1000, quant="fp8_block")
    layer = FusedMoE(8, 64, 32, ep_rank=1, ep_size=2)
    with pytest.raises(RuntimeError, match="load_weights"):
        layer(torch.zeros(1, 64), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"w13: got shape \(3, 64, 64\)"):
        layer.load_weights(torch.zeros(3, 64, 64, dtype=torch.bfloat16), torch.zeros(3, 64, 32, dtype=torch.bfloat16))
    layer.load_weights(torch.zeros(8, 64, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 32, dtype=torch.bfloat16))
    assert layer.weights["w13"].shape == (4, 64, 64)


def test_layer_prepares_four_bit_weights_once():
    """FusedMoE takes 4-bit weights in the checkpoint packing (all experts or this rank's) or
    prepared, and holds them prepared either way."""
    from moe_kernels import FusedMoE, quant4
    from moe_kernels.prepare import prepare_weights
    E, H, I = 4, 2880, 64
    g = torch.Generator().manual_seed(0)
    (q13, e13), (q2, e2) = (quant4.quantize_mxfp4(torch.randn(*s, generator=g)) for s in ((E, 2 * I, H), (E, H, I)))
    layer = FusedMoE(E, H, I, quant="w4a16_mxfp4", activation="swiglu_oai", ep_rank=1, ep_size=2)
    layer.load_weights(q13, q2, w13_scale=e13, w2_scale=e2)
    assert layer.weights["w13"].shape == (2, 23, 8, 1024) and layer.weights["w2"].shape == (2, 1, 180, 1024)
    assert torch.equal(quant4.unprepare(layer.weights["w13"], H, quant4.PLACED), q13[2:])
    p = prepare_weights(q13, q2, quant="w4a16_mxfp4", w13_scale=e13, w2_scale=e2)
    layer.load_weights(p["w13"], p["w2"], w13_scale=e13, w2_scale=e2)  # prepared, all experts: sliced
    assert torch.equal(layer.weights["w13"], p["w13"][2:]) and torch.equal(layer.weights["w2"], p["w2"][2:])
    with pytest.raises(ValueError, match=r"w13: got shape \(2, 22, 8, 1024\), expected \(2, 23, 8, 1024\) "
                                         r"\(or \(4, 23, 8, 1024\) for all experts\)"):
        layer.load_weights(p["w13"][:, :22], p["w2"], w13_scale=e13, w2_scale=e2)


def test_info_cli_without_gpu():
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "info", "--json"], capture_output=True,
                       text=True, check=True)
    info = json.loads(r.stdout)
    assert info["version"] == moe_kernels.__version__
    assert info["libraries"] and info["libraries"][0]["kernels"]
    if not torch.cuda.is_available():
        assert info["devices"] == []
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "info"], capture_output=True, text=True, check=True)
    assert "sm90a" in r.stdout


def test_runtime_guards_for_the_driver_and_two_distributions(monkeypatch):
    from types import SimpleNamespace
    from moe_kernels import _native
    monkeypatch.setattr(_native, "C", lambda: SimpleNamespace(driver_version=lambda: 12080))
    with pytest.raises(RuntimeError, match=r"driver supports CUDA 12\.8; this build of moe_kernels "
                                           r"\(moe-kernels-cu13\) needs a driver for CUDA 13\.0 or newer: "
                                           r"update the driver, or install moe-kernels-cu12 instead"):
        _native.check_driver(13000)
    _native.check_driver(12040)  # a 12.x runtime on a 12.8 driver: fine
    monkeypatch.setattr(_native, "C", lambda: SimpleNamespace(driver_version=lambda: 0))
    _native.check_driver(13000)  # no driver at all: nothing to say here (no GPU is visible)
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.0")
    with pytest.raises(ImportError, match="both moe-kernels-cu12 and moe-kernels-cu13 are installed"):
        _native.check_distributions()
