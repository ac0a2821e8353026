"""The kernel catalog: the only place a tile shape, cluster shape or schedule is written.

Every grouped-GEMM instantiation the project can build is one row of ``CATALOG``. The
generator (``generate_kernels.py``), the runtime registry, the default tactic rule and
the tests all read it, through the stable name each row gets from ``GemmConfig.name``.

Stdlib only: CMake runs this with whatever Python it finds.
"""
from __future__ import annotations

import dataclasses
import itertools

# Archs a build can target (CMake CUDA_ARCHITECTURES spelling).
ARCHS = {
    # lib: the per-arch library suffix; cc: the compute capability it runs on;
    # family: the source folder src/gemm/<family> and C++ namespace of its GEMM template.
    "90a": {"lib": "sm90a", "cc": (9, 0), "family": "sm90"},
}

# Element types by the name used in kernel names, with their CUTLASS spelling.
DTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}

SCHEDULES = ("pingpong", "coop")


@dataclasses.dataclass(frozen=True, order=True)
class GemmConfig:
    arch: str          # "90a"
    act_dtype: str     # activation (A) element type, key of DTYPES
    weight_dtype: str  # weight (B) element type, key of DTYPES
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    schedule: str      # "pingpong" | "coop"

    @property
    def name(self) -> str:
        return (f"{ARCHS[self.arch]['family']}_{self.act_dtype}x{self.weight_dtype}_"
                f"{self.tile_m}x{self.tile_n}x{self.tile_k}_"
                f"{self.cluster_m}x{self.cluster_n}_{self.schedule}")

    def check(self) -> None:
        """Legality rules, each with its reason; a row that breaks one is a catalog bug."""
        assert self.arch in ARCHS, self
        assert self.act_dtype in DTYPES and self.weight_dtype in DTYPES, self
        assert self.schedule in SCHEDULES, self
        # Cooperative splits the M tile across two consumer warpgroups of 64 rows each.
        assert self.schedule != "coop" or self.tile_m % 128 == 0, f"{self.name}: coop needs tile_m % 128"
        # Ping-pong gives each consumer warpgroup a whole tile; 64 rows is one wgmma M.
        assert self.tile_m % 64 == 0, f"{self.name}: wgmma M is 64"
        # TMA multicast inside a cluster: at most 2 CTAs per mode keeps the smem budget and
        # leaves enough clusters for skewed per-expert M.
        assert self.cluster_m * self.cluster_n <= 2, f"{self.name}: cluster too large"


def _sm90_16bit(dtype: str, tiles) -> list[GemmConfig]:
    return [GemmConfig("90a", dtype, dtype, m, n, k, cm, cn, s) for (m, n, k, cm, cn, s) in tiles]


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

CATALOG = {
    "full": list(itertools.chain.from_iterable(_sm90_16bit(d, _SM90_16BIT_FULL) for d in DTYPES)),
    "minimal": list(itertools.chain.from_iterable(_sm90_16bit(d, _SM90_16BIT_MINIMAL) for d in DTYPES)),
}


def select(subset: str, archs: list[str]) -> list[GemmConfig]:
    """The configs of one catalog subset for the given archs, validated and sorted."""
    if subset not in CATALOG:
        raise ValueError(f"unknown catalog subset {subset!r}; expected one of {sorted(CATALOG)}")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown archs {unknown}; this catalog knows {sorted(ARCHS)}")
    configs = sorted(c for c in CATALOG[subset] if c.arch in archs)
    for c in configs:
        c.check()
    names = [c.name for c in configs]
    assert len(names) == len(set(names)), "duplicate kernel names in the catalog"
    return configs
