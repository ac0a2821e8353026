"""moe_kernels.integrations.transformers: the "moe_kernels" experts backend for Hugging Face
transformers.

CPU tests: registration; for each MoE family, a tiny model's experts module run eagerly
against moe_kernels.reference on the mapped layout (the layout and the activation); whole
models with the core forward replaced by moe_kernels.reference (dispatch, routing, the cache
on the module and its invalidation); FP8 block-scaled experts against transformers' own
dequantization; the fallback and its one warning; a whole model under torch.compile reaching
the registered op (a reference kernel for it on the CPU); the transformers benchmark's
measurements on tiny models. GPU tests (marked gpu): tiny models with the kernels against
"eager", for prefill and greedy generation, under torch.compile, and in generate() with a
static cache and its compiled (CUDA-graph) decode steps.
"""
import argparse
import copy
import logging
import os
import subprocess
import sys

import pytest
import torch

hf = pytest.importorskip("transformers")
hf_moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(hf_moe, "ExpertsInterface"):
    pytest.skip("this transformers has no experts interface (transformers 5 has)", allow_module_level=True)

from helpers import rel_error  # noqa: E402

from moe_kernels import fp8, problem, reference  # noqa: E402
from moe_kernels.cli import bench_transformers  # noqa: E402
from moe_kernels.integrations import _common  # noqa: E402
from moe_kernels.integrations import transformers as backend  # noqa: E402
from moe_kernels.modes import QuantMode  # noqa: E402

BF16 = torch.bfloat16
TOL = {m: QuantMode.parse(m).spec.tolerance for m in ("bf16", "fp8_block")}
LOGGER = backend.__name__


# ---- tiny models of each family ----------------------------------------------------------

def _config(family, H, I, E, k, vocab, layers, positions):
    heads = 4
    common = dict(vocab_size=vocab, hidden_size=H, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=2, max_position_embeddings=positions, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return hf.Qwen3MoeConfig(**common, moe_intermediate_size=I, intermediate_size=2 * H, num_experts=E,
                                 num_experts_per_tok=k, head_dim=H // heads, decoder_sparse_step=1,
                                 mlp_only_layers=[], norm_topk_prob=True)
    if family == "qwen2_moe":
        return hf.Qwen2MoeConfig(**common, moe_intermediate_size=I, intermediate_size=2 * H, num_experts=E,
                                 num_experts_per_tok=k, shared_expert_intermediate_size=2 * H)
    if family == "mixtral":
        return hf.MixtralConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    if family == "deepseek_v3":  # MLA: one key/value head per attention head
        common["num_key_value_heads"] = heads
        return hf.DeepseekV3Config(**common, intermediate_size=2 * H, moe_intermediate_size=I, n_routed_experts=E,
                                   num_experts_per_tok=k, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gpt_oss":
        return hf.GptOssConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k,
                               head_dim=H // heads,
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2) +
                               ["sliding_attention"] * (layers % 2))
    if family == "llama4_text":
        return hf.Llama4TextConfig(**common, intermediate_size=I, intermediate_size_mlp=2 * H, num_local_experts=E,
                                   num_experts_per_tok=1, head_dim=H // heads, interleave_moe_layer_step=1)
    if family == "olmoe":
        return hf.OlmoeConfig(**common, intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    raise ValueError(f"family={family!r}")


FAMILY_CONFIGS = {"qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "mixtral": "MixtralConfig",
                  "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig",
                  "llama4_text": "Llama4TextConfig", "olmoe": "OlmoeConfig"}
FAMILIES = list(FAMILY_CONFIGS)


def build(family, *, H=64, I=32, E=8, k=2, vocab=128, layers=2, positions=512, dtype=BF16, device="cpu",
          implementation="eager", seed=0, **config):
    """A random-init model of `family` (skipped where this transformers lacks it)."""
    if not hasattr(hf, FAMILY_CONFIGS[family]):
        pytest.skip(f"this transformers has no {FAMILY_CONFIGS[family]}")
    cfg = _config(family, H, I, E, k, vocab, layers, positions)
    for name, value in config.items():
        setattr(cfg, name, value)
    torch.manual_seed(seed)
    model = hf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation=implementation,
                                                attn_implementation="eager")
    return model.to(device).eval()


def dispatched(model) -> bool:
    """Whether this transformers routes the model's experts through the experts interface."""
    return type(model)._can_set_experts_implementation()


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith(".experts")]


