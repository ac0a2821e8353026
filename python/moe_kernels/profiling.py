"""Profiling inputs and timing, shared by the benchmark and the autotuner.

Inputs are built the way the real path builds them: weights go through
`moe_kernels.prepare` (one function per quant mode, so every buffer a mode needs exists
and holds neutral, finite values), routing is drawn as a router would draw it.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import re
import statistics
import threading
import time

ROUTINGS = ("uniform", "skewed", "balanced")


def load_histogram(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    counts = data["counts"] if isinstance(data, dict) else data
    if not counts or not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) == 0:
        raise ValueError(f"routing histogram {path}: expected a non-empty list of non-negative ints")
    return counts


def histogram_ids(counts, T, k):
    """topk_ids [T, k] whose per-expert counts follow `counts`: exactly, when they add up to
    T*k; else scaled to T*k (largest remainder). No expert twice in one token: an expert's
    pairs run down consecutive tokens of one slot column, so at most T each."""
    import torch
    E = len(counts)
    if k > E:
        raise ValueError(f"routing histogram has {E} experts, fewer than top_k={k}")
    total = sum(counts)
    want = [c * T * k / total for c in counts]
    n = [min(T, int(w)) for w in want]
    for e in sorted(range(E), key=lambda e: want[e] - int(want[e]), reverse=True):
        if sum(n) >= T * k:
            break
        if n[e] < T:
            n[e] += 1
    while sum(n) < T * k:  # caps left some pairs over: give them to experts with room
        e = min((e for e in range(E) if n[e] < T), key=lambda e: n[e])
        n[e] += 1
    labels = torch.repeat_interleave(torch.arange(E), torch.tensor(n))
    ids = torch.empty(T * k, dtype=torch.int64)
    pos = torch.arange(T * k)
    ids[(pos % T) * k + pos // T] = labels  # pair i -> token i % T, slot i // T
    return ids.view(T, k)


def routing(T, E, k, kind, *, skew=1.2, counts=None, gen=None, device="cpu"):
    """(topk_ids int32 [T, k], topk_weights float32 [T, k]) drawn as a router would."""
    import torch
    gen = gen or torch.Generator().manual_seed(0)
    if counts is not None:
        ids = histogram_ids(counts, T, k)
        ids = ids[torch.randperm(T, generator=gen)]
    elif kind == "balanced":  # every expert the same load (to within one pair)
        ids = (torch.arange(T * k) % E).view(T, k)
    else:
        if kind == "uniform":
            probs = torch.ones(E)
        elif kind == "skewed":  # Zipf-like popularity over a random permutation of the experts
            probs = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew)[torch.randperm(E, generator=gen)]
        else:
            raise ValueError(f"routing={kind!r}: expected uniform, skewed or balanced")
        ids = torch.multinomial(probs.float().expand(T, E), k, replacement=False, generator=gen)
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return ids.to(device=device, dtype=torch.int32), weights.to(device)


def time_graph(fn, replays, per_graph, warmup_s=0.025):
    """Median seconds per call of fn (and min, max), from CUDA events around replays of one
    graph holding `per_graph` calls, after at least `warmup_s` of replays; fn may rotate its
    inputs from call to call."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(per_graph):
            fn()  # warm-up outside the capture (kernel choice, attribute setup)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    # Warm up for at least 25 ms of replays (as triton's do_bench), so that clocks settle: a few
    # replays left a run's first point slower than its re-timing (docs/performance.md, "Timing").
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < warmup_s:
        g.replay()
        torch.cuda.synchronize()
        n += 1
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    del g
    return statistics.median(times), min(times), max(times)


READ_METHODS = {0: "vector loads"}  # src/probe.cu


