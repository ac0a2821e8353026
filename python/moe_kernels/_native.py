"""The bridge to the compiled code: `_C` and the per-arch libraries it loads.

Everything here works without a GPU; only calls that need one touch the driver.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os


@functools.lru_cache(maxsize=None)
def C():
    """The native module, imported on first use so `import moe_kernels` never fails on it."""
    try:
        from . import _C
    except ImportError as e:  # a source checkout that was never built
        raise ImportError(
            "moe_kernels._C is missing: this copy of moe_kernels was not built. Install it with "
            "`pip install .` (see README.md)") from e
    return _C


@functools.lru_cache(maxsize=None)
def build_info() -> dict:
    """What this build holds, written by cmake/generate_kernels.py."""
    path = os.path.join(os.path.dirname(__file__), "build_info.json")
    if not os.path.exists(path):
        return {"catalog": None, "archs": {}}
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """One grouped-GEMM instantiation of the catalog, as the library reports it."""

    name: str
    arch: str
    quant: str         # the QuantMode value it serves
    act_dtype: str
    weight_dtype: str
    out_dtype: str
    tile: tuple
    cluster: tuple
    schedule: str
    smem_bytes: int

    def __str__(self) -> str:
        return self.name


def _kernels(lib: dict) -> list:
    return [KernelInfo(name=k["name"], arch=lib["arch"], quant=k["quant"], act_dtype=k["act_dtype"],
                       weight_dtype=k["weight_dtype"], out_dtype=k["out_dtype"], tile=tuple(k["tile"]),
                       cluster=tuple(k["cluster"]), schedule=k["schedule"],
                       smem_bytes=k["smem_bytes"]) for k in lib["kernels"]]


@functools.lru_cache(maxsize=None)
def libraries() -> list:
    """Every per-arch library in this build: [{arch, path, cuda_version, kernels}]. No GPU needed."""
    return [dict(lib, kernels=_kernels(lib)) for lib in C().libraries()]


@functools.lru_cache(maxsize=None)
def library_for(device: int) -> dict:
    """The library for a device; raises naming the GPU and what this build holds if none fits."""
    lib = C().library_for(device)
    return dict(lib, kernels=_kernels(lib))


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> dict:
    return C().device_info(device)


@functools.lru_cache(maxsize=None)
def kernel_problem(device: int, name: str) -> str:
    """Why kernel `name` cannot run on `device`, or "" when it can (cached per device)."""
    return C().check_kernel(device, name)