def route(model, experts_name, h):
    """Top-k ids and weights from the model's own router for hidden states h [T, H]."""
    block = model.get_submodule(experts_name.rsplit(".", 1)[0])
    if type(block.experts).__name__ == "Llama4TextExperts":
        scores, logits = block.router(h)  # sigmoid of the top-k logits, 0 elsewhere
        ids = logits.topk(block.top_k, dim=-1).indices
        return ids, scores.gather(1, ids)
    router = block.router if hasattr(block, "router") else block.gate
    _, weights, ids = router(h)
    return ids, weights


def eager_experts(module, h, ids, weights):
    """The module's own forward (Llama 4: as Llama4TextMoe runs it, every expert on every token,
    the input scaled by the router score)."""
    if type(module).__name__ == "Llama4TextExperts":
        E, T = module.num_experts, h.shape[0]
        scores = torch.zeros(T, E, dtype=h.dtype).scatter_(1, ids, weights.to(h.dtype))
        routed_in = h.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
        return module(routed_in).view(E, T, -1).sum(dim=0)
    return module(h, ids, weights)


def reference_from_layout(layout, h, ids, weights):
    kw = {"activation": layout["activation"], "w13_bias": layout["w13_bias"], "w2_bias": layout["w2_bias"],
          "apply_router_weight_on_input": layout["apply_router_weight_on_input"]}
    if layout["quant"] == "fp8_block":
        kw.update(quant="fp8_block", w13_scale=layout["w13_scale"], w2_scale=layout["w2_scale"])
    if layout["activation"] == "swiglu_oai":
        kw.update(swiglu_alpha=layout["swiglu_alpha"], swiglu_limit=layout["swiglu_limit"])
    if not layout["apply_router_weight_on_input"]:
        return reference.fused_moe(h, layout["w13"], layout["w2"], weights.float(), ids, **kw)
    return sum(reference.fused_moe(h, layout["w13"], layout["w2"], weights[:, s:s + 1].float(), ids[:, s:s + 1],
                                   **kw) for s in range(ids.shape[1]))


# ---- a core on the CPU: moe_kernels.reference in place of the kernels --------------------

