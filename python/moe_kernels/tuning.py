"""The autotuner: validated tactics, realistic routing, never a crash of the caller.

- `list_tactics(...)`: every tactic for a mode on this GPU (each pair of GEMM kernels, and
  each whole-forward kernel), and the kernels filtered out with their reason (shared
  memory, arch). Filtered kernels are never launched; a forward kernel is timed only where
  the problem fits it (the library says why not, and the record keeps that).
- Tuning runs in a child process (`python -m moe_kernels.tuning --worker ...`): a kernel
  that faults takes down the child, and one that never finishes gets it killed (HANG_S); the
  parent records it against the candidate being tried, excludes it and goes on in a fresh child.
- Each candidate's output on the profiling inputs is compared with
  `moe_kernels.reference` before its time counts; wrong candidates are excluded.
- Choices are kept per token bucket (moe_kernels.cache): in memory and in a JSON file.
- `with moe_kernels.autotune(cache="file.json", routing="skewed"):` tunes each problem
  the first time a token bucket is seen; outside it, cached choices (including the tables
  shipped in moe_kernels/tuned/) or the default rule apply; inside a CUDA graph capture
  only cached choices are used.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

from . import _native
from . import cache as _cache
from .cache import ProblemSpec, TuningCache
from .modes import Activation, QuantMode
from .problem import c_shape, device_index, out_dtype_name, parse_quant
from .profiling import round_robin
from .tactic import Tactic

ROUTING_SETS = 4       # rotated routing/input sets per timing (experts hit differ per forward)
TEST_CORRUPT_ENV = "MOE_KERNELS_TEST_CORRUPT_KERNEL"  # test-only: treat this kernel's output as wrong
MAX_RESTARTS = 8
FINALISTS = 3          # fastest candidates of the search, timed again before one is chosen
CONFIRM_ROUNDS = 3     # interleaved re-timings of each finalist
SETTLE_S = 1.0         # seconds of forwards before a bucket's first timing (clocks: see _worker)
# A child that reports nothing for this long is hung (a kernel that never finishes: a deadlocked
# warp-specialized pipeline): killed, its candidate excluded like a faulting one. Far above a
# candidate's validation and timing, and the problem set-up before the first one.
HANG_S = 300.0
WORKER = [sys.executable, "-m", "moe_kernels.tuning"]  # the child's command (tests replace it)


@dataclasses.dataclass
class TacticSet:
    """Tactics that can run for a mode on a device, and kernels filtered out, with why.
    kernels: the usable GEMM kernels; forwards: the usable whole-forward kernels."""

    tactics: list
    kernels: list
    filtered: dict
    forwards: list = dataclasses.field(default_factory=list)


def list_tactics(quant="bf16", device=None, out_dtype=None) -> TacticSet:
    """Every tactic of kernels usable for `quant` on `device` (modes with several hidden
    dtypes: with output `out_dtype`, by default the mode's first, as in list_kernels)."""
    mode = parse_quant(quant)
    out = out_dtype_name(mode, out_dtype)
    dev = device_index(device, "list_tactics")
    gemms, forwards, filtered = [], [], {}
    for k in _native.library_for(dev)["kernels"]:
        if k.mode != mode.value or k.out_dtype != out:
            continue  # another mode's (or output type's) kernel: not a candidate, nothing to report
        why = _native.kernel_problem(dev, k.name)
        if why:
            filtered[k.name] = why
        else:
            (gemms if k.gemm else forwards).append(k.name)
    tactics = [Tactic(a, b) for a in gemms for b in gemms] + [Tactic(forward=f) for f in forwards]
    return TacticSet(tactics, gemms, filtered, forwards)


@contextlib.contextmanager
def autotune(cache: str | None = None, *, routing: str = "uniform", skew: float = 1.2,
             histogram: str | None = None, replays: int = 10):
    """Tune problems as they are first seen (per token bucket), in an isolated child process.

    cache: a JSON file to read choices from (if its key matches this GPU/CUDA/library) and
    to write new ones to. routing: "uniform", "skewed" (Zipf, exponent `skew`) or
    "balanced"; histogram: a JSON file of per-expert token counts from a real trace.
    """
    import torch
    device = torch.cuda.current_device()
    mem = _cache.cache_for(device)
    file_cache = None
    if cache is not None:
        file_cache = TuningCache(mem.key, cache)
        for sig, buckets in file_cache.entries.items():
            mem.entries.setdefault(sig, {}).update(buckets)
    options = {"routing": routing, "skew": skew, "histogram": histogram, "replays": replays}

    def tuner(spec, bucket, dev):
        results = tune([spec], [bucket], device=dev, progress=False, **options)
        rec = results.get(spec.signature, {}).get(str(bucket))
        if rec is not None and file_cache is not None:
            file_cache.put(spec, bucket, rec)
            file_cache.save()
        return rec

    _cache.tuners.append(tuner)
    try:
        yield mem
    finally:
        _cache.tuners.remove(tuner)


# ---- the parent: child processes, faults, progress ------------------------------------------

def tune(specs, buckets, *, device=None, routing="uniform", skew=1.2, histogram=None, replays=10,
         progress=True, exhaustive=False, log=None, env=None) -> dict:
    """Tune each problem at each bucket in child processes; returns {signature: {bucket: record}}.

    A child that dies (a kernel fault) or hangs (no report for HANG_S seconds: killed) is
    replaced; the candidate it was trying is excluded and reported under "faulted" in that
    bucket's record. `env`: extra environment variables for the children (the tests use it for
    the test-only fault and corruption hooks)."""
    dev = device_index(device)
    progress = progress and sys.stderr.isatty()  # a \r-rewritten line is noise in a log file
    results: dict = {}
    for spec in specs:
        todo = list(buckets)
        excluded: dict = {}  # kernel name -> why: it faulted in an earlier child
        restarts = 0
        while todo:
            cmd = WORKER + ["--worker", spec.signature,
                   "--buckets", ",".join(map(str, todo)), "--routing", routing, "--skew", str(skew),
                   "--replays", str(replays), "--device", str(dev),
                   "--exclude", json.dumps(excluded)]
            if histogram:
                cmd += ["--histogram", histogram]
            if exhaustive:
                cmd.append("--exhaustive")
            trying, finished = None, False
            errfile = tempfile.TemporaryFile(mode="w+")  # a file, so a chatty child cannot block
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errfile, text=True,
                                    env={**os.environ, **(env or {})})
            lines: queue.Queue = queue.Queue()  # the child's stdout, read by a thread: waits can time out
            threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
            hung = False
            while True:
                try:
                    line = lines.get(timeout=HANG_S)
                except queue.Empty:
                    hung = True
                    proc.kill()
                    break
                if line is None:
                    break
                if not line.startswith("{"):
                    continue
                ev = json.loads(line)
                if log is not None:
                    log(ev)
                if ev["event"] == "try":
                    trying = ev["suspect"]
                    if progress:
                        sys.stderr.write(f"\r{spec.signature} bucket {ev['bucket']}: "
                                         f"{ev['index'] + 1}/{ev['count']} {ev['tactic'][:60]:<60}")
                        sys.stderr.flush()
                elif ev["event"] == "bucket":
                    results.setdefault(spec.signature, {})[str(ev["bucket"])] = ev["record"]
                    todo.remove(ev["bucket"])
                    trying = None
                elif ev["event"] == "done":
                    finished = True
            proc.wait()
            errfile.seek(0)
            stderr = errfile.read()
            errfile.close()
            if progress:
                sys.stderr.write("\r" + " " * 100 + "\r")
            if finished and not todo:
                break
            what = f"hung (no report for {HANG_S:g} s, killed)" if hung else f"failed (exit {proc.returncode})"
            if trying is None or restarts >= MAX_RESTARTS:
                raise RuntimeError(f"tuning {spec.signature} {what} outside any candidate:\n{stderr[-2000:]}")
            excluded[trying] = (f"hung: no report for {HANG_S:g} s, killed" if hung
                                else f"faulted (exit {proc.returncode}): {_last_error(stderr)}")
            restarts += 1
    return results