def xor_fold(buf):
    """The XOR of a uint8 CUDA buffer's 16-byte words as two int64 (the read probe's checksum),
    computed with torch: halve, XOR the halves, repeat."""
    import torch
    w = buf.view(torch.int64).view(-1, 2)
    acc = torch.zeros(2, dtype=torch.int64, device=buf.device)
    while w.shape[0] > 1:
        if w.shape[0] % 2:
            acc ^= w[-1]
            w = w[:-1]
        h = w.shape[0] // 2
        w = w[:h] ^ w[h:]
    return acc ^ w[0] if w.shape[0] else acc


def read_probe(buf, method, checksum):
    """Launch the read-only probe (src/probe.cu) over `buf` (uint8, CUDA, 16-byte multiple) on
    the current stream, XOR-ing its 16-byte words into `checksum` (2 x int64, CUDA)."""
    import torch
    from ._native import C
    C().read_probe(buf.device.index, buf.data_ptr(), buf.numel(), method, checksum.data_ptr(),
                   torch.cuda.current_stream(buf.device).cuda_stream)


def read_rates(nbytes, windows=8, replays=20):
    """The read-only streaming rate (bytes/s) over `nbytes` (rounded up to 16), per method,
    timed as the benchmark times forwards: graph replays (median), each graph reading
    `windows` distinct buffers of that size in turn, as its forwards read the weights of
    different experts (so a small size is not served from L2 any more than they are). The
    buffers are random; each method's checksum over every window is checked against torch's
    once, so a probe that skipped bytes fails loudly instead of reading fast.
    {method name: bytes/s, or None where the method does not run}."""
    import torch
    size = max(16, -(-int(nbytes) // 16) * 16)
    pool = torch.randint(-128, 128, (windows, size), dtype=torch.int8, device="cuda").view(torch.uint8)
    checksum = torch.zeros(2, dtype=torch.int64, device="cuda")
    want = xor_fold(pool.view(-1))
    rates = {}
    for method, name in READ_METHODS.items():
        checksum.zero_()
        try:
            for w in range(windows):
                read_probe(pool[w], method, checksum)
        except RuntimeError:  # a method this GPU does not run
            rates[name] = None
            continue
        if not torch.equal(checksum, want):
            raise RuntimeError(f"read probe ({name}) over {windows} x {size} bytes: checksum "
                               f"{checksum.tolist()}, expected {want.tolist()}")
        it = iter(range(1 << 62))
        rates[name] = size / time_graph(lambda: read_probe(pool[next(it) % windows], method, checksum),
                                        replays, windows)[0]
    return rates


def round_robin(candidates: dict, time_one, rounds: int):
    """Time each named candidate in turn, `rounds` times over, so slow drift (clocks, heat) hits
    all alike: ({name: median}, {name: [every time]})."""
    times = {n: [] for n in candidates}
    for _ in range(rounds):
        for n, c in candidates.items():
            times[n].append(time_one(c))
    return {n: statistics.median(v) for n, v in times.items()}, times


def kernel_times(fn, calls):
    """Mean GPU microseconds per call of fn of each kernel it launches, from torch.profiler over
    `calls` eager calls after one warm-up. Kernels that wait on their predecessor (PDL) count
    the wait: set MOE_KERNELS_PDL=0 for each kernel's own time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us > 0:
            totals[e.key] = totals.get(e.key, 0.0) + us / calls
    short = short_kernel_names(totals)
    return {short[k]: us for k, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def short_kernel_names(names, width=110) -> dict:
    """{full name: a readable name of at most about `width` characters}, distinct per kernel:
    without "void", the parameter list and our namespaces; a longer one keeps its head and a
    tail that grows until no two kernels share a short name (two decode kernels differ only
    in template arguments near the end)."""
    def tidy(n):
        n = re.sub(r"^void ", "", n)
        n = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", n)  # the parameter list
        return n.replace("moe_kernels::", "").replace("(anonymous namespace)::", "")
    names = list(names)
    tidied = {n: tidy(n) for n in names}
    if len(set(tidied.values())) < len(names):
        tidied = {n: n for n in names}  # the parameter lists were what told them apart
    out, tail = {}, 35
    while True:
        out = {n: t if len(t) <= width else f"{t[:width - tail - 5]} ... {t[-tail:]}"
               for n, t in tidied.items()}
        if len(set(out.values())) == len(out) or tail >= width:
            break
        tail += 15
    if len(set(out.values())) < len(out):  # still equal: number them
        out = {n: f"{s} #{i}" for i, (n, s) in enumerate(out.items())}
    return out


def make_weights(quant, activation, experts, hidden, inter, *, device="cuda", seed=0):
    """Random expert weights of a problem, prepared exactly as FusedMoE.load_weights would."""
    import torch
    from .modes import Activation, QuantMode
    from .prepare import prepare_weights, quantize_weights
    from .problem import DTYPES
    from .reference import MODES
    mode = QuantMode.parse(quant)
    if mode.value not in MODES:
        raise NotImplementedError(f"profiling inputs for quant={mode.value!r} are not written yet")
    dtype = DTYPES[mode.spec.hidden[0]]
    n1 = 2 * inter if Activation.parse(activation).gated else inter
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(experts, n1, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * inter ** -0.5
    if mode.spec.weight != "w16":  # fp8: per channel, as checkpoints mostly ship; int4: symmetric, group 128
        return quantize_weights(w13, w2, quant=mode, activation=activation, scale_dtype=dtype, device=device)
    return prepare_weights(w13, w2, quant=mode, activation=activation, device=device)


class GpuSampler:
    """The GPU's SM clock (MHz) and board power (W), sampled from a thread while a block of work
    runs (`with sampler.window() as w: ...`, then w["sm_mhz"], w["power_w"], w["samples"]).

    Why: the FP8 GEMMs run power-capped (an H200 at 700 W holds ~1.4-1.6 GHz, not its 1.98 GHz
    boost), so a kernel's rate, and its share of the dense one, depends on the clock it ran at.
    The power is NVML's, which on Ampere and newer is an average over the last second: over a
    shorter window it lags. `read` returns one (MHz, W) sample; by default NVML through the
    driver's libnvidia-ml (no Python package needed) for torch's current device. Where NVML is
    missing or fails, the sampler is `available == False` and its windows stay empty: nothing
    else changes."""

    def __init__(self, read=None, period_s=0.005):
        self.period_s = period_s
        self.read = read
        if read is None:
            try:
                self.read = _nvml_reader()
            except Exception:  # no driver library, no CUDA device, an older torch: no samples
                self.read = None
        self.available = self.read is not None

    @contextlib.contextmanager
    def window(self):
        result = {}
        if not self.available:
            yield result
            return
        samples, stop = [], threading.Event()

        def run():
            while not stop.is_set():
                try:
                    samples.append(self.read())
                except (OSError, RuntimeError):
                    return
                stop.wait(self.period_s)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield result
        finally:
            stop.set()
            thread.join()
            if samples:
                result.update(sm_mhz=statistics.median(m for m, _ in samples),
                              power_w=statistics.median(w for _, w in samples), samples=len(samples))


def _nvml_reader():
    """A function that reads (SM clock MHz, board power W) of torch's current CUDA device from
    NVML, found by PCI bus id (NVML's indices need not be CUDA's)."""
    import torch
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit failed")
    prop = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus_id = f"{prop.pci_domain_id:08X}:{prop.pci_bus_id:02X}:{prop.pci_device_id:02X}.0".encode()
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus_id), ctypes.byref(handle)) != 0:
        raise RuntimeError(f"NVML has no device at PCI bus id {bus_id.decode()}")
    NVML_CLOCK_SM = 1

    def read():
        mhz, mw = ctypes.c_uint(), ctypes.c_uint()
        if (lib.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM, ctypes.byref(mhz)) != 0 or
                lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)) != 0):
            raise RuntimeError("NVML clock or power query failed")
        return float(mhz.value), mw.value / 1000.0
    return read