class ReferenceCore:
    """Stands in for moe_kernels.fused_moe: records each call and computes it with
    moe_kernels.reference, rounded to the hidden dtype as the kernels' output is."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, w13, w2, topk_weights, topk_ids, **kw):
        assert topk_weights.dtype == torch.float32 and x.is_contiguous()
        self.calls.append(dict(kw, w13=w13, w2=w2))
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, **kw).to(x.dtype)


@pytest.fixture
def core(monkeypatch):
    """The reference core, with every device taken as one the kernels run on."""
    rec = ReferenceCore()
    monkeypatch.setattr(_common, "core_fused_moe", rec)
    monkeypatch.setattr(backend, "_device_problem", lambda device, quant: None)
    return rec


def fallback_warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and "default experts backend" in r.getMessage()]


# ---- registration ----------------------------------------------------------------------------

def test_importing_moe_kernels_does_not_import_transformers():
    code = "import sys, moe_kernels, moe_kernels.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_registered_in_both_experts_interfaces():
    assert hf_moe.ALL_EXPERTS_FUNCTIONS[backend.NAME] is backend.moe_kernels_experts_forward
    backend.register()  # again: the same entry
    assert hf_moe.ALL_EXPERTS_FUNCTIONS[backend.NAME] is backend.moe_kernels_experts_forward
    fp8_experts = pytest.importorskip("transformers.integrations.finegrained_fp8")
    assert fp8_experts.ALL_FP8_EXPERTS_FUNCTIONS[backend.NAME] is backend.moe_kernels_experts_forward


def test_from_config_and_set_experts_implementation_dispatch_to_the_backend(core):
    model = build("qwen3_moe", implementation="moe_kernels")
    assert model.config._experts_implementation == "moe_kernels"
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        model(ids)
    assert len(core.calls) == len(experts_modules(model)) == 2
    model.set_experts_implementation("eager")
    with torch.no_grad():
        model(ids)
    assert len(core.calls) == 2
    model.set_experts_implementation("moe_kernels")
    with torch.no_grad():
        model(ids)
    assert len(core.calls) == 4


# ---- the layout mapping, per family: the module's eager forward against the reference ------

EXPECTED_ACTIVATION = {"gpt_oss": "swiglu_oai"}


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_matches_the_modules_own_forward(family):
    model = build(family)
    name, module = experts_modules(model)[0]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 64, generator=g).to(BF16)
    with torch.no_grad():
        ids, weights = route(model, name, h)
        out = eager_experts(module, h, ids, weights)
        layout = backend.to_moe_kernels_layout(module)
    assert layout["quant"] == "bf16"
    assert layout["activation"] == EXPECTED_ACTIVATION.get(family, "swiglu")
    assert layout["apply_router_weight_on_input"] == (family == "llama4_text")
    assert tuple(layout["w13"].shape) == (module.num_experts, 64, 64) and tuple(layout["w2"].shape) == (
        module.num_experts, 64, 32)
    if family == "gpt_oss":
        assert layout["swiglu_alpha"] == module.alpha and layout["swiglu_limit"] == module.limit
        assert layout["w13_bias"] is not None and layout["w2_bias"] is not None
    ref = reference_from_layout(layout, h, ids, weights)
    err = rel_error(out, ref)
    assert err < TOL["bf16"], f"{family}: relative error {err:.3e}"


def test_concatenated_16bit_experts_are_used_without_a_copy():
    model = build("mixtral")
    _, module = experts_modules(model)[0]
    layout = backend.to_moe_kernels_layout(module)
    assert layout["w13"].data_ptr() == module.gate_up_proj.data_ptr()
    assert layout["w2"].data_ptr() == module.down_proj.data_ptr()


def test_non_gated_experts_map_up_proj_and_relu2():
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    cfg = hf.NemotronHConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                             mlp_hidden_act="relu2")
    torch.manual_seed(0)
    module = nh.NemotronHExperts(cfg).to(BF16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    cfg._experts_implementation = "eager"
    h = torch.randn(9, 64).to(BF16)
    ids = torch.rand(9, 4).argsort(dim=1)[:, :2]
    weights = torch.rand(9, 2)
    layout = backend.to_moe_kernels_layout(module)
    assert layout["activation"] == "relu2" and tuple(layout["w13"].shape) == (4, 32, 64)
    with torch.no_grad():
        out = module(h, ids, weights)
    assert rel_error(out, reference_from_layout(layout, h, ids, weights)) < TOL["bf16"]


# ---- whole models through the backend, the core replaced by the reference ----------------

@pytest.mark.parametrize("family", FAMILIES)
def test_model_logits_through_the_backend(family, core, caplog):
    model = build(family)
    if not dispatched(model):
        pytest.skip(f"this transformers does not dispatch {type(model).__name__}'s experts through the "
                    "experts interface: the backend is not reached")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = model(ids).logits
        model.set_experts_implementation("moe_kernels")
        ours = model(ids).logits
    assert len(core.calls) == len(experts_modules(model)) > 0
    assert not fallback_warnings(caplog)
    assert rel_error(ours, eager) < TOL["bf16"]


def test_llama4_experts_are_not_dispatched_by_this_transformers():
    model = build("llama4_text")
    if dispatched(model):
        pytest.skip("this transformers dispatches Llama 4's experts; test_model_logits_through_the_backend runs it")
    model.set_experts_implementation("moe_kernels")
    assert model.config._experts_implementation == "eager"


# ---- the cache on the module ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # the layout as is / transposed copies
def test_layout_made_once_and_again_after_load_state_dict(family, core, monkeypatch):
    made = []
    real = backend.to_moe_kernels_layout
    monkeypatch.setattr(backend, "to_moe_kernels_layout", lambda m: made.append(m) or real(m))
    model = build(family, implementation="moe_kernels")
    n = len(experts_modules(model))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(ids).logits
        again = model(ids).logits
    assert len(made) == n
    assert torch.equal(first, again)

    other = build(family, seed=7).state_dict()
    model.load_state_dict(other)  # copies in place: the same parameters, new versions
    with torch.no_grad():
        ours = model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    assert len(made) == 2 * n
    assert not torch.equal(ours, first)
    assert rel_error(ours, eager) < TOL["bf16"]


def test_layout_made_again_after_an_in_place_update(core):
    model = build("gpt_oss", implementation="moe_kernels")
    name, module = experts_modules(model)[0]
    h = torch.randn(5, 64).to(BF16)
    with torch.no_grad():
        ids, weights = route(model, name, h)
        module(h, ids, weights)
        key = module.__dict__[backend.CACHE_ATTR][0]
        module.down_proj.mul_(2)
        out = module(h, ids, weights)
        assert module.__dict__[backend.CACHE_ATTR][0] != key
        model.set_experts_implementation("eager")
        assert rel_error(out, module(h, ids, weights)) < TOL["bf16"]


# ---- FP8 128x128 blocks (transformers' finegrained-fp8 FP8Experts) --------------------------

def fp8_experts_module(E=4, H=256, I=128, seed=0, **kw):
    ff = pytest.importorskip("transformers.integrations.finegrained_fp8")

    class FP8ExpertsUnderTest(ff.FP8Experts):
        """Decorated apart, so FP8Experts itself is left as transformers made it."""

    cls = hf_moe.use_experts_implementation(FP8ExpertsUnderTest, experts_interface=ff.ALL_FP8_EXPERTS_FUNCTIONS)
    cfg = hf.DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2)
    cfg._experts_implementation = "moe_kernels"
    module = cls(cfg, block_size=kw.pop("block_size", (128, 128)), **kw)
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    with torch.no_grad():
        for name, w in (("gate_up_proj", w13), ("down_proj", w2)):
            q, s = fp8.quantize_weight(w, "block")
            getattr(module, name).copy_(q)
            getattr(module, name + "_scale_inv").copy_(s.to(getattr(module, name + "_scale_inv").dtype))
    return module, ff


def test_fp8_block_experts_map_to_fp8_block(core):
    module, ff = fp8_experts_module()
    layout = backend.to_moe_kernels_layout(module)
    assert layout["quant"] == "fp8_block" and layout["activation"] == "swiglu"
    assert layout["w13"].data_ptr() == module.gate_up_proj.data_ptr()
    assert layout["w13_scale"].data_ptr() == module.gate_up_proj_scale_inv.data_ptr()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(21, 256, generator=g).to(BF16)
    ids = torch.rand(21, 4, generator=g).argsort(dim=1)[:, :2]
    weights = torch.rand(21, 2, generator=g).to(BF16)
    with torch.no_grad():
        out = module(h, ids, weights)
    assert core.calls[-1]["quant"] == "fp8_block"
    # transformers' own dequantization of the same checkpoint tensors, run in 16 bits
    deq = ff.Fp8Dequantize(None)
    w13 = deq._dequantize_one(module.gate_up_proj, module.gate_up_proj_scale_inv, torch.float32)
    w2 = deq._dequantize_one(module.down_proj, module.down_proj_scale_inv, torch.float32)
    ref = reference.fused_moe(h, w13, w2, weights.float(), ids, activation="swiglu")
    assert rel_error(out, ref) < TOL["fp8_block"]


def test_fp8_ue8m0_scales_are_taken_as_float32():
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    module, _ = fp8_experts_module(scale_fmt="ue8m0")
    layout = backend.to_moe_kernels_layout(module)
    assert layout["w13_scale"].dtype == torch.float32
    assert torch.equal(layout["w13_scale"], module.gate_up_proj_scale_inv.float())


@pytest.mark.parametrize("kw,why", [(dict(activation_scheme="static"), "activation_scheme='static'"),
                                    (dict(block_size=None), "weight_block_size None")])
def test_fp8_experts_that_do_not_map_are_refused(kw, why):
    ff = pytest.importorskip("transformers.integrations.finegrained_fp8")

    class Experts(ff.FP8Experts):
        pass

    cls = hf_moe.use_experts_implementation(Experts, experts_interface=ff.ALL_FP8_EXPERTS_FUNCTIONS)
    cfg = hf.DeepseekV3Config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=4)
    module = cls(cfg, **dict(dict(block_size=(128, 128)), **kw))
    with pytest.raises(backend.UnsupportedExperts, match=why):
        backend.to_moe_kernels_layout(module)


def test_mxfp4_experts_are_not_an_experts_interface_module():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    module = mx.Mxfp4GptOssExperts(_config("gpt_oss", 64, 32, 4, 2, 128, 2, 512))
    with pytest.raises(backend.UnsupportedExperts, match="not an experts module transformers dispatches"):
        backend.to_moe_kernels_layout(module)


# ---- the fallback -----------------------------------------------------------------------------

def twice_then(model, other, seed, caplog):
    """Logits of two forwards with "moe_kernels" (so a second warning would show), then of one
    with `other`."""
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        ours = model(ids).logits
        model(ids)
        model.set_experts_implementation(other)
        return ours, model(ids).logits


def test_fallback_off_cuda_warns_once_per_module(caplog):
    model = build("qwen3_moe", implementation="moe_kernels")
    ours, default = twice_then(model, "grouped_mm", 5, caplog)
    warned = fallback_warnings(caplog)
    assert len(warned) == len(experts_modules(model)) == 2
    assert all("Qwen3MoeExperts" in r.getMessage() and "cpu" in r.getMessage() for r in warned)
    assert torch.equal(ours, default)


@pytest.mark.parametrize("case,why", [("activation", "QuickGELUActivation"), ("float32", "torch.float32")])
def test_fallback_names_why(case, why, core, caplog):
    if case == "activation":
        model = build("qwen3_moe", implementation="moe_kernels", hidden_act="quick_gelu")
    else:
        model = build("qwen3_moe", implementation="moe_kernels", dtype=torch.float32)
    ours, eager = twice_then(model, "eager", 6, caplog)
    assert not core.calls
    warned = fallback_warnings(caplog)
    assert len(warned) == 2 and all(why in r.getMessage() for r in warned)
    assert rel_error(ours, eager) < 1e-2


# ---- torch.compile: the backend traced into the registered op (CPU) -------------------------

@pytest.fixture
def cpu_op_kernel(monkeypatch):
    """A CPU kernel for torch.ops.moe_kernels.fused_moe that writes moe_kernels.reference into
    out (as tests/test_ops.py registers one), every device taken as one the kernels run on, and
    the modes taken as built (the fake implementation checks them). An eager call still goes to
    the library, which refuses CPU tensors: only a call traced by torch.compile reaches this."""
    lib = torch.library.Library("moe_kernels", "IMPL")
    calls = []

    def kernel(x, w13, w2, wts, ids, b13, b2, s13, s2, a13, a2, z13, z2, emap, out, workspace, quant, activation,
               experts, alpha, limit, on_input, scaling, tactic, last_step):
        calls.append(x.shape[0])
        out.copy_(reference.fused_moe(x, w13, w2, wts, ids, activation=activation, w13_bias=b13, w2_bias=b2,
                                      swiglu_alpha=alpha, swiglu_limit=limit).to(out.dtype))

    lib.impl("fused_moe", kernel, "CPU")
    monkeypatch.setattr(backend, "_device_problem", lambda device, quant: None)
    monkeypatch.setattr(problem, "built_modes", lambda: {"bf16", "fp16"})
    yield calls
    lib._destroy()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_torch_compile_traces_the_backend_into_the_op(family, cpu_op_kernel, counting_core, caplog):
    torch._dynamo.reset()  # no compiled code or recompile counts left from other tests
    model = build(family)
    n = len(experts_modules(model))
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(8))
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        eager = model(ids).logits
        model.set_experts_implementation("moe_kernels")
        compiled = torch.compile(model, backend="aot_eager")
        ours = [compiled(ids).logits for _ in range(2)]
    assert not fallback_warnings(caplog)
    # every compiled forward ran the op through the dispatcher, and the counting core saw each call
    assert cpu_op_kernel == [7] * (2 * n) and len(counting_core) == 2 * n
    for logits in ours:
        assert rel_error(logits, eager) < TOL["bf16"]


# ---- the transformers benchmark's measurements, on tiny models (CPU) -------------------------

def bench_args(*argv):
    p = argparse.ArgumentParser()
    bench_transformers.add_arguments(p)
    return p.parse_args(["--decode-context", "160", "--prefill-tokens", "16", "--repeats", "2", *argv])


@pytest.fixture
def untimed(monkeypatch):
    """The benchmark's timers replaced by ones that call as the real ones do and report the calls."""
    def median_ms(fn, repeats, warmup=bench_transformers.WARMUP):
        for _ in range(warmup + repeats):
            fn()
        return float(warmup + repeats)

    def graph_ms(step, repeats):  # eager warm-ups, then replays; the capture itself runs nothing
        for _ in range(bench_transformers.GRAPH_WARMUP):
            step()
        return median_ms(step, repeats) + bench_transformers.GRAPH_WARMUP
    monkeypatch.setattr(bench_transformers, "median_ms", median_ms)
    monkeypatch.setattr(bench_transformers, "graph_ms", graph_ms)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bench_measures_each_implementation_within_its_static_cache(family, untimed, core, caplog):
    """Every timed decode step fits the static cache (an index past it raises), the kernels run on
    every timed forward, and batched_mm's prefill is skipped where its gathered weights do not fit."""
    model = build(family)
    args = bench_args()
    n, calls = len(experts_modules(model)), (bench_transformers.WARMUP + args.repeats)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rows = {impl: bench_transformers.measure(model, impl, args, free_bytes=1 << 30)
                for impl in bench_transformers.IMPLEMENTATIONS}
    assert not fallback_warnings(caplog)
    for impl, row in rows.items():
        assert (row["decode_ms"], row["decode_graph_ms"], row["prefill_ms"]) == (calls, calls + 2, calls), impl
        assert not row["notes"]
    # the cache is filled with grouped_mm; then decode eager, decode graph and prefill with the kernels
    assert len(core.calls) == n * (3 * calls + bench_transformers.GRAPH_WARMUP)
    gathered = bench_transformers.batched_mm_bytes(model.config, args.prefill_tokens)
    tight = bench_transformers.measure(model, "batched_mm", args, free_bytes=gathered)
    assert tight["prefill_ms"] is None and "batched_mm would gather" in tight["notes"][0]


