"""`python -m moe_kernels bench`: the whole fused layer, timed against its floors and peers.

Method (DESIGN.md section 7): CUDA events around CUDA-graph replays, median of many; each
graph holds several forwards over rotated routing/input sets so the experts hit differ
from one forward to the next and weights come from HBM, not L2. In the same run: measured
device-to-device copy bandwidth and dense GEMM rate (the ceilings), the bandwidth floor
(bytes of the experts actually hit + activations) and the FLOP floor per point, and the
peers present on the machine, each checked against moe_kernels.reference first.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys

PRESETS = {  # DESIGN.md section 8: experts, top_k, hidden, intermediate
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "deepseek-v3": (256, 8, 7168, 2048),
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
DEFAULT_PRESETS = ["mixtral-8x7b", "qwen3-30b-a3b"]
DEFAULT_TOKENS = [1, 16, 128, 1024, 4096]
ROUTING_SETS = 8   # forwards per graph, each on its own routing and input set
REL_TOL = 2e-2     # bf16/fp16 against the float32 reference


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int

    @classmethod
    def from_args(cls, args) -> list:
        if args.experts or args.hidden or args.intermediate:
            missing = [n for n in ("experts", "top_k", "hidden", "intermediate") if not getattr(args, n)]
            if missing:
                raise SystemExit(f"custom shape: also give --{', --'.join(m.replace('_', '-') for m in missing)}")
            shapes = [cls("custom", args.experts, args.top_k, args.hidden, args.intermediate)]
        else:
            names = args.preset or DEFAULT_PRESETS
            unknown = [n for n in names if n not in PRESETS]
            if unknown:
                raise SystemExit(f"--preset {unknown}: expected one of {sorted(PRESETS)}")
            shapes = [cls(n, *PRESETS[n]) for n in names]
        out = []
        for s in shapes:
            if s.inter % args.tp or s.experts % args.ep:
                raise SystemExit(f"{s.name}: I={s.inter} must divide by --tp {args.tp} and E={s.experts} by --ep {args.ep}")
            suffix = "".join(f"-{k}{v}" for k, v in (("tp", args.tp), ("ep", args.ep)) if v > 1)
            out.append(cls(s.name + suffix, s.experts // args.ep, s.top_k, s.hidden, s.inter // args.tp))
        return out


def add_arguments(p) -> None:
    p.add_argument("--preset", action="append", help=f"model shape; repeatable; one of {sorted(PRESETS)}")
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: divides I")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size: divides E (this rank's share)")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated token counts")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent for --routing skewed")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays per point")
    p.add_argument("--no-peers", action="store_true", help="time moe_kernels only")
    p.add_argument("--sweep", action="store_true",
                   help="also time every built kernel for each GEMM (the other GEMM on the default) "
                        "and report the best pair against the default rule's choice")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each step (routing, GEMM1, activation, GEMM2, finalize) by prefixes")
    p.add_argument("--json", help="write the results to this file")


# ---- inputs --------------------------------------------------------------------------------

def routing(T, E, k, kind, skew, gen, device):
    import torch
    if kind == "uniform":
        probs = torch.ones(E, device=device)
    else:  # Zipf-like popularity over a random permutation of the experts
        probs = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** skew
        probs = probs[torch.randperm(E, generator=gen, device="cpu").to(device)]
    ids = torch.multinomial(probs.expand(T, E), k, replacement=False)
    logits = torch.randn(T, k, device=device)
    return ids.to(torch.int32), torch.softmax(logits, dim=-1)


def measure_ceilings(dtype):
    """Copy bandwidth (bytes read + written / s) and dense GEMM rate (FLOP/s) on this GPU.

    The copy is an elementwise kernel over 2 GiB: a memcpy node inside a CUDA graph can be
    served by the copy engines, which are slower than the SMs and would understate the
    ceiling (seen on an H200: 2.75 against 4.3 TB/s)."""
    import torch
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    t, _ = _time_graph(lambda: torch.mul(src, 1.0, out=dst), replays=20, per_graph=1)
    bw = 2 * src.numel() * src.element_size() / t
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t, _ = _time_graph(lambda: torch.matmul(a, b), replays=10, per_graph=1)
    return bw, 2 * n ** 3 / t


def _time_graph(fn, replays, per_graph):
    """Median seconds per call of fn, from CUDA events around replays of a graph of
    `per_graph` calls (fn may rotate inputs between calls)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(per_graph):
            fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    return statistics.median(times), (min(times), max(times))


# ---- implementations -----------------------------------------------------------------------

