"""The humming-kernels peer's CPU parts: its registration, the block alignment and the weight
conversion (the GEMMs themselves need a GPU and humming-kernels)."""
import importlib.util

import pytest
import torch

from moe_kernels import quant4
from moe_kernels.cli import bench
from moe_kernels.prepare import quantize_weights


def humming(quant):
    return next(p for p in bench.peers("swiglu", quant) if p[0] == "humming-kernels")


@pytest.mark.parametrize("quant", ["w4a16_int4", "w4a16_mxfp4", "w4a8_int4", "w4a8_mxfp4"])
def test_registered_for_the_4_bit_modes(quant, monkeypatch):
    name, fn, why = humming(quant)
    if importlib.util.find_spec("humming") is None:
        assert fn is None and why == "not installed"
    else:
        assert isinstance(fn, bench.HummingMoE) and fn.weight_format == quant.split("_")[1]
        assert fn.fp8_inputs == quant.startswith("w4a8")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert humming(quant)[1:] == (None, "not installed")
    assert all(p[0] != "humming-kernels" for p in bench.peers("swiglu", "fp8_block"))


@pytest.mark.parametrize("T,k,E,block", [(1, 8, 128, 8), (5, 2, 4, 16), (64, 4, 8, 48), (300, 8, 16, 80)])
def test_align_blocks_is_moe_align_block_size(T, k, E, block):
    g = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k].int()
    sorted_ids, expert_ids, padded = bench._align_blocks(ids, E, block)
    assert sorted_ids.dtype == expert_ids.dtype == padded.dtype == torch.int32
    assert sorted_ids.numel() == block * expert_ids.numel()
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    n = int(padded)
    assert n == int(((counts + block - 1) // block * block).sum())
    valid = sorted_ids[:n]
    real = valid[valid < T * k].long()
    assert torch.equal(real.sort().values, torch.arange(T * k))  # every (token, slot) once
    assert (sorted_ids[n:] == T * k).all()
    flat = ids.flatten()
    for b in range(n // block):  # each block: one expert's ids, in order, then padding
        run = valid[b * block:(b + 1) * block].long()
        ids_in = run[run < T * k]
        assert (flat[ids_in] == expert_ids[b]).all()
        assert torch.equal(ids_in, ids_in.sort().values) and (run[len(ids_in):] == T * k).all()


def test_humming_tensors_keep_the_values():
    g = torch.Generator().manual_seed(0)
    E, N, K = 2, 256, 256  # w13 [E, 2I, H] with I = 128, H = 256
    w = torch.randn(E, N, K, generator=g)

    def nibbles(words):  # humming's packing: element i of a 32-bit word in bits 4i
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        return ((words.long()[..., None] >> shifts) & 15).flatten(-2)

    p = quantize_weights(w, w[:, :, :128], quant="w4a16_int4")
    packed = quant4.unprepare(p["w13"], K, "int4")  # humming takes the checkpoint packing
    config, t = bench._humming_tensors(packed, p["w13_scale"], "int4")
    assert config == {"dtype": "uint4", "group_size": 128}
    assert t["weight"].shape == (E, N, K // 8) and t["weight_scale"].shape == (E, N, K // 128)
    assert torch.equal(nibbles(t["weight"]) - 8, quant4.int4_values(packed).long())
    assert torch.equal(t["weight_scale"], p["w13_scale"].transpose(1, 2))


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu (humming needs 2.7+)")
def test_humming_mxfp4_tensors_keep_the_values():
    g = torch.Generator().manual_seed(0)
    E, N, K = 2, 256, 256
    w = torch.randn(E, N, K, generator=g)

    def nibbles(words):
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        return ((words.long()[..., None] >> shifts) & 15).flatten(-2)

    p = quantize_weights(w, w[:, :, :128], quant="w4a16_mxfp4")  # the placed layout, scales folded
    packed = quant4.unprepare(p["w13"], K, quant4.PLACED)
    q, e = quant4.quantize_mxfp4(w)  # the checkpoint's codes and E8M0 exponents
    assert torch.equal(packed, q)
    config, t = bench._humming_tensors(packed, p["w13_scale"], quant4.PLACED)
    assert config == {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"}
    assert torch.equal(nibbles(t["weight"]), quant4.unpack_nibbles(q).long())
    assert torch.equal(t["weight_scale"].view(torch.uint8), e)
    q8 = quantize_weights(w, w[:, :, :128], quant="w4a8_mxfp4")  # the fragment layout, scales as they are
    _, t8 = bench._humming_tensors(quant4.unprepare(q8["w13"], K, "mxfp4"), q8["w13_scale"], "mxfp4")
    assert torch.equal(t8["weight_scale"].view(torch.uint8), e)


def test_forward_glue_with_an_indexed_gemm_stand_in(monkeypatch):
    """HummingMoE's routing, activation and sum around a PyTorch stand-in for humming's indexed
    GEMM (row ids sorted in blocks of its M tile; input row id // top_k, output row id; ids of
    T*k are padding), each GEMM on its own tile, match the mode's reference."""
    from moe_kernels import reference
    g = torch.Generator().manual_seed(1)
    E, H, I, T, k = 4, 256, 128, 7, 2
    p = quantize_weights(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5,
                         torch.randn(E, H, I, generator=g) * I ** -0.5, quant="w4a16_int4")
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k].int()
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)

    class StandIn:
        def __init__(self, w, scale, K, block):
            self.w = torch.stack([reference.dequantize_weight(w[e], "int4", scale[e], K=K) for e in range(E)])
            self.block = block

        def __call__(self, a, sorted_ids, expert_ids, num_tokens_padded, top_k, compute_config, tuning_config):
            rows = a.shape[0] * top_k
            out = torch.full((rows, self.w.shape[1]), float("nan"), dtype=a.dtype)
            for b in range(int(num_tokens_padded) // self.block):
                run = sorted_ids[b * self.block:(b + 1) * self.block].long()
                run = run[run < rows]
                out[run] = (a[run // top_k].float() @ self.w[expert_ids[b]].T).to(a.dtype)
            return out

    peer = bench.HummingMoE("int4")
    layers = StandIn(p["w13"], p["w13_scale"], H, 8), StandIn(p["w2"], p["w2_scale"], I, 16)
    monkeypatch.setattr(peer, "weights", lambda *a: layers)
    monkeypatch.setattr(peer, "_tile", lambda layer, rows: ("{}", layer.block))
    out = peer(x, p["w13"], p["w2"], wts, ids, "swiglu", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    ref = reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant="w4a16_int4", w13_scale=p["w13_scale"],
                              w2_scale=p["w2_scale"])
    assert out.dtype == x.dtype and ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