def test_bench_reports_a_fallback_instead_of_a_time(untimed, caplog):
    model = build("qwen3_moe")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        row = bench_transformers.measure(model, "moe_kernels", bench_args("--no-graphs"), free_bytes=1 << 30)
    assert (row["decode_ms"], row["decode_graph_ms"], row["prefill_ms"]) == (None, None, None)
    assert "fell back to transformers' default experts backend: hidden states on cpu" in row["notes"][0]


def test_bench_model_configs_have_the_presets_experts():
    from moe_kernels.cli.bench import PRESETS
    for name in bench_transformers.MODELS:
        cfg = bench_transformers.model_config(name, 3)
        keys = bench_transformers.EXPERT_KEYS[type(cfg).__name__]
        assert tuple(getattr(cfg, k) for k in keys) == PRESETS[name]
        assert cfg.num_hidden_layers == 3
    oss = bench_transformers.model_config("gpt-oss-20b", 3)
    assert oss.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    qwen = bench_transformers.model_config("qwen3-30b-a3b", 2)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim, qwen.vocab_size) == (32, 4, 128, 151936)
    # 2048 tokens would gather far more expert weights than any GPU holds
    assert bench_transformers.batched_mm_bytes(qwen, 2048) == 2048 * 8 * 3 * 2048 * 768 * 2


