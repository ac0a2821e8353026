"""4-bit weights prepared once into the fragment layout: prepare_weights, the reference, the host
checks of fused_moe's weights and the FlashInfer-named helper (CPU)."""
import pytest
import torch

from moe_kernels import Activation, QuantMode, problem, quant4, reference
from moe_kernels.prepare import interleave_moe_weights_for_sm90_mixed_gemm, prepare_weights, quantize_weights


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _checkpoint(quant, E, H, I, seed=0):
    """Random 4-bit weights as checkpoints hold them (w13 [E, 2I, H/2], w2 [E, H, I/2] packed)
    with prepare_weights' scale arguments, and each one's dequantized [E, N, K] from that packing."""
    g = _gen(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    if QuantMode.parse(quant).spec.weight == "int4":
        (q13, s13, z13), (q2, s2, z2) = (quant4.quantize_int4(w, 128, symmetric=False) for w in (w13, w2))
        kw = dict(w13_scale=s13, w2_scale=s2, w13_zero=z13, w2_zero=z2)
        dense = [quant4.dequantize_int4(q13, s13, z13), quant4.dequantize_int4(q2, s2, z2)]
    else:
        (q13, e13), (q2, e2) = quant4.quantize_mxfp4(w13), quant4.quantize_mxfp4(w2)
        kw = dict(w13_scale=e13, w2_scale=e2)
        dense = [quant4.dequantize_mxfp4(q13, e13), quant4.dequantize_mxfp4(q2, e2)]
    return q13, q2, kw, dense


# K not a multiple of 128 where the mode's alignment allows it: gpt-oss's 2880 (MXFP4 takes
# multiples of 32); INT4 modes take multiples of 128, so K = 384 (three K slices) there.
CASES = [("w4a16_int4", 2, 384, 128), ("w4a8_int4", 1, 128, 384), ("w4a16_mxfp4", 1, 2880, 96),
         ("w4a16_mxfp4", 2, 160, 32), ("w4a8_mxfp4", 1, 96, 160)]


@pytest.mark.parametrize("quant,E,H,I", CASES)
def test_prepared_weights_dequantize_exactly_as_the_checkpoint(quant, E, H, I):
    q13, q2, kw, dense = _checkpoint(quant, E, H, I)
    fmt = quant4.prepared_layout(QuantMode.parse(quant).spec)  # w4a16_mxfp4: the placed layout
    p = prepare_weights(q13, q2, quant=quant, **kw)
    assert p["w13"].shape == (E, -(-H // 128), 2 * I // 16, 1024) == quant4.prepared_shape(E, 2 * I, H)
    assert p["w2"].shape == (E, -(-I // 128), H // 16, 1024)
    for name, K, want in (("w13", H, dense[0]), ("w2", I, dense[1])):
        zero = p.get(f"{name}_zero")
        got = torch.stack([reference.dequantize_weight(p[name][e], fmt, p[f"{name}_scale"][e],
                                                       None if zero is None else zero[e], K=K) for e in range(E)])
        assert torch.equal(got, want)  # MXFP4: E8M0 exponents as the kernels' bfloat16 powers of two, exact
        assert torch.equal(quant4.unprepare(p[name], K, fmt), q13 if name == "w13" else q2)


@pytest.mark.parametrize("quant,E,H,I", CASES)
def test_padding_bytes_are_zero(quant, E, H, I):
    q13, q2, kw, _ = _checkpoint(quant, E, H, I, seed=1)
    p = prepare_weights(q13, q2, quant=quant, **kw)
    shuffle = QuantMode.parse(quant).spec.weight_format.fragment_shuffle
    for name, K in (("w13", H), ("w2", I)):
        full = quant4.from_fragment_layout(p[name], shuffle)  # [E, N, 128 * ceil(K/128) / 2]
        assert full.shape[-1] == 64 * -(-K // 128)
        assert not full[..., K // 2:].any()


@pytest.mark.parametrize("quant", ["w4a16_int4", "w4a16_mxfp4"])
def test_prepare_weights_takes_prepared_weights_as_they_are(quant):
    E, H, I = 2, 256, 128
    q13, q2, kw, _ = _checkpoint(quant, E, H, I, seed=2)
    p = prepare_weights(q13, q2, quant=quant, **kw)
    again = prepare_weights(p["w13"], p["w2"], quant=quant, **kw)
    for name in ("w13", "w2"):  # not repacked a second time: the very tensors
        assert again[name].data_ptr() == p[name].data_ptr() and torch.equal(again[name], p[name])
    q = quantize_weights(torch.randn(E, 2 * I, H, generator=_gen(3)), torch.randn(E, H, I, generator=_gen(4)),
                         quant=quant)
    assert quant4.is_prepared(q["w13"]) and q["w2"].shape == (E, 1, H // 16, 1024)
    if quant == "w4a16_int4":  # its scales are taken as returned too (MXFP4's E8M0 are converted once)
        assert prepare_weights(q["w13"], q["w2"], quant=quant, w13_scale=q["w13_scale"],
                               w2_scale=q["w2_scale"])["w13"].data_ptr() == q["w13"].data_ptr()


def test_prepare_weights_takes_prepared_weights_of_non_gated_and_padded_sizes():
    E, H, I = 2, 2880, 64  # gpt-oss's H: w13's K padded to 2944; non-gated: w13's N is I
    g = _gen(5)
    (q13, e13), (q2, e2) = quant4.quantize_mxfp4(torch.randn(E, I, H, generator=g)), \
        quant4.quantize_mxfp4(torch.randn(E, H, I, generator=g))
    kw = dict(quant="w4a16_mxfp4", activation="silu", w13_scale=e13, w2_scale=e2)
    p = prepare_weights(q13, q2, **kw)
    assert p["w13"].shape == (E, 23, I // 16, 1024) and p["w2"].shape == (E, 1, H // 16, 1024)
    assert prepare_weights(p["w13"], p["w2"], **kw)["w2"].data_ptr() == p["w2"].data_ptr()
    # gated, the same tensors read as I = 32 (w13's N / 2): K = 32 and K = 64 are both one padded K
    # slice of w2, and the scales' K/32 tell them apart
    with pytest.raises(ValueError, match=r"w2_scale: got shape \(2, 2880, 2\), expected one of \[\(2, 2880, 1\)\]"):
        prepare_weights(p["w13"], p["w2"], **{**kw, "activation": "swiglu"})


def test_interleave_helper_gives_what_prepare_weights_gives():
    for quant, quant_type, I in (("w4a16_int4", "int4", 128), ("w4a16_mxfp4", "fp4", 96),
                                 ("w4a8_mxfp4", "fp4_fp8", 96)):
        E, H = 2, 384 if quant_type == "int4" else 2880
        q13, q2, kw, _ = _checkpoint(quant, E, H, I, seed=6)
        p = prepare_weights(q13, q2, quant=quant, **kw)
        h13, h2 = (interleave_moe_weights_for_sm90_mixed_gemm(q, quant_type) for q in (q13, q2))
        assert torch.equal(h13, p["w13"]) and torch.equal(h2, p["w2"]), quant_type
        again = prepare_weights(h13, h2, quant=quant, **kw)  # the helper's output is prepared: taken as is
        assert again["w13"].data_ptr() == h13.data_ptr() and again["w2"].data_ptr() == h2.data_ptr()


def _host_check(quant, x, w13, w2, activation="swiglu"):
    spec = QuantMode.parse(quant).spec
    return problem.expert_weight_sizes(spec, Activation.parse(activation).gated, x.shape[1], w13, w2,
                                       dtype=x.dtype, device=x.device)


@pytest.mark.parametrize("quant", ["w4a16_int4", "w4a8_mxfp4"])
def test_fused_moe_weight_check_refuses_the_checkpoint_packing(quant):
    """What Problem (fused_moe, its torch op and fake implementation) checks of the weights: the
    prepared 4-D shapes, and 3-D checkpoint-packed weights refused with the way to prepare them."""
    E, H, I = 2, 256, 128
    q13, q2, kw, _ = _checkpoint(quant, E, H, I, seed=7)
    p = prepare_weights(q13, q2, quant=quant, **kw)
    x = torch.zeros(3, H, dtype=torch.bfloat16)
    assert _host_check(quant, x, p["w13"], p["w2"]) == (E, I, 2 * I)
    assert _host_check(quant, x, p["w13"][:, :, :I // 16].contiguous(), p["w2"], "silu") == (E, I, I)
    for w13, w2, name, got, want in ((q13, p["w2"], "w13", (E, 2 * I, H // 2), (E, 2, 16, 1024)),
                                     (p["w13"], q2, "w2", (E, H, I // 2), (E, 1, 16, 1024))):
        with pytest.raises(ValueError, match=rf"{name}: got shape \({', '.join(map(str, got))}\) \(4-bit weights in "
                                             rf"the checkpoint packing \[E, N, K/2\]\), expected the prepared layout "
                                             rf"\({', '.join(map(str, want))}\) = \[E, ceil\(K/128\), N/16, 1024\]: "
                                             r"pass the weights through moe_kernels.prepare.prepare_weights"):
            _host_check(quant, x, w13, w2)
    with pytest.raises(ValueError, match=r"w2: got shape \(2, 2, 16, 1024\), expected shape \(2, 1, 16, 1024\)"):
        _host_check(quant, x, p["w13"], p["w2"].repeat(1, 2, 1, 1))
    with pytest.raises(ValueError, match=r"w13: got shape \(2, 2, 16, 1024\), expected shape \(2, 3, 16, 1024\)"):
        _host_check(quant, torch.zeros(3, 384, dtype=torch.bfloat16), p["w13"], p["w2"])
    with pytest.raises(TypeError, match="w13: got dtype torch.bfloat16, expected torch.uint8"):
        _host_check(quant, x, p["w13"].bfloat16(), p["w2"])


def test_reference_refuses_the_checkpoint_packing():
    E, H, I, T = 2, 256, 128, 3
    q13, q2, kw, _ = _checkpoint("w4a16_int4", E, H, I, seed=8)
    p = prepare_weights(q13, q2, quant="w4a16_int4", **kw)
    x = torch.randn(T, H, generator=_gen(9))
    ids, wts = torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1)
    scales = {n: p[n] for n in ("w13_scale", "w2_scale", "w13_zero", "w2_zero")}
    with pytest.raises(ValueError, match=r"w13: got torch.uint8 \(2, 256, 128\), expected int4 weights in the "
                                         r"prepared layout .*moe_kernels.prepare.prepare_weights"):
        reference.fused_moe(x, q13, p["w2"], wts, ids, quant="w4a16_int4", **scales)
    with pytest.raises(ValueError, match=r"K: got None, expected the unpadded K"):
        reference.dequantize_weight(p["w13"][0], "int4", p["w13_scale"][0])
    with pytest.raises(ValueError, match=r"K: got 384, expected an even K with ceil\(K/128\) = 2"):
        quant4.unprepare(p["w13"], 384, "int4")
