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


# Default rule, from the H200 sweep (`bench --sweep`, Mixtral-8x7B and Qwen3-30B-A3B, 1 to
# 4096 tokens): the M=64 ping-pong tile was best or within 1% up to 256 rows per expert and
# within 1% at 1024, where M=128 cooperative led GEMM1 by 1%. Among same-M tiles, the widest
# N tile that still gives at least half the SMs a tile won: fewer CTAs cannot pull the
# weights at full bandwidth (Mixtral GEMM2 at T=1: 64x64 beat 64x256 by 21%).
# fp8_block (DeepSeek-V3 sweep, 1 to 16384 tokens): among CUTLASS's tiles the M=128
# cooperative one led GEMM1 at 128 rows per expert, and M=64 ping-pong led at 32 (past 64 rows
# per expert our contiguous kernel comes first: CONTIG_TILE_N below).
# 16-bit and per-tensor FP8 switch past 384 rows (was 512; session 41: the 64x256 ping-pong
# against the 128x256 cooperative tile in each GEMM, 3 interleaved rounds, 256-768 rows per
# expert, `h200-{bf16,fp8}-m128-threshold-sweep-session41.json`). At 512 rows the cooperative
# tile was 4.5-6% faster in each GEMM for gpt-oss-120b/20b bf16 (6-9% in fp8), 0.5-2.7% for
# Qwen3-30B-A3B bf16 (0.7-0.8% slower in fp8), tied for Qwen3-235B-A22B, and 3-3.5% slower
# in Mixtral-8x7B's GEMM1; at 384 rows it lost Qwen3-30B-A3B bf16's GEMM2 (K = 768) by 4-6%
# and Qwen3-235B-A22B's GEMM1 by up to 3%, so the switch is not earlier.
DECODE_ROWS = {"bf16": 384, "fp16": 384, "fp8": 384, "fp8_block": 64}
MIN_SM_FILL = 0.5
# The "decode" schedule (our mma.sync kernel, weights read once per pass of tile_m tokens):
# the default for both GEMMs up to 64 (token, expert) pairs. H200 with the 64-column blocks
# (Qwen3-30B-A3B fp8, DeepSeek-V3 fp8_block, k=8):
# best or within noise in both slots up to 8 tokens; at 16 tokens best for Qwen3 (uniform
# routing: 125 vs 131-143 us with CUTLASS in either slot) but 3-4% behind CUTLASS's 64x128
# for DeepSeek-V3.
DECODE_PAIRS = (64, 64)  # GEMM1, GEMM2
# 16-bit GEMM1 with K >= 4096 leaves decode past 16 pairs: with CUTLASS's M=64 ping-pong tile in
# GEMM1 the layer was 1.2-4.7% faster than with the best decode tile at 32 and 64 pairs (H200
# sweeps, uniform routing: Mixtral-8x7B 16/32 tokens 700/812 us vs 722/849; DeepSeek-V3 4/8
# tokens; Qwen3-235B-A22B 8 tokens), except Qwen3-235B-A22B at 32 pairs (1% behind), and within
# 2% either way at 16 pairs and fewer.
DECODE_PAIRS_16BIT_LONG_K = 16
DECODE_LONG_K = 4096
# A decode pass holds tile_m tokens, so an expert with more rows streams its weights again.
# Routing is never even: take the smallest tile_m that holds this many times the mean rows
# per expert (Mixtral-8x7B bf16 at 32 tokens, 8 rows per expert: the 8-token tiles took
# 1039/1047 us in GEMM1/GEMM2 against 860/981 for the 16-token ones of the same width).
DECODE_HEADROOM = 1.5
# Decode blocks of 64 columns (a warp per 16, each over all of K) once there are enough of
# them for 4 per SM (their occupancy); below that, 16 columns with K split over the 4 warps,
# so that a few experts' weights still spread over every SM. 16-bit blocks of 64 columns take
# 16 tokens a pass whatever the rows: wherever this rule takes them, 16x64 was as fast as 8x64
# or faster in the same sweeps (by up to 3.5% where both make one pass: DeepSeek-V3 GEMM1 at 4
# tokens 687 vs 710 us, Qwen3-235B-A22B GEMM1 at 8 tokens 500 vs 517; ties within 0.1%).
DECODE_WIDE_BLOCKS_PER_SM = 4
# Swap-AB CUTLASS kernels (catalog "coop_swapab", fp8_block): the default up to this many rows
# per expert (GEMM1, GEMM2), before the decode kernel, with the narrowest tile that holds
# SWAP_AB_HEADROOM times the rows (routing is never even). DeepSeek-V3 on H200 (sweep at 1 and
# 16 tokens, uniform routing; tuner at 32-128 tokens, skewed): best in both GEMMs at 1 row per
# expert; at 2 and 4 rows (64 and 128 tokens) GEMM1 was 9-17% faster with the 64x128 ping-pong
# tile (1408 vs 1534 us, 1914 vs 2237 us for the whole layer), GEMM2 still best swapped, the
# 16-wide tile 1.7-3.5% ahead of the 8-wide. Untimed beyond 4 rows, hence the bounds.
SWAP_AB_ROWS = (1, 4)
SWAP_AB_HEADROOM = 8
# The narrow swap tiles (tokens per tile) this decode rule picks from; the wider ones (64
# tokens) are not in the default rule, only in tuned tables (measured near a tie).
SWAP_AB_DECODE_TILE = 16
# Our contiguous fp8_block kernel (catalog "contig"), 256 columns wide, in both GEMMs past
# DECODE_ROWS["fp8_block"] rows per expert where N allows (in GEMM1 it also applies a gated
# activation). H200, DeepSeek-V3, uniform routing, one sweep: at 4096 tokens the pair took
# 4751 us, with CUTLASS's 128x128 cooperative tile in GEMM1 instead 5265, in GEMM2 4916; at
# 16384 GEMM1 14578 vs 15435 us, GEMM2 14585 vs 14420 (a tie). A 128-wide form tied or lost
# and is not in the catalog.
CONTIG_TILE_N = 256


