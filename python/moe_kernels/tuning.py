"""The autotuner: validated tactics, realistic routing, never a crash of the caller.

- `list_tactics(...)`: every (GEMM1, GEMM2) kernel pair for a problem on this GPU, and the
  kernels filtered out with their reason (shared memory, arch, mode). Filtered kernels are
  never launched. At one token the tuner also times the one_token tactic where the problem
  fits it.
- Tuning runs in a child process (`python -m moe_kernels.tuning --worker ...`): a kernel
  that faults takes down the child, the parent records it against the candidate being
  tried, excludes it and goes on in a fresh child.
- Each candidate's output on the profiling inputs is compared with
  `moe_kernels.reference` before its time counts; wrong candidates are excluded.
- Choices are kept per token bucket in memory and in a JSON file keyed by GPU name and SM
  count, CUDA version and library version; a file with another key is ignored (warning).
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
import subprocess
import sys
import tempfile
import warnings

from . import _native
from .modes import Activation, QuantMode
from .profiling import round_robin
from .tactic import ONE_TOKEN, Tactic

# Token buckets: powers of two. A forward of T tokens uses the smallest bucket >= T (the
# largest for more tokens), tuned at the bucket's T, so a pick runs only forwards of more than
# half its T (x4 steps above 256 left a 16384-token pick on 4097 tokens, up to 11% slower per GEMM). A
# bucket without a record (a table made before 512/2048/8192 existed) takes the default rule.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CACHE_FORMAT = 1
ROUTING_SETS = 4       # rotated routing/input sets per timing (experts hit differ per forward)
REL_TOL = {"fp8": 5e-2, "fp8_block": 5e-2}  # candidate output against the float32 reference; 2e-2 for 16-bit
# A record tuned with the one_token tactic among its candidates says so (its time, or why not).
ONE_TOKEN_KEY = "one_token"
TEST_CORRUPT_ENV = "MOE_KERNELS_TEST_CORRUPT_KERNEL"  # test-only: treat this kernel's output as wrong
MAX_RESTARTS = 8
FINALISTS = 3          # fastest candidates of the search, timed again before one is chosen
CONFIRM_ROUNDS = 3     # interleaved re-timings of each finalist
SETTLE_S = 1.0         # seconds of forwards before a bucket's first timing (clocks: see _worker)
WORKER = [sys.executable, "-m", "moe_kernels.tuning"]  # the child's command (tests replace it)


def bucket_for(num_tokens: int) -> int:
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens: got {num_tokens!r}, expected a positive int")
    return next((b for b in BUCKETS if b >= num_tokens), BUCKETS[-1])


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """What a tuned choice depends on besides the token count (E is the local expert count)."""

    quant: str
    activation: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    out_dtype: str = ""  # the FP8 modes with fp16 hidden states and out: "fp16" (else bf16)

    def __post_init__(self):
        if self.out_dtype not in ("", "fp16") or (self.out_dtype and self.quant not in ("fp8", "fp8_block")):
            raise ValueError(f"out_dtype: got {self.out_dtype!r}, expected '' or 'fp16' (FP8 modes only)")

    @property
    def hidden_dtype(self):
        """The torch dtype of hidden_states and out."""
        import torch
        if self.quant in ("bf16", "fp16"):
            return torch.bfloat16 if self.quant == "bf16" else torch.float16
        return torch.float16 if self.out_dtype == "fp16" else torch.bfloat16

    @property
    def signature(self) -> str:
        return (f"{self.quant}/{self.activation}/E{self.experts}/k{self.top_k}/"
                f"H{self.hidden}/I{self.inter}" + (f"/{self.out_dtype}" if self.out_dtype else ""))

    @classmethod
    def parse(cls, signature: str) -> "ProblemSpec":
        try:
            quant, act, e, k, h, i, *out = signature.split("/")
            if len(out) > 1:
                raise ValueError
            return cls(QuantMode.parse(quant).value, Activation.parse(act).value, int(e[1:]),
                       int(k[1:]), int(h[1:]), int(i[1:]), *out)
        except (ValueError, IndexError):
            raise ValueError(f"problem signature {signature!r}: expected "
                             "quant/activation/E<n>/k<n>/H<n>/I<n>[/fp16]") from None


@dataclasses.dataclass
class TacticSet:
    """Tactics that can run for a problem on a device, and kernels filtered out, with why."""

    tactics: list
    kernels: list
    filtered: dict


def list_tactics(quant="bf16", device=None, out_dtype=None) -> TacticSet:
    """All (GEMM1, GEMM2) pairs of kernels usable for `quant` on `device` (FP8 modes: with
    output `out_dtype`, "bf16" by default or "fp16", as in list_kernels)."""
    from .api import _device_index, _out_dtype
    mode = QuantMode.parse(quant)
    out = _out_dtype(mode, out_dtype)
    dev = _device_index(device)
    usable, filtered = [], {}
    for k in _native.library_for(dev)["kernels"]:
        why = _native.kernel_problem(dev, k.name)
        if k.quant != mode.value or k.out_dtype != out:
            continue  # another mode's (or output type's) kernel: not a candidate, nothing to report
        if why:
            filtered[k.name] = why
        else:
            usable.append(k.name)
    return TacticSet([Tactic(a, b) for a in usable for b in usable], usable, filtered)


# ---- the cache ------------------------------------------------------------------------------

def cache_key(device: int) -> dict:
    from . import __version__
    info = _native.device_info(device)
    lib = _native.library_for(device)
    return {"gpu": info["name"], "sm_count": info["sm_count"],
            "cuda": lib["cuda_version"], "version": __version__}


class TuningCache:
    """Tuned tactics per problem signature and token bucket, for one GPU/CUDA/library key."""

    def __init__(self, key: dict, path: str | None = None):
        self.key = key
        self.path = path
        self.entries: dict = {}
        if path and os.path.exists(path):
            self.merge_file(path)

    def merge_file(self, path: str) -> bool:
        """Add a file's entries if its key matches ours; warn and ignore it otherwise."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"moe_kernels: ignoring tuning cache {path}: {e}")
            return False
        if data.get("format") != CACHE_FORMAT or data.get("key") != self.key:
            warnings.warn(f"moe_kernels: ignoring tuning cache {path}: it was made for "
                          f"{data.get('key')} (format {data.get('format')}), this process is "
                          f"{self.key} (format {CACHE_FORMAT})")
            return False
        for sig, buckets in data.get("entries", {}).items():
            self.entries.setdefault(sig, {}).update(buckets)
        return True

    def get(self, spec: ProblemSpec, bucket: int, *, one_token: bool = False):
        """The bucket's tactic, or None. one_token: the problem can take the one_token tactic,
        so a record tuned without it as a candidate (ONE_TOKEN_KEY absent: an older table)
        does not count."""
        rec = self.entries.get(spec.signature, {}).get(str(bucket))
        if not rec or (one_token and ONE_TOKEN_KEY not in rec):
            return None
        return Tactic(rec["gemm1"], rec["gemm2"])

    def put(self, spec: ProblemSpec, bucket: int, record: dict) -> None:
        self.entries.setdefault(spec.signature, {})[str(bucket)] = record

    def save(self, path: str | None = None) -> None:
        path = path or self.path
        if not path:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"format": CACHE_FORMAT, "key": self.key, "entries": self.entries}, f, indent=1)
        os.replace(tmp, path)


