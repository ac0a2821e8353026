"""The bridge to the compiled code: `_C` and the per-arch libraries it loads.

Everything here works without a GPU; only calls that need one touch the driver.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os


# The distributions of this package, one per CUDA major; each installs the import name moe_kernels.
DISTRIBUTIONS = {12: "moe-kernels-cu12", 13: "moe-kernels-cu13"}

# The GPUs each per-arch library runs on: "a" machine code runs only on its own compute capability.
ARCH_GPUS = {
    "sm90a": {"compute_capability": "9.0", "gpus": ["H100", "H200", "H20", "GH200"]},
    "sm100a": {"compute_capability": "10.0", "gpus": ["B200", "GB200"]},
    "sm103a": {"compute_capability": "10.3", "gpus": ["B300", "GB300"]},
}


def arch_gpus(arch: str) -> str:
    """The GPUs a library's arch runs on, for messages: "H100/H200/H20/GH200"."""
    return "/".join(ARCH_GPUS[arch]["gpus"]) if arch in ARCH_GPUS else "GPUs of its compute capability"


def installed_distributions() -> list:
    import importlib.metadata
    found = []
    for name in DISTRIBUTIONS.values():
        try:
            importlib.metadata.version(name)
            found.append(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def check_distributions() -> None:
    """Two distributions install the same files: whichever was installed last won them."""
    found = installed_distributions()
    if len(found) > 1:
        raise ImportError(f"both {' and '.join(found)} are installed; they install the same package "
                          f"(moe_kernels) for different CUDA majors: `pip uninstall {' '.join(found)}`, "
                          "then install the one for your driver")


def cuda_string(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def check_driver(cuda_version: int) -> None:
    """A clear error where the driver is older than the CUDA major the libraries were built with
    (the CUDA runtime they link statically then cannot start)."""
    driver = C().driver_version()
    major = cuda_version // 1000
    if 0 < driver < major * 1000:
        other = DISTRIBUTIONS.get(driver // 1000)
        raise RuntimeError(
            f"the NVIDIA driver supports CUDA {cuda_string(driver)}; this build of moe_kernels "
            f"({DISTRIBUTIONS.get(major, 'its CUDA major')}) needs a driver for CUDA {major}.0 or newer: "
            "update the driver" + (f", or install {other} instead" if other else ""))


@functools.lru_cache(maxsize=None)
def C():
    """The native module, imported on first use so `import moe_kernels` never fails on it."""
    check_distributions()
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
    """One registry entry of a per-arch library, as the library reports it: what the kernel
    is, as fields (selection reads these, never the name)."""

    name: str
    arch: str
    mode: str           # the QuantMode value it serves
    act_format: str     # modes.ACT_FORMATS key
    weight_format: str  # modes.WEIGHT_FORMATS key
    out_dtype: str      # "bf16" or "fp16"
    kind: str           # "grouped" (CUTLASS), "decode", "contiguous" or "forward" (the whole forward)
    schedule: str
    mainloop: str       # "", "fastaccum" or "blockwise" (FP8 mainloops)
    swap_ab: bool       # the weights are the MMA's A operand
    tile: tuple
    cluster: tuple
    smem_bytes: int

    @property
    def quant(self) -> str:
        return self.mode

    @property
    def gemm(self) -> bool:
        """A kernel for one GEMM of a tactic (else the whole forward)."""
        return self.kind != "forward"

    def same_kernel(self, other: "KernelInfo") -> bool:
        """The same instantiation but for its output type (an FP8 kernel's bf16/fp16 forms)."""
        return all(getattr(self, f) == getattr(other, f) for f in
                   ("arch", "mode", "kind", "schedule", "mainloop", "swap_ab", "tile", "cluster"))

    def __str__(self) -> str:
        return self.name


def _kernels(lib: dict) -> list:
    from .modes import ACT_FORMATS, WEIGHT_FORMATS
    acts, weights, kinds = list(ACT_FORMATS), list(WEIGHT_FORMATS), C().KERNEL_KINDS
    return [KernelInfo(name=k["name"], arch=lib["arch"], mode=k["mode"], act_format=acts[k["act_format"]],
                       weight_format=weights[k["weight_format"]], out_dtype=("bf16", "fp16")[k["out_dtype"]],
                       kind=kinds[k["kind"]], schedule=k["schedule"], mainloop=k["mainloop"],
                       swap_ab=k["swap_ab"], tile=tuple(k["tile"]), cluster=tuple(k["cluster"]),
                       smem_bytes=k["smem_bytes"]) for k in lib["kernels"]]


@functools.lru_cache(maxsize=None)
def libraries() -> list:
    """Every per-arch library in this build: [{arch, path, cuda_version, kernels}]. No GPU needed."""
    return [dict(lib, kernels=_kernels(lib)) for lib in C().libraries()]


@functools.lru_cache(maxsize=None)
def library_for(device: int) -> dict:
    """The library for a device; raises naming the GPU and what this build holds if none fits
    (or the driver, where it is too old for them)."""
    for built in libraries():
        check_driver(built["cuda_version"])
    lib = C().library_for(device)
    return dict(lib, kernels=_kernels(lib))


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> dict:
    return C().device_info(device)


@functools.lru_cache(maxsize=None)
def kernel_problem(device: int, name: str) -> str:
    """Why kernel `name` cannot run on `device`, or "" when it can (cached per device)."""
    return C().check_kernel(device, name)


@functools.lru_cache(maxsize=None)
def usable_kernels(device: int, mode: str, out_dtype: str) -> dict:
    """{name: KernelInfo} of one mode's kernels with this output type that can run on
    `device` (GEMM and forward kernels alike). Cached: forwards look it up on every call."""
    return {k.name: k for k in library_for(device)["kernels"]
            if k.mode == mode and k.out_dtype == out_dtype and not kernel_problem(device, k.name)}
