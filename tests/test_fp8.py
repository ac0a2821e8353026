"""FP8 numerics, weight preparation and the FP8 reference (CPU; the kernels come later)."""
import pytest
import torch

from moe_kernels import fp8, reference
from moe_kernels.prepare import prepare_weights, quantize_weights


def test_saturates_instead_of_overflowing():
    q = fp8.quantize(torch.tensor([1000.0, -1000.0, 1.0, 0.0, 448.0]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 1.0, 0.0, 448.0]
    assert torch.isfinite(q.float()).all()


def test_per_token_round_trip_and_zero_rows():
    x = torch.randn(6, 200) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0
    q, s = fp8.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert s[2].item() == 1.0 and torch.all(q[2].float() == 0)
    back = fp8.dequantize(q, s)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.all((back - x).abs() <= amax / 16 + 1e-30)   # 3 mantissa bits
    torch.testing.assert_close(back.abs().amax(dim=1), x.abs().amax(dim=1))  # amax maps to 448 exactly


def test_per_token_group_covers_a_ragged_tail():
    x = torch.randn(3, 300)
    q, s = fp8.quantize_per_token_group(x)
    assert s.shape == (3, 3)
    back = fp8.dequantize(q, fp8.expand_groups(s, 300))
    assert (back - x).abs().max() <= x.abs().max() / 16


@pytest.mark.parametrize("gran,shape", [("tensor", (2,)), ("channel", (2, 300)), ("block", (2, 3, 2))])
def test_weight_quantization(gran, shape):
    w = torch.randn(2, 300, 200)
    q, s = fp8.quantize_weight(w, gran)
    assert s.shape == shape and q.shape == w.shape
    back = q.float() * fp8.weight_scale_full(s, 300, 200)
    assert (back - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize_weight(w, "row")


def fp8_problem(E=3, H=256, I=128, granularity=None, quant="fp8"):
    w13 = torch.randn(E, 2 * I, H) * H ** -0.5
    w2 = torch.randn(E, H, I) * I ** -0.5
    return w13, w2, quantize_weights(w13, w2, quant=quant, granularity=granularity)


def test_prepare_fp8_checkpoint_validation():
    _, _, p = fp8_problem()
    q13, q2, s13, s2 = p["w13"], p["w2"], p["w13_scale"], p["w2_scale"]
    ok = prepare_weights(q13, q2, quant="fp8", w13_scale=s13[:, :, None], w2_scale=s2)
    assert ok["w13_scale"].shape == (3, 256)  # [E, N, 1] accepted as [E, N]
    assert prepare_weights(q13, q2, quant="fp8", w13_scale=s13[:, 0].contiguous(),
                           w2_scale=s2[:, 0].contiguous())["w13_scale"].shape == (3,)
    with pytest.raises(TypeError, match=r"w13: got dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        prepare_weights(q13.bfloat16(), q2, quant="fp8", w13_scale=s13, w2_scale=s2)
    with pytest.raises(TypeError, match=r"w2_scale: got NoneType, expected a float32"):
        prepare_weights(q13, q2, quant="fp8", w13_scale=s13)
    with pytest.raises(ValueError, match=r"w13_scale: got shape \(3, 255\), expected one of"):
        prepare_weights(q13, q2, quant="fp8", w13_scale=s13[:, :255], w2_scale=s2)
    with pytest.raises(TypeError, match="w2_scale: got dtype torch.float16"):
        prepare_weights(q13, q2, quant="fp8", w13_scale=s13, w2_scale=s2.half())
    bad = s2.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="w2_scale: got non-positive"):
        prepare_weights(q13, q2, quant="fp8", w13_scale=s13, w2_scale=bad)
    with pytest.raises(ValueError, match="expected none for quant='bf16'"):
        prepare_weights(q13.bfloat16(), q2.bfloat16(), w13_scale=s13)


def test_prepare_fp8_biases_in_either_16_bit_type():
    # The biases take the type of the hidden states the layer will get: bf16 or fp16, both the same.
    _, _, p = fp8_problem()
    kw = dict(quant="fp8", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    for dt in (torch.bfloat16, torch.float16):
        ok = prepare_weights(p["w13"], p["w2"], w13_bias=torch.zeros(3, 256, dtype=dt),
                             w2_bias=torch.zeros(3, 256, dtype=dt), **kw)
        assert ok["w13_bias"].dtype == ok["w2_bias"].dtype == dt
    with pytest.raises(TypeError, match=r"w2_bias: got dtype torch.bfloat16, expected torch.float16"):
        prepare_weights(p["w13"], p["w2"], w13_bias=torch.zeros(3, 256, dtype=torch.float16),
                        w2_bias=torch.zeros(3, 256, dtype=torch.bfloat16), **kw)
    with pytest.raises(TypeError, match=r"w13_bias: got dtype torch.float32, expected torch.bfloat16 or torch.float16"):
        prepare_weights(p["w13"], p["w2"], w13_bias=torch.zeros(3, 256), **kw)


def test_prepare_fp8_static_activation_scales():
    # One scale, or one per expert (a checkpoint's input_scale) reduced to the max.
    _, _, p = fp8_problem()
    w = dict(w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    ok = prepare_weights(p["w13"], p["w2"], quant="fp8", a13_scale=torch.tensor([0.5, 2.0, 1.0]),
                         a2_scale=torch.tensor([0.25]), **w)
    assert ok["a13_scale"].tolist() == [2.0] and ok["a2_scale"].tolist() == [0.25]
    assert prepare_weights(p["w13"], p["w2"], quant="fp8", **w)["a13_scale"] is None  # dynamic
    for bad, exc, match in [(torch.tensor([1.0, 0.0, 1.0]), ValueError,
                             r"a13_scale: got 1 non-positive or non-finite value\(s\), first 0.0, expected"),
                            (torch.tensor([float("nan")]), ValueError, "a13_scale: got 1 non-positive.*first nan"),
                            (torch.ones(2), ValueError, r"a13_scale: got shape \(2,\), expected one element"),
                            (torch.ones(1, dtype=torch.float16), TypeError, "a13_scale: got torch.float16"),
                            (0.5, TypeError, "a13_scale: got float")]:
        with pytest.raises(exc, match=match):
            prepare_weights(p["w13"], p["w2"], quant="fp8", a13_scale=bad, **w)
    _, _, b = fp8_problem(quant="fp8_block")
    with pytest.raises(ValueError, match="a2_scale: got a static activation scale, expected None for quant='fp8_block'"):
        prepare_weights(b["w13"], b["w2"], quant="fp8_block", w13_scale=b["w13_scale"],
                        w2_scale=b["w2_scale"], a2_scale=torch.ones(1))
    with pytest.raises(ValueError, match="expected none for quant='bf16'"):
        prepare_weights(p["w13"].bfloat16(), p["w2"].bfloat16(), a13_scale=torch.ones(1))


def test_layer_takes_this_ranks_max_activation_scale():
    from moe_kernels import FusedMoE
    _, _, p = fp8_problem(E=4)
    layer = FusedMoE(4, 256, 128, quant="fp8", ep_rank=1, ep_size=2)
    layer.load_weights(p["w13"], p["w2"], w13_scale=p["w13_scale"], w2_scale=p["w2_scale"],
                       a13_scale=torch.tensor([1.0, 4.0, 3.0, 0.5]), a2_scale=torch.tensor([0.125]))
    assert layer.weights["a13_scale"].tolist() == [3.0]  # experts 2 and 3 are this rank's
    assert layer.weights["a2_scale"].tolist() == [0.125]
    assert layer.weights["w13"].shape[0] == 2


def test_prepare_fp8_block_validation():
    _, _, p = fp8_problem(H=384, I=128, quant="fp8_block")
    assert p["w13_scale"].shape == (3, 2, 3) and p["w2_scale"].shape == (3, 3, 1)
    with pytest.raises(ValueError, match=r"w13_scale: got shape \(3, 256\), expected one of \[\(3, 2, 3\)\]"):
        prepare_weights(p["w13"], p["w2"], quant="fp8_block", w13_scale=torch.ones(3, 256),
                        w2_scale=p["w2_scale"])
    # The mode's alignment, from the mode table: whole 128-wide scale blocks.
    with pytest.raises(ValueError, match=r"hidden_size=200, intermediate_size=136, expected both multiples of 128"):
        quantize_weights(torch.randn(3, 272, 200), torch.randn(3, 200, 136), quant="fp8_block")
    with pytest.raises(ValueError, match="fp8_block is always 'block'"):
        quantize_weights(torch.randn(1, 16, 8), torch.randn(1, 8, 8), quant="fp8_block", granularity="tensor")
    with pytest.raises(ValueError, match="makes fp8, fp8_block, int4 or mxfp4 weights"):
        quantize_weights(torch.randn(1, 16, 8), torch.randn(1, 8, 8), quant="bf16")


@pytest.mark.parametrize("quant,gran", [("fp8", "tensor"), ("fp8", "channel"), ("fp8_block", None)])
def test_fp8_reference_tracks_the_full_precision_one(quant, gran):
    torch.manual_seed(0)
    w13, w2, p = fp8_problem(E=4, H=256, I=128, granularity=gran, quant=quant)
    T, k = 33, 2
    x = torch.randn(T, 256)
    ids = torch.rand(T, 4).argsort(1)[:, :k]
    wts = torch.rand(T, k)
    exact = reference.fused_moe(x, w13, w2, wts, ids)
    q = reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant=quant,
                            w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    err = ((q - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 8e-2, err  # quantization noise: present, and small
    static = reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant=quant, w13_scale=p["w13_scale"],
                                 w2_scale=p["w2_scale"], a13_scale=x.abs().max() / 448,
                                 a2_scale=torch.tensor(0.05))
    assert ((static - exact).norm() / exact.norm()).item() < 0.15
    with pytest.raises(ValueError, match="w13_scale and w2_scale are required"):
        reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant=quant)