# 4-bit weights (W4A16): our decode kernel (src/gemm/decode_w4a16.cuh) up to this many rows
# per expert, then CUTLASS's mixed-input GEMM with the narrowest token tile that holds them,
# else (groups of 32: MXFP4, INT4 g32) our tiled kernel (src/gemm/tiled_w4a16.cuh) likewise.
FOUR_BIT_FORMATS = ("int4", "mxfp4")
FOUR_BIT_DECODE_ROWS = 16


def _pick_four_bit(kernels: list, rows_per_expert: float) -> KernelInfo:
    decode, grouped, tiled = (sorted((k for k in kernels if k.kind == kind), key=lambda k: k.tile[0])
                              for kind in ("decode", "grouped", "tiled"))
    pool = decode if decode and rows_per_expert <= FOUR_BIT_DECODE_ROWS else grouped or tiled or decode
    return next((k for k in pool if k.tile[0] >= rows_per_expert), pool[-1])


def _sixteen_bit(kernels: list) -> bool:
    return all(k.act_format == "a16" and k.weight_format == "w16" for k in kernels)


def _pick(kernels: list, rows_per_expert: float, n: int, experts_hit: int, sm_count: int,
          decode_pairs: int, swap_rows: float) -> KernelInfo:
    swap = sorted((k for k in kernels if k.swap_ab and k.tile[0] <= SWAP_AB_DECODE_TILE),
                  key=lambda k: k.tile[0])
    if swap and rows_per_expert <= swap_rows:
        return next((k for k in swap if k.tile[0] >= SWAP_AB_HEADROOM * rows_per_expert), swap[-1])
    decode = [k for k in kernels if k.kind == "decode"]
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
    # Same N: FP8 fast accumulation first (H200 sweep: it was never slower).
    same_m = sorted((k for k in plain if k.tile[0] == tm),
                    key=lambda k: (k.tile[1], k.mainloop == "fastaccum"))

    def tiles(k):
        return math.ceil(max(rows_per_expert, 1) / k.tile[0]) * math.ceil(n / k.tile[1]) * experts_hit

    filling = [k for k in same_m if tiles(k) >= MIN_SM_FILL * sm_count]
    return filling[-1] if filling else same_m[0]


def default_tactic(kernels: list, *, num_tokens: int, top_k: int, num_experts: int,
                   hidden_size: int, gemm1_n: int, sm_count: int) -> Tactic:
    """The rule used when nothing was tuned: a forward kernel for one token where `kernels`
    holds one (the caller passes only those that serve the problem), else GEMM kernels by rows
    per expert, N and the SM count."""
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
        pick = _pick_four_bit(kernels, rows)
        return Tactic(pick.name, pick.name)
    decode1 = DECODE_PAIRS[0]
    if _sixteen_bit(kernels) and hidden_size >= DECODE_LONG_K:  # GEMM1's K
        decode1 = DECODE_PAIRS_16BIT_LONG_K
    return Tactic(_pick(kernels, rows, gemm1_n, experts_hit, sm_count, decode1, SWAP_AB_ROWS[0]).name,
                  _pick(kernels, rows, hidden_size, experts_hit, sm_count, DECODE_PAIRS[1], SWAP_AB_ROWS[1]).name)


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
        sm_count=_native.device_info(dev)["sm_count"]), "default rule")


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