def _pump(stream, lines: queue.Queue) -> None:
    """Every line of `stream`, then None at its end, into `lines`."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no message"


def confirm(timings: dict, time_again, finalists: int = FINALISTS, rounds: int = CONFIRM_ROUNDS,
            default: str | None = None) -> dict:
    """The search's fastest `finalists` candidates, and the `default` rule's pair where it was
    timed, timed again round-robin for `rounds` rounds, each scored by the median of those
    re-timings; {candidate: us}, fastest first.
    Single timings of near-tied pairs pick by noise, and interleaving keeps slow drift off any
    one candidate. The search's own timings only choose the finalists: taken one after another
    as the GPU warms, they favour what was timed first (docs/design.md, "Tactics"). The default
    is always a finalist, so a pick has beaten it in the same rounds."""
    top = sorted(timings, key=timings.get)[:finalists]
    if default in timings and default not in top:
        top.append(default)
    if len(top) == 1:
        return {top[0]: timings[top[0]]}
    scored, _ = round_robin({k: k for k in top}, time_again, rounds)
    return dict(sorted(scored.items(), key=lambda kv: kv[1]))


# ---- the child: validate, then time ---------------------------------------------------------

def _emit(**event):
    print(json.dumps(event), flush=True)


def _worker(args) -> int:
    import torch
    from . import api, profiling, reference
    from .tactic import default_tactic

    spec = ProblemSpec.parse(args.worker)
    torch.cuda.set_device(args.device)
    torch.cuda.reset_peak_memory_stats()
    excluded = json.loads(args.exclude)  # kernel name -> why (it faulted in an earlier child)
    buckets = [int(b) for b in args.buckets.split(",")]
    counts = profiling.load_histogram(args.histogram) if args.histogram else None
    act = Activation.parse(spec.activation)
    weights = profiling.make_weights(spec.quant, act, spec.experts, spec.hidden, spec.inter)
    w13, w2 = weights["w13"], weights["w2"]
    scales = {k: weights[k] for k in ("w13_scale", "w2_scale") if weights.get(k) is not None}
    tol = QuantMode.parse(spec.quant).spec.tolerance
    # One workspace for the largest bucket: tuning memory is bounded by it plus the inputs.
    ws = torch.empty(api.workspace_size(max(buckets), spec.top_k, spec.experts, spec.hidden, spec.inter,
                                        quant=spec.quant, activation=act), dtype=torch.uint8, device="cuda")
    ts = list_tactics(spec.quant, out_dtype=spec.out_dtype or None)
    # GEMM kernels that cannot take these weights (a 4-bit kernel built for another scale group
    # or for zero points) are filtered with the library's reason, not run and blamed as faults.
    mode = parse_quant(spec.quant)
    shape = c_shape(T=max(buckets), H=spec.hidden, I=spec.inter, E=spec.experts, k=spec.top_k,
                    dtype=out_dtype_name(mode, spec.out_dtype or None), mode=mode.spec, activation=act)
    for name in list(ts.kernels):
        why = _native.C().check_kernel(args.device, name, shape)
        if why:
            ts.kernels.remove(name)
            ts.filtered[name] = why
    infos = {k.name: k for k in _native.library_for(args.device)["kernels"]}
    sm_count = _native.device_info(args.device)["sm_count"]
    gen = torch.Generator().manual_seed(1234)
    corrupt = os.environ.get(TEST_CORRUPT_ENV, "")
    for T in buckets:
        sets = []
        for _ in range(ROUTING_SETS):
            ids, wts = profiling.routing(T, spec.experts, spec.top_k, args.routing, skew=args.skew,
                                         counts=counts, gen=gen, device="cuda")
            sets.append((torch.randn(T, spec.hidden, device="cuda", dtype=spec.hidden_dtype), ids, wts))
        outs = [torch.empty_like(x) for x, _, _ in sets]
        x0, ids0, w0 = sets[0]
        ref = reference.fused_moe(x0, w13, w2, w0, ids0, activation=act, quant=spec.quant, **scales)
        rejected: dict = {}
        timings: dict = {}

        def run(tactic, x, ids, w, out):
            api.fused_moe(x, w13, w2, w, ids, quant=spec.quant, activation=act, workspace=ws,
                          out=out, tactic=tactic, **scales)

        def valid(tactic) -> bool:
            """Run once on poisoned output and compare with the reference."""
            outs[0].fill_(float("nan"))
            run(tactic, x0, ids0, w0, outs[0])
            if corrupt and corrupt in tactic.kernels:
                outs[0].add_(1.0)  # test-only hook: this candidate computes a wrong result
            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            if not err <= tol:  # NaN fails too
                rejected[str(tactic)] = f"wrong result: relative error {err:.3e} against the reference"
                return False
            return True

        # Probe: each kernel alone in both slots. A fault here is blamed on that kernel.
        good = []
        for i, k in enumerate(kk for kk in ts.kernels if kk not in excluded):
            _emit(event="try", bucket=T, tactic=f"{k}+{k}", suspect=k, index=i, count=len(ts.kernels))
            if valid(Tactic(k, k)):
                good.append(k)

        def measure(tactic, suspect, index, count):
            key = str(tactic)
            if key not in timings and key not in rejected:
                _emit(event="try", bucket=T, tactic=key, suspect=suspect, index=index, count=count)
                if valid(tactic):
                    timings[key] = time_tactic(tactic)
            return timings.get(key, float("inf"))

        def time_tactic(tactic, warmup_s=0.025) -> float:
            it = iter(range(1 << 62))

            def call():
                j = next(it) % len(sets)
                run(tactic, *sets[j], outs[j])
            return profiling.time_graph(call, args.replays, len(sets), warmup_s=warmup_s)[0] * 1e6

        # Settle the clocks first: after the reference and the probe the GPU runs above its
        # sustained clock for a while, which flattered the first timing (docs/design.md,
        # "Tactics"); confirm() does not score the search's timings anyway.
        if good:
            _emit(event="try", bucket=T, tactic=f"{good[0]}+{good[0]}", suspect=good[0], index=0, count=1)
            time_tactic(Tactic(good[0], good[0]), warmup_s=SETTLE_S)

        # Whole-forward kernels (the one-token forward) where the problem fits them: the
        # library says why not, and the record keeps it.
        forwards = {}
        for f in ts.forwards if T == 1 else ():
            if f in excluded:
                forwards[f] = excluded[f]
                continue
            try:
                forwards[f] = measure(Tactic(forward=f), f, 0, 1)
            except ValueError as e:
                forwards[f] = f"not applicable: {e}"
            forwards[f] = rejected.get(f, forwards[f])
        if not good and not timings:
            _emit(event="bucket", bucket=T, record=None)
            continue
        default = searched = default_us = None
        if good:
            default = default_tactic([infos[k] for k in good], num_tokens=T, top_k=spec.top_k,
                                     num_experts=spec.experts, hidden_size=spec.hidden,
                                     gemm1_n=(2 if act.gated else 1) * spec.inter, sm_count=sm_count,
                                     inter_size=spec.inter)
            default_us = measure(default, default.gemm1, 0, 1)
            if args.exhaustive:
                pairs = [Tactic(a, b) for a in good for b in good]
                for i, t in enumerate(pairs):
                    measure(t, t.gemm1, i, len(pairs))
            # Coordinate search: GEMM1 with GEMM2 on the default, then GEMM2 with the best
            # GEMM1. After an exhaustive run every pair is timed already, so this replays the
            # search on the same timings: what tuning would have chosen, comparable with the
            # exhaustive best.
            for i, k in enumerate(good):
                measure(Tactic(k, default.gemm2), k, i, 2 * len(good))
            best1 = min(good, key=lambda k: timings.get(str(Tactic(k, default.gemm2)), float("inf")))
            for i, k in enumerate(good):
                measure(Tactic(best1, k), k, len(good) + i, 2 * len(good))
            best2 = min(good, key=lambda k: timings.get(str(Tactic(best1, k)), float("inf")))
            searched = Tactic(best1, best2)
        if not timings:
            _emit(event="bucket", bucket=T, record=None)
            continue

        def again(key):  # a finalist, validated and timed once already
            t = Tactic.parse(key)
            _emit(event="try", bucket=T, tactic=key, suspect=t.kernels[0], index=0, count=1)
            return time_tactic(t)
        ranked = list(confirm(timings, again, default=str(default) if default else None).items())
        rec = {"tactic": ranked[0][0], "us": ranked[0][1],
               "search": str(searched) if searched else None,
               "search_us": timings.get(str(searched)) if searched else None,
               "exhaustive": bool(args.exhaustive),
               "runner_up": ranked[1][0] if len(ranked) > 1 else None,
               "runner_up_us": ranked[1][1] if len(ranked) > 1 else None,
               "finalists": dict(ranked),
               "default": str(default) if default else None, "default_us": default_us,
               "routing": args.histogram or args.routing, "candidates": len(timings),
               "rejected": rejected, "filtered": ts.filtered, "faulted": excluded}
        if forwards:
            rec["forwards"] = forwards
        _emit(event="bucket", bucket=T, record=rec)
        del sets, outs, ref
    _emit(event="done", peak_bytes=torch.cuda.max_memory_allocated(),
          weight_bytes=sum(t.numel() * t.element_size() for t in weights.values() if t is not None),
          workspace_bytes=ws.numel())
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m moe_kernels.tuning")
    p.add_argument("--worker", required=True, help="problem signature (internal: the child process)")
    p.add_argument("--buckets", required=True)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--skew", type=float, default=1.2)
    p.add_argument("--histogram")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--exclude", default="{}")
    p.add_argument("--exhaustive", action="store_true")
    sys.exit(_worker(p.parse_args()))