_caches: dict = {}       # device -> TuningCache holding every choice this process knows
_active: list = []       # the innermost autotune() context's settings


def _cache_for(device: int) -> TuningCache:
    """The in-memory cache of a device, seeded once with the shipped tables that match it."""
    if device not in _caches:
        cache = TuningCache(cache_key(device))
        tuned_dir = os.path.join(os.path.dirname(__file__), "tuned")
        if os.path.isdir(tuned_dir):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tables for other GPUs are expected not to match
                for name in sorted(os.listdir(tuned_dir)):
                    if name.endswith(".json"):
                        cache.merge_file(os.path.join(tuned_dir, name))
        _caches[device] = cache
    return _caches[device]


def _fp16_form(tactic):
    """An FP8 tactic tuned with bf16 output, with each kernel's fp16-output form (same tile and
    schedule; the caller checks that this build has it)."""
    if tactic is None:
        return None
    return Tactic(*(n if n == ONE_TOKEN else n.replace("_bf16_", "_fp16_", 1) for n in (tactic.gemm1, tactic.gemm2)))


def cached_tactic(spec: ProblemSpec, num_tokens: int, device: int, *, one_token: bool = False):
    """The tuned tactic for this problem's bucket, tuning it first inside autotune() (never
    during a CUDA graph capture); None when nothing is known (the default rule applies).
    one_token: as in TuningCache.get. Outside autotune(), an FP8 problem with fp16 output that
    has no record of its own takes the bf16 record's tiles (fp16_form)."""
    import torch
    cache = _cache_for(device)
    bucket = bucket_for(num_tokens)
    tactic = cache.get(spec, bucket, one_token=one_token)
    if tactic is not None:
        return tactic
    if not _active or torch.cuda.is_current_stream_capturing():
        return _fp16_form(cache.get(dataclasses.replace(spec, out_dtype=""), bucket, one_token=one_token)) \
            if spec.out_dtype == "fp16" else None
    settings = _active[-1]
    results = tune([spec], [bucket], device=device, progress=False, **settings["options"])
    rec = results.get(spec.signature, {}).get(str(bucket))
    if rec is None:
        return None
    cache.put(spec, bucket, rec)
    if settings["file"] is not None:
        settings["file"].put(spec, bucket, rec)
        settings["file"].save()
    return Tactic(rec["gemm1"], rec["gemm2"])


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
    mem = _cache_for(device)
    file_cache = None
    if cache is not None:
        file_cache = TuningCache(mem.key, cache)
        for sig, buckets in file_cache.entries.items():
            mem.entries.setdefault(sig, {}).update(buckets)
    _active.append({"file": file_cache, "options": {"routing": routing, "skew": skew,
                                                    "histogram": histogram, "replays": replays}})
    try:
        yield mem
    finally:
        _active.pop()