def torch_grouped_mm_moe(x, w13, w2, wts, ids, act):
    """Peer: plain PyTorch (sort by expert, torch._grouped_mm, activation, torch._grouped_mm,
    weighted index_add_). No host sync, so it can be graph-captured too."""
    import torch
    from .reference import apply_activation
    T, k = ids.shape
    E = w13.shape[0]
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.searchsorted(flat[order], torch.arange(1, E + 1, device=x.device)).to(torch.int32)
    h = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)
    a = apply_activation(h.float(), act).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y.float() * wts.flatten()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def peers():
    """(name, fn or None, why-not) for each peer this benchmark knows."""
    import torch
    out = []
    if hasattr(torch, "_grouped_mm"):
        out.append(("torch._grouped_mm", torch_grouped_mm_moe, None))
    else:
        out.append(("torch._grouped_mm", None, f"not in torch {torch.__version__}"))
    return out


# ---- the run -------------------------------------------------------------------------------

def bench_shape(shape, tokens, args, ceilings, report):
    import torch
    import moe_kernels
    from moe_kernels import reference
    from moe_kernels.modes import Activation, QuantMode

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[QuantMode.parse(args.quant).value]
    act = Activation.parse(args.activation)
    E, k, H, I = shape.experts, shape.top_k, shape.hidden, shape.inter
    n1 = 2 * I if act.gated else I
    gen = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, n1, H, device="cuda", dtype=dtype) * H ** -0.5)
    w2 = (torch.randn(E, H, I, device="cuda", dtype=dtype) * I ** -0.5)
    bytes_per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    bw, rate = ceilings
    peer_list = [] if args.no_peers else peers()
    for T in tokens:
        sets = [(torch.randn(T, H, device="cuda", dtype=dtype),) + routing(T, E, k, args.routing, args.skew, gen, "cuda")
                for _ in range(ROUTING_SETS)]
        hit = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
        act_bytes = T * H * 2 * w13.element_size() + T * k * 8
        floor_bytes = hit * bytes_per_expert + act_bytes
        flops = 2 * T * k * (H * n1 + I * H)
        floor_s = max(floor_bytes / bw, flops / rate)
        ws = torch.empty(moe_kernels.workspace_size(T, k, E, H, I, quant=args.quant, activation=act),
                         dtype=torch.uint8, device="cuda")
        outs = [torch.empty(T, H, device="cuda", dtype=dtype) for _ in sets]
        x0, ids0, w0 = sets[0]
        ref = reference.fused_moe(x0, w13, w2, w0, ids0, activation=act)
        row = {"preset": shape.name, "E": E, "top_k": k, "H": H, "I": I, "tokens": T,
               "experts_hit": hit, "floor_us": floor_s * 1e6, "bw_floor_us": floor_bytes / bw * 1e6,
               "flop_floor_us": flops / rate * 1e6, "results": {}}
        impls = [("moe_kernels", lambda x, ids, w, o: moe_kernels.fused_moe(
            x, w13, w2, w, ids, quant=args.quant, activation=act, workspace=ws, out=o), None)]
        impls += [(name, (lambda f: lambda x, ids, w, o: o.copy_(f(x, w13, w2, w, ids, act)))(fn) if fn else None, why)
                  for name, fn, why in peer_list]
        for name, fn, why in impls:
            if fn is None:
                row["results"][name] = {"status": f"not installed: {why}"}
                continue
            try:
                outs[0].fill_(float("nan"))
                fn(x0, ids0, w0, outs[0])
                err = ((outs[0].float() - ref).norm() / ref.norm()).item()
                if not math.isfinite(err) or err > REL_TOL:
                    row["results"][name] = {"status": f"wrong: relative error {err:.2e}"}
                    continue
                i = iter(range(1 << 30))

                def call():
                    j = next(i) % len(sets)
                    fn(*sets[j], outs[j])
                t, spread = _time_graph(call, args.replays, len(sets))
                row["results"][name] = {"status": "ok", "us": t * 1e6, "min_us": spread[0] * 1e6,
                                        "max_us": spread[1] * 1e6, "rel_err": err,
                                        "tb_s": floor_bytes / t / 1e12, "tflop_s": flops / t / 1e12,
                                        "of_floor": floor_s / t}
            except Exception as e:  # a peer that fails is reported, never silently dropped
                row["results"][name] = {"status": f"failed: {type(e).__name__}: {e}"[:200]}
        if args.breakdown and row["results"]["moe_kernels"].get("status") == "ok":
            prefix = []
            for last in (1, 2, 3, 4):
                j = iter(range(1 << 30))

                def partial(last=last, j=j):
                    n = next(j) % len(sets)
                    x, ids, w = sets[n]
                    moe_kernels.fused_moe(x, w13, w2, w, ids, quant=args.quant, activation=act,
                                          workspace=ws, out=outs[n], _last_step=last)
                prefix.append(_time_graph(partial, args.replays, len(sets))[0] * 1e6)
            prefix.append(row["results"]["moe_kernels"]["us"])
            steps = ["routing", "gemm1", "activation", "gemm2", "finalize"]
            row["breakdown_us"] = {n: b - a for n, a, b in zip(steps, [0.0] + prefix[:-1], prefix)}
        if args.sweep and row["results"]["moe_kernels"].get("status") == "ok":
            row["sweep"] = _sweep(moe_kernels, sets, outs, ws, w13, w2, args, act, ref)
        report(row)
        del ws, outs, sets
    del w13, w2
    torch.cuda.empty_cache()


