"""Problem generators and checks shared by the GPU tests."""
import torch

from moe_kernels import reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
          "fp8_block": torch.bfloat16, "w4a16_int4": torch.bfloat16, "w4a16_mxfp4": torch.bfloat16,
          "w4a8_int4": torch.bfloat16, "w4a8_mxfp4": torch.bfloat16}
# ||out - ref|| / ||ref|| against the float32 reference; the kernels round GEMM1's output,
# the activation and GEMM2's output to 16 bits, the reference rounds nothing. For fp8 the
# reference quantizes where the kernels do; rounding GEMM1's output first moves some of
# the activation's E4M3 roundings by one step.
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp8": 5e-2, "fp8_block": 5e-2, "w4a16_int4": 2e-2,
             "w4a16_mxfp4": 2e-2, "w4a8_int4": 5e-2, "w4a8_mxfp4": 5e-2}
W4A16 = ("w4a16_int4", "w4a16_mxfp4")
W4 = W4A16 + ("w4a8_int4", "w4a8_mxfp4")  # 4-bit weights, 16-bit or E4M3 tokens


def make_problem(T, E, k, H, I, *, dtype="bf16", gated=True, bias=False, ids_dtype=torch.int32,
                 device="cuda", seed=None, ids=None, global_experts=None, granularity="channel",
                 act_dtype=None, group=128, symmetric=True):
    """Fresh random inputs; weights scaled so every stage stays O(1). act_dtype ("bf16" or
    "fp16"): the FP8 modes' hidden states, biases and output type (default bf16)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    assert act_dtype is None or dtype in ("fp8", "fp8_block") + W4, "act_dtype is for the quantized modes"
    dt = DTYPES[act_dtype or dtype]
    n1 = 2 * I if gated else I
    ge = global_experts or E

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    p = {
        "hidden_states": randn(T, H),
        "w13": randn(E, n1, H, scale=H ** -0.5),
        "w2": randn(E, H, I, scale=I ** -0.5),
    }
    if ids is None:
        # k distinct experts per token, drawn uniformly
        ids = torch.rand(T, ge, generator=g).argsort(dim=1)[:, :k]
    p["topk_ids"] = ids.to(device=device, dtype=ids_dtype)
    w = torch.rand(T, k, generator=g) + 0.1
    p["topk_weights"] = (w / w.sum(dim=1, keepdim=True)).to(device=device, dtype=torch.float32)
    if bias:
        p["w13_bias"] = randn(E, n1, scale=0.5)
        p["w2_bias"] = randn(E, H, scale=0.5)
    if dtype in W4:  # INT4 in groups of `group` (symmetric: GPTQ-like; else AWQ-like zero terms), or MXFP4
        from moe_kernels.prepare import quantize_weights
        q = quantize_weights(p["w13"], p["w2"], quant=dtype, group_size=group, scale_dtype=dt,
                             activation="swiglu" if gated else "silu", symmetric=symmetric)
        p.update(w13=q["w13"], w2=q["w2"], w13_scale=q["w13_scale"], w2_scale=q["w2_scale"], quant=dtype)
        if q.get("w13_zero") is not None:
            p.update(w13_zero=q["w13_zero"], w2_zero=q["w2_zero"])
    if dtype in ("fp8", "fp8_block"):  # p["quant"]: the mode, passed to fused_moe and reference
        from moe_kernels.prepare import quantize_weights
        q = quantize_weights(p["w13"], p["w2"], quant=dtype,
                             granularity=granularity if dtype == "fp8" else None,
                             activation="swiglu" if gated else "silu")
        p.update(w13=q["w13"], w2=q["w2"], w13_scale=q["w13_scale"], w2_scale=q["w2_scale"],
                 quant=dtype)
    return p


def fill_w13_rows(p, rows, byte):
    """Expert 0's w13 rows `rows` of a 4-bit problem set to `byte` in every byte of the checkpoint
    packing (both nibbles one code), then prepared again: p["w13"] is in the prepared layout."""
    from moe_kernels import QuantMode, quant4
    fmt = quant4.prepared_layout(QuantMode.parse(p["quant"]).spec)
    w13 = quant4.unprepare(p["w13"], p["hidden_states"].shape[1], fmt)
    w13[0, rows] = byte
    p["w13"] = quant4.prepare_packed(w13, fmt)


SCALES = ("w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_zero", "w2_zero")


def scale_kwargs(p):
    return {n: p[n] for n in SCALES if p.get(n) is not None}


def rel_error(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"{bad} of {out.numel()} outputs are not finite (unwritten or overflowed)"
    num = (out.float() - ref.float()).norm().item()
    den = ref.float().norm().item()
    return num / den if den > 0 else num


def worst_row_error(out, ref):
    """The largest relative error of one row: catches a few wrong rows that the whole tensor's
    error would average away."""
    num = (out.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1).clamp_min(1e-6)
    return (num / den).max().item()


def poisoned_out(p):
    return torch.full_like(p["hidden_states"], float("nan"))


def reference_out(p, **kw):
    return reference.fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"],
                               p["topk_ids"], w13_bias=p.get("w13_bias"),
                               w2_bias=p.get("w2_bias"), quant=p.get("quant"), **scale_kwargs(p), **kw)
