"""4-bit weights: numerics, checkpoint importers, preparation and the reference (CPU)."""
import pytest
import torch

from moe_kernels import QuantMode, quant4, reference
from moe_kernels.prepare import (AWQ_PACK_ORDER, from_awq, from_compressed_tensors, from_gpt_oss, from_gptq,
                                 prepare_weights, quantize_weights)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_nibbles_pack_low_first_and_int4_is_twos_complement():
    codes = torch.tensor([[1, 2, 15, 8]])
    packed = quant4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert quant4.unpack_nibbles(packed).tolist() == codes.tolist()
    assert quant4.int4_values(packed).tolist() == [[1, 2, -1, -8]]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_int4_quantizer_is_exact_on_representable_weights(symmetric, group):
    g = _gen(1)
    N, K = 16, 256
    scale = (torch.rand(N, K // group, generator=g) + 0.5).bfloat16()
    q = torch.randint(-7 if symmetric else -8, 8, (N, K), generator=g)
    # each group holds its extremes, so the quantizer recovers this very scale
    q[:, ::group] = 7 if symmetric else -8
    q[:, 1::group] = -7 if symmetric else 7
    zp = torch.randint(0, 16, (N, K // group), generator=g)
    if symmetric:
        w = q.float() * quant4.expand_groups(scale.float(), K)
    else:
        u = q + 8
        w = (u - quant4.expand_groups(zp, K)).float() * quant4.expand_groups(scale.float(), K)
    packed, s, z = quant4.quantize_int4(w, group, symmetric)
    back = quant4.dequantize_int4(packed, s, z)
    assert (z is None) == symmetric and s.dtype == torch.bfloat16 and packed.shape == (N, K // 2)
    assert torch.equal(quant4.int4_values(packed), q) and torch.equal(s, scale.t())  # q and scale recovered
    # dequantized as the kernels compute it: q * scale rounded to bf16 (symmetric); with zero
    # terms q * scale + zero rounded once, the zero term itself rounded to bf16 before (|w| < 24,
    # |zero| < 12: half a bf16 step of each, 1/16 + 1/32)
    if symmetric:
        torch.testing.assert_close(back, w.bfloat16().float(), rtol=0, atol=0)
    else:
        torch.testing.assert_close(back, w, rtol=0, atol=2 ** -4 + 2 ** -5)


def test_int4_quantizer_error_is_small_on_random_weights():
    w = torch.randn(2, 64, 512, generator=_gen(2))
    for symmetric in (True, False):
        packed, s, z = quant4.quantize_int4(w, 128, symmetric)
        err = ((quant4.dequantize_int4(packed, s, z) - w).norm() / w.norm()).item()
        assert 0.01 < err < 0.15, (symmetric, err)


def test_mxfp4_values_scales_and_rounding():
    # one block of 32: the E2M1 grid at exponent 2^-1 (e8m0 126), exactly representable
    codes = torch.arange(32) % 16
    w = torch.tensor([E2M1[c] for c in codes]) * 0.5
    w[7] = 6 * 0.5  # the block's amax picks the exponent: floor(log2(3)) - 2 = -1
    packed, e = quant4.quantize_mxfp4(w[None])
    assert e.tolist() == [[126]]
    torch.testing.assert_close(quant4.dequantize_mxfp4(packed, e)[0], w)
    # ties go to the even code; past 6 it saturates (exponent 0 here: amax 6)
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] + [0.0] * 23)
    packed, e = quant4.quantize_mxfp4(x[None])
    assert e.tolist() == [[127]]
    assert quant4.dequantize_mxfp4(packed, e)[0, :9].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0]
    big = torch.full((1, 32), 7.9)  # amax 7.9: exponent floor(log2 7.9) - 2 = 0, 7.9 saturates to 6
    assert quant4.dequantize_mxfp4(*quant4.quantize_mxfp4(big)).unique().tolist() == [6.0]
    zeros = torch.zeros(1, 32)
    assert quant4.dequantize_mxfp4(*quant4.quantize_mxfp4(zeros)).abs().sum() == 0


def test_mxfp4_quantizer_error_is_small_on_random_weights():
    w = torch.randn(2, 64, 256, generator=_gen(3))
    back = quant4.dequantize_mxfp4(*quant4.quantize_mxfp4(w))
    err = ((back - w).norm() / w.norm()).item()
    assert 0.02 < err < 0.2, err


# ---- importers: synthetic checkpoints built from a known canonical form ---------------------

def _int4_problem(E=2, N=32, K=256, group=128, seed=4):
    g = _gen(seed)
    u = torch.randint(0, 16, (E, N, K), generator=g)          # unsigned nibbles, [E, N, K]
    zp = torch.randint(0, 16, (E, N, K // group), generator=g)
    scale = (torch.rand(E, N, K // group, generator=g) + 0.5).half()
    dense = (u - quant4.expand_groups(zp, K)).float() * quant4.expand_groups(scale.float(), K)
    return u, zp, scale, dense


def _pack_int32(vals: torch.Tensor) -> torch.Tensor:
    """[..., C, 8] nibbles -> int32 [..., C], nibble i at bits 4i."""
    out = torch.zeros(vals.shape[:-1], dtype=torch.int64)
    for i in range(8):
        out |= vals[..., i].long() << (4 * i)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def test_awq_importer_round_trip():
    u, zp, scale, dense = _int4_problem()
    E, N, K = u.shape
    order = list(AWQ_PACK_ORDER)

    def awq_pack(x):  # [E, R, N] -> [E, R, N/8], nibble i holds column 8c + order[i]
        return _pack_int32(x.reshape(*x.shape[:-1], x.shape[-1] // 8, 8)[..., order])
    qweight, qzeros = awq_pack(u.transpose(1, 2)), awq_pack(zp.transpose(1, 2))
    w, s, z = from_awq(qweight, qzeros, scale.transpose(1, 2).contiguous())
    assert w.shape == (E, N, K // 2) and s.shape == (E, 2, N) and z.dtype == torch.float16
    # the zero term (8 - zp) * scale is held in the scales' dtype: exact up to its rounding
    torch.testing.assert_close(quant4.dequantize_int4(w, s, z), dense, rtol=2e-3, atol=1e-2)
    # the nibble order is 0,4,1,5,2,6,3,7: column 1 sits in nibble 4
    one = torch.zeros(1, 32, 8, dtype=torch.int64)  # [E, K, N], one group of 32
    one[0, :, 1] = 5
    q, _, z = from_awq(awq_pack(one), torch.full((1, 1, 1), 0x88888888 - 2**32, dtype=torch.int32),
                       torch.ones(1, 1, 8, dtype=torch.float16))
    assert quant4.int4_values(q)[0, 1].tolist() == [5 - 8] * 32 and quant4.int4_values(q)[0, 0].tolist() == [-8] * 32
    assert z.abs().sum() == 0  # zero points 8: no zero term
    with pytest.raises(TypeError, match="qweight: got dtype torch.int64, expected torch.int32"):
        from_awq(qweight.long(), qzeros, scale.transpose(1, 2))
    with pytest.raises(ValueError, match=r"groups along K=256, expected K/g for g in \[128, 64, 32\]"):
        from_awq(qweight, qzeros[:, :1].repeat(1, 3, 1), scale.transpose(1, 2)[:, :1].repeat(1, 3, 1))


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_importer_round_trip(symmetric):
    u, zp, scale, dense = _int4_problem(seed=5)
    E, N, K = u.shape
    if symmetric:
        zp = torch.full_like(zp, 8)
        dense = (u - 8).float() * quant4.expand_groups(scale.float(), K)
    qweight = _pack_int32(u.transpose(1, 2).reshape(E, K // 8, 8, N).permute(0, 1, 3, 2))  # [E, K/8, N]
    qzeros = _pack_int32((zp.transpose(1, 2) - 1).clamp(min=0).reshape(E, K // 128, N // 8, 8))  # v1: zp - 1
    if not symmetric:
        zp = zp.clamp(min=1)  # the v1 format cannot store a zero point of 0
        dense = (u - quant4.expand_groups(zp, K)).float() * quant4.expand_groups(scale.float(), K)
    w, s, z = from_gptq(qweight, scale.transpose(1, 2).contiguous(), None if symmetric else qzeros)
    assert (z is None) == symmetric
    torch.testing.assert_close(quant4.dequantize_int4(w, s, z), dense, rtol=2e-3, atol=1e-2)
    plain = torch.arange(K) // 128
    from_gptq(qweight, scale.transpose(1, 2).contiguous(), g_idx=plain)
    with pytest.raises(ValueError, match="g_idx: got an act-order"):
        from_gptq(qweight, scale.transpose(1, 2).contiguous(), g_idx=plain.flip(0))
    with pytest.raises(ValueError, match="zero points past 15"):
        from_gptq(qweight, scale.transpose(1, 2).contiguous(), _pack_int32(torch.full((E, 2, N // 8, 8), 15)))


def test_compressed_tensors_importer_round_trip():
    u, _, scale, _ = _int4_problem(seed=6)
    E, N, K = u.shape
    dense = (u - 8).float() * quant4.expand_groups(scale.float(), K)
    packed = _pack_int32(u.reshape(E, N, K // 8, 8))
    w, s, z = from_compressed_tensors(packed, scale)
    assert z is None
    torch.testing.assert_close(quant4.dequantize_int4(w, s, z), dense, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match=r"weight_scale: got shape \(2, 16, 2\)"):
        from_compressed_tensors(packed, scale[:, :16])


def test_compressed_tensors_importer_zero_points():
    u, zp, scale, dense = _int4_problem(seed=8)  # dense = (u - zp) * scale
    E, N, K = u.shape
    packed = _pack_int32(u.reshape(E, N, K // 8, 8))
    # as compressed-tensors stores them: z + 8 (= zp), 8 rows of N per int32
    zp_packed = _pack_int32(zp.reshape(E, N // 8, 8, -1).transpose(2, 3))  # [E, N/8, K/g]
    for zero_points in (zp_packed, (zp - 8).to(torch.int8)):
        w, s, z = from_compressed_tensors(packed, scale, zero_points)
        assert z is not None and z.shape == s.shape == (E, K // 128, N)
        torch.testing.assert_close(quant4.dequantize_int4(w, s, z), dense, rtol=2e-3, atol=1e-2)
    # zero points of 8 (z = 0) are the symmetric checkpoint: no zero term left
    eights = _pack_int32(torch.full((E, N // 8, K // 128, 8), 8))
    assert from_compressed_tensors(packed, scale, eights)[2].abs().sum() == 0
    with pytest.raises(ValueError, match=r"weight_zero_point: got shape \(2, 32, 2\) \(torch.int32\), expected "
                                         r"\[2, 4, 2\]"):
        from_compressed_tensors(packed, scale, torch.zeros(E, N, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="weight_zero_point: got torch.float32, expected int32"):
        from_compressed_tensors(packed, scale, torch.zeros(E, N, 2))
    with pytest.raises(ValueError, match=r"from 9 to 9, expected signed INT4 values in \[-8, 7\]"):
        from_compressed_tensors(packed, scale, torch.full((E, N, 2), 9, dtype=torch.int8))


def test_gpt_oss_importer_deinterleaves_gate_and_up():
    g = _gen(7)
    E, I, H = 2, 64, 128
    codes13 = torch.randint(0, 16, (E, 2 * I, H), generator=g)
    e13 = torch.randint(119, 129, (E, 2 * I, H // 32), generator=g).to(torch.uint8)
    codes2 = torch.randint(0, 16, (E, H, I), generator=g)
    e2 = torch.randint(119, 129, (E, H, I // 32), generator=g).to(torch.uint8)
    lut = torch.tensor(E2M1)

    def dense(codes, e):  # independent decode: the LUT times 2^(e - 127) per 32
        return lut[codes] * torch.exp2(quant4.expand_groups(e.float() - 127, codes.shape[-1]))
    blocks13 = quant4.pack_nibbles(codes13).reshape(E, 2 * I, H // 32, 16)
    blocks2 = quant4.pack_nibbles(codes2).reshape(E, H, I // 32, 16)
    bias13 = torch.randn(E, 2 * I, generator=g).bfloat16()
    out = from_gpt_oss(blocks13, e13, blocks2, e2, bias13, torch.zeros(E, H, dtype=torch.bfloat16))
    gate, up = dense(codes13, e13)[:, 0::2], dense(codes13, e13)[:, 1::2]  # interleaved rows
    torch.testing.assert_close(quant4.dequantize_mxfp4(out["w13"], out["w13_scale"]), torch.cat([gate, up], 1))
    torch.testing.assert_close(quant4.dequantize_mxfp4(out["w2"], out["w2_scale"]), dense(codes2, e2))
    assert torch.equal(out["w13_bias"], torch.cat([bias13[:, 0::2], bias13[:, 1::2]], 1))
    p = prepare_weights(quant="w4a16_mxfp4", activation="swiglu_oai", **out)
    # the kernels' weights prepared, [E, ceil(K/128), N/16, 1024], in the placed layout; their
    # scales 2^(e - 127 + 126) in the hidden dtype, [E, K/32, N]
    assert p["w13"].shape == (E, 1, 2 * I // 16, 1024) and p["w13_scale"].dtype == torch.bfloat16
    assert p["w13_scale"].shape == (E, H // 32, 2 * I)
    torch.testing.assert_close(quant4.dequantize_mxfp4(quant4.unprepare(p["w13"], H, quant4.PLACED),
                                                       p["w13_scale"], placed=True), torch.cat([gate, up], 1))
    # W4A8 reads the fragment layout with the scales as they are; scales past 2 only it takes
    p8 = prepare_weights(quant="w4a8_mxfp4", activation="swiglu_oai", **out)
    torch.testing.assert_close(quant4.dequantize_mxfp4(quant4.unprepare(p8["w13"], H, "mxfp4"), p8["w13_scale"]),
                               torch.cat([gate, up], 1))
    big = dict(out, w2_scale=torch.full_like(out["w2_scale"], 129))
    prepare_weights(quant="w4a8_mxfp4", activation="swiglu_oai", **big)
    with pytest.raises(ValueError, match=r"w2_scale: got E8M0 exponents 2\^2 .. 2\^2, expected at most 2\^1"):
        prepare_weights(quant="w4a16_mxfp4", activation="swiglu_oai", **big)
    with pytest.raises(ValueError, match=r"gate_up_blocks/gate_up_scales: got \(2, 128, 4, 16\) and \(2, 128, 3\)"):
        from_gpt_oss(blocks13, e13[:, :, :3], blocks2, e2)


# ---- prepare and reference for the 4-bit modes ----------------------------------------------

def test_prepare_validates_four_bit_weights():
    g = _gen(8)
    E, H, I = 2, 256, 128
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    p = quantize_weights(w13, w2, quant="w4a16_int4", group_size=64, symmetric=False)
    assert p["w13"].dtype == torch.uint8 and p["w13_scale"].shape == (E, H // 64, 2 * I)
    assert p["w13"].shape == (E, H // 128, 2 * I // 16, 1024) and p["w2"].shape == (E, I // 128, H // 16, 1024)
    assert p["w13_zero"].shape == p["w13_scale"].shape
    kw = dict(quant="w4a16_int4", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    packed13 = quant4.unprepare(p["w13"], H, "int4")  # the checkpoint packing, validated as before
    packed2 = quant4.unprepare(p["w2"], I, "int4")
    with pytest.raises(TypeError, match="w13: got dtype torch.int8, expected torch.uint8"):
        prepare_weights(packed13.view(torch.int8), packed2, **kw)
    with pytest.raises(TypeError, match="w13_scale: got dtype torch.float32"):
        prepare_weights(packed13, packed2, **{**kw, "w13_scale": p["w13_scale"].float()})
    with pytest.raises(ValueError, match=r"w13_scale: got shape \(2, 3, 256\), expected one of"):
        prepare_weights(packed13, packed2, **{**kw, "w13_scale": p["w13_scale"][:, :3]})
    with pytest.raises(TypeError, match=r"w2_zero: got dtype torch.float32, expected torch.bfloat16"):
        prepare_weights(packed13, packed2, w2_zero=p["w2_zero"].float(), **kw)
    # prepared weights are checked as strictly: the dtype, and each shape against the other's sizes
    with pytest.raises(TypeError, match="w13_scale: got dtype torch.float32"):
        prepare_weights(p["w13"], p["w2"], **{**kw, "w13_scale": p["w13_scale"].float()})
    with pytest.raises(ValueError, match=r"w2: got shape \(2, 2, 16, 1024\), expected \(2, 1, 16, 1024\)"):
        prepare_weights(p["w13"], p["w2"].repeat(1, 2, 1, 1), **kw)
    with pytest.raises(ValueError, match=r"w2: got torch.uint8 \(2, 256, 64\), expected the prepared layout .* "
                                         r"\(both prepared, or both in the checkpoint packing \[E, N, K/2\]\)"):
        prepare_weights(p["w13"], packed2, **kw)
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_weights(w13[..., :192], w2[:, :192], quant="w4a16_int4")
    with pytest.raises(ValueError, match=r"group_size=16: expected one of \[128, 64, 32\]"):
        quantize_weights(w13, w2, quant="w4a16_int4", group_size=16)
    (q13, e13), (q2, e2) = quant4.quantize_mxfp4(w13), quant4.quantize_mxfp4(w2)  # E8M0, as stored
    kw = dict(quant="w4a16_mxfp4", w13_scale=e13)
    bad = e2.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(ValueError, match=r"w2_scale: got NaN \(E8M0 255\)"):
        prepare_weights(q13, q2, w2_scale=bad, **kw)
    with pytest.raises(ValueError, match="w13_zero: got zero points, expected None for quant='w4a16_mxfp4'"):
        prepare_weights(q13, q2, w2_scale=e2, w13_zero=p["w13_zero"], **kw)
    m = prepare_weights(q13, q2, w2_scale=e2, dtype=torch.float16, **kw)
    assert m["w2_scale"].dtype == torch.float16 and m["w2_scale"].shape == (E, I // 32, H)
    with pytest.raises(TypeError, match=r"w13_scale: got dtype torch.bfloat16, expected torch.uint8"):
        prepare_weights(q13, q2, w2_scale=e2, **{**kw, "w13_scale": m["w13_scale"].bfloat16()})  # prepared twice
    huge = e2.clone()
    huge[0, 0, 0] = 127 + 16
    with pytest.raises(ValueError, match=r"w2_scale: got E8M0 exponents .*2\^16, expected 2\^-24 .. 2\^15"):
        prepare_weights(q13, q2, w2_scale=huge, dtype=torch.float16, **{**kw, "quant": "w4a8_mxfp4"})
    assert prepare_weights(q13, q2, w2_scale=huge, **{**kw, "quant": "w4a8_mxfp4"})["w2_scale"].max() == 2.0 ** 16
    # w4a16_mxfp4's scales are stored times 2^126 (bfloat16) or 2^14 (float16): at most 2^1
    with pytest.raises(ValueError, match=r"w2_scale: got E8M0 exponents .*2\^16, expected 2\^-38 .. 2\^1 for float16"):
        prepare_weights(q13, q2, w2_scale=huge, dtype=torch.float16, **kw)
    with pytest.raises(ValueError, match=r"w2_scale: got E8M0 exponents .*2\^16, expected at most 2\^1 for bfloat16"):
        prepare_weights(q13, q2, w2_scale=huge, **kw)


@pytest.mark.parametrize("quant", ["w4a16_int4", "w4a16_mxfp4"])
def test_reference_dequantizes_as_the_format_says(quant):
    g = _gen(9)
    E, H, I, T, k = 4, 256, 128, 9, 2
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    p = quantize_weights(w13, w2, quant=quant, symmetric=False)
    extra = {n: p[n] for n in ("w13_zero", "w2_zero") if p.get(n) is not None}
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    wts = torch.rand(T, k, generator=g)
    out = reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant=quant, w13_scale=p["w13_scale"],
                              w2_scale=p["w2_scale"], **extra)
    fmt = quant4.prepared_layout(QuantMode.parse(quant).spec)

    def dequantized(w):
        zero = p.get(f"{w}_zero")
        return torch.stack([reference.dequantize_weight(p[w][e], fmt, p[f"{w}_scale"][e],
                                                        None if zero is None else zero[e], K=H if w == "w13" else I)
                            for e in range(E)])
    dense = reference.fused_moe(x, dequantized("w13"), dequantized("w2"), wts, ids)
    torch.testing.assert_close(out, dense)
    exact = reference.fused_moe(x, w13, w2, wts, ids)
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0.005 < err < 0.25, err  # 4-bit noise: present, and bounded


def test_fused_moe_validates_int4_arguments_on_the_host():
    """CPU: every check before a launch, from the mode table (no GPU needed to fail)."""
    from moe_kernels import fused_moe
    g = _gen(10)
    E, H, I, T, k = 4, 256, 128, 3, 2
    p = quantize_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g),
                         quant="w4a16_int4", group_size=64)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.zeros(T, k, dtype=torch.int32)
    wts = torch.ones(T, k)
    kw = dict(quant="w4a16_int4", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    with pytest.raises(ValueError, match="hidden_states: got device cpu, expected a CUDA tensor"):
        fused_moe(x, p["w13"], p["w2"], wts, ids, **kw)  # valid: only the device is wrong
    with pytest.raises(TypeError, match="w13: got dtype torch.bfloat16, expected torch.uint8"):
        fused_moe(x, p["w13"].bfloat16(), p["w2"], wts, ids, **kw)
    with pytest.raises(ValueError, match=r"w13: got shape \(4, 1, 16, 1024\).*dimension 1 must be 2"):
        fused_moe(x, p["w13"][:, :1].contiguous(), p["w2"], wts, ids, **kw)  # K = H = 256: two K slices
    with pytest.raises(ValueError, match=r"w2: got shape \(4, 1, 16, 1024\).*dimension 1 must be 2"):
        fused_moe(x, p["w13"].repeat(1, 1, 2, 1), p["w2"], wts, ids, **kw)  # w13 says I = 256
    with pytest.raises(ValueError, match=r"w2: got shape \(4, 256, 64\) \(4-bit weights in the checkpoint packing"
                                         r".*expected the prepared layout \(4, 1, 16, 1024\).*prepare_weights"):
        fused_moe(x, p["w13"], quant4.unprepare(p["w2"], I, "int4"), wts, ids, **kw)
    with pytest.raises(TypeError, match="w13_scale: got dtype torch.float16, expected torch.bfloat16"):
        fused_moe(x, p["w13"], p["w2"], wts, ids, **{**kw, "w13_scale": p["w13_scale"].half()})
    q = quantize_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g),
                         quant="w4a16_int4", group_size=128)
    with pytest.raises(ValueError, match="w2_scale: got groups of 128 along K, expected groups of 64"):
        fused_moe(x, p["w13"], p["w2"], wts, ids, **{**kw, "w2_scale": q["w2_scale"]})


def test_flashinfer_named_interleave_helpers():
    from moe_kernels.prepare import (interleave_moe_scales_for_sm90_mixed_gemm,
                                     interleave_moe_weights_for_sm90_mixed_gemm)
    g = _gen(11)
    E, N, K = 2, 64, 256
    q, e = quant4.quantize_mxfp4(torch.randn(E, N, K, generator=g))
    prepared = interleave_moe_weights_for_sm90_mixed_gemm(q, "fp4")  # w4a16_mxfp4: the placed layout
    assert torch.equal(prepared, quant4.place_e2m1(quant4.to_fragment_layout(q, shuffle=False)))
    assert torch.equal(interleave_moe_weights_for_sm90_mixed_gemm(prepared, "fp4"), prepared)  # prepared once
    s = interleave_moe_scales_for_sm90_mixed_gemm(e)
    assert s.dtype == torch.bfloat16 and s.shape == (E, K // 32, N)
    assert torch.equal(s, quant4.mxfp4_scales(e, torch.bfloat16, placed=True))
    torch.testing.assert_close(quant4.dequantize_mxfp4(q, s, placed=True), quant4.dequantize_mxfp4(q, e))
    s16 = interleave_moe_scales_for_sm90_mixed_gemm(e, dtype=torch.float16)
    torch.testing.assert_close(quant4.dequantize_mxfp4(q, s16, placed=True), quant4.dequantize_mxfp4(q, e))
    s8 = interleave_moe_scales_for_sm90_mixed_gemm(e, quant_type="fp4_fp8")  # w4a8_mxfp4: as they are
    torch.testing.assert_close(quant4.dequantize_mxfp4(q, s8), quant4.dequantize_mxfp4(q, e))
    assert torch.equal(interleave_moe_weights_for_sm90_mixed_gemm(q, "fp4_fp8"),  # W4A8: the fragment layout
                       quant4.to_fragment_layout(q, shuffle=False))
    with pytest.raises(ValueError, match=r"quant_type: got 'int4', expected 'fp4' or 'fp4_fp8'"):
        interleave_moe_scales_for_sm90_mixed_gemm(e, quant_type="int4")
    q128 = quant4.pack_nibbles(torch.randint(0, 16, (E, 128, K), generator=g))
    assert torch.equal(interleave_moe_weights_for_sm90_mixed_gemm(q128, "int4"),  # CUTLASS's value shuffle
                       quant4.to_fragment_layout(q128, shuffle=True))
    with pytest.raises(ValueError, match=r"quant_type: got 'fp8', expected one of \['fp4', 'fp4_fp8', 'int4'\]"):
        interleave_moe_weights_for_sm90_mixed_gemm(q, "fp8")
    with pytest.raises(TypeError, match=r"weight: got dtype torch.int8, expected torch.uint8"):
        interleave_moe_weights_for_sm90_mixed_gemm(q.view(torch.int8))
    with pytest.raises(ValueError, match=r"weight: got shape \(64, 128\), expected a 3-D tensor"):
        interleave_moe_weights_for_sm90_mixed_gemm(q[0])
    with pytest.raises(ValueError, match=r"weight: got N=64 rows and K=256 .* multiples of 128 for quant_type='int4'"):
        interleave_moe_weights_for_sm90_mixed_gemm(q, "int4")
    with pytest.raises(ValueError, match=r"weight: got N=48 rows and K=256 .* multiples of 32 for quant_type='fp4'"):
        interleave_moe_weights_for_sm90_mixed_gemm(q[:, :48])
    with pytest.raises(ValueError, match=r"group_size: got 16, expected 32"):
        interleave_moe_scales_for_sm90_mixed_gemm(e, group_size=16)
    with pytest.raises(TypeError, match=r"scales: got dtype torch.float32, expected torch.uint8"):
        interleave_moe_scales_for_sm90_mixed_gemm(e.float())
    bad = e.clone()
    bad[1, 2, 3] = 255
    with pytest.raises(ValueError, match=r"scales: got NaN \(E8M0 255\)"):
        interleave_moe_scales_for_sm90_mixed_gemm(bad)