# ---- the parent: child processes, faults, progress ------------------------------------------

def tune(specs, buckets, *, device=None, routing="uniform", skew=1.2, histogram=None, replays=10,
         progress=True, exhaustive=False, log=None, env=None) -> dict:
    """Tune each problem at each bucket in child processes; returns {signature: {bucket: record}}.

    A child that dies (a kernel fault) is replaced; the candidate it was trying is excluded
    and reported under "faulted" in that bucket's record. `env`: extra environment variables
    for the children (the tests use it for the test-only fault and corruption hooks)."""
    from .api import _device_index
    dev = _device_index(device)
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
            for line in proc.stdout:
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
            if trying is None or restarts >= MAX_RESTARTS:
                raise RuntimeError(f"tuning {spec.signature} failed (exit {proc.returncode}) "
                                   f"outside any candidate:\n{stderr[-2000:]}")
            excluded[trying] = f"faulted (exit {proc.returncode}): {_last_error(stderr)}"
            restarts += 1
    return results


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no message"


def confirm(timings: dict, time_again, finalists: int = FINALISTS, rounds: int = CONFIRM_ROUNDS,
            default: str | None = None) -> dict:
    """The search's fastest `finalists` candidates, and the `default` rule's pair where it was
    timed, timed again round-robin for `rounds` rounds, each scored by the median of those
    re-timings; {candidate: us}, fastest first.
    On H200 one pair measured 109-131 us across runs of the same build: single timings of
    near-tied pairs pick by noise, and interleaving keeps slow drift off any one candidate. The
    search's own timings only choose the finalists: taken one after another as the GPU warms,
    they favour what was timed first (on H200 the default pair's first timing read up to 10%
    below its re-timings at 8192-16384 tokens, _worker's settle or not). The default is always
    a finalist, so a pick has beaten it in the same rounds."""
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
    tol = REL_TOL.get(spec.quant, 2e-2)
    # One workspace for the largest bucket: tuning memory is bounded by it plus the inputs.
    ws = torch.empty(api.workspace_size(max(buckets), spec.top_k, spec.experts, spec.hidden, spec.inter,
                                        quant=spec.quant, activation=act), dtype=torch.uint8, device="cuda")
    ts = list_tactics(spec.quant, out_dtype=spec.out_dtype or None)
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
            if corrupt and corrupt in (tactic.gemm1, tactic.gemm2):
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

        # Settle the clocks first. After the reference and the probe the GPU runs above its
        # sustained clock for a while: on H200 a bucket's first timing (the default pair's) read
        # up to 8% faster than the same pair re-timed among the finalists. This removed that in
        # bf16, not in fp8 at 8192+ tokens; confirm() does not score the search's timings.
        if good:
            _emit(event="try", bucket=T, tactic=f"{good[0]}+{good[0]}", suspect=good[0], index=0, count=1)
            time_tactic(Tactic(good[0], good[0]), warmup_s=SETTLE_S)

        # The one-kernel forward of one token, where the problem fits it (the runner says why not).
        one_token = None
        if T == 1 and ONE_TOKEN in excluded:
            one_token = excluded[ONE_TOKEN]
        elif T == 1:
            whole = Tactic(ONE_TOKEN, ONE_TOKEN)
            try:
                one_token = measure(whole, ONE_TOKEN, 0, 1)
            except ValueError as e:
                one_token = f"not applicable: {e}"
            if str(whole) in rejected:
                one_token = rejected[str(whole)]
        if not good and not timings:
            _emit(event="bucket", bucket=T, record=None)
            continue
        default = searched = default_us = None
        if good:
            default = default_tactic([infos[k] for k in good], num_tokens=T, top_k=spec.top_k,
                                     num_experts=spec.experts, hidden_size=spec.hidden,
                                     gemm1_n=(2 if act.gated else 1) * spec.inter, sm_count=sm_count)
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
            t = Tactic(*key.split("+"))
            _emit(event="try", bucket=T, tactic=key, suspect=t.gemm1, index=0, count=1)
            return time_tactic(t)
        ranked = list(confirm(timings, again, default=str(default) if default else None).items())
        best = Tactic(*ranked[0][0].split("+"))
        rec = {"gemm1": best.gemm1, "gemm2": best.gemm2, "us": ranked[0][1],
               "search": str(searched) if searched else None,
               "search_us": timings.get(str(searched)) if searched else None,
               "exhaustive": bool(args.exhaustive),
               "runner_up": ranked[1][0] if len(ranked) > 1 else None,
               "runner_up_us": ranked[1][1] if len(ranked) > 1 else None,
               "finalists": dict(ranked),
               "default": str(default) if default else None, "default_us": default_us,
               "routing": args.histogram or args.routing, "candidates": len(timings),
               "rejected": rejected, "filtered": ts.filtered, "faulted": excluded}
        if one_token is not None:
            rec[ONE_TOKEN_KEY] = one_token
        _emit(event="bucket", bucket=T, record=rec)
        del sets, outs, ref
    _emit(event="done", peak_bytes=torch.cuda.max_memory_allocated(),
          weight_bytes=sum(t.numel() * t.element_size() for t in weights.values() if t is not None),
          workspace_bytes=ws.numel())
    return 0


