"""Tactics: which GEMM1 and GEMM2 kernels a forward uses, named by their stable names.

No public function takes or returns a bare integer index. Tile shapes come from the
catalog (cmake/catalog.py) through the library's registry; this module only ranks them.
"""
from __future__ import annotations

import dataclasses
import math

from ._native import KernelInfo


@dataclasses.dataclass(frozen=True)
class Tactic:
    """One GEMM1 kernel and one GEMM2 kernel, by registry name."""

    gemm1: str
    gemm2: str

    def __post_init__(self):
        for field in ("gemm1", "gemm2"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Tactic.{field}={value!r}: expected a kernel name (str), "
                                "see moe_kernels.list_kernels()")

    def __str__(self) -> str:
        return f"{self.gemm1}+{self.gemm2}"


# The whole forward of one token as one kernel (src/one_token.cuh: fp8, gated activations,
# when the token's experts fit across the SMs), named as both GEMMs of a tactic. H200 bench,
# Qwen3-30B-A3B fp8: 17.4 us against 26.0 for the grouped path's six launches.
ONE_TOKEN = "one_token"


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


def _sixteen_bit(kernels: list) -> bool:
    return all(k.quant in ("bf16", "fp16") for k in kernels)


def _pick(kernels: list, rows_per_expert: float, n: int, experts_hit: int, sm_count: int,
          decode_pairs: int, swap_rows: float) -> KernelInfo:
    swap = sorted((k for k in kernels if k.schedule.endswith("_swapab") and k.tile[0] <= SWAP_AB_DECODE_TILE),
                  key=lambda k: k.tile[0])
    if swap and rows_per_expert <= swap_rows:
        return next((k for k in swap if k.tile[0] >= SWAP_AB_HEADROOM * rows_per_expert), swap[-1])
    decode = [k for k in kernels if k.schedule == "decode"]
    if decode and rows_per_expert * experts_hit <= decode_pairs:
        narrow, wide = min(k.tile[1] for k in decode), max(k.tile[1] for k in decode)
        use_wide = wide > narrow and math.ceil(n / wide) * experts_hit >= DECODE_WIDE_BLOCKS_PER_SM * sm_count
        same_n = sorted((k for k in decode if k.tile[1] == (wide if use_wide else narrow)), key=lambda k: k.tile[0])
        if use_wide and _sixteen_bit(decode):
            return same_n[-1]
        return next((k for k in same_n if k.tile[0] >= DECODE_HEADROOM * rows_per_expert), same_n[-1])
    kernels = [k for k in kernels if k.schedule != "decode" and not k.schedule.endswith("_swapab")] or kernels
    plain = [k for k in kernels if k.cluster == (1, 1)] or kernels
    decode_rows = min(DECODE_ROWS[k.quant] for k in plain)
    contig = [k for k in plain if k.schedule == "contig" and k.tile[1] == CONTIG_TILE_N and n % CONTIG_TILE_N == 0]
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
                    key=lambda k: (k.tile[1], k.name.endswith("_fastaccum")))

    def tiles(k):
        return math.ceil(max(rows_per_expert, 1) / k.tile[0]) * math.ceil(n / k.tile[1]) * experts_hit

    filling = [k for k in same_m if tiles(k) >= MIN_SM_FILL * sm_count]
    return filling[-1] if filling else same_m[0]


def default_tactic(kernels: list, *, num_tokens: int, top_k: int, num_experts: int,
                   hidden_size: int, gemm1_n: int, sm_count: int) -> Tactic:
    """The rule used when nothing was tuned: by rows per expert, N and the SM count."""
    if not kernels:
        raise ValueError("no kernels to choose from")
    pairs = num_tokens * top_k
    experts_hit = max(1, min(num_experts, pairs))
    rows = pairs / experts_hit
    decode1 = DECODE_PAIRS[0]
    if _sixteen_bit(kernels) and hidden_size >= DECODE_LONG_K:  # GEMM1's K
        decode1 = DECODE_PAIRS_16BIT_LONG_K
    return Tactic(_pick(kernels, rows, gemm1_n, experts_hit, sm_count, decode1, SWAP_AB_ROWS[0]).name,
                  _pick(kernels, rows, hidden_size, experts_hit, sm_count, DECODE_PAIRS[1], SWAP_AB_ROWS[1]).name)
