"""`python -m moe_kernels bench-transformers`: whole Hugging Face transformers models, timed with
each of transformers' experts backends and this package's ("moe_kernels").

Models: Qwen3-30B-A3B and gpt-oss-20b shaped (their experts as bench's presets, their attention
as the released configs), a few layers, random bf16 weights on the GPU. For each experts
implementation (switched on the one model with `set_experts_implementation`):
- decode: one new token after a transformers StaticCache of --decode-context positions, filled
  but for the steps timed (a static cache attends over all its positions), eagerly and as one
  CUDA graph of the decode step (torch.cuda.graph; transformers' own generate() reaches CUDA graphs
  through torch.compile's "reduce-overhead" with a static cache);
- prefill: --prefill-tokens tokens in one eager forward, no cache, the last token's logits only.
Each time is the median of --repeats CUDA-event timings after warm-ups. "batched_mm" gathers
each token's expert weights, so its prefill is skipped where that copy would not fit; a
"moe_kernels" row whose experts fell back to transformers' default backend reports why, not a time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from .bench import PRESETS, _positive

IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "moe_kernels")
OURS = "moe_kernels"
WARMUP = 3          # untimed calls before each timing
GRAPH_WARMUP = 2    # eager calls on a side stream before a capture (torch.cuda.graphs' recipe)

# Attention and the rest of the released configs (the experts' sizes come from bench.PRESETS).
MODELS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        max_position_embeddings=40960, rms_norm_eps=1e-6, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "gpt-oss-20b": ("GptOssConfig", dict(
        vocab_size=201088, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
}
EXPERT_KEYS = {"Qwen3MoeConfig": ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"),
               "GptOssConfig": ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size")}


def _models(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names of {', '.join(MODELS)}")
    return names


def add_arguments(p) -> None:
    p.add_argument("--models", type=_models, default=list(MODELS), metavar="NAMES",
                   help=f"comma-separated, of {', '.join(MODELS)} (default: both)")
    p.add_argument("--layers", type=_positive, default=2, help="decoder layers per model (default %(default)s)")
    p.add_argument("--decode-context", dest="decode_context", type=_positive, default=512, metavar="TOKENS",
                   help="positions of the static KV cache a decode step attends over (default %(default)s)")
    p.add_argument("--prefill-tokens", dest="prefill_tokens", type=_positive, default=2048, metavar="TOKENS",
                   help="tokens of the timed prefill (default %(default)s)")
    p.add_argument("--repeats", type=_positive, default=20, help="timed calls per number (default %(default)s)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="time decode eagerly only (no CUDA graph of the decode step)")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--markdown", help="write the results as a Markdown table to this file")


def model_config(name: str, layers: int):
    """The transformers config of a `name`-shaped model with `layers` decoder layers."""
    import transformers
    cls, extra = MODELS[name]
    experts, top_k, hidden, inter = PRESETS[name]
    kw = dict(extra, num_hidden_layers=layers, hidden_size=hidden, num_experts_per_tok=top_k,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if cls == "Qwen3MoeConfig":
        kw.update(num_experts=experts, moe_intermediate_size=inter)
    else:  # gpt-oss: sliding and full attention layers in turn, as released
        kw.update(num_local_experts=experts, intermediate_size=inter,
                  layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])
    return getattr(transformers, cls)(**kw)


def decode_steps(repeats: int, graphs: bool) -> int:
    """Decode steps one implementation runs (each writes one position of the static cache)."""
    eager = WARMUP + repeats
    return eager + (GRAPH_WARMUP + WARMUP + repeats if graphs else 0)


def batched_mm_bytes(config, tokens: int) -> int:
    """Bytes of expert weights batched_mm gathers for `tokens` tokens (a copy per token and slot)."""
    experts_key, top_k_key, hidden_key, inter_key = EXPERT_KEYS[type(config).__name__]
    H, inter = getattr(config, hidden_key), getattr(config, inter_key)
    return tokens * getattr(config, top_k_key) * 3 * H * inter * 2  # bf16 gate/up [2I, H] and down [H, I]


def median_ms(fn, repeats: int, warmup: int = WARMUP) -> float:
    """Median milliseconds of `fn` between CUDA events, each call timed alone after warm-ups."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(step, repeats: int) -> float:
    """Median milliseconds of a CUDA graph holding one call of `step`."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(graph.replay, repeats)


def _fallbacks(model) -> list:
    """Why experts modules ran transformers' default backend instead of moe_kernels (none: they did not)."""
    from ..integrations import transformers as backend
    return sorted({why for m in model.modules() for why in m.__dict__.get(backend.WARNED_ATTR, ())})


