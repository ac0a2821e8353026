"""Tactics: which kernels a forward uses, named by their stable registry names, and the one
function that resolves them (`resolve`: the caller's, else the tuned table's, else the rule).

No public function takes or returns a bare integer index. Kernels come from the catalog
(cmake/catalog.py) through the library's registry; selection reads their fields
(`moe_kernels.KernelInfo`), never their names.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

from . import _native, cache
from ._native import KernelInfo
from .problem import Problem, fail


@dataclasses.dataclass(frozen=True)
class Tactic:
    """A GEMM1 kernel and a GEMM2 kernel, or one kernel for the whole forward (`forward`, a
    registry entry of kind "forward", such as the one-token forward), by registry name."""

    gemm1: str = ""
    gemm2: str = ""
    forward: str = ""

    def __post_init__(self):
        names = (self.gemm1, self.gemm2, self.forward)
        if not all(isinstance(v, str) for v in names) or \
                not (bool(self.forward) != bool(self.gemm1 and self.gemm2)) or \
                (self.forward and (self.gemm1 or self.gemm2)) or bool(self.gemm1) != bool(self.gemm2):
            raise TypeError(f"Tactic(gemm1={self.gemm1!r}, gemm2={self.gemm2!r}, forward={self.forward!r}): "
                            "expected two GEMM kernel names, or one forward kernel name alone; "
                            "see moe_kernels.list_kernels()")

    def __str__(self) -> str:
        return self.forward or f"{self.gemm1}+{self.gemm2}"

    @property
    def kernels(self) -> tuple:
        return (self.forward,) if self.forward else (self.gemm1, self.gemm2)

    @classmethod
    def parse(cls, text: str) -> "Tactic":
        """The tactic str() printed: "gemm1+gemm2", or a forward kernel's name."""
        return cls(*text.split("+")) if "+" in text else cls(forward=text)


# Default rule, per GEMM: CUTLASS's 64-row ping-pong tiles up to DECODE_ROWS rows per expert,
# past that its 128-row cooperative ones (fp8_block: our contiguous kernel, CONTIG_TILE_N). 384
# is where the 128-row tile starts to win on H200 without losing short-K GEMMs; for fp8_block
# the contiguous kernel leads past 64 (docs/performance.md, default rule).
DECODE_ROWS = {"bf16": 384, "fp16": 384, "fp8": 384, "fp8_block": 64}
# Among tiles of one M, the widest N that still gives this share of the SMs a tile: fewer CTAs
# cannot pull the weights at full bandwidth (docs/performance.md, default rule).
MIN_SM_FILL = 0.5
# The decode kernel (our mma.sync GEMM, weights read once per pass of tile_m tokens) is the
# default in both GEMMs up to this many (token, expert) pairs, where it was best or within noise
# on H200 (docs/performance.md, default rule).
DECODE_PAIRS = (64, 64)  # GEMM1, GEMM2
# A 16-bit GEMM1 with K >= DECODE_LONG_K leaves the decode kernel past this many pairs: CUTLASS's
# 64-row ping-pong tile was faster there (docs/performance.md, default rule).
DECODE_PAIRS_16BIT_LONG_K = 16
DECODE_LONG_K = 4096
# A decode pass holds tile_m tokens and routing is never even: take the smallest tile_m that holds
# this many times the mean rows per expert, or the fuller experts stream their weights twice
# (docs/performance.md, default rule).
DECODE_HEADROOM = 1.5
# Decode blocks of 64 columns once there are enough of them for this many per SM (their
# occupancy), else 16 columns with K split over the 4 warps so that a few experts' weights still
# reach every SM; 16-bit 64-column blocks take 16 tokens a pass (docs/performance.md, default rule).
DECODE_WIDE_BLOCKS_PER_SM = 4
# The ring form of the decode kernel (catalog "ring", src/gemm/decode_ring.cuh: vLLM's tuned Triton
# MoE's decomposition), its 16-token tile in both GEMMs, from RING_MIN_TOKENS tokens while
# DECODE_HEADROOM times the rows per expert fit one 16-token pass, for the modes of RING_MODES.
# On one H100, whole forward: 0.5-3.5% faster than this rule's mma.sync and CUTLASS tiles at 16-128
# tokens of DeepSeek-V3, gpt-oss-120b, Qwen3-30B-A3B and Mixtral-8x7B (bf16) and at 16-128 tokens
# of DeepSeek-V3 fp8_block; at 4 tokens (one row per expert) 1.5-6% slower on Qwen3 and Mixtral;
# an expert past 16 rows takes a second pass (docs/performance.md, default rule). fp8 per channel
# keeps the older tiles: on the ring it won one of eight cells (by 2%) and lost the rest.
RING_MIN_TOKENS = 16
RING_MODES = ("bf16", "fp16", "fp8_block")
# fp8_block: CUTLASS's swap-AB kernels (catalog "coop_swapab") are the default up to this many rows
# per expert (GEMM1, GEMM2), before the decode kernel, with the narrowest tile that holds
# SWAP_AB_HEADROOM times the rows. Past 1 row GEMM1 was faster on the 64-row ping-pong tile;
# past 4 rows it is untimed (docs/performance.md, default rule).
SWAP_AB_ROWS = (1, 4)
SWAP_AB_HEADROOM = 8
# The widest swap tile (tokens per tile) this rule picks from; the 64-token ones measured near a
# tie and are left to tuned tables.
SWAP_AB_DECODE_TILE = 16
# Our contiguous fp8_block kernel (catalog "contig"), 256 columns wide, in both GEMMs past
# DECODE_ROWS["fp8_block"] rows per expert where N allows (in GEMM1 it also applies a gated
# activation): faster than CUTLASS's tiles and a 128-wide form (docs/performance.md, default rule).
CONTIG_TILE_N = 256