def _sweep(moe_kernels, sets, outs, ws, w13, w2, args, act, ref):
    """Time every kernel in each GEMM slot, keeping the default in the other slot."""
    from moe_kernels import Tactic
    x0, ids0, w0 = sets[0]
    default = moe_kernels.api.choose_tactic(x0, w13, w2, w0, ids0, quant=args.quant, activation=act)
    names = [k.name for k in moe_kernels.list_kernels(quant=args.quant)]

    def timed(tactic):
        outs[0].fill_(float("nan"))
        moe_kernels.fused_moe(x0, w13, w2, w0, ids0, quant=args.quant, activation=act, workspace=ws,
                              out=outs[0], tactic=tactic)
        err = ((outs[0].float() - ref).norm() / ref.norm()).item()
        if not err < REL_TOL:
            return float("inf")
        it = iter(range(1 << 30))

        def call():
            j = next(it) % len(sets)
            x, ids, w = sets[j]
            moe_kernels.fused_moe(x, w13, w2, w, ids, quant=args.quant, activation=act,
                                  workspace=ws, out=outs[j], tactic=tactic)
        return _time_graph(call, args.replays, len(sets))[0] * 1e6

    g1 = {n: timed(Tactic(n, default.gemm2)) for n in names}
    g2 = {n: timed(Tactic(default.gemm1, n)) for n in names}
    best = Tactic(min(g1, key=g1.get), min(g2, key=g2.get))
    return {"default": str(default), "default_us": g1[default.gemm1], "best": str(best),
            "best_us": timed(best), "gemm1_us": g1, "gemm2_us": g2}


def _print_row(row, names):
    ours = row["results"]["moe_kernels"]
    cells = [f"{row['preset']:<22}", f"{row['tokens']:>6}", f"{row['experts_hit']:>6.1f}",
             f"{row['bw_floor_us']:>9.1f}", f"{row['flop_floor_us']:>9.1f}"]
    if ours.get("status") == "ok":
        cells += [f"{ours['us']:>9.1f}", f"{ours['tb_s']:>6.2f}", f"{ours['tflop_s']:>7.1f}", f"{ours['of_floor']:>6.0%}"]
    else:
        cells += [f"{ours['status'][:40]:>40}"]
    for n in names[1:]:
        r = row["results"].get(n, {})
        if r.get("status") == "ok" and ours.get("status") == "ok":
            cells.append(f"{r['us']:>9.1f} ({r['us'] / ours['us']:.2f}x)")
        else:
            cells.append(f"{r.get('status', '-')[:24]:>22}")
    print("  ".join(cells), flush=True)
    if "sweep" in row:
        sw = row["sweep"]
        print(f"      default {sw['default']} {sw['default_us']:.1f} us; best {sw['best']} {sw['best_us']:.1f} us",
              flush=True)
    if "breakdown_us" in row:
        print("      steps (us): " + ", ".join(f"{k} {v:.1f}" for k, v in row["breakdown_us"].items()), flush=True)


def main(args) -> int:
    import torch
    import moe_kernels
    from moe_kernels import info

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so there is nothing to time. What this build holds:\n")
        return info.main(type("A", (), {"json": False})())
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        raise SystemExit(f"--tokens {args.tokens!r}: expected comma-separated integers")
    shapes = Shape.from_args(args)
    dev = torch.cuda.get_device_properties(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(args.quant))
    if dtype is None:
        raise SystemExit(f"--quant {args.quant}: this benchmark knows bf16 and fp16")
    print(f"moe_kernels {moe_kernels.__version__} on {dev.name} ({dev.multi_processor_count} SMs), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    bw, rate = measure_ceilings(dtype)
    print(f"ceilings measured now: copy {bw / 1e12:.2f} TB/s, dense {args.quant} GEMM {rate / 1e12:.0f} TFLOP/s "
          f"(8192^3); routing {args.routing}, activation {args.activation}\n")
    names = ["moe_kernels"] + ([] if args.no_peers else [n for n, _, _ in peers()])
    print("  ".join([f"{'preset':<22}", f"{'tokens':>6}", f"{'hit':>6}", f"{'bw_fl_us':>9}", f"{'fl_fl_us':>9}",
                     f"{'ours_us':>9}", f"{'TB/s':>6}", f"{'TFLOP/s':>7}", f"{'floor%':>6}"] +
                    [f"{n + ' us (x)':>22}" for n in names[1:]]))
    rows = []

    def report(row):
        rows.append(row)
        _print_row(row, names)

    for s in shapes:
        bench_shape(s, tokens, args, (bw, rate), report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": dev.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "version": moe_kernels.__version__, "copy_bw_bytes_s": bw, "gemm_flop_s": rate,
                       "routing": args.routing, "quant": str(args.quant), "activation": args.activation,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(None))
