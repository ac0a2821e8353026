"""`python -m moe_kernels info`: what this build holds and whether this machine can use it."""
from __future__ import annotations

import json

from .. import _native
from ..modes import MODES


def _modes(kernels) -> list:
    """The quant modes a set of kernels serves, in the mode table's order."""
    served = {k.mode for k in kernels}
    return [m for m in MODES if m in served]


def collect() -> dict:
    from .. import __version__
    import torch

    libs = [{"arch": lib["arch"], "cuda_version": _native.cuda_string(lib["cuda_version"]),
             "compute_capability": _native.ARCH_GPUS.get(lib["arch"], {}).get("compute_capability"),
             "gpus": _native.ARCH_GPUS.get(lib["arch"], {}).get("gpus", []),
             "modes": _modes(lib["kernels"]),
             "kernels": [k.name for k in lib["kernels"]],
             "kinds": {k.name: k.kind for k in lib["kernels"]},
             "kernel_modes": {k.name: k.mode for k in lib["kernels"]}} for lib in _native.libraries()]
    devices = []
    for d in range(_native.C().device_count()):
        info = _native.device_info(d)
        try:
            arch = _native.library_for(d)["arch"]
            why = None
        except RuntimeError as e:
            arch, why = None, str(e)
        devices.append({"index": d, "name": info["name"], "compute_capability": f"{info['major']}.{info['minor']}",
                        "sm_count": info["sm_count"], "library": arch, "supported": arch is not None,
                        **({"reason": why} if why else {})})
    driver = _native.C().driver_version()
    problem = None
    try:
        for lib in _native.libraries():
            _native.check_driver(lib["cuda_version"])
    except RuntimeError as e:
        problem = str(e)
    return {"version": __version__, "torch": torch.__version__, "catalog": _native.build_info().get("catalog"),
            "modes": _modes(k for lib in _native.libraries() for k in lib["kernels"]), "libraries": libs,
            "driver": _native.cuda_string(driver) if driver else None,
            **({"driver_problem": problem} if problem else {}), "devices": devices}


def main(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"moe_kernels {info['version']} (torch {info['torch']}), catalog: {info['catalog']}")
    print(f"quant modes this build runs: {', '.join(info['modes']) or 'none'}")
    for lib in info["libraries"]:
        gpus = (f"runs on {', '.join(lib['gpus'])} (compute capability {lib['compute_capability']})"
                if lib["gpus"] else "runs on GPUs of its own compute capability only")
        print(f"  library {lib['arch']}: {gpus}; built with CUDA {lib['cuda_version']}, "
              f"{len(lib['kernels'])} kernels")
        print(f"    modes: {', '.join(lib['modes'])}")
        for name in lib["kernels"]:
            print(f"    {name:<60} {lib['kinds'][name]:<10} {lib['kernel_modes'][name]}")
    if info.get("driver_problem"):
        print(f"CUDA driver: {info['driver_problem']}")
    elif info["driver"]:
        print(f"CUDA driver: supports CUDA {info['driver']}")
    if not info["devices"]:
        print("GPU: none visible (no CUDA driver or device); kernels can be listed but not run here")
    for d in info["devices"]:
        status = f"supported by {d['library']}" if d["supported"] else f"NOT supported: {d['reason']}"
        print(f"GPU {d['index']}: {d['name']} (sm_{d['compute_capability'].replace('.', '')}, "
              f"{d['sm_count']} SMs): {status}")
    return 0