# 4-bit weights (W4A16, W4A8): our decode kernel (src/gemm/decode_w4a16.cuh) up to
# FOUR_BIT_DECODE_ROWS rows per expert of the (activation, weight) format, with the narrowest
# token tile that holds DECODE_HEADROOM times the rows; then CUTLASS's mixed-input GEMM with the
# narrowest token tile that holds them, else (W4A8; groups of 32: MXFP4, INT4 g32) our
# contiguous wgmma kernel (src/gemm/sm90/contiguous_w4.cuh) past FOUR_BIT_CONTIG_ROWS rows per
# expert, else our tiled kernel (src/gemm/tiled_w4a16.cuh) likewise. The decode kernel's block
# width per GEMM: 64 columns where K is at most FOUR_BIT_DECODE_WIDE_MAX_K, else 16 (K split
# over the block's 4 warps, which a short K leaves unevenly loaded). Measured over 1-64 tokens
# (H200) and 8-32 rows per expert (H100), Qwen3-30B-A3B, DeepSeek-V3 and DeepSeek-V4-Pro
# (docs/performance.md, default rule). On SM90 the 64-column block is the wgmma kernel
# (src/gemm/sm90/decode_w4_wgmma.cuh; W4A8's: sm90/decode_w4a8_wgmma.cuh), which also wins on
# long K once an expert has more than one row (1.04-1.37x at 16-128 tokens in two H100 runs,
# 0.97-1.00x on gpt-oss-120b's MXFP4 at 16; at one token, with a block per 64 columns of 4-8
# experts, the split-K block's 4x more blocks were up to 1.46x faster; docs/kernels/decode.md).
# MXFP4 takes it at one row too: on the prepared layout the split-K block's MXFP4 form is about
# 2x slower than on the checkpoint packing (gpt-oss-120b, 1 and 16 tokens) while the wgmma
# block's speed did not change (docs/performance.md, "The prepared 4-bit layout").
FOUR_BIT_FORMATS = ("int4", "mxfp4")
# W4A8 leaves the decode kernel past 8 rows (MXFP4's 32-row tiled tile 1.11-1.42x faster at
# 12-16 rows, INT4's contiguous kernel 1.31-1.67x), W4A16 MXFP4 past 12 (level at 12, the tiled
# tile 1.25x faster at 16); W4A16 INT4 against CUTLASS's tiles is not measured there.
FOUR_BIT_DECODE_ROWS = {("fp8_row", "int4"): 8, ("fp8_row", "mxfp4"): 8, ("a16", "mxfp4"): 12, ("a16", "int4"): 16}
# Where the decode kernels include SM90's 32-token W4A8 block (catalog tile 32x64, FP8 wgmma),
# the decode kernel serves W4A8 MXFP4 up to 64 rows per expert instead: on gpt-oss-120b (H100)
# the forward was 1.54x faster than with the contiguous kernel in GEMM1 at 32 rows and 1.07x
# faster than the contiguous pair at 64 (docs/performance.md, "... W4A8 decode at 32 tokens a
# pass"). W4A8 INT4 there is not measured yet (`benchmarks/run.sh w4a8_int4_decode32_rows`).
FOUR_BIT_DECODE_ROWS_32 = {("fp8_row", "mxfp4"): 64}
FOUR_BIT_DECODE_WIDE_MAX_K = 1024
# Past these rows per expert, by (activation, weight) format, the contiguous kernel instead of
# the tiled one (docs/performance.md, default rule): W4A8 INT4 ahead from 8 rows on; W4A8
# MXFP4 behind at 20 rows, ahead from 32; W4A16 MXFP4 behind at 32, ahead at 64 (where the
# tiled kernel's 64-row tile is slower than its 32-row one); W4A16 INT4 without CUTLASS (AWQ,
# groups of 32) not yet measured against the tiled kernel.
FOUR_BIT_CONTIG_ROWS = {("fp8_row", "int4"): 8, ("fp8_row", "mxfp4"): 24, ("a16", "mxfp4"): 32}