# ---- GPU: tiny models with the kernels against "eager" --------------------------------------

GPU_SIZES = dict(H=256, I=128, E=8, vocab=512, layers=2, positions=1024, dtype=BF16, device="cuda")


@pytest.fixture
def counting_core(monkeypatch):
    """The real core, counted, so a test sees that the kernels ran (no silent fallback). The
    count runs outside torch.compile's graphs, on every call: a list appended to inside a
    compiled frame would be guarded on its length, and so compiled again on each call."""
    calls = []
    real = _common.core_fused_moe

    @torch.compiler.disable
    def record(kind):
        calls.append(kind)

    def counted(*args, **kw):
        record(kw.get("quant", "16-bit"))
        return real(*args, **kw)
    monkeypatch.setattr(_common, "core_fused_moe", counted)
    return calls


def gpu_model(family):
    model = build(family, **GPU_SIZES)
    if not dispatched(model):
        pytest.skip(f"this transformers does not dispatch {type(model).__name__}'s experts through the "
                    "experts interface")
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_prefill_logits_match_eager(family, tokens, counting_core, caplog):
    """The bf16 model's logits with the kernels against the same model in float32: within the
    bf16 tolerance, or (where the bf16 model as a whole drifts further, gpt-oss at 300 tokens)
    no further from it than transformers' own bf16 eager experts."""
    model = gpu_model(family)
    truth_model = copy.deepcopy(model).float()
    truth_model.set_experts_implementation("eager")
    ids = torch.randint(0, GPU_SIZES["vocab"], (1, tokens), generator=torch.Generator().manual_seed(tokens))
    ids = ids.cuda()
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        truth = truth_model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        model.set_experts_implementation("moe_kernels")
        ours = model(ids).logits
    assert not fallback_warnings(caplog), [r.getMessage() for r in fallback_warnings(caplog)]
    assert len(counting_core) == len(experts_modules(model))
    err, eager_err = rel_error(ours, truth), rel_error(eager, truth)
    assert err < max(TOL["bf16"], 1.25 * eager_err), \
        f"{family}, {tokens} tokens: relative error {err:.3e} from the float32 model (bf16 eager: {eager_err:.3e})"


