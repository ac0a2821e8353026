"""`python -m moe_kernels bench`: the whole fused layer, timed against its floors and peers.

Method (docs/design.md, "Measuring"): CUDA events around CUDA-graph replays, median of many; each
graph holds several forwards over rotated routing/input sets, so the experts hit differ
from one forward to the next and weights come from HBM, not L2. In the same run: the
measured copy bandwidth and dense GEMM rate (the ceilings), per point the read-only streaming
rate at its weight size and the bandwidth floor from it (the weights of the experts actually hit
read at that rate, the activations at the copy rate) and the FLOP floor, and every peer
present on the machine, each checked against moe_kernels.reference before it is timed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys

from .. import _native
from ..modes import MODES, Activation, QuantMode
from ..profiling import (ROUTINGS, GpuSampler, kernel_times, load_histogram, make_weights, round_robin, routing,
                        time_graph)

PRESETS = {  # experts, top_k, hidden, intermediate (docs/design.md, "Measuring")
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "deepseek-v3": (256, 8, 7168, 2048),
    "deepseek-v4-pro": (384, 6, 7168, 3072),
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
DEFAULT_PRESETS = ["mixtral-8x7b", "qwen3-30b-a3b"]
DEFAULT_TOKENS = [1, 16, 128, 1024, 4096]
ROUTING_SETS = 8   # forwards per graph, each on its own routing and input set
STEPS = ["routing", "gemm1", "activation", "gemm2", "finalize"]


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int


def shapes_from_args(args) -> list:
    """The model shapes to run: presets (default two), or one custom shape; --tp/--ep divide."""
    custom = (args.experts, args.top_k, args.hidden, args.intermediate)
    if any(custom):
        if not all(custom):
            raise SystemExit("custom shape: give all of --experts, --top-k, --hidden, --intermediate")
        shapes = [Shape("custom", *custom)]
    else:
        names = args.preset or DEFAULT_PRESETS
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise SystemExit(f"--preset {unknown}: expected one of {sorted(PRESETS)}")
        shapes = [Shape(n, *PRESETS[n]) for n in names]
    out = []
    for s in shapes:
        if args.tp < 1 or args.ep < 1 or s.inter % args.tp or s.experts % args.ep:
            raise SystemExit(f"{s.name}: I={s.inter} must divide by --tp {args.tp} and "
                             f"E={s.experts} by --ep {args.ep}")
        suffix = "".join(f"-{k}{v}" for k, v in (("tp", args.tp), ("ep", args.ep)) if v > 1)
        out.append(Shape(s.name + suffix, s.experts // args.ep, s.top_k, s.hidden, s.inter // args.tp))
    return out


def parse_tactic(text):
    """--tactic GEMM1+GEMM2 or --tactic FORWARD -> a Tactic (None when not given)."""
    if not text:
        return None
    from ..tactic import Tactic
    try:
        return Tactic.parse(text)
    except TypeError:
        raise SystemExit(f"--tactic {text!r}: expected two GEMM kernel names joined by '+', or one "
                         "forward kernel's name (python -m moe_kernels info lists them)") from None


def parse_tokens(text: str) -> list:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--tokens {text!r}: expected comma-separated integers") from None
    if not tokens or min(tokens) < 1:
        raise SystemExit(f"--tokens {text!r}: expected positive integers")
    return tokens


def add_arguments(p) -> None:
    add_problem_arguments(p)
    p.add_argument("--replays", type=int, default=30, help="timed graph replays per point")
    p.add_argument("--no-peers", action="store_true", help="time moe_kernels only")
    p.add_argument("--sweep", action="store_true",
                   help="also time every built kernel in each GEMM slot (the other on the default)")
    p.add_argument("--sweep-only", metavar="REGEX", type=_regex,
                   help="--sweep, only the kernels whose names match (e.g. to skip slow decode tiles at large T)")
    p.add_argument("--sweep-rounds", type=_positive, default=1, metavar="N",
                   help="time each slot's candidates round-robin N times and report the medians "
                        "(near-tied tiles: one timing each picks by drift)")
    p.add_argument("--compare", metavar="PAIRS", type=_pairs,
                   help="also time these GEMM1+GEMM2 pairs (comma-separated) against each other, round-robin "
                        "--sweep-rounds times (e.g. the tuned picks of two token buckets)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each step (routing, GEMM1, activation, GEMM2, finalize)")
    p.add_argument("--host", action="store_true",
                   help="also time the host side of an eager call with workspace= and out= given (the GPU "
                        "held busy, so that no launch waits): the library's overhead per forward")
    p.add_argument("--kernels", action="store_true",
                   help="also list each kernel's GPU time per forward (torch.profiler, eager calls; "
                        "run with MOE_KERNELS_PDL=0 so that no kernel's time holds a wait)")
    p.add_argument("--clocks", action="store_true",
                   help="also sample the SM clock and board power (NVML) while ours and the dense ceiling "
                        "are timed: the clock drops under the power cap; more --replays give more samples")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--plot", help="write a plot (PNG) to this file; needs matplotlib")
    p.add_argument("--markdown", help="write the results as a Markdown table to this file")


def hidden_dtype(args):
    """The torch dtype of the hidden states and output (--quant, --fp16-out)."""
    import torch
    hidden = QuantMode.parse(args.quant).spec.hidden
    if getattr(args, "fp16_out", False):
        if "fp16" not in hidden[1:]:
            raise SystemExit(f"--fp16-out is for modes with bf16 or fp16 hidden states, not {args.quant}")
        return torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[hidden[0]]


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return v


def _pairs(text: str) -> list:
    from ..tactic import Tactic
    pairs = [p.split("+") for p in text.split(",")]
    if len(pairs) < 2 or any(len(p) != 2 or not all(p) for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected two or more GEMM1+GEMM2 pairs, comma-separated")
    return [Tactic(*p) for p in pairs]


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a regular expression ({e})") from None
    return text


def add_preset_argument(p, default: str) -> None:
    """--preset NAME, repeatable; argparse rejects an unknown name and lists the presets."""
    p.add_argument("--preset", action="append", choices=list(PRESETS), metavar="NAME",
                   help=f"model shape, repeatable; one of {', '.join(PRESETS)} ({default})")


def add_shape_arguments(p) -> None:
    """A custom shape (all four, instead of --preset) and the parallel split (bench, profile, tune)."""
    p.add_argument("--experts", type=int, metavar="E", help="custom shape: number of experts")
    p.add_argument("--top-k", dest="top_k", type=int, metavar="K", help="custom shape: experts per token")
    p.add_argument("--hidden", type=int, metavar="H", help="custom shape: hidden size")
    p.add_argument("--intermediate", type=int, metavar="I", help="custom shape: expert intermediate size")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: divides I (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size: divides E (one rank's share; default 1). Under torchrun "
                        "(--nproc-per-node equal to it) every rank times its share, and its all-to-all "
                        "dispatch and combine beside it")


def add_problem_arguments(p) -> None:
    """The shapes, inputs and tactic of the points (bench and profile)."""
    add_preset_argument(p, f"default: {' and '.join(DEFAULT_PRESETS)}")
    add_shape_arguments(p)
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated token counts (default %(default)s)")
    p.add_argument("--quant", default="bf16", choices=list(MODES), metavar="MODE",
                   help=f"quantization mode, one of {', '.join(MODES)} (default bf16; "
                        "`python -m moe_kernels info` lists those this build runs)")
    p.add_argument("--fp16-out", dest="fp16_out", action="store_true",
                   help="fp8/fp8_block with fp16 hidden states and output (default bf16)")
    p.add_argument("--activation", default="swiglu", type=str.lower, choices=[a.value for a in Activation],
                   metavar="NAME",
                   help=f"expert activation, one of {', '.join(a.value for a in Activation)} (default swiglu)")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help=f"how tokens pick experts: {', '.join(ROUTINGS)} (default uniform)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent for --routing skewed (default 1.2)")
    p.add_argument("--routing-file", help="JSON list of per-expert token counts from a real trace "
                                          "(or {\"counts\": [...]}); overrides --routing")
    p.add_argument("--tactic", help="run this GEMM1+GEMM2 pair (kernel names joined by '+') "
                   "instead of the tuned or default choice")


# ---- floors --------------------------------------------------------------------------------

def floors(*, tokens, top_k, hidden, inter, gated, experts_hit, elem_bytes, copy_bw, gemm_rate,
           weight_elem_bytes=None, read_bw=None):
    """Bytes, FLOPs and the floor times (seconds) of one forward.

    Bytes: the weights of the experts hit (weight_elem_bytes each, default elem_bytes), the
    input and output activations (elem_bytes), ids and routing weights.
    FLOPs: 2 per multiply-add in both GEMMs over the routed (token, slot) pairs.
    The bandwidth floor reads the weights at `read_bw` (the read-only probe's rate over a
    buffer of their size; the copy rate when not given) and moves the activations at the copy
    rate; `copy_floor_s` is all bytes at the copy rate."""
    n1 = 2 * inter if gated else inter
    wb = elem_bytes if weight_elem_bytes is None else weight_elem_bytes
    weight_bytes = experts_hit * (n1 * hidden + hidden * inter) * wb
    act_bytes = 2 * tokens * hidden * elem_bytes + tokens * top_k * 8
    flops = 2 * tokens * top_k * (hidden * n1 + inter * hidden)
    total = weight_bytes + act_bytes
    bw_floor = weight_bytes / (read_bw or copy_bw) + act_bytes / copy_bw
    return {"bytes": total, "weight_bytes": weight_bytes, "flops": flops, "bw_floor_s": bw_floor,
            "copy_floor_s": total / copy_bw, "flop_floor_s": flops / gemm_rate,
            "floor_s": max(bw_floor, flops / gemm_rate)}


class ReadCeiling:
    """The read-only streaming rate at a forward's weight size (`profiling.read_rates`, best
    method), measured once per MiB of size in this run: the decode floor's ceiling (a forward
    that streams its weights once reads, it does not copy), each graph reading ROUTING_SETS
    buffers of that size in turn, as its forwards read different experts' weights."""

    def __init__(self):
        self.rates = {}

    def __call__(self, nbytes):
        from ..profiling import read_rates
        # Past a GiB the rate no longer depends on the size: 2 GiB at most, fewer windows.
        mib = min(2048, max(1, round(nbytes / (1 << 20))))
        if mib not in self.rates:
            self.rates[mib] = read_rates(mib << 20, windows=max(1, min(ROUTING_SETS, 1024 // mib)))
        return max(r for r in self.rates[mib].values() if r), self.rates[mib]


# ---- timing --------------------------------------------------------------------------------

def measure_ceilings(quant, sampler=None):
    """Copy bandwidth (bytes read + written per second), and the dense GEMM rate (FLOP/s) in the
    mode's arithmetic (fp8: torch._scaled_mm, E4M3 x E4M3 -> bf16) sustained and in a burst.

    The copy is an elementwise kernel over 2 GiB (a memcpy node inside a CUDA graph can go to
    the copy engines, slower than the SMs). The GEMM rate is the best of three rounds of graphs
    of four 8192^3 GEMMs, taken after a second of such GEMMs, so the card is at the same power
    cap as during the forwards. The burst rate is the same best of three, taken first, while the
    SM clock may still be at its boost: it varies from one process to the next, so percentages
    are of the sustained rate (docs/performance.md, "How the benchmark measures"). The last
    value: the SM clock and power during the sustained rounds, from `sampler` (a GpuSampler),
    or {}."""
    import torch
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    t = time_graph(lambda: torch.mul(src, 1.0, out=dst), replays=20, per_graph=1)[0]
    bw = 2 * src.numel() * src.element_size() / t
    del src, dst
    n = 8192
    if MODES[quant].act_format.element == "e4m3":  # the FP8 tensor-core rate
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        gemm = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[MODES[quant].hidden[0]]
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        gemm = lambda: torch.matmul(a, b)  # noqa: E731
    burst = min(time_graph(gemm, replays=10, per_graph=4)[0] for _ in range(3))
    with sampler.window() if sampler else contextlib.nullcontext({}) as clocks:
        sustained = min(time_graph(gemm, replays=10, per_graph=4, warmup_s=1.0 if r == 0 else 0.025)[0]
                        for r in range(3))
    return bw, 2 * n ** 3 / sustained, 2 * n ** 3 / burst, clocks


# ---- peers ---------------------------------------------------------------------------------

def _torch_moe(x, wts, ids, act, num_experts, gemm1, gemm2):
    """Plain PyTorch: sort by expert, gemm1, activation, gemm2, weighted index_add_.
    gemm(a, offs) is one grouped GEMM over the expert-sorted rows a (x.dtype or float32).
    No host sync, so it is graph-captured like ours."""
    import torch
    from ..reference import apply_activation
    T, k = ids.shape
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.searchsorted(flat[order], torch.arange(1, num_experts + 1, device=x.device)).to(torch.int32)
    a = apply_activation(gemm1(x[token], offs).float(), act)
    y = gemm2(a, offs).float() * wts.flatten()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def torch_grouped_mm_moe(x, w13, w2, wts, ids, act):
    """The 16-bit peer: torch._grouped_mm for both GEMMs."""
    import torch

    def gemm(w):
        return lambda a, offs: torch._grouped_mm(a.to(x.dtype), w.transpose(1, 2), offs=offs)

    return _torch_moe(x, wts, ids, act, w13.shape[0], gemm(w13), gemm(w2))


def torch_scaled_grouped_mm_moe(x, w13, w2, wts, ids, act, w13_scale, w2_scale):
    """The fp8 peer: dynamic per-row activation quantization and torch._scaled_grouped_mm
    (row-wise scales, fast accumulation) for both GEMMs."""
    import torch
    from ..fp8 import quantize_per_token
    E = w13.shape[0]

    def gemm(w, scale):
        s_w = scale.reshape(E, -1).expand(E, w.shape[1]).contiguous()  # per tensor -> per channel

        def run(a, offs):  # bf16 out, the only grouped output type it takes; cast for fp16
            q, s = quantize_per_token(a)
            return torch._scaled_grouped_mm(q, w.transpose(1, 2), s.reshape(-1), s_w, offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=True).to(x.dtype)
        return run

    return _torch_moe(x, wts, ids, act, E, gemm(w13, w13_scale), gemm(w2, w2_scale))


def unpadded_ks(w13, w2, w13_scale=None, w2_scale=None):
    """(H, I), each GEMM's K, for prepared 4-bit weights, whose shapes give K only up to its
    padding to 128: H is w2's N (16 * shape[2]), I the scales' group (H / w13_scale's K/g, one
    group in both GEMMs) times w2_scale's K/g. (None, None) for other weights (K is their shape's)."""
    from .. import quant4
    if not quant4.is_prepared(w2):
        return None, None
    H = quant4.FRAGMENT_ROWS * w2.shape[2]
    return H, H // w13_scale.shape[1] * w2_scale.shape[1]


class Bf16GroupedMM:
    """torch._grouped_mm on a bf16 copy of the weights, made once per weight tensor, with the
    hidden states cast in and the output cast back. The fp16 peer: torch._grouped_mm's fp16
    path copies its offsets to the host, which a CUDA graph cannot capture, so an fp16 stack
    without a kernel of its own would serve this. Checked against the reference on that copy."""
    tolerance = MODES["bf16"].tolerance

    def __init__(self):
        self._key, self._w = None, None

    def to_bf16(self, w, scale, K=None):
        import torch
        return w.to(torch.bfloat16)

    def release(self) -> None:
        """Drops the copy (free_other_peers); the next call makes it again."""
        self._key, self._w = None, None

    def weights(self, w13, w2, w13_scale=None, w2_scale=None):
        key = (w13.data_ptr(), w2.data_ptr())
        if self._key != key:
            self._key, self._w = None, None  # the last shape's copy goes first
            H, I = unpadded_ks(w13, w2, w13_scale, w2_scale)
            self._key, self._w = key, (self.to_bf16(w13, w13_scale, H), self.to_bf16(w2, w2_scale, I))
        return self._w

    def __call__(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        import torch
        y = torch_grouped_mm_moe(x.to(torch.bfloat16), *self.weights(w13, w2, w13_scale, w2_scale), wts, ids, act)
        return y.to(x.dtype)

    def reference(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        import torch
        from ..reference import fused_moe
        return fused_moe(x.to(torch.bfloat16), *self.weights(w13, w2, w13_scale, w2_scale), wts, ids,
                         activation=act)


class DequantizedGroupedMM(Bf16GroupedMM):
    """The peer of modes PyTorch has no grouped GEMM for (fp8_block, INT4, MXFP4): the checkpoint's
    weights are dequantized to bf16 once (what a stack without such a kernel can serve, at the
    bf16 weight bytes) and torch._grouped_mm runs on them, in bf16 also for fp16 hidden
    states. Its activations stay 16-bit, so it is checked against the 16-bit reference on those
    weights, not the quantized mode's."""

    def __init__(self, layout: str):  # quant4.prepared_layout of the mode
        super().__init__()
        self.layout = layout

    def to_bf16(self, w, scale, K=None):  # one expert at a time: float32 temporaries of one expert
        import torch
        from .. import quant4
        from ..reference import dequantize_weight
        if quant4.is_prepared(w):  # 4-bit: [E, ceil(K/128), N/16, 1024], unprepared to K per expert
            shape = (w.shape[0], quant4.FRAGMENT_ROWS * w.shape[2], K)
        else:
            shape, K = w.shape, None
        out = w.new_empty(shape, dtype=torch.bfloat16)
        for e in range(w.shape[0]):
            out[e] = dequantize_weight(w[e], self.layout, scale[e], K=K).to(torch.bfloat16)
        return out


class OwnBf16:
    """For the W4A16 modes: this package's bf16 mode on the weights the PyTorch peer dequantized
    (its copy, not a second one): the same forward with 16-bit weights, four times the weight
    bytes at the same tensor-core rate, the ceiling a 4-bit prefill kernel is held against.
    Checked against the 16-bit reference on those weights."""
    tolerance = MODES["bf16"].tolerance

    def __init__(self, dequantized: "DequantizedGroupedMM"):
        self.dequantized = dequantized

    def __call__(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        import torch
        import moe_kernels
        b13, b2 = self.dequantized.weights(w13, w2, w13_scale, w2_scale)
        return moe_kernels.fused_moe(x.to(torch.bfloat16), b13, b2, wts, ids, activation=act).to(x.dtype)

    def reference(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        return self.dequantized.reference(x, w13, w2, wts, ids, act, w13_scale, w2_scale)


class OwnFp8(Bf16GroupedMM):
    """For the 4-bit modes: this package's own `fp8` per-tensor-activation, per-channel-weight
    mode on the same weights (dequantized, then quantized to E4M3 once), the baseline that
    mixed-input MoE work compares with: twice the 4-bit weight bytes. Checked against the fp8
    reference on those E4M3 weights."""
    tolerance = MODES["fp8"].tolerance

    def __init__(self, layout: str):
        super().__init__()
        self.dequantized = DequantizedGroupedMM(layout)

    def to_bf16(self, w, scale, K=None):  # E4M3 and its per-channel scales, made once per weight tensor
        import torch
        from ..fp8 import quantize_weight
        # one expert at a time: a 16-bit copy of all experts and its float32 temporaries do not
        # fit beside the other peers' weights for DeepSeek-V4-Pro
        parts = [quantize_weight(self.dequantized.to_bf16(w[e:e + 1], scale[e:e + 1], K), "channel")
                 for e in range(w.shape[0])]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    def __call__(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        import moe_kernels
        (q13, s13), (q2, s2) = self.weights(w13, w2, w13_scale, w2_scale)
        return moe_kernels.fused_moe(x, q13, q2, wts, ids, quant="fp8", activation=act, w13_scale=s13, w2_scale=s2)

    def reference(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        from ..reference import fused_moe
        (q13, s13), (q2, s2) = self.weights(w13, w2, w13_scale, w2_scale)
        return fused_moe(x, q13, q2, wts, ids, quant="fp8", activation=act, w13_scale=s13, w2_scale=s2)


def _align_blocks(ids, num_experts, block):
    """vLLM's moe_align_block_size in plain PyTorch, with no host sync: the flat (token, slot)
    ids sorted by expert, each expert's run padded with the id T*k (no row) to a multiple of
    `block`; the expert of each block; the padded length. All int32, on ids' device."""
    import torch
    flat = ids.flatten().long()
    M, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    ends = torch.searchsorted(expert, torch.arange(1, num_experts + 1, device=dev))
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block - 1) // block * block
    padded_ends = torch.cumsum(padded, 0)
    shift = (padded_ends - padded) - (ends - counts)  # each expert's padded start minus its start
    size = -(-(M + min(M, num_experts) * (block - 1)) // block) * block  # room for the worst padding
    sorted_ids = torch.full((size,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, shift[expert] + torch.arange(M, device=dev), order.to(torch.int32))
    block_starts = torch.arange(0, size, block, device=dev)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_ends[-1:].to(torch.int32)


def _humming_tensors(w, scale, layout):
    """This package's 4-bit weights in the checkpoint packing ([E, N, K/2]: quant4.unprepare of
    the prepared ones; humming takes that packing) with their prepared scales [E, K/g, N], as
    humming's weight schema and tensors: the same nibbles as int32 words along K (element i in
    bits 4i), scales [E, N, K/g]. INT4's two's-complement q becomes humming's offset-binary
    q + 8 (its symmetric uint4); MXFP4's prepared powers of two go back to E8M0 exponents (the
    placed layout's less their fold)."""
    import torch
    from .. import quant4
    s = scale.transpose(1, 2)
    config = {"dtype": "uint4", "group_size": 2 * w.shape[2] // s.shape[2]}
    if layout == "int4":
        w = w ^ 0x88
    else:
        config.update(dtype="float4e2m1", scale_dtype="float8e8m0")
        fold = quant4.PLACED_FOLD[scale.dtype] if layout == quant4.PLACED else 0
        s = (torch.log2(s.float()) + 127 - fold).round().to(torch.uint8).view(torch.float8_e8m0fnu)
    return config, {"weight": w.contiguous().view(torch.int32), "weight_scale": s.contiguous()}


class HummingMoE:
    """humming-kernels (the vLLM project's JIT-compiled quantized GEMM library) for the 4-bit
    modes: both GEMMs are its indexed MoE GEMM (vLLM fused_moe's layout: expert-sorted,
    block-padded (token, slot) ids), each with humming's own heuristic tile config for the
    routed row count; the alignment, activation and weighted sum are PyTorch. For W4A8
    (`fp8_inputs`) its GEMMs quantize their 16-bit inputs to E4M3 per token themselves (its
    `dynamic_token` input mode; MXFP4's group scales folded into the FP8 operand before the
    MMA). Its layers are built once per weight tensor from the prepared weights unprepared
    (quant4.unprepare: the checkpoint packing, which humming repacks itself). Same weights and
    arithmetic as the mode, so it is checked against the mode's reference."""
    INDEXED = json.dumps({"gemm_type": "indexed"})
    # Building its layers asks for an int32 per weight value (28 GiB for DeepSeek-V3's GEMM1):
    # run before the peers whose copies of the weights would otherwise sit beside that.
    runs_first = True

    def __init__(self, layout: str, fp8_inputs: bool = False):
        self.layout, self.fp8_inputs = layout, fp8_inputs
        self._key, self._layers, self._tiles = None, None, {}

    def _layer(self, w, scale, K):
        import torch
        from humming.layer import HummingLayer
        from .. import quant4
        w = quant4.unprepare(w, K, self.layout)  # humming repacks the checkpoint packing itself
        config, tensors = _humming_tensors(w, scale, self.layout)
        inputs = {"dtype": "float8e4m3", "quant_mode": "dynamic_token"} if self.fp8_inputs else None
        with torch.device(w.device):
            # its SM90 tiles are at least 128 wide along N: pad N (gpt-oss's 2880) to a multiple
            layer = HummingLayer(shape_n=w.shape[1], shape_k=2 * w.shape[2], weight_config=config,
                                 input_config=inputs, num_experts=w.shape[0], pad_n_to_multiple=128,
                                 torch_dtype=scale.dtype)
        layer.load_from_tensors(tensors)
        layer.transform()  # humming's repacking for this GPU
        return layer

    def release(self) -> None:
        """Drops the layers (free_other_peers); the next call makes them again."""
        self._key, self._layers, self._tiles = None, None, {}

    def weights(self, w13, w2, w13_scale, w2_scale):
        key = (w13.data_ptr(), w2.data_ptr())
        if self._key != key:
            self._key, self._layers, self._tiles = None, None, {}  # the last shape's layers go first
            H, I = unpadded_ks(w13, w2, w13_scale, w2_scale)
            self._key, self._layers = key, (self._layer(w13, w13_scale, H), self._layer(w2, w2_scale, I))
        return self._layers

    def _tile(self, layer, rows):
        """humming's tile config for `rows` routed rows (JSON) and its M tile, the block the ids
        are padded to; chosen once per GEMM and row count, before any graph is captured."""
        if (id(layer), rows) not in self._tiles:
            from humming.tune import get_heuristics_config
            config = get_heuristics_config(layer.humming_config, shape_m=rows, gemm_type="indexed")
            self._tiles[id(layer), rows] = (json.dumps(config), config["block_shape"][0])
        return self._tiles[id(layer), rows]

    def __call__(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        from ..reference import apply_activation
        T, k = ids.shape
        aligned = {}  # the two GEMMs may take different M tiles

        def gemm(layer, a, top_k):  # output row t*k + j: token t through its j-th expert
            tuning, block = self._tile(layer, T * k)
            if block not in aligned:
                aligned[block] = _align_blocks(ids, w13.shape[0], block)
            sorted_ids, expert_ids, padded = aligned[block]
            return layer(a, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                         top_k=top_k, compute_config=self.INDEXED, tuning_config=tuning)

        l13, l2 = self.weights(w13, w2, w13_scale, w2_scale)
        h = apply_activation(gemm(l13, x, k).float(), act).to(x.dtype)
        y = gemm(l2, h, 1).view(T, k, -1).float() * wts.float()[..., None]
        return y.sum(1).to(x.dtype)


def _humming_peer(quant):
    """(name, HummingMoE or None, why not) for a 4-bit mode."""
    import importlib.util
    name = "humming-kernels"
    if MODES[quant].act not in ("a16", "fp8_row"):
        return name, None, f"not for {quant}"
    if importlib.util.find_spec("humming") is None:
        return name, None, "not installed"
    from .. import quant4
    return name, HummingMoE(quant4.prepared_layout(MODES[quant]), fp8_inputs=MODES[quant].act == "fp8_row"), None


class OwnW4A16:
    """For the W4A8 modes: this package's W4A16 mode on the same 4-bit weights and scales (16-bit
    GEMM inputs instead of E4M3), checked against the W4A16 reference. MXFP4 weights are moved
    to W4A16's placed layout and their scales folded once per weight tensor (a copy)."""

    def __init__(self, weight_format: str):
        self.quant = {"int4": "w4a16_int4", "mxfp4": "w4a16_mxfp4"}[weight_format]
        self.tolerance = MODES[self.quant].tolerance
        self._key, self._weights = None, None

    def weights(self, w13, w2, w13_scale, w2_scale):
        from .. import quant4
        if quant4.prepared_layout(MODES[self.quant]) != quant4.PLACED:
            return w13, w2, w13_scale, w2_scale
        key = (w13.data_ptr(), w2.data_ptr())
        if self._key != key:
            self._key, self._weights = None, None
            fold = 2.0 ** quant4.PLACED_FOLD[w13_scale.dtype]
            self._key, self._weights = key, (quant4.place_e2m1(w13), quant4.place_e2m1(w2),
                                             (w13_scale.float() * fold).to(w13_scale.dtype),
                                             (w2_scale.float() * fold).to(w2_scale.dtype))
        return self._weights

    def release(self) -> None:
        """Drops the copies (free_other_peers)."""
        self._key, self._weights = None, None

    def __call__(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        import moe_kernels
        w13, w2, w13_scale, w2_scale = self.weights(w13, w2, w13_scale, w2_scale)
        return moe_kernels.fused_moe(x, w13, w2, wts, ids, quant=self.quant, activation=act,
                                     w13_scale=w13_scale, w2_scale=w2_scale)

    def reference(self, x, w13, w2, wts, ids, act, w13_scale=None, w2_scale=None):
        from ..reference import fused_moe
        w13, w2, w13_scale, w2_scale = self.weights(w13, w2, w13_scale, w2_scale)
        return fused_moe(x, w13, w2, wts, ids, quant=self.quant, activation=act, w13_scale=w13_scale,
                         w2_scale=w2_scale)


def _vllm_triton(x, w13, w2, wts, ids, act):
    from vllm.model_executor.layers.fused_moe import fused_experts
    return fused_experts(x, w13, w2, wts, ids)


def _sglang_triton(x, w13, w2, wts, ids, act):
    from sglang.srt.layers.moe.fused_moe_triton import fused_experts
    return fused_experts(x, w13, w2, (wts, ids, None))


def _flashinfer_cutlass(x, w13, w2, wts, ids, act):
    import flashinfer
    # FlashInfer stacks [up | gate]; ours is [gate | up]
    I = w2.shape[2]
    w31 = w13.view(w13.shape[0], 2, I, -1).flip(1).reshape_as(w13)
    return flashinfer.fused_moe.cutlass_fused_moe(x, ids, wts, w31, w2, x.dtype)[0]


def peers(activation, quant="bf16"):
    """(name, fn or None, why not) for every peer this benchmark knows: for fp8 and fp8_block
    the PyTorch ones; for the 4-bit modes also this package's fp8 (and for W4A16 its bf16 on
    the dequantized weights, for W4A8 its W4A16) and humming-kernels. A peer
    with a `reference` method is checked against what it returns, within its `tolerance`,
    instead of the mode's reference."""
    import importlib.util
    from .. import quant4
    import torch
    if quant == "fp8":
        return [("torch._scaled_grouped_mm",
                 torch_scaled_grouped_mm_moe if hasattr(torch, "_scaled_grouped_mm") else None,
                 f"not in torch {torch.__version__}")]
    if MODES[quant].weight in ("e4m3_block128", "int4", "mxfp4"):
        dequantized = DequantizedGroupedMM(quant4.prepared_layout(MODES[quant]))
        out = [("torch._grouped_mm (bf16 weights)", dequantized if hasattr(torch, "_grouped_mm") else None,
                f"not in torch {torch.__version__}")]
        if MODES[quant].weight_format.bits == 4 and not MODES[quant].act_format.quantized:
            out.append(("moe_kernels bf16 (same weights dequantized)", OwnBf16(dequantized), ""))
        if MODES[quant].weight_format.bits == 4:
            out.append(("moe_kernels fp8 (same weights)", OwnFp8(quant4.prepared_layout(MODES[quant])), ""))
            if MODES[quant].act_format.quantized:  # W4A8: also W4A16 on the same weights
                out.append(("moe_kernels w4a16 (same weights)", OwnW4A16(MODES[quant].weight), ""))
            out.append(_humming_peer(quant))
        return out
    if quant not in ("bf16", "fp16"):
        return [(n, None, f"not compared for {quant}") for n in
                ("torch._grouped_mm", "vllm-triton", "sglang-triton", "flashinfer-cutlass")]
    if quant == "fp16":  # see Bf16GroupedMM
        out = [("torch._grouped_mm (bf16 copy)", Bf16GroupedMM() if hasattr(torch, "_grouped_mm") else None,
                f"not in torch {torch.__version__}")]
    else:
        out = [("torch._grouped_mm", torch_grouped_mm_moe if hasattr(torch, "_grouped_mm") else None,
                f"not in torch {torch.__version__}")]
    for name, module, fn in (("vllm-triton", "vllm", _vllm_triton),
                             ("sglang-triton", "sglang", _sglang_triton),
                             ("flashinfer-cutlass", "flashinfer", _flashinfer_cutlass)):
        if importlib.util.find_spec(module) is None:
            out.append((name, None, "not installed"))
        elif str(activation) != "swiglu":
            out.append((name, None, f"compared on swiglu only, not {activation}"))
        else:
            out.append((name, fn, None))
    return out


def run_order(peer_list) -> list:
    """The peers in the order they run in a row: those marked `runs_first` (the ones whose
    set-up needs the most memory, run while no other peer holds a copy of the weights) before
    the rest, otherwise as listed. The columns keep the listed order."""
    return sorted(peer_list, key=lambda p: not getattr(p[1], "runs_first", False))


def free_other_peers(peer_list, keep) -> None:
    """Drops the converted weights every peer but `keep` (and the copy `keep` reads through its
    `dequantized`) holds, so that `keep`'s fit: they are made again when next called."""
    keep_ids = {id(keep), id(getattr(keep, "dequantized", None))}
    for _, fn, _ in peer_list:
        if fn is not None and id(fn) not in keep_ids and hasattr(fn, "release"):
            fn.release()


# ---- the run -------------------------------------------------------------------------------

def bench_shape(shape, tokens, args, ceilings, report, progress, sampler=None):
    import torch
    import moe_kernels
    from moe_kernels import reference
    from moe_kernels.modes import Activation

    dtype = hidden_dtype(args)
    act = Activation.parse(args.activation)
    forced = getattr(args, "tactic", None)  # a Tactic (parse_tactic) or None
    E, k, H, I = shape.experts, shape.top_k, shape.hidden, shape.inter
    gen = torch.Generator().manual_seed(0)
    weights = make_weights(args.quant, act, E, H, I)
    w13, w2 = weights["w13"], weights["w2"]
    scales = {n: weights[n] for n in ("w13_scale", "w2_scale") if weights.get(n) is not None}
    try:
        counts = load_histogram(args.routing_file) if args.routing_file else None
    except ValueError as e:
        raise SystemExit(f"--routing-file: {e}") from None
    if counts is not None and len(counts) != E:
        raise SystemExit(f"--routing-file has {len(counts)} experts, {shape.name} has {E}")
    peer_list = [] if args.no_peers else peers(act, args.quant)
    bw, rate, read_ceiling = ceilings
    for T in tokens:
        sets = []
        for _ in range(ROUTING_SETS):
            ids, wts = routing(T, E, k, args.routing, skew=args.skew, counts=counts, gen=gen, device="cuda")
            sets.append((torch.randn(T, H, device="cuda", dtype=dtype), ids, wts))
        hit = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
        # bytes per weight value, packing and scales included (4-bit: half a byte plus group
        # scales; the prepared layout's zero padding of K to a multiple of 128 is not counted)
        n1 = (2 if act.gated else 1) * I
        s13 = scales.get("w13_scale")
        wbytes = (E * n1 * H * MODES[args.quant].weight_format.bits / 8
                  + (s13.numel() * s13.element_size() if s13 is not None else 0)) / (E * n1 * H)
        f = floors(tokens=T, top_k=k, hidden=H, inter=I, gated=act.gated, experts_hit=hit,
                   elem_bytes=2, weight_elem_bytes=wbytes, copy_bw=bw, gemm_rate=rate)
        read_bw, read_by_method = read_ceiling(f["weight_bytes"])
        f = floors(tokens=T, top_k=k, hidden=H, inter=I, gated=act.gated, experts_hit=hit,
                   elem_bytes=2, weight_elem_bytes=wbytes, copy_bw=bw, gemm_rate=rate, read_bw=read_bw)
        ws = torch.empty(moe_kernels.workspace_size(T, k, E, H, I, quant=args.quant, activation=act),
                         dtype=torch.uint8, device="cuda")
        outs = [torch.empty(T, H, device="cuda", dtype=dtype) for _ in sets]
        x0, ids0, w0 = sets[0]
        ref = reference.fused_moe(x0, w13, w2, w0, ids0, activation=act, quant=args.quant, **scales)

        def ours(x, ids, w, o, tactic=forced, last_step=0):
            moe_kernels.fused_moe(x, w13, w2, w, ids, quant=args.quant, activation=act, workspace=ws,
                                  out=o, tactic=tactic, _last_step=last_step, **scales)

        def timed(fn, check=True, ref=ref, tol=QuantMode.parse(args.quant).spec.tolerance, clocks=False):
            """Check fn against ref on set 0, then time it over all sets (with clocks and a
            sampler, the SM clock and power while it runs)."""
            if check:
                outs[0].fill_(float("nan"))
                fn(x0, ids0, w0, outs[0])
                err = ((outs[0].float() - ref).norm() / ref.norm()).item()
                if not (math.isfinite(err) and err <= tol):
                    return {"status": f"wrong: relative error {err:.2e}"}
            it = iter(range(1 << 62))

            def call():
                j = next(it) % len(sets)
                fn(*sets[j], outs[j])
            with sampler.window() if clocks and sampler else contextlib.nullcontext({}) as gpu:
                t, lo, hi = time_graph(call, args.replays, len(sets))
            r = {"status": "ok", "us": t * 1e6, "min_us": lo * 1e6, "max_us": hi * 1e6,
                 "tb_s": f["bytes"] / t / 1e12, "tflop_s": f["flops"] / t / 1e12, "of_floor": f["floor_s"] / t}
            if check:
                r["rel_err"] = err
            r.update(gpu)
            return r

        row = {"preset": shape.name, "E": E, "top_k": k, "H": H, "I": I, "tokens": T,
               "experts_hit": hit, "bytes": f["bytes"], "flops": f["flops"],
               "bw_floor_us": f["bw_floor_s"] * 1e6, "flop_floor_us": f["flop_floor_s"] * 1e6,
               "floor_us": f["floor_s"] * 1e6, "copy_floor_us": f["copy_floor_s"] * 1e6,
               "read_bw_bytes_s": read_bw, "read_bw_by_method": read_by_method,
               "tactic": str(forced or moe_kernels.api.choose_tactic(
                   x0, w13, w2, w0, ids0, quant=args.quant, activation=act, **scales)),
               "results": {"moe_kernels": timed(ours, clocks=True)}}
        for name, fn, why in run_order(peer_list):
            if fn is None:
                row["results"][name] = {"status": why}
                continue
            def run_peer(fn=fn):
                check = {}
                if hasattr(fn, "reference"):
                    check = {"ref": fn.reference(x0, w13, w2, w0, ids0, act, **scales), "tol": fn.tolerance}
                return timed(lambda x, ids, w, o: o.copy_(fn(x, w13, w2, w, ids, act, **scales)), **check)
            try:  # a failing peer is reported, never silently dropped
                out_of_memory = False
                try:
                    row["results"][name] = run_peer()
                except torch.OutOfMemoryError:
                    out_of_memory = True
                if out_of_memory:  # its weights do not fit beside the other peers': free theirs and
                    # retry, outside the handler (its traceback holds the failed attempt's tensors)
                    free_other_peers(peer_list, fn)
                    torch.cuda.empty_cache()
                    row["results"][name] = run_peer()
            except Exception as e:
                row["results"][name] = {"status": f"failed: {type(e).__name__}: {e}"[:200]}
        if row["results"]["moe_kernels"]["status"] == "ok":
            if args.breakdown and "+" not in row["tactic"]:  # a forward kernel: one step
                row["breakdown_us"] = {row["tactic"]: row["results"]["moe_kernels"]["us"]}
            elif args.breakdown:
                prefix = [timed(lambda *a, s=s: ours(*a, last_step=s), check=False)["us"] for s in (1, 2, 3, 4)]
                prefix.append(row["results"]["moe_kernels"]["us"])
                row["breakdown_us"] = {n: b - a for n, a, b in zip(STEPS, [0.0] + prefix[:-1], prefix)}
            if getattr(args, "host", False):
                row["host_us"] = host_time(lambda: ours(*sets[0], outs[0]))
                row["host_python_us"] = python_time(lambda: ours(*sets[0], outs[0]))
                try:  # the profiler may be unavailable (no CUPTI): the rest of the row stands
                    row["host_runtime"] = launch_cost(lambda: ours(*sets[0], outs[0]))
                except Exception as e:
                    row["host_runtime"] = {"status": f"failed: {type(e).__name__}: {e}"[:200]}
                if "+" in row["tactic"]:  # per step: the forward cut after each (its launches, a GEMM's setup)
                    prefix = [host_time(lambda s=s: ours(*sets[0], outs[0], last_step=s)) for s in (1, 2, 3, 4)]
                    prefix.append(row["host_us"])
                    row["host_steps_us"] = {n: b - a for n, a, b in zip(STEPS, [0.0] + prefix[:-1], prefix)}
                    row["host_steps_us"][STEPS[0]] = prefix[0]
            if _distributed():  # under torchrun with --ep: this rank's all-to-all beside its forward
                elem = 1 if QuantMode.parse(args.quant).spec.act_format.quantized else 2
                row["ranks"] = _gather_ranks(row["results"]["moe_kernels"]["us"], all_to_all_time(T * k, H, elem))
            if getattr(args, "kernels", False):
                order = iter(range(1 << 62))

                def rotated():  # each call on the next routing/input set, as in the graphs
                    j = next(order) % len(sets)
                    ours(*sets[j], outs[j])
                row["kernels_us"] = kernel_times(rotated, 4 * len(sets))
            if getattr(args, "compare", None):
                row["compare"] = _compare(args.compare, ours, timed, args.sweep_rounds)
            if args.sweep or args.sweep_only:
                row["sweep"] = _sweep(moe_kernels, row["tactic"], args.quant, dtype, ours, timed, args.sweep_only,
                                      args.sweep_rounds)
        report(row)
        progress()
        del ws, outs, sets
    del w13, w2, peer_list  # the fp8_block peer holds a 16-bit copy of the weights
    torch.cuda.empty_cache()


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def all_to_all_time(rows: int, hidden: int, elem_bytes: int, replays: int = 20) -> float:
    """us of an expert-parallel step's communication on this rank: its rows [rows, hidden]
    dispatched evenly to every rank and the 16-bit results combined back (two all_to_all_single),
    median of `replays` timed with CUDA events."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    rows = max(world, rows // world * world)
    send = torch.empty(rows, hidden * elem_bytes, dtype=torch.uint8, device="cuda")
    back = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    recv, recv_back = torch.empty_like(send), torch.empty_like(back)
    times = []
    for i in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        dist.all_to_all_single(recv, send)
        dist.all_to_all_single(recv_back, back)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _gather_ranks(forward_us: float, a2a_us: float) -> list:
    import torch.distributed as dist
    mine = {"rank": dist.get_rank(), "forward_us": forward_us, "all_to_all_us": a2a_us}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _init_distributed(args) -> bool:
    """Under torchrun (WORLD_SIZE > 1): one GPU per rank, NCCL, --ep equal to the ranks; every
    rank times its own share, rank 0 reports. False when not launched that way."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return False
    import torch
    import torch.distributed as dist
    if args.ep != world:
        raise SystemExit(f"--ep {args.ep}: under torchrun expected --ep {world}, the number of ranks")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    args.no_peers = True  # peers are timed on one GPU, without --ep
    return True


def host_time(call, calls=64, rounds=5) -> float:
    """us of host time per eager call: calls issued behind a GPU spin, so that launches queue
    and none waits for the device; the median of `rounds` batches, after a first call."""
    import time
    import torch
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clocks: longer than the batch takes to issue
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def python_time(call, calls=2000) -> float:
    """us of host time per eager call with the library call replaced by a no-op: the Python
    side (argument checks, the plan lookup, the pointers), median of five batches."""
    import time
    from .. import ops
    call()  # the plan is made and cached with the real library
    real = ops._native.C

    class NoLibrary:
        @staticmethod
        def run(*args):
            return None
    times = []
    try:
        ops._native.C = NoLibrary
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - t0) / calls)
    finally:
        ops._native.C = real
    return statistics.median(times) * 1e6


def launch_cost(call, forwards=32) -> dict:
    """What one eager call hands to the CUDA runtime, from PyTorch's profiler (CUPTI): the
    launches, the GPU operations and the host time spent inside CUDA runtime and driver calls
    (launches, memsets, attribute calls), medians over `forwards` calls. That is the share of the
    host time per call that no caching on our side removes; CUPTI adds its own cost to each
    runtime call, so the figure overstates it (compare `host_us - host_python_us`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            with torch.profiler.record_function("moe_kernels.forward"):
                call()
        torch.cuda.synchronize()
    events = prof.events()
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    # the annotation also appears on the GPU timeline: the calls are its CPU ranges
    calls = sorted((e for e in events if e.name == "moe_kernels.forward" and e.device_type == cpu),
                   key=lambda e: e.time_range.start)
    runtime = [e for e in events if e.device_type == cpu and e.name.startswith("cu") and "Synchronize" not in e.name]
    kernels = [e for e in events if e.device_type == gpu and e.name != "moe_kernels.forward"]
    per_call_us, per_call_n = [], []
    for c in calls:
        inside = [e for e in runtime if c.time_range.start <= e.time_range.start <= c.time_range.end]
        per_call_us.append(sum(e.time_range.elapsed_us() for e in inside))
        per_call_n.append(sum("Launch" in e.name for e in inside))
    names = {}
    for e in runtime:
        names[e.name] = names.get(e.name, 0) + 1
    return {"launches": statistics.median(per_call_n) if per_call_n else None,
            "kernels": len(kernels) / max(len(calls), 1),
            "runtime_us": statistics.median(per_call_us) if per_call_us else None,
            "runtime_calls": {n: c / max(len(calls), 1) for n, c in sorted(names.items())}}


def _timer(ours, timed):
    """A tactic's time in us (inf where it failed or was wrong)."""
    def t(tactic):
        r = timed(lambda *a: ours(*a, tactic=tactic))
        return r["us"] if r["status"] == "ok" else float("inf")
    return t


def _compare(pairs, ours, timed, rounds=1):
    """--compare: the given GEMM1+GEMM2 pairs timed round-robin (e.g. two tuned picks)."""
    us, times = round_robin({str(p): p for p in pairs}, _timer(ours, timed), rounds)
    return {"rounds": rounds, "us": us, "times_us": times}


def _sweep(moe_kernels, default, quant, out_dtype, ours, timed, only=None, rounds=1):
    """Every usable kernel (matching only) in each GEMM slot, the other slot on the default;
    out_dtype: the output's torch dtype. With rounds > 1 a slot's candidates are timed
    round-robin that many times and scored by their median (the times are kept)."""
    from moe_kernels import Tactic
    if "+" not in default:
        return {"default": default, "skipped": "a forward kernel has no GEMM slots to sweep"}
    d1, d2 = default.split("+")
    names = [k.name for k in moe_kernels.list_kernels(quant=quant, out_dtype=out_dtype)
             if k.gemm and (not only or re.search(only, k.name) or k.name in (d1, d2))]

    t = _timer(ours, timed)
    g1, g1_times = round_robin({n: Tactic(n, d2) for n in names}, t, rounds)
    g2, g2_times = round_robin({n: Tactic(d1, n) for n in names}, t, rounds)
    best = Tactic(min(g1, key=g1.get), min(g2, key=g2.get))
    out = {"default": default, "default_us": g1[d1], "best": str(best), "best_us": t(best),
           "gemm1_us": g1, "gemm2_us": g2}
    if rounds > 1:
        out.update(rounds=rounds, gemm1_times_us=g1_times, gemm2_times_us=g2_times)
    return out


# ---- output --------------------------------------------------------------------------------

def format_row(row, peer_names) -> str:
    ours = row["results"]["moe_kernels"]
    cells = [f"{row['preset']:<18}", f"{row['tokens']:>6}", f"{row['experts_hit']:>6.1f}",
             f"{row['read_bw_bytes_s'] / 1e12:>6.2f}" if row.get("read_bw_bytes_s") else f"{'-':>6}",
             f"{row['bw_floor_us']:>9.1f}", f"{row['flop_floor_us']:>9.1f}"]
    if ours["status"] == "ok":
        cells += [f"{ours['us']:>9.1f}", f"{ours['tb_s']:>6.2f}", f"{ours['tflop_s']:>7.1f}", f"{ours['of_floor']:>6.0%}"]
    else:
        cells += [f"{ours['status'][:40]:>40}"]
    for n in peer_names:
        r, w = row["results"].get(n, {}), _peer_width(n)
        if r.get("status") == "ok" and ours["status"] == "ok":
            cells.append(f"{r['us']:>9.1f} ({r['us'] / ours['us']:4.2f}x)".rjust(w))
        else:
            cells.append(f"{r.get('status', '-')[:w]:>{w}}")
    lines = ["  ".join(cells)]
    if "sweep" in row:
        sw = row["sweep"]
        lines.append(f"    default {sw['default']} {sw['default_us']:.1f} us; best {sw['best']} {sw['best_us']:.1f} us")
        for slot in ("gemm1", "gemm2"):
            lines += [f"    {slot} {us:9.1f} us  {n}" for n, us in sorted(sw[f"{slot}_us"].items(), key=lambda x: x[1])]
    if "compare" in row:
        lines += [f"    compare {us:9.1f} us  {n}" for n, us in sorted(row["compare"]["us"].items(), key=lambda x: x[1])]
    if "sm_mhz" in ours:
        lines.append(f"    ours ran at {ours['sm_mhz']:.0f} MHz, {ours['power_w']:.0f} W ({ours['samples']} samples)")
    if "breakdown_us" in row:
        lines.append("    steps (us): " + ", ".join(f"{k} {v:.1f}" for k, v in row["breakdown_us"].items()))
    if "host_us" in row:
        lines.append(f"    host time per eager call: {row['host_us']:.1f} us"
                     + (f" (Python side {row['host_python_us']:.1f})" if "host_python_us" in row else ""))
    rt = row.get("host_runtime", {})
    if rt.get("runtime_us") is not None:
        lines.append(f"    inside the CUDA runtime per call: {rt['runtime_us']:.1f} us, {rt['launches']:.0f} launches, "
                     f"{rt['kernels']:.0f} kernels")
    elif "status" in rt:
        lines.append(f"    CUDA runtime time per call: {rt['status']}")
    if "host_steps_us" in row:
        lines.append("    host time by step: " + ", ".join(f"{n} {v:.1f}" for n, v in row["host_steps_us"].items()))
    if "ranks" in row:
        lines.append("    per rank (forward / all-to-all dispatch + combine, us): " + ", ".join(
            f"{r['rank']}: {r['forward_us']:.1f} / {r['all_to_all_us']:.1f}" for r in row["ranks"]))
    for name, us in row.get("kernels_us", {}).items():
        lines.append(f"    kernel {us:8.1f} us  {name}")
    return "\n".join(lines)


def _peer_width(name) -> int:  # a peer's column holds its whole name
    return max(17, len(name))


def header(peer_names) -> str:
    return "  ".join([f"{'preset':<18}", f"{'tokens':>6}", f"{'hit':>6}", f"{'read':>6}", f"{'bw_floor':>9}",
                      f"{'flop_flr':>9}",
                      f"{'ours_us':>9}", f"{'TB/s':>6}", f"{'TFLOP/s':>7}", f"{'floor%':>6}"] +
                     [f"{n:>{_peer_width(n)}}" for n in peer_names])


def markdown(result) -> str:
    """The results as a Markdown table (what benchmarks/results/*.md hold)."""
    rows = result["rows"]
    peers_ = [n for n in rows[0]["results"] if n != "moe_kernels"] if rows else []
    clocks = any("sm_mhz" in r["results"]["moe_kernels"] for r in rows)  # bench --clocks
    host = any("host_us" in r for r in rows)  # bench --host
    out = [f"{result['gpu']}, driver {result['driver']}, torch {result['torch']} (CUDA {result['cuda']}), "
           f"moe_kernels {result['version']} at {result['commit'][:12]}"
           + (f" ({result['catalog']} catalog)" if result.get("catalog") else "") + f"; {result['quant']}, "
           f"{result['activation']}, routing {result['routing']}. Measured ceilings: copy "
           f"{result['copy_bw_bytes_s'] / 1e12:.2f} TB/s, read-only "
           + (f"{result['read_bw_bytes_s'] / 1e12:.2f} TB/s (2 GiB)" if result.get("read_bw_bytes_s") else "not measured")
           + f", dense GEMM {result['gemm_flop_s'] / 1e12:.0f} TFLOP/s"
           f" sustained" + (f" (at {result['gemm_sm_mhz']:.0f} MHz, {result['gemm_power_w']:.0f} W)"
                            if result.get("gemm_sm_mhz") else "") + "."
           + (f" Cut short: {result['incomplete']}." if result.get("incomplete") else ""),
           "",
           "| " + " | ".join(["preset", "tokens", "experts hit", "read-only TB/s", "bw floor us", "FLOP floor us",
                              "ours us", "TB/s", "TFLOP/s", "of floor", "of dense"]
                             + [f"{p} us (speedup)" for p in peers_]
                             + (["SM clock, power (ours)"] if clocks else [])
                             + (["host us per eager call (in the CUDA runtime)"] if host else [])) + " |",
           "|---" * (11 + len(peers_) + clocks + host) + "|"]
    for r in rows:
        o = r["results"]["moe_kernels"]
        read = f"{r['read_bw_bytes_s'] / 1e12:.2f}" if r.get("read_bw_bytes_s") else "-"
        cells = [r["preset"], str(r["tokens"]), f"{r['experts_hit']:.1f}", read, f"{r['bw_floor_us']:.1f}",
                 f"{r['flop_floor_us']:.1f}"]
        cells += ([f"{o['us']:.1f}", f"{o['tb_s']:.2f}", f"{o['tflop_s']:.0f}", f"{o['of_floor']:.0%}",
                   f"{o['tflop_s'] * 1e12 / result['gemm_flop_s']:.0%}"]
                  if o["status"] == "ok" else [o["status"], "", "", "", ""])
        for p in peers_:
            q = r["results"][p]
            cells.append(f"{q['us']:.1f} ({q['us'] / o['us']:.2f}x)" if q["status"] == "ok" and o["status"] == "ok"
                         else q["status"])
        if clocks:
            cells.append(f"{o['sm_mhz']:.0f} MHz, {o['power_w']:.0f} W" if "sm_mhz" in o else "-")
        if host:
            rt = r.get("host_runtime", {})
            cells.append((f"{r['host_us']:.1f}" if "host_us" in r else "-")
                         + (f" (CUDA runtime {rt['runtime_us']:.1f}, {rt['launches']:.0f} launches)"
                            if rt.get("runtime_us") is not None else ""))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        rs = [r for r in rows if r["preset"] == preset]
        xs = [r["tokens"] for r in rs]
        for name in rs[0]["results"]:
            pts = [(r["tokens"], r["results"][name]["us"]) for r in rs if r["results"][name].get("status") == "ok"]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.plot(xs, [r["bw_floor_us"] for r in rs], "k--", lw=1, label="bandwidth floor")
        ax.plot(xs, [r["flop_floor_us"] for r in rs], "k:", lw=1, label="FLOP floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="time per forward (us)", title=preset)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _environment():
    import torch
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    commit = os.environ.get("MOE_KERNELS_COMMIT") or git_commit()
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit,
            "catalog": _native.build_info().get("catalog")}  # minimal and full pick other tiles


def git_commit(cwd=None) -> str:
    """HEAD of the current directory's checkout, with "-dirty" when tracked files differ from
    it (a copied tree under an old .git must not pass for that commit); "unknown" outside git."""
    try:
        def git(*a):
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=20, cwd=cwd)
        head = git("rev-parse", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def add_profile_arguments(p) -> None:
    add_problem_arguments(p)
    p.add_argument("--forwards", type=int, default=1, help="forwards inside the profiled range per point")


def profile_main(args) -> int:
    """`python -m moe_kernels profile`: per point, a few warm-up forwards, then `--forwards`
    forwards between cudaProfilerStart and cudaProfilerStop (eager, not graphs), for
    `ncu --profile-from-start off ...` or `nsys profile --capture-range=cudaProfilerApi ...`."""
    import torch
    import moe_kernels
    from moe_kernels.modes import Activation

    if args.forwards < 1:
        raise SystemExit(f"--forwards {args.forwards}: expected a positive count")
    tactic = parse_tactic(args.tactic)
    tokens = parse_tokens(args.tokens)
    act = Activation.parse(args.activation)
    dtype = hidden_dtype(args)
    try:
        counts = load_histogram(args.routing_file) if args.routing_file else None
    except ValueError as e:
        raise SystemExit(f"--routing-file: {e}") from None
    gen = torch.Generator().manual_seed(0)
    for s in shapes_from_args(args):
        if counts is not None and len(counts) != s.experts:
            raise SystemExit(f"--routing-file has {len(counts)} experts, {s.name} has {s.experts}")
        weights = make_weights(args.quant, act, s.experts, s.hidden, s.inter)
        scales = {n: weights[n] for n in ("w13_scale", "w2_scale") if weights.get(n) is not None}
        for T in tokens:
            ids, wts = routing(T, s.experts, s.top_k, args.routing, skew=args.skew, counts=counts,
                               gen=gen, device="cuda")
            x = torch.randn(T, s.hidden, device="cuda", dtype=dtype)
            ws = torch.empty(moe_kernels.workspace_size(T, s.top_k, s.experts, s.hidden, s.inter,
                                                        quant=args.quant, activation=act),
                             dtype=torch.uint8, device="cuda")
            out = torch.empty(T, s.hidden, device="cuda", dtype=dtype)
            call = dict(quant=args.quant, activation=act, workspace=ws, out=out, **scales)
            chosen = tactic or moe_kernels.api.choose_tactic(x, weights["w13"], weights["w2"], wts,
                                                             ids, quant=args.quant, activation=act,
                                                             **scales)
            for _ in range(3):
                moe_kernels.fused_moe(x, weights["w13"], weights["w2"], wts, ids, tactic=chosen, **call)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for _ in range(args.forwards):
                moe_kernels.fused_moe(x, weights["w13"], weights["w2"], wts, ids, tactic=chosen, **call)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"{s.name}, {T} tokens, {args.quant}: {args.forwards} forward(s) in the profiled "
                  f"range, tactic {chosen}", flush=True)
        del weights
    return 0


def main(args) -> int:
    import moe_kernels

    args.tactic = parse_tactic(getattr(args, "tactic", None))
    tokens = parse_tokens(args.tokens)
    shapes = shapes_from_args(args)
    distributed = _init_distributed(args)
    if distributed:
        import torch.distributed as dist
        if dist.get_rank() != 0:  # every rank times, rank 0 reports
            sys.stdout = open(os.devnull, "w")
            args.json = args.markdown = args.plot = None
    dtype_name = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}[str(hidden_dtype(args))]
    env = _environment()
    print(f"moe_kernels {moe_kernels.__version__} ({env['commit'][:12]}, {env['catalog'] or 'unknown'} catalog) "
          f"on {env['gpu']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}")
    sampler = None
    if args.clocks:
        sampler = GpuSampler()
        if not sampler.available:
            print("--clocks: NVML (libnvidia-ml) is not available here: no clocks or power")
    bw, rate, burst, ceiling_clocks = measure_ceilings(args.quant, sampler)
    read_ceiling = ReadCeiling()
    read_big, _ = read_ceiling(1 << 31)
    at = (f" at {ceiling_clocks['sm_mhz']:.0f} MHz, {ceiling_clocks['power_w']:.0f} W"
          if "sm_mhz" in ceiling_clocks else "")
    print(f"ceilings measured now: copy {bw / 1e12:.2f} TB/s, read-only {read_big / 1e12:.2f} TB/s (2 GiB), "
          f"dense {args.quant} GEMM {rate / 1e12:.0f} TFLOP/s "
          f"sustained{at} ({burst / 1e12:.0f} in a burst; 8192^3, best of 3); "
          f"routing {args.routing_file or args.routing}, activation {args.activation}, {dtype_name} in and out")
    peer_names = [] if args.no_peers else [n for n, _, _ in peers(args.activation, args.quant)]
    print("floors and times in us per forward; peers: their time (their time / ours)\n")
    print(header(peer_names))
    rows, done, total = [], [0], len(shapes) * len(tokens)
    tty = sys.stderr.isatty()  # the \r progress bar only on a terminal, never in a log file

    def save(complete):
        result = {**env, "version": moe_kernels.__version__, "copy_bw_bytes_s": bw, "read_bw_bytes_s": read_big,
                  "gemm_flop_s": rate,
                  "gemm_flop_s_burst": burst, **{f"gemm_{k}": v for k, v in ceiling_clocks.items()},
                  "routing": args.routing_file or args.routing, "quant": args.quant, "hidden_dtype": dtype_name,
                  "activation": args.activation, "rows": rows}
        if not complete:  # rewritten after every point, so that a run cut short keeps what it measured
            result["incomplete"] = f"{len(rows)} of {total} points"
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(result))
        return result

    def report(row):
        rows.append(row)
        if tty:
            sys.stderr.write("\r" + " " * 40 + "\r")
        print(format_row(row, peer_names), flush=True)
        save(complete=False)

    def progress():
        done[0] += 1
        if tty and done[0] < total:
            filled = 20 * done[0] // total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {done[0]}/{total} points")
            sys.stderr.flush()

    for s in shapes:
        bench_shape(s, tokens, args, (bw, rate, read_ceiling), report, progress, sampler)
    save(complete=True)
    if args.plot:
        plot(rows, args.plot)
    if distributed:
        dist.destroy_process_group()
    return 0