def _pick_four_bit(kernels: list, rows_per_expert: float, k_size: int) -> KernelInfo:
    decode, grouped, tiled, contig = (sorted((k for k in kernels if k.kind == kind), key=lambda k: k.tile[0])
                                      for kind in ("decode", "grouped", "tiled", "contiguous"))
    fmt = (kernels[0].act_format, kernels[0].weight_format)
    decode_rows = FOUR_BIT_DECODE_ROWS[fmt]
    if any(k.tile[0] >= 32 for k in decode):
        decode_rows = FOUR_BIT_DECODE_ROWS_32.get(fmt, decode_rows)
    if decode and rows_per_expert <= decode_rows:
        narrow, wide = min(k.tile[1] for k in decode), max(k.tile[1] for k in decode)
        wgmma = all(k.arch.startswith("sm90") for k in decode if k.tile[1] == wide)
        use_wide = 0 < k_size <= FOUR_BIT_DECODE_WIDE_MAX_K or (wgmma and (rows_per_expert > 1 or fmt[1] == "mxfp4"))
        pool = [k for k in decode if k.tile[1] == (wide if use_wide else narrow)]
        return next((k for k in pool if k.tile[0] >= DECODE_HEADROOM * rows_per_expert), pool[-1])
    contig_rows = FOUR_BIT_CONTIG_ROWS.get(fmt) if contig else None
    if not grouped and contig_rows is not None and rows_per_expert > contig_rows:
        return contig[0]
    pool = grouped or tiled or [k for k in decode if k.tile[1] == min(k.tile[1] for k in decode)]
    return next((k for k in pool if k.tile[0] >= rows_per_expert), pool[-1])


def _sixteen_bit(kernels: list) -> bool:
    return all(k.act_format == "a16" and k.weight_format == "w16" for k in kernels)


def _pick(kernels: list, rows_per_expert: float, n: int, experts_hit: int, sm_count: int,
          decode_pairs: int, swap_rows: float, ring_ok: bool) -> KernelInfo:
    ring = sorted((k for k in kernels if k.schedule == "ring" and k.mode in RING_MODES), key=lambda k: k.tile[0])
    if ring_ok and ring and DECODE_HEADROOM * rows_per_expert <= ring[0].tile[0]:
        return ring[0]
    swap = sorted((k for k in kernels if k.swap_ab and k.tile[0] <= SWAP_AB_DECODE_TILE),
                  key=lambda k: k.tile[0])
    if swap and rows_per_expert <= swap_rows:
        return next((k for k in swap if k.tile[0] >= SWAP_AB_HEADROOM * rows_per_expert), swap[-1])
    decode = [k for k in kernels if k.schedule == "decode"]  # the mma.sync tiles
    if decode and rows_per_expert * experts_hit <= decode_pairs:
        narrow, wide = min(k.tile[1] for k in decode), max(k.tile[1] for k in decode)
        use_wide = wide > narrow and math.ceil(n / wide) * experts_hit >= DECODE_WIDE_BLOCKS_PER_SM * sm_count
        same_n = sorted((k for k in decode if k.tile[1] == (wide if use_wide else narrow)), key=lambda k: k.tile[0])
        if use_wide and _sixteen_bit(decode):
            return same_n[-1]
        return next((k for k in same_n if k.tile[0] >= DECODE_HEADROOM * rows_per_expert), same_n[-1])
    kernels = [k for k in kernels if k.kind != "decode" and not k.swap_ab] or kernels
    plain = [k for k in kernels if k.cluster == (1, 1)] or kernels
    decode_rows = min(DECODE_ROWS.get(k.mode, DECODE_ROWS["bf16"]) for k in plain)
    contig = [k for k in plain if k.kind == "contiguous" and k.tile[1] == CONTIG_TILE_N and n % CONTIG_TILE_N == 0]
    if rows_per_expert <= decode_rows:
        tm = min(k.tile[0] for k in plain)
    elif contig:
        return contig[0]
    else:
        coop = [k for k in plain if k.schedule == "coop"] or plain
        tm = min((k.tile[0] for k in coop), key=lambda t: (abs(t - 128), t))
        plain = [k for k in coop if k.tile[0] == tm]
    # Same N: FP8 fast accumulation first (never slower on H200; docs/performance.md, default rule).
    same_m = sorted((k for k in plain if k.tile[0] == tm),
                    key=lambda k: (k.tile[1], k.mainloop == "fastaccum"))

    def tiles(k):
        return math.ceil(max(rows_per_expert, 1) / k.tile[0]) * math.ceil(n / k.tile[1]) * experts_hit

    filling = [k for k in same_m if tiles(k) >= MIN_SM_FILL * sm_count]
    return filling[-1] if filling else same_m[0]