# ---- command line: python -m moe_kernels tune ------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--preset", action="append", help="model shape from the benchmark presets; repeatable")
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--quant", default="bf16")
    p.add_argument("--fp16-out", dest="fp16_out", action="store_true",
                   help="fp8/fp8_block with fp16 hidden states and output (default bf16)")
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--routing", choices=("uniform", "skewed", "balanced"), default="skewed")
    p.add_argument("--skew", type=float, default=1.2)
    p.add_argument("--histogram", help="JSON per-expert token counts from a real trace")
    p.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    p.add_argument("--replays", type=int, default=10)
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
                      f"{_us(rec, 'default_us'):>10}  {_us(rec, 'default_us', best):>12}  "
                      f"{rec['gemm1']}+{rec['gemm2']}")
            else:
                print(f"{b:>6}  {rec['us']:>9.1f}  {_us(rec, 'default_us'):>10}  {_us(rec, 'runner_up_us'):>12}  "
                      f"{rec['gemm1']}+{rec['gemm2']}")
            if ONE_TOKEN_KEY in rec:  # its time, or why it did not run
                v = rec[ONE_TOKEN_KEY]
                print(f"        {ONE_TOKEN}: {v:.1f} us" if isinstance(v, float) else f"        {ONE_TOKEN}: {v}")
            for name, why in {**rec["rejected"], **rec["faulted"]}.items():
                print(f"        rejected {name}: {why}")


def main(args) -> int:
    import torch
    from . import bench
    if not torch.cuda.is_available():
        print("No CUDA GPU is visible: nothing to tune.")
        return 1
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
