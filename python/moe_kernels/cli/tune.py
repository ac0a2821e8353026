"""`python -m moe_kernels tune`: tune presets or a shape per token bucket, write a JSON table."""
from __future__ import annotations

import argparse
import sys

from ..cache import BUCKETS, ProblemSpec, TuningCache, cache_key
from ..modes import MODES, Activation, QuantMode
from ..tuning import tune
from . import NO_GPU


def add_arguments(p) -> None:
    from .bench import add_preset_argument, add_shape_arguments
    add_preset_argument(p, "or give a custom shape")
    add_shape_arguments(p)
    p.add_argument("--quant", default="bf16", choices=list(MODES), metavar="MODE",
                   help=f"quantization mode, one of {', '.join(MODES)} (default bf16; "
                        "`python -m moe_kernels info` lists those this build runs)")
    p.add_argument("--fp16-out", dest="fp16_out", action="store_true",
                   help="fp8/fp8_block with fp16 hidden states and output (default bf16)")
    p.add_argument("--activation", default="swiglu", type=str.lower, choices=[a.value for a in Activation],
                   metavar="NAME",
                   help=f"expert activation, one of {', '.join(a.value for a in Activation)} (default swiglu)")
    p.add_argument("--routing", choices=("uniform", "skewed", "balanced"), default="skewed",
                   help="how tokens pick experts while timing: uniform, skewed or balanced (default skewed)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent for --routing skewed (default 1.2)")
    p.add_argument("--histogram", help="JSON per-expert token counts from a real trace")
    p.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                   help="comma-separated token buckets to tune (default: all of %(default)s)")
    p.add_argument("--replays", type=int, default=10, help="timed graph replays per candidate (default 10)")
    p.add_argument("--exhaustive", action="store_true", help="time every (GEMM1, GEMM2) pair")
    p.add_argument("--out", required=True, help="JSON cache file to write (merged if it exists)")


def _us(rec: dict, key: str, per=None) -> str:
    """A record's time (or its ratio to `per`); "-" where it has none."""
    v = rec.get(key)
    return "-" if v is None else f"{v / per:.3f}" if per else f"{v:.1f}"


def report(specs, results: dict, routing: str, exhaustive: bool) -> None:
    """Print each problem's tuned choice per bucket (what `python -m moe_kernels tune` shows)."""
    for spec in specs:
        print(f"\n{spec.signature} ({routing} routing)")
        if exhaustive:  # the search's pick against the best of every pair, same timings
            print(f"{'bucket':>6}  {'exhaustive us':>13}  {'tuned us':>9}  {'tuned/best':>10}  "
                  f"{'default us':>10}  {'default/best':>12}  exhaustive best")
        else:
            print(f"{'bucket':>6}  {'tuned us':>9}  {'default us':>10}  {'runner-up us':>12}  tactic")
        for b, rec in sorted(results.get(spec.signature, {}).items(), key=lambda kv: int(kv[0])):
            if rec is None:
                print(f"{b:>6}  no valid tactic")
                continue
            if exhaustive:
                best = rec["us"]
                print(f"{b:>6}  {best:>13.1f}  {_us(rec, 'search_us'):>9}  {_us(rec, 'search_us', best):>10}  "
                      f"{_us(rec, 'default_us'):>10}  {_us(rec, 'default_us', best):>12}  {rec['tactic']}")
            else:
                print(f"{b:>6}  {rec['us']:>9.1f}  {_us(rec, 'default_us'):>10}  {_us(rec, 'runner_up_us'):>12}  "
                      f"{rec['tactic']}")
            for name, v in rec.get("forwards", {}).items():  # its time, or why it did not run
                print(f"        {name}: {v:.1f} us" if isinstance(v, float) else f"        {name}: {v}")
            for name, why in {**rec["rejected"], **rec["faulted"]}.items():
                print(f"        rejected {name}: {why}")


def main(args) -> int:
    import torch
    from . import bench
    if not torch.cuda.is_available():  # the same message and exit code as bench and profile (cli.main)
        print(NO_GPU.format(verb="tune"), file=sys.stderr)
        return 2
    bench_args = argparse.Namespace(experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                                    intermediate=args.intermediate, preset=args.preset or None,
                                    tp=args.tp, ep=args.ep)
    if not (args.preset or args.experts):
        raise SystemExit("give --preset NAME or a custom shape (--experts/--top-k/--hidden/--intermediate)")
    shapes = bench.shapes_from_args(bench_args)
    bench.hidden_dtype(args)  # --fp16-out only with an FP8 --quant
    specs = [ProblemSpec(QuantMode.parse(args.quant).value, Activation.parse(args.activation).value,
                         s.experts, s.top_k, s.hidden, s.inter, "fp16" if args.fp16_out else "")
             for s in shapes]
    buckets = [int(b) for b in args.buckets.split(",")]
    if any(b not in BUCKETS for b in buckets):
        raise SystemExit(f"--buckets: each must be one of {BUCKETS}")
    dev = torch.cuda.current_device()
    memory, results = [], {}
    cache = TuningCache(cache_key(dev), args.out)
    for spec in specs:  # saved after each problem, so a long run keeps what it finished
        results.update(tune([spec], buckets, device=dev, routing=args.routing, skew=args.skew,
                            histogram=args.histogram, replays=args.replays, exhaustive=args.exhaustive,
                            log=lambda ev: memory.append(ev) if ev["event"] == "done" else None))
        for b, rec in results.get(spec.signature, {}).items():
            if rec is not None:
                cache.put(spec, int(b), rec)
        cache.save()
    report(specs, results, args.routing, args.exhaustive)
    for ev in memory:
        print(f"\ntuning process peak device memory {ev['peak_bytes'] / 2**30:.2f} GiB: weights "
              f"{ev['weight_bytes'] / 2**30:.2f} GiB, workspace of the largest bucket "
              f"{ev['workspace_bytes'] / 2**30:.2f} GiB, the rest inputs, outputs and the reference")
    print(f"wrote {args.out}")
    return 0


