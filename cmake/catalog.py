"""The kernel catalog: the only place a tile shape, cluster shape or schedule is written.

Every grouped-GEMM instantiation the project can build is one row of ``CATALOG``. The
generator (``generate_kernels.py``), the runtime registry, the default tactic rule and
the tests all read it, through the stable name each row gets from ``GemmConfig.name``.

Stdlib only: CMake runs this with whatever Python it finds.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys


def _load_modes():
    """The mode table (python/moe_kernels/modes.py, stdlib only), loaded by path."""
    if "moe_kernels_modes" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "moe_kernels", "modes.py")
        spec = importlib.util.spec_from_file_location("moe_kernels_modes", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["moe_kernels_modes"]


modes = _load_modes()

# Archs a build can target (CMake CUDA_ARCHITECTURES spelling).
ARCHS = {
    # lib: the per-arch library suffix; cc: the compute capability it runs on;
    # family: the source folder src/gemm/<family> and C++ namespace of its GEMM template.
    "90a": {"lib": "sm90a", "cc": (9, 0), "family": "sm90"},
    # B200/GB200 and B300/GB300: the same sources and tiles (family sm100), one library each,
    # since "a" machine code runs only on its own compute capability. Compiled and
    # disassembled in this project, not yet run on such a GPU.
    "100a": {"lib": "sm100a", "cc": (10, 0), "family": "sm100"},
    "103a": {"lib": "sm103a", "cc": (10, 3), "family": "sm100"},
}

# Element types by the name used in kernel names, with their CUTLASS spelling.
DTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t", "e4m3": "cutlass::float_e4m3_t",
          "int4": "cutlass::int4b_t", "e2m1": "cutlass::float_e2m1_t"}

# Schedules: (kind, swap_ab) by name, the names used in kernel names and the catalog. Kinds:
# "grouped": CUTLASS's ptr-array grouped GEMM; "coop_swapab" is its cooperative schedule with
# the weights as the wgmma's A operand (M = tile_n) and the tile_m tokens as its N, for a few
# rows per expert. "decode": our own kernel for a few rows per expert
# (src/gemm/decode_gemm.cuh: mma.sync with the weights as the 16-row operand, tile_m tokens
# per pass; tile_n output columns per block: 16 with K split over its 4 warps, or 64, 16 per
# warp), the same source for both families. "ring": the decode kind's other form, vLLM's
# Triton MoE's decomposition (src/gemm/decode_ring.cuh: 64 weight rows by tile_m tokens per
# block, both operands through a cp.async ring of K steps of tile_k values, mma.sync), 16-bit
# and per-channel fp8. "contiguous": our own TMA + wgmma kernel for
# fp8_block at many rows per expert (src/gemm/sm90/contiguous_gemm.cuh: one descriptor per
# operand for all experts, tiles taken from a counter, an expert's last M tile cut to the
# 64-row half with rows in it), and in that frame for 4-bit weights converted in shared memory
# (contiguous_w4.cuh). "forward": the whole forward of one token as one kernel
# (src/one_token.cuh), a tactic of its own rather than a GEMM. "tiled": our own 4-bit kernel
# for many rows per expert (src/gemm/tiled_w4a16.cuh: mma.sync, 128 weight rows by tile_m
# tokens per block, the 4-bit weights dequantized once per block tile, any scale group of 32
# or more, zero terms), for what CUTLASS's mixed-input mainloop cannot take (MXFP4's groups of 32).
SCHEDULE_KINDS = {"pingpong": ("grouped", False), "coop": ("grouped", False),
                  "coop_swapab": ("grouped", True), "1sm": ("grouped", False),
                  "2sm": ("grouped", False), "decode": ("decode", False), "ring": ("decode", False),
                  "contig": ("contiguous", False), "one_token": ("forward", False), "tiled": ("tiled", False)}
KINDS = ("grouped", "decode", "contiguous", "forward", "tiled")  # C codes: positions here
SCHEDULES = {"sm90": ("pingpong", "coop", "coop_swapab", "decode", "ring", "contig", "one_token", "tiled"),
             "sm100": ("1sm", "2sm", "decode", "ring", "one_token", "tiled")}
DECODE_TILE_N = (16, 64)

# FP8 mainloops (SM90). "": partial sums promoted to fp32 every few k-blocks (accurate for
# long K). "fastaccum": the tensor core's own accumulator all the way (what vLLM and
# TensorRT-LLM use for per-tensor/per-channel FP8). "blockwise": DeepSeek-style scales per
# 1x128 activation group and 128x128 weight block, applied in the mainloop (fp8_block).
MAINLOOPS = ("", "fastaccum", "blockwise")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    arch: str          # "90a"
    mode: str          # the QuantMode value it serves, a key of modes.MODES
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    schedule: str      # a key of SCHEDULE_KINDS
    out: str = "bf16"  # D element type, one of the mode's hidden dtypes
    mainloop: str = ""  # FP8 only: one of MAINLOOPS

    @property
    def quant(self) -> str:
        return self.mode

    @property
    def spec(self):
        return modes.MODES[self.mode]

    @property
    def act_dtype(self) -> str:
        """The activation (A) element type, a key of DTYPES."""
        return self.spec.element_names(self.out)[0]

    @property
    def weight_dtype(self) -> str:
        return self.spec.element_names(self.out)[1]

    @property
    def kind(self) -> str:
        return SCHEDULE_KINDS.get(self.schedule, ("?", False))[0]

    @property
    def swapped(self) -> bool:
        return SCHEDULE_KINDS.get(self.schedule, ("?", False))[1]

    @property
    def sort_key(self) -> tuple:
        """Registry order: by arch, element types, tile, cluster, schedule, output, mainloop."""
        out = "" if self.out == self.act_dtype else self.out
        return (self.arch, self.kind == "forward", self.act_dtype, self.weight_dtype, self.tile_m,
                self.tile_n, self.tile_k, self.cluster_m, self.cluster_n, self.schedule, out, self.mainloop)

    @property
    def name(self) -> str:
        family = ARCHS[self.arch]["family"]
        if self.kind == "forward":
            return f"{family}_{self.mode}_{self.out}_{self.schedule}"
        out = f"_{self.out}" if self.out != self.act_dtype else ""
        return (f"{family}_{self.act_dtype}x{self.weight_dtype}{out}_"
                f"{self.tile_m}x{self.tile_n}x{self.tile_k}_"
                f"{self.cluster_m}x{self.cluster_n}_{self.schedule}"
                + (f"_{self.mainloop}" if self.mainloop else ""))

    def check(self) -> None:
        """Legality rules, each with its reason; a row that breaks one is a catalog bug."""
        assert self.arch in ARCHS, self
        assert self.mode in modes.MODES, f"{self}: not a mode of modes.MODES"
        assert self.arch in self.spec.archs, f"{self.name}: modes.py does not build {self.mode} for {self.arch}"
        # Outputs are 16-bit: the runner's activation and finalize kernels read them.
        assert self.out in self.spec.hidden, f"{self.name}: output must be one of {self.spec.hidden}"
        assert self.act_dtype in DTYPES and self.weight_dtype in DTYPES, self
        # Mixed input (4-bit weights): CUTLASS converts them in registers, so they must be the
        # wgmma's A operand (swap-AB, SM90's RS mainloop); our own kernels convert their own.
        mixed = self.weight_dtype != self.act_dtype
        assert not mixed or self.schedule in ("decode", "tiled", "contig") or (self.swapped and self.arch == "90a"), \
            f"{self.name}: mixed input is SM90 swap-AB, decode, tiled or contig"
        assert self.schedule != "tiled" or mixed, f"{self.name}: tiled is for 4-bit weights"
        family = ARCHS[self.arch]["family"]
        assert self.schedule in SCHEDULES[family], f"{self.name}: not a {family} schedule"
        assert self.mainloop in MAINLOOPS, f"{self.name}: mainloop"
        # The block-scaled mainloop is what the 128x128 weight blocks need, and only they.
        assert (self.mainloop == "blockwise") == (self.spec.weight == "e4m3_block128"), \
            f"{self.name}: blockwise mainloop iff 128x128 weight blocks"
        assert self.mainloop == "" or self.act_dtype == "e4m3", f"{self.name}: mainloops are for E4M3"
        if self.kind == "forward":
            assert self.mode in ("fp8", "fp8_block") and (self.tile_m, self.tile_n, self.tile_k) == (0, 0, 0), \
                f"{self.name}: one_token is an fp8/fp8_block forward without tiles"
            return
        if self.schedule == "ring":  # src/gemm/decode_ring.cuh: 16 tokens per mma, 64 weight rows
            assert not mixed and self.tile_n == 64 and self.tile_m in (16, 64) and \
                (self.cluster_m, self.cluster_n) == (1, 1), f"{self.name}: ring tile"
            # K steps of 128 or 256 bytes: whole rows of the 8-chunk swizzle.
            assert self.tile_k * (1 if self.act_dtype == "e4m3" else 2) in (128, 256), f"{self.name}: ring tile_k"
            # With block scales a 64-token pass needs 255 registers and spills.
            assert self.mainloop == "" or self.tile_m == 16, f"{self.name}: block-scaled ring passes are 16 tokens"
            return
        # wgmma reads 32 bytes of K per instruction: K tiles of 64 (16-bit) or 128 (8-bit).
        if mixed and self.schedule == "decode":  # src/gemm/decode_w4a16.cuh: K steps of 128 values
            # 32 tokens a pass: SM90's 64-column W4A8 block only (src/gemm/sm90/decode_w4a8_wgmma.cuh).
            fp8_wgmma = family == "sm90" and self.tile_n == 64 and self.act_dtype == "e4m3"
            assert self.tile_n in (16, 64) and self.tile_k == 128 and \
                self.tile_m in ((8, 16, 32) if fp8_wgmma else (8, 16)), f"{self.name}: W4 decode tile"
        elif self.schedule == "tiled":  # src/gemm/tiled_w4a16.cuh: 128 rows, K stages of 64 values
            assert (self.tile_n, self.tile_k) == (128, 64) and self.tile_m in (16, 32, 64) and \
                (self.cluster_m, self.cluster_n) == (1, 1) and not self.mainloop, f"{self.name}: W4 tiled tile"
            return
        elif mixed and self.swapped:  # CUTLASS's mixed-input mainloop: K tiles of one fragment-layout atom
            assert self.tile_k == 128, f"{self.name}: tile_k (the fragment layout's atom spans 128 of K)"
        else:
            assert self.tile_k * (1 if self.act_dtype == "e4m3" else 2) == 128, f"{self.name}: tile_k"
        # SM100's FP8 MMA accumulates in fp32 (no fast-accumulation variant); blockwise is
        # CUTLASS's block-scaled mainloop there as on SM90.
        assert family == "sm90" or self.mainloop in ("", "blockwise"), f"{self.name}: SM90 mainloop"
        if self.schedule == "decode":
            assert self.tile_n in DECODE_TILE_N and self.tile_m % 8 == 0, f"{self.name}: decode tile"
            assert (self.cluster_m, self.cluster_n) == (1, 1), f"{self.name}: decode has no clusters"
            assert self.mainloop != "fastaccum", f"{self.name}: decode accumulates in fp32 (mma.sync)"
            return
        if self.schedule == "contig":
            assert (self.tile_m, self.tile_n, self.cluster_m, self.cluster_n) == (128, 256, 1, 1) and \
                (self.mode, self.mainloop) in (("fp8_block", "blockwise"), ("w4a8_int4", ""), ("w4a8_mxfp4", ""),
                                               ("w4a16_int4", ""), ("w4a16_mxfp4", "")), \
                f"{self.name}: contig is fp8_block or 4-bit weights, 128 rows by 256 columns"
            return
        # Block scales cover 128 output columns; a tile must not split one.
        assert self.mainloop != "blockwise" or self.tile_n % 128 == 0, f"{self.name}: blockwise tile_n"
        if family == "sm90":
            # wgmma's M: the weights' rows (tile_n) when swapped, whose N is then tile_m.
            m = self.tile_n if self.swapped else self.tile_m
            # Cooperative splits the M tile across two consumer warpgroups of 64 rows each.
            assert not self.schedule.startswith("coop") or m % 128 == 0, f"{self.name}: coop needs M % 128"
            # Ping-pong gives each consumer warpgroup a whole tile; 64 rows is one wgmma M.
            assert m % 64 == 0, f"{self.name}: wgmma M is 64"
            assert not self.swapped or self.tile_m % 8 == 0, f"{self.name}: wgmma N is a multiple of 8"
        else:
            # tcgen05 MMA M is 64 or 128 per CTA; a 2-CTA MMA spans a CTA pair along M.
            per_cta = self.tile_m // (2 if self.schedule == "2sm" else 1)
            assert per_cta in (64, 128), f"{self.name}: MMA M per CTA must be 64 or 128"
            assert self.schedule != "2sm" or self.cluster_m % 2 == 0, f"{self.name}: 2sm needs cluster_m % 2"
        # TMA multicast inside a cluster: at most 2 CTAs per mode keeps the smem budget and
        # leaves enough clusters for skewed per-expert M.
        assert self.cluster_m * self.cluster_n <= 2, f"{self.name}: cluster too large"


def _rows(arch: str, mode: str, tiles, out: str) -> list[GemmConfig]:
    """Rows from (tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule[, mainloop]) tuples;
    mode "fp8" rows with the blockwise mainloop serve fp8_block."""
    return [GemmConfig(arch, "fp8_block" if mode == "fp8" and t[6:] == ("blockwise",) else mode,
                       *t[:6], out, *t[6:]) for t in tiles]


def _k(tiles, k):
    """The same tiles with K set for the element size (64 for 16-bit, 128 for 8-bit)."""
    return [(m, n, k, *rest) for (m, n, _, *rest) in tiles]


# (tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule)
# Decode (a few rows per expert): M=64 ping-pong tiles, N narrow enough to give every SM
# a tile when few experts are hit. Prefill: M=128/256 cooperative tiles, 2-CTA clusters
# multicast the weight (2x1) or activation (1x2) tile.
_SM90_16BIT_FULL = [
    (64, 64, 64, 1, 1, "pingpong"),
    (64, 128, 64, 1, 1, "pingpong"),
    (64, 256, 64, 1, 1, "pingpong"),
    (64, 128, 64, 2, 1, "pingpong"),
    (128, 128, 64, 1, 1, "pingpong"),
    (128, 128, 64, 1, 1, "coop"),
    (128, 256, 64, 1, 1, "coop"),
    (128, 128, 64, 2, 1, "coop"),
    (128, 256, 64, 2, 1, "coop"),
    (128, 128, 64, 1, 2, "coop"),
    (256, 128, 64, 1, 1, "coop"),
]
# The development/CI subset: one decode and one prefill tile per dtype.
_SM90_16BIT_MINIMAL = [
    (64, 128, 64, 1, 1, "pingpong"),
    (128, 256, 64, 1, 1, "coop"),
]
# FP8 (E4M3 x E4M3, bf16 out), K tiles of 128 bytes. Wide (N=256) tiles only with fast
# accumulation: with the promoting mainloop they hold two fp32 accumulators per thread and
# trail N=128 (docs/design.md, "Tiles left out").
_SM90_FP8_FULL = [
    (64, 128, 128, 1, 1, "pingpong"),
    (128, 128, 128, 1, 1, "coop"),
    (64, 128, 128, 1, 1, "pingpong", "fastaccum"),
    (64, 256, 128, 1, 1, "pingpong", "fastaccum"),
    (128, 128, 128, 1, 1, "coop", "fastaccum"),
    (128, 256, 128, 1, 1, "coop", "fastaccum"),
]
_SM90_FP8_MINIMAL = [
    (64, 128, 128, 1, 1, "pingpong"),
    (128, 128, 128, 1, 1, "coop", "fastaccum"),
]
# fp8_block: CUTLASS's blockwise-scaled mainloop (scales per 128 of K, applied to fp32 partial
# sums); tile_n a multiple of the 128-column weight block. No 2x1 clusters (one M tile per
# expert leaves half of each cluster idle); a 1x2 cluster multicasts the activation tile to
# two N tiles of the same expert instead. 128x256 (two N scales per tile with K-major
# scales) does not compile in CUTLASS 4.2.
_SM90_FP8_BLOCK_FULL = [
    (64, 128, 128, 1, 1, "pingpong", "blockwise"),
    (128, 128, 128, 1, 1, "coop", "blockwise"),
    (128, 128, 128, 1, 2, "coop", "blockwise"),
    # Our own kernel (schedule "contig"): the default past 64 rows per expert where N is a
    # multiple of 256 (tactic.py; in GEMM1 it also applies a gated activation).
    (128, 256, 128, 1, 1, "contig", "blockwise"),
]
_SM90_FP8_BLOCK_MINIMAL = _SM90_FP8_BLOCK_FULL[:2] + _SM90_FP8_BLOCK_FULL[3:]
# fp8_block swap-AB: tile_m tokens per tile as the wgmma's N, tile_n = 128 weight rows (one
# scale block) as its M, so a few tokens per expert pad 8 or 16 columns, not 64 rows; 64 tokens
# swapped for about 32 rows per expert. The measurements behind these three and the swap
# tiles left out: docs/design.md, "Tiles left out".
_SM90_FP8_BLOCK_SWAPAB = [
    (8, 128, 128, 1, 1, "coop_swapab", "blockwise"),
    (16, 128, 128, 1, 1, "coop_swapab", "blockwise"),
    (64, 128, 128, 1, 1, "coop_swapab", "blockwise"),
]

# W4A16 INT4 (SM90, CUTLASS's mixed-input ptr-array mainloop, group scales, the weights as the
# converted A operand): 128 weight rows by 16, 64 or 128 tokens. The weights are read in the
# fragment layout prepare_weights stores (quant4.py), given to CUTLASS as a per-expert CuTe
# layout of 16-row x 128-k atoms, so K tiles of 128 (one atom) and scale groups of 128 or more
# (smaller groups run on the decode, tiled and contiguous kernels). Symmetric INT4 only: CUTLASS
# 4.2's ptr-array form of this mainloop with zero terms never loads the scales' TMA descriptor
# (an illegal instruction on the H200); AWQ's zero points run on the decode and tiled kernels.
_SM90_W4A16_INT4_FULL = [(m, 128, 128, 1, 1, "coop_swapab") for m in (16, 64, 128)]
_SM90_W4A16_INT4_MINIMAL = [(64, 128, 128, 1, 1, "coop_swapab")]
# 4-bit decode (src/gemm/decode_w4a16.cuh, mma.sync, so on every arch): 8 or 16 tokens per
# pass, 16 weight rows per block (split K) or 64 (a warp per 16 over all of K), K steps of 128
# values; both 4-bit formats, and W4A8's E4M3 tokens. The minimal set keeps one 64-row form.
_W4_DECODE_FULL = [(m, n, 128, 1, 1, "decode") for m in (8, 16) for n in (16, 64)]
_W4_DECODE_MINIMAL = [(m, 16, 128, 1, 1, "decode") for m in (8, 16)] + [(8, 64, 128, 1, 1, "decode")]
# SM90's 64-column W4A8 decode block (FP8 register-sourced wgmma) also takes 32 tokens a pass:
# the weights of a 64-column block read once for up to 32 rows of an expert (1024 tokens of
# gpt-oss-120b or DeepSeek-V3). The 16-bit block's 32-token form was slower than the tiled and
# CUTLASS kernels there (docs/kernels/decode.md) and is not built.
_SM90_W4A8_DECODE_32 = [(32, 64, 128, 1, 1, "decode")]
# 4-bit weights on wgmma: our contiguous kernel with the weights converted in shared memory
# (src/gemm/sm90/contiguous_w4.cuh): to the 16-bit type for W4A16 (K blocks of 64; any group of
# 32 or more, AWQ's zero terms), to E4M3 for W4A8 (INT4 in groups of 128, MXFP4's scales
# folded in); partial last N tiles and K blocks.
_SM90_W4A16_CONTIG = [(128, 256, 64, 1, 1, "contig")]
_SM90_W4A8_CONTIG = [(128, 256, 128, 1, 1, "contig")]
# 4-bit weights past the decode kernel where CUTLASS's mixed-input mainloop cannot serve (it
# loads one scale per K tile of 64 or more; MXFP4 has a scale per 32; SM100 has none here): our
# tiled kernel (src/gemm/tiled_w4a16.cuh, mma.sync), 32 or 64 tokens per tile.
_W4_TILED_FULL = [(m, 128, 64, 1, 1, "tiled") for m in (32, 64)]
_W4_TILED_MINIMAL = [(64, 128, 64, 1, 1, "tiled")]

# Decode: 8 or 16 tokens per pass over an expert's weights (in registers); more rows make
# more passes, so these are for a few rows per expert only. K steps of 128 bytes. On SM100
# too (mma.sync is there; compiled, not yet run on a B200), for every mode.
_DECODE = [(m, n, 128, 1, 1, "decode") for m in (8, 16) for n in DECODE_TILE_N]
# The ring form (16-bit, per-channel fp8 and fp8_block, every arch as mma.sync is): 16 tokens with K steps
# of 256 bytes (vLLM's tuned H100 configs at 4-128 tokens are mostly 16 tokens by 32-256 weight rows
# by 64-256 values of K, 2-5 stages), and 64 tokens with steps of 128 bytes. tile_k in values
# of the 16-bit type; _RING8 doubles it for E4M3.
_RING = [(16, 64, 128, 1, 1, "ring"), (64, 64, 64, 1, 1, "ring")]
_RING8 = [(m, n, 2 * k, *rest) for (m, n, k, *rest) in _RING]
# fp8_block: the 16-token form only (GemmConfig.check says why).
_RING8_BLOCK = _RING8[:1]

# SM100: 1-CTA tiles for decode and moderate M, 2-CTA (256-row) tiles for prefill. A first,
# untuned set (no B200 to measure on yet), for bf16/fp16 (K=64) and fp8 (K=128).
_SM100_FULL = [
    (64, 128, 0, 1, 1, "1sm"),
    (128, 128, 0, 1, 1, "1sm"),
    (128, 256, 0, 1, 1, "1sm"),
    (256, 128, 0, 2, 1, "2sm"),
    (256, 256, 0, 2, 1, "2sm"),
]
# fp8_block on SM100 (compiled, not run): tile_n of one 128-column weight-scale block.
_SM100_FP8_BLOCK_FULL = [
    (128, 128, 128, 1, 1, "1sm", "blockwise"),
    (256, 128, 128, 2, 1, "2sm", "blockwise"),
]
_SM100_FP8_FULL = _k(_SM100_FULL, 128) + _SM100_FP8_BLOCK_FULL
# The minimal SM100 set only has to keep each code path compiling (nothing runs it here, and
# CI compiles it twice, for 100a and 103a): the 2-CTA tile in 16-bit, the 1-CTA tile in both
# FP8 modes, and in fp16 (which differs from bf16 only in its element type) the decode kernels.
_SM100_16BIT_MINIMAL = [(256, 256, 0, 2, 1, "2sm")]
_SM100_FP8_MINIMAL = [(128, 256, 128, 1, 1, "1sm"), _SM100_FP8_BLOCK_FULL[0]]


def _subset(sm90_16bit, sm90_fp8, sm100_16bit, sm100_fp8, fp16, sm90_int4, sm90_w4a8, w4, w4_outs):
    """Each family's 16-bit and FP8 tiles, all built with bf16 (output); fp16: by family, the
    (16-bit, FP8) tiles also built with fp16. The decode kernels, the mma.sync tiles and the ring
    form, come in every 16-bit and FP8 form. 4-bit
    weights: SM90's CUTLASS INT4 tiles, contiguous kernels and W4A8's extra decode tiles
    `sm90_w4a8`, and on every arch the `w4` decode and tiled tiles, for the outputs `w4_outs`
    names per family."""
    fp8_decode = _DECODE + [(*t, "blockwise") for t in _DECODE + _RING8_BLOCK]
    families = {"sm90": (sm90_16bit, sm90_fp8), "sm100": (sm100_16bit, sm100_fp8)}
    rows = []
    for arch, v in ARCHS.items():
        (bf16_16bit, bf16_fp8), (fp16_16bit, fp16_fp8) = families[v["family"]], fp16[v["family"]]
        rows += _rows(arch, "fp8", bf16_fp8 + fp8_decode + _RING8, out="bf16")
        rows += _rows(arch, "fp8", fp16_fp8 + fp8_decode + _RING8, out="fp16")
        rows += _rows(arch, "bf16", _k(bf16_16bit + _DECODE, 64) + _RING, out="bf16")
        rows += _rows(arch, "fp16", _k(fp16_16bit + _DECODE, 64) + _RING, out="fp16")
        rows += [GemmConfig(arch, mode, 0, 0, 0, 1, 1, "one_token", out, "blockwise" if mode == "fp8_block" else "")
                 for mode in ("fp8", "fp8_block") for out in ("bf16", "fp16")]
        sm90 = v["family"] == "sm90"
        # W4A8 runs the same decode and tiled kernels with E4M3 tokens (widened to 16 bits, row
        # scales on the output).
        for mode in ("w4a16_int4", "w4a16_mxfp4", "w4a8_int4", "w4a8_mxfp4"):
            own = (sm90_int4 if mode == "w4a16_int4" else []) + \
                (sm90_w4a8 + _SM90_W4A8_CONTIG if mode.startswith("w4a8") else _SM90_W4A16_CONTIG)
            rows += [r for out in w4_outs[v["family"]] for r in _rows(arch, mode, (own if sm90 else []) + w4, out)]
    return rows


_SM90_FP8_ALL = _SM90_FP8_FULL + _SM90_FP8_BLOCK_FULL + _SM90_FP8_BLOCK_SWAPAB
CATALOG = {
    "full": _subset(_SM90_16BIT_FULL, _SM90_FP8_ALL, _SM100_FULL, _SM100_FP8_FULL,
                    {"sm90": (_SM90_16BIT_FULL, _SM90_FP8_ALL), "sm100": (_SM100_FULL, _SM100_FP8_FULL)},
                    _SM90_W4A16_INT4_FULL, _SM90_W4A8_DECODE_32, _W4_DECODE_FULL + _W4_TILED_FULL,
                    {"sm90": ("bf16", "fp16"), "sm100": ("bf16", "fp16")}),
    # fp16 on SM90 in the minimal set: both 16-bit tiles, one prefill tile per FP8 mode and our
    # contiguous kernel (with the decode kernels, every routing has a kernel), so that form is
    # built and tested in CI and on the GPU too.
    "minimal": _subset(_SM90_16BIT_MINIMAL, _SM90_FP8_MINIMAL + _SM90_FP8_BLOCK_MINIMAL + _SM90_FP8_BLOCK_SWAPAB[:1],
                       _SM100_16BIT_MINIMAL, _SM100_FP8_MINIMAL,
                       {"sm90": (_SM90_16BIT_MINIMAL, _SM90_FP8_MINIMAL[1:] + _SM90_FP8_BLOCK_MINIMAL[1:]),
                        "sm100": ([], [])},
                       _SM90_W4A16_INT4_MINIMAL, [], _W4_DECODE_MINIMAL + _W4_TILED_MINIMAL,
                       {"sm90": ("bf16", "fp16"), "sm100": ("bf16",)}),
}


def select(subset: str, archs: list[str]) -> list[GemmConfig]:
    """The configs of one catalog subset for the given archs, validated and sorted."""
    if subset not in CATALOG:
        raise ValueError(f"unknown catalog subset {subset!r}; expected one of {sorted(CATALOG)}")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown archs {unknown}; this catalog knows {sorted(ARCHS)}")
    configs = sorted((c for c in CATALOG[subset] if c.arch in archs), key=lambda c: c.sort_key)
    for c in configs:
        c.check()
    # Names are unique per arch (a library); archs of one family share them.
    keys = [(c.arch, c.name) for c in configs]
    assert len(keys) == len(set(keys)), "duplicate kernel names in the catalog"
    return configs