def measure(model, impl: str, args, free_bytes: int) -> dict:
    """One implementation's decode and prefill times on `model` (in ms; None where not timed)."""
    import torch
    from transformers import StaticCache

    from ..integrations import transformers as backend
    backend.register()  # "moe_kernels" among the experts implementations (importing it registers it too)
    row = {"implementation": impl, "decode_ms": None, "decode_graph_ms": None, "prefill_ms": None, "notes": []}
    device, vocab = model.device, model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    steps = decode_steps(args.repeats, args.graphs)
    cache = StaticCache(config=model.config, max_cache_len=args.decode_context)
    context = torch.randint(0, vocab, (1, args.decode_context - steps), generator=gen).to(device)
    token = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
    prompt = torch.randint(0, vocab, (1, args.prefill_tokens), generator=gen).to(device)
    with torch.no_grad():
        model.set_experts_implementation("grouped_mm")  # fills the cache: any backend would do, this one fits
        model(context, past_key_values=cache, use_cache=True, logits_to_keep=1)
        model.set_experts_implementation(impl)

        def decode():
            return model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        row["decode_ms"] = median_ms(decode, args.repeats)
        why = _fallbacks(model) if impl == OURS else []
        if why:  # the times are transformers' default backend's, not ours
            row["decode_ms"] = None
            row["notes"].append("fell back to transformers' default experts backend: " + "; ".join(why))
            return row
        if args.graphs:
            try:
                row["decode_graph_ms"] = graph_ms(decode, args.repeats)
            except RuntimeError as e:  # something in the step cannot be captured
                row["notes"].append(f"no CUDA graph: {str(e).splitlines()[0]}")
        gathered = batched_mm_bytes(model.config, args.prefill_tokens)
        if impl == "batched_mm" and gathered > free_bytes // 2:
            row["notes"].append(f"prefill not timed: batched_mm would gather {gathered / 2**30:.0f} GiB of expert "
                                f"weights ({free_bytes / 2**30:.0f} GiB free)")
            return row
        row["prefill_ms"] = median_ms(lambda: model(prompt, use_cache=False, logits_to_keep=1), args.repeats)
        why = _fallbacks(model) if impl == OURS else []
        if why:
            row["prefill_ms"] = None
            row["notes"].append("prefill fell back to transformers' default experts backend: " + "; ".join(why))
    return row


def speedups(rows: list) -> None:
    """Adds to each other row of a model moe_kernels' speedup over it (its time / ours) per measure."""
    ours = {r["model"]: r for r in rows if r["implementation"] == OURS}
    for r in rows:
        o = ours.get(r["model"])
        if r["implementation"] == OURS or o is None:
            continue
        r["moe_kernels_speedup"] = {k: r[k] / o[k] for k in ("decode_ms", "decode_graph_ms", "prefill_ms")
                                    if r[k] is not None and o[k] is not None}


def markdown(result) -> str:
    """The results as a Markdown table (what benchmarks/results/*-transformers.md holds)."""
    out = [f"{result['gpu']}, driver {result['driver']}, torch {result['torch']} (CUDA {result['cuda']}), "
           f"transformers {result['transformers']}, moe_kernels {result['version']} at {result['commit'][:12]}"
           + (f" ({result['catalog']} catalog)" if result.get("catalog") else "")
           + f". {result['layers']} decoder layers, random bf16 weights. Decode: 1 token after a static cache of "
           f"{result['decode_context']} positions, eager"
           + (" and as a CUDA graph of the step" if result["graphs"] else "")
           + f"; prefill: {result['prefill_tokens']} tokens, eager, no cache. Each the median of "
           f"{result['repeats']} CUDA-event timings after {WARMUP} warm-ups, in ms; speedup: the implementation's "
           "time / moe_kernels'. (transformers' generate() switches grouped_mm to batched_mm for decode.)",
           "",
           "| model | attention | implementation | decode ms | decode ms, CUDA graph | prefill ms | "
           "moe_kernels speedup (decode, graph, prefill) | notes |",
           "|---" * 8 + "|"]

    def ms(v):
        return "-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.2f}"
    for r in result["rows"]:
        s = r.get("moe_kernels_speedup", {})
        cells = [r["model"], r["attention"], r["implementation"], ms(r["decode_ms"]), ms(r["decode_graph_ms"]),
                 ms(r["prefill_ms"]),
                 "" if r["implementation"] == OURS else
                 ", ".join(f"{s[k]:.2f}x" if k in s else "-" for k in ("decode_ms", "decode_graph_ms", "prefill_ms")),
                 "; ".join(r["notes"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(args) -> int:
    import torch
    try:
        import transformers

        from ..integrations import transformers as backend
        backend.register()
    except ImportError as e:
        print(f"bench-transformers needs transformers 5 with its experts interface: {e}", file=sys.stderr)
        return 2
    import moe_kernels

    from .bench import _environment
    steps = decode_steps(args.repeats, args.graphs)
    if args.decode_context <= steps:
        raise SystemExit(f"--decode-context {args.decode_context}: must be more than the {steps} decode steps "
                         f"timed (--repeats {args.repeats})")
    env = _environment()
    print(f"moe_kernels {moe_kernels.__version__} ({env['commit'][:12]}, {env['catalog'] or 'unknown'} catalog), "
          f"transformers {transformers.__version__} on {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}",
          flush=True)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(model_config(name, args.layers),
                                                                  dtype=torch.bfloat16).eval()
        attention = model.config._attn_implementation
        for impl in IMPLEMENTATIONS:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            row = {"model": name, "attention": attention, **measure(model, impl, args, free)}
            rows.append(row)
            print(f"{name} {impl}: decode {row['decode_ms']} ms, graph {row['decode_graph_ms']} ms, "
                  f"prefill {row['prefill_ms']} ms" + "".join(f"; {n}" for n in row["notes"]), flush=True)
        del model
        torch.cuda.empty_cache()
    speedups(rows)
    result = {**env, "version": moe_kernels.__version__, "transformers": transformers.__version__,
              "layers": args.layers, "decode_context": args.decode_context, "prefill_tokens": args.prefill_tokens,
              "repeats": args.repeats, "graphs": args.graphs, "rows": rows}
    table = markdown(result)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0