def generate(model, ids, implementation, steps, **kw):
    model.set_experts_implementation(implementation)
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[0, ids.shape[1]:], [step[0].float() for step in out.logits]


def same_greedy_steps(family, got, got_logits, want, want_logits, steps):
    """The same tokens and, up to the first token that differs, logits within the bf16 tolerance."""
    assert len(got) == len(want) == steps
    for step in range(steps):
        err = rel_error(got_logits[step], want_logits[step])
        assert err < TOL["bf16"], f"{family}, step {step}: logits' relative error {err:.3e}"
        if got[step] != want[step]:
            break  # a bf16 near-tie parted the tokens; the prefixes, and so the logits, differ from here on


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_greedy_generation_matches_eager(family, counting_core, caplog):
    steps = 20
    model = gpu_model(family)
    model.generation_config.eos_token_id = None  # exactly `steps` tokens
    ids = torch.randint(0, GPU_SIZES["vocab"], (1, 12), generator=torch.Generator().manual_seed(11)).cuda()
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        want, want_logits = generate(model, ids, "eager", steps)
        got, got_logits = generate(model, ids, "moe_kernels", steps)
    assert not fallback_warnings(caplog)
    assert counting_core, "the kernels did not run"
    same_greedy_steps(family, got, got_logits, want, want_logits, steps)


