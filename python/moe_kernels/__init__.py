"""moe_kernels: prebuilt CUTLASS fused Mixture-of-Experts kernels.

    from moe_kernels import FusedMoE, fused_moe
"""
from . import prepare, reference
from ._native import KernelInfo
from .api import fused_moe, list_kernels, workspace_size
from .layer import FusedMoE
from .modes import Activation, QuantMode
from .tactic import Tactic
from .tuning import autotune, list_tactics

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "FusedMoE",
    "KernelInfo",
    "QuantMode",
    "Tactic",
    "autotune",
    "fused_moe",
    "list_kernels",
    "list_tactics",
    "prepare",
    "reference",
    "workspace_size",
]