def default_tactic(kernels: list, *, num_tokens: int, top_k: int, num_experts: int,
                   hidden_size: int, gemm1_n: int, sm_count: int, inter_size: int = 0) -> Tactic:
    """The rule used when nothing was tuned: a forward kernel for one token where `kernels`
    holds one (the caller passes only those that serve the problem), else GEMM kernels by rows
    per expert, N and the SM count (4-bit weights: by rows per expert and K, GEMM2's K being
    inter_size; 0: not given, taken as long)."""
    forward = [k for k in kernels if not k.gemm]
    if num_tokens == 1 and forward:
        return Tactic(forward=forward[0].name)
    kernels = [k for k in kernels if k.gemm]
    if not kernels:
        raise ValueError("no kernels to choose from")
    pairs = num_tokens * top_k
    experts_hit = max(1, min(num_experts, pairs))
    rows = pairs / experts_hit
    if kernels[0].weight_format in FOUR_BIT_FORMATS:
        return Tactic(_pick_four_bit(kernels, rows, hidden_size).name,
                      _pick_four_bit(kernels, rows, inter_size).name)
    decode1 = DECODE_PAIRS[0]
    if _sixteen_bit(kernels) and hidden_size >= DECODE_LONG_K:  # GEMM1's K
        decode1 = DECODE_PAIRS_16BIT_LONG_K
    ring = num_tokens >= RING_MIN_TOKENS
    return Tactic(_pick(kernels, rows, gemm1_n, experts_hit, sm_count, decode1, SWAP_AB_ROWS[0], ring).name,
                  _pick(kernels, rows, hidden_size, experts_hit, sm_count, DECODE_PAIRS[1], SWAP_AB_ROWS[1], ring).name)


# ---- resolution ----------------------------------------------------------------------------

def problem_spec(p: Problem) -> cache.ProblemSpec:
    """What a tuned choice for `p` is keyed by (besides its token bucket)."""
    default_out = p.quant.spec.hidden[0]
    return cache.ProblemSpec(p.quant.value, p.activation.value, p.E, p.k, p.H, p.I,
                             out_dtype=p.out_dtype if p.out_dtype != default_out else "")


def _forward_problem(device: int, p: Problem, k: KernelInfo) -> str:
    """Why forward kernel `k` cannot run `p` (the library's limits for the shape on this
    device, and the scales' alignment), or ""."""
    why = _native.C().check_kernel(device, k.name, p.shape)
    if not why and p.quant.spec.weight == "e4m3_block128" and p.scales[0].data_ptr() % 16:
        why = (f"w13_scale at address {p.scales[0].data_ptr():#x} is not 16-byte aligned "
               "(the forward copies the scale rows in bulk)")
    return why


_group_checks: dict = {}


def _serves(device: int, p: Problem, k: KernelInfo) -> bool:
    """A GEMM kernel serves any problem of its formats (4-bit ones: of scale groups and zero
    points it takes, the library's check, asked once per kernel, group, zero points and sizes); a forward kernel only those
    within its limits."""
    if k.gemm and p.weight_group:
        key = (device, k.name, p.weight_group, p.shape["weight_zero"], p.H, p.I)
        if key not in _group_checks:
            _group_checks[key] = not _native.C().check_kernel(device, k.name, p.shape)
        return _group_checks[key]
    return k.gemm or not _forward_problem(device, p, k)