COMPILED_FAMILIES = ["qwen3_moe", "gpt_oss"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_gpu_torch_compile_prefill_matches_eager(family, counting_core, caplog):
    """torch.compile(model) (inductor, default mode) with the kernels: a 7-token prefill's logits
    against the float32 model as test_gpu_prefill_logits_match_eager holds them, twice (the second
    call runs the compiled code alone), the kernels called per experts module on each. Inductor
    rounds the rest of a bf16 model (norms, attention, router) its own way, so the bound is the
    larger of the bf16 model's error uncompiled and compiled with transformers' own experts."""
    torch._dynamo.reset()  # no compiled code or recompile counts left from other tests
    model = gpu_model(family)
    truth_model = copy.deepcopy(model).float()
    truth_model.set_experts_implementation("eager")
    ids = torch.randint(0, GPU_SIZES["vocab"], (1, 7), generator=torch.Generator().manual_seed(7)).cuda()
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        truth = truth_model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        compiled_eager = torch.compile(model)(ids).logits
        torch._dynamo.reset()
        model.set_experts_implementation("moe_kernels")
        compiled = torch.compile(model)
        ours = [compiled(ids).logits for _ in range(2)]
    assert not fallback_warnings(caplog), [r.getMessage() for r in fallback_warnings(caplog)]
    assert len(counting_core) == 2 * len(experts_modules(model))
    eager_err, compiled_eager_err = rel_error(eager, truth), rel_error(compiled_eager, truth)
    for call, logits in enumerate(ours):
        err = rel_error(logits, truth)
        assert err < max(TOL["bf16"], 1.25 * max(eager_err, compiled_eager_err)), \
            f"{family}, compiled call {call}: relative error {err:.3e} from the float32 model " \
            f"(bf16 eager: {eager_err:.3e}, compiled with eager experts: {compiled_eager_err:.3e})"


@pytest.mark.gpu
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_gpu_static_cache_compiled_generation_matches_eager(family, counting_core, caplog):
    """generate() with cache_implementation="static", whose decode steps transformers runs through
    torch.compile (CompileConfig's defaults: inductor, "reduce-overhead", i.e. CUDA graphs): greedy
    tokens and logits against the eager experts with the same static cache run uncompiled
    (same_greedy_steps); every forward reached the kernels."""
    torch._dynamo.reset()
    steps = 12
    model = gpu_model(family)
    model.generation_config.eos_token_id = None  # exactly `steps` tokens
    compiled_steps = []
    compiled_call = model.get_compiled_call

    def get_compiled_call(compile_config):  # generate()'s compiled forward, its calls counted
        forward = compiled_call(compile_config)

        def counted(*args, **kw):
            compiled_steps.append(kw["input_ids"].shape[1] if "input_ids" in kw else None)
            return forward(*args, **kw)
        return counted
    model.get_compiled_call = get_compiled_call
    ids = torch.randint(0, GPU_SIZES["vocab"], (1, 12), generator=torch.Generator().manual_seed(12)).cuda()
    static = dict(cache_implementation="static", compile_config=hf.CompileConfig())
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        want, want_logits = generate(model, ids, "eager", steps, disable_compile=True, **static)
        assert not compiled_steps
        got, got_logits = generate(model, ids, "moe_kernels", steps, **static)
    assert not fallback_warnings(caplog)
    assert compiled_steps == [1] * (steps - 1)  # the prefill runs uncompiled, each one-token step compiled
    assert len(counting_core) == steps * len(experts_modules(model))
    same_greedy_steps(family, got, got_logits, want, want_logits, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_gpu_fp8_block_experts_match_the_reference(tokens, counting_core, caplog):
    module, _ = fp8_experts_module(E=8)
    module = module.cuda()
    g = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 256, generator=g).to(BF16).cuda()
    ids = torch.rand(tokens, 8, generator=g).argsort(dim=1)[:, :2].cuda()
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1).to(BF16).cuda()
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        out = module(h, ids, weights)
    assert not fallback_warnings(caplog)
    assert counting_core == ["fp8_block"]
    ref = reference.fused_moe(h, module.gate_up_proj, module.down_proj, weights.float(), ids, quant="fp8_block",
                              w13_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv)
    assert rel_error(out, ref) < TOL["fp8_block"]
