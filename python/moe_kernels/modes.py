"""Quantization modes and activations: the names the public API accepts."""
from __future__ import annotations

import enum


def _parse(cls, value, argument: str, noun: str):
    """A member of the str-valued enum `cls` from a member or its (case-insensitive) value."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        raise ValueError(f"{argument}={value!r} is not {noun}; expected one of "
                         f"{[m.value for m in cls]}") from None


class QuantMode(str, enum.Enum):
    """What the GEMMs compute in (DESIGN.md section 3). Pass a member or its string value."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP8_BLOCK = "fp8_block"
    W4A16_INT4 = "w4a16_int4"
    W4A16_MXFP4 = "w4a16_mxfp4"
    W4A8_INT4 = "w4a8_int4"
    W4A8_MXFP4 = "w4a8_mxfp4"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, argument: str = "quant") -> "QuantMode":
        return _parse(cls, value, argument, "a quantization mode")


class Activation(str, enum.Enum):
    """Activation between GEMM1 and GEMM2. Values of `code` are the C ABI's moek_activation."""

    SWIGLU = "swiglu"          # silu(gate) * up
    GEGLU = "geglu"            # gelu(gate) * up, erf gelu
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss clamped SwiGLU with alpha and limit, (up + 1)
    SILU = "silu"
    GELU = "gelu"
    RELU2 = "relu2"            # relu(x) ** 2
    IDENTITY = "identity"

    def __str__(self) -> str:
        return self.value

    @property
    def gated(self) -> bool:
        return self in (Activation.SWIGLU, Activation.GEGLU, Activation.SWIGLU_OAI)

    @property
    def code(self) -> int:
        return list(Activation).index(self)

    @classmethod
    def parse(cls, value, argument: str = "activation") -> "Activation":
        return _parse(cls, value, argument, "an activation")