_logged: set = set()


def _log_choice(spec, num_tokens, tactic, source):
    """MOE_KERNELS_LOG_TACTIC=1 prints the chosen tactic once per problem and token count."""
    if os.environ.get("MOE_KERNELS_LOG_TACTIC") and (spec, num_tokens) not in _logged:
        _logged.add((spec, num_tokens))
        print(f"moe_kernels: {spec.signature} T={num_tokens}: {tactic} ({source})", file=sys.stderr)
    return tactic


def resolve(p: Problem, requested=None) -> Tactic:
    """The tactic a forward of `p` runs: `requested` once checked against this GPU and
    problem; else the tuned table's record for the problem's token bucket (tuning it first
    inside moe_kernels.autotune()); else default_tactic."""
    dev = p.device.index
    usable = _native.usable_kernels(dev, p.quant.value, p.out_dtype)
    what = p.quant.value + (f" ({p.out_dtype} out)" if p.quant.value != p.out_dtype else "")
    if requested is not None:
        return _checked(p, requested, usable, what)
    if not any(k.gemm for k in usable.values()):
        raise NotImplementedError(f"no {what} kernels can run on {_native.device_info(dev)['name']} in this build")
    spec = problem_spec(p)
    tuned = _parse(cache.lookup(spec, p.T, dev))
    if tuned is None and spec.out_dtype:  # no record of its own: the default output's, in this output's kernels
        tuned = _other_output_on(_parse(cache.lookup(dataclasses.replace(spec, out_dtype=""), p.T, dev)),
                                 dev, p.out_dtype)
    if tuned is not None and all(n in usable and _serves(dev, p, usable[n]) for n in tuned.kernels):
        return _log_choice(spec, p.T, tuned, "tuned")
    candidates = [k for k in usable.values() if (p.T == 1 or k.gemm) and _serves(dev, p, k)]
    return _log_choice(spec, p.T, default_tactic(
        candidates, num_tokens=p.T, top_k=p.k, num_experts=p.E, hidden_size=p.H, gemm1_n=p.n1,
        sm_count=_native.device_info(dev)["sm_count"], inter_size=p.I), "default rule")


def _parse(text):
    return None if text is None else Tactic.parse(text)


@functools.lru_cache(maxsize=None)
def _other_output_on(tactic, device: int, out_dtype: str):
    """_other_output with the device's library, once per tactic (forwards ask on every call)."""
    return _other_output(tactic, _native.library_for(device)["kernels"], out_dtype)


def _other_output(tactic, kernels: list, out_dtype: str):
    """`tactic` with each kernel replaced by the same instantiation writing `out_dtype` (from
    `kernels`, a library's), or None where one has no such form."""
    if tactic is None:
        return None
    by_name = {k.name: k for k in kernels}
    names = []
    for name in tactic.kernels:
        k = by_name.get(name)
        twin = next((o for o in kernels if k and o.out_dtype == out_dtype and o.same_kernel(k)), None)
        if twin is None:
            return None
        names.append(twin.name)
    return Tactic(forward=names[0]) if tactic.forward else Tactic(*names)


def _checked(p: Problem, tactic, usable: dict, what: str) -> Tactic:
    """A caller's tactic, refused with the reason where it cannot run this problem here."""
    dev = p.device.index
    if not isinstance(tactic, Tactic):
        fail("tactic", repr(tactic), "a moe_kernels.Tactic", TypeError)
    slots = ("forward",) if tactic.forward else ("gemm1", "gemm2")
    for slot in slots:
        name = getattr(tactic, slot)
        if name not in usable:
            k = next((k for k in _native.library_for(dev)["kernels"] if k.name == name), None)
            why = ("not in this build" if k is None else _native.kernel_problem(dev, name)
                   or f"it is a {k.mode} kernel with {k.out_dtype} out")
            fail(f"tactic.{slot}", repr(name), f"a {what} kernel usable on this GPU ({why}); usable: {sorted(usable)}")
        k = usable[name]
        if k.gemm == (slot == "forward"):
            fail(f"tactic.{slot}", repr(name), f"a {'forward' if slot == 'forward' else 'GEMM'} kernel "
                 f"(it is a {k.kind} kernel)")
        if not k.gemm:
            why = _forward_problem(dev, p, k)
            if why:
                fail("tactic", str(tactic), f"a problem {name!r} runs: {why}")
    return tactic
