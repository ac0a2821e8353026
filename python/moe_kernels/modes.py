"""The mode table: every quantization mode, declared once as a pair of formats.

A mode is how the activations enter the GEMMs (an activation format) paired with what the
weights are (a weight format). This file is the only place either is written: the Python
layer reads these tables, and the build generates the C header `moe_kernels/modes.h` from
them (cmake/generate_kernels.py), so the runner, the catalog and the kernels see the same
codes, alignments and scale layouts. docs/design.md says how to add a mode.

Stdlib only, with no package-relative imports: CMake's generator loads this file by path.
"""
from __future__ import annotations

import dataclasses
import enum


@dataclasses.dataclass(frozen=True)
class ScaleSpec:
    """One scale tensor a format takes. Shapes are tuples of symbols: E (local experts),
    N (output rows), K (input columns), 'N/128', 'K/g' (g: the format's group along K), 1."""

    dtype: str                # "float32", "e8m0" (uint8 exponents), "hidden" (the hidden dtype)
    shapes: tuple             # accepted shapes, the first one canonical
    what: str                 # one line for error messages


@dataclasses.dataclass(frozen=True)
class ActFormat:
    """How a GEMM's input is fed to the tensor cores (the hidden states and the activation's
    output alike). Routing/expand and the activation kernel depend on this alone."""

    name: str
    element: str              # "" (the hidden dtype, bf16 or fp16, as is), or "e4m3", "e2m1"
    bits: int                 # bits per element in the GEMM's input buffer
    group: int                # quantized: columns per dynamic scale, 0 = one per row
    static_scale: bool        # takes a static per-tensor scale (a13_scale/a2_scale) instead
    doc: str

    @property
    def quantized(self) -> bool:
        return bool(self.element)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """What the expert weights are: element, packing, scales and zero points."""

    name: str
    element: str              # "" (the hidden dtype), "e4m3", "int4", "e2m1"
    bits: int
    storage: str              # torch dtype the weights are held in: "" (hidden), "float8_e4m3fn", "uint8"
    scale: ScaleSpec | None   # None: unscaled
    groups: tuple = ()        # accepted groups along K (the scale's g), the first the default
    zero_point: bool = False  # takes optional zero points (AWQ)
    doc: str = ""
    # The scales as the kernels take them, where prepare_weights converts the checkpoint's
    # (`scale`) into another form; None: the kernels take `scale` as it is.
    prepared_scale: ScaleSpec | None = None
    # The weights as the kernels take them, where prepare_weights repacks the checkpoint's
    # packing: "fragment" is moe_kernels.quant4's fragment layout, uint8 [E, ceil(K/128), N/16,
    # 1024]; "": the weights as stored.
    prepared_layout: str = ""
    # In the fragment layout, CUTLASS's value shuffle (INT4's conversion takes nibbles i and
    # i + 4 of a word), or not (MXFP4's E2M1 lookup takes adjacent nibbles).
    fragment_shuffle: bool = False

    @property
    def kernel_scale(self) -> ScaleSpec | None:
        """The scale tensor fused_moe takes (after prepare_weights)."""
        return self.prepared_scale or self.scale

    @property
    def group_scales16(self) -> bool:
        """The kernels take 16-bit scales per group along K, [E, K/g, N] (4-bit formats)."""
        return self.kernel_scale is not None and self.kernel_scale.dtype == "hidden"

    @property
    def fragment_layout(self) -> bool:
        """fused_moe takes the weights in quant4's fragment layout (4-D), made by prepare_weights."""
        return self.prepared_layout == "fragment"

    @property
    def per_byte(self) -> int:
        """Weight values per storage element along K (2 for 4-bit packed in uint8)."""
        return 8 // self.bits if self.bits < 8 else 1


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    act: str                  # ACT_FORMATS key
    weight: str               # WEIGHT_FORMATS key
    hidden: tuple             # hidden_states dtypes (out and biases: the same), "bf16"/"fp16"
    align: int                # H and I must be multiples of this
    why_align: str
    tolerance: float          # relative error against moe_kernels.reference that a kernel may have
    archs: tuple              # CMake archs the catalog builds kernels for
    doc: str

    @property
    def act_format(self) -> ActFormat:
        return ACT_FORMATS[self.act]

    @property
    def weight_format(self) -> WeightFormat:
        return WEIGHT_FORMATS[self.weight]

    @property
    def act_code(self) -> int:
        return list(ACT_FORMATS).index(self.act)

    @property
    def weight_code(self) -> int:
        return list(WEIGHT_FORMATS).index(self.weight)

    @property
    def e2m1_placed(self) -> bool:
        """This mode's E2M1 weights go to 16-bit tensor cores: prepared in quant4's placed layout,
        their scales folded (quant4.PLACED_FOLD)."""
        return self.weight_format.element == "e2m1" and not self.act_format.quantized

    def element_names(self, out: str) -> tuple:
        """(activation, weight) element names as kernel names spell them ("bf16", "e4m3", ...)."""
        return (self.act_format.element or out, self.weight_format.element or out)


# The C codes of the formats are their positions here: append, never reorder (C ABI).
ACT_FORMATS = {f.name: f for f in (
    ActFormat("a16", "", 16, 0, False, "the hidden states as they are, bf16 or fp16"),
    ActFormat("fp8_row", "e4m3", 8, 0, True,
              "E4M3, one dynamic scale per row (amax / 448), or a static per-tensor scale"),
    ActFormat("fp8_row128", "e4m3", 8, 128, False,
              "E4M3, one dynamic scale per row per 128 columns (DeepSeek-V3)"),
    ActFormat("mxfp8", "e4m3", 8, 32, False, "E4M3 with an E8M0 scale per 32 columns (OCP MX)"),
    ActFormat("nvfp4", "e2m1", 4, 16, False, "E2M1 with an E4M3 scale per 16 columns and a global scale"),
)}

_PER_EXPERT_FP32 = ScaleSpec("float32", (("E",), ("E", 1), ("E", 1, 1), ("E", "N"), ("E", "N", 1)),
                             "per tensor [E] or per output channel [E, N]")
WEIGHT_FORMATS = {f.name: f for f in (
    WeightFormat("w16", "", 16, "", None, doc="the hidden dtype, nn.Linear [out, in]"),
    WeightFormat("e4m3", "e4m3", 8, "float8_e4m3fn", _PER_EXPERT_FP32,
                 doc="E4M3, dequantized = q * scale"),
    WeightFormat("e4m3_block128", "e4m3", 8, "float8_e4m3fn",
                 ScaleSpec("float32", (("E", "N/128", "K/128"),),
                           "one per 128x128 block [E, N/128, K/128] (weight_scale_inv)"),
                 groups=(128,), doc="E4M3 in 128x128 blocks (DeepSeek-V3)"),
    WeightFormat("int4", "int4", 4, "uint8",
                 ScaleSpec("hidden", (("E", "K/g", "N"),),
                           "one per group of g along K, [E, K/g, N] (N contiguous, as AWQ and GPTQ store them)"),
                 groups=(128, 64, 32), zero_point=True,
                 doc="INT4 two per byte, group scales along K, optional zero terms (AWQ, GPTQ)",
                 prepared_layout="fragment", fragment_shuffle=True),
    WeightFormat("mxfp4", "e2m1", 4, "uint8",
                 ScaleSpec("e8m0", (("E", "N", "K/g"),), "E8M0 exponents, one per 32 along K [E, N, K/32]"),
                 groups=(32,), doc="E2M1 two per byte with E8M0 scales per 32 (OCP MX; gpt-oss)",
                 prepared_scale=ScaleSpec("hidden", (("E", "K/g", "N"),),
                                          "2^(e - 127) in the hidden dtype, [E, K/32, N] (prepare_weights "
                                          "makes them from the checkpoint's E8M0 [E, N, K/32])"),
                 prepared_layout="fragment"),
    WeightFormat("mxfp8", "e4m3", 8, "float8_e4m3fn",
                 ScaleSpec("e8m0", (("E", "N", "K/g"),), "E8M0 exponents, one per 32 along K [E, N, K/32]"),
                 groups=(32,), doc="E4M3 with E8M0 scales per 32 (OCP MX)"),
    WeightFormat("nvfp4", "e2m1", 4, "uint8",
                 ScaleSpec("float8_e4m3fn", (("E", "N", "K/g"),), "E4M3 per 16 along K [E, N, K/16]"),
                 groups=(16,), doc="E2M1 with E4M3 scales per 16 and a global scale"),
)}

_BOTH = ("bf16", "fp16")
_SM90_SM100 = ("90a", "100a", "103a")
_TMA = "16-byte rows for TMA"
MODES = {m.name: m for m in (
    Mode("bf16", "a16", "w16", ("bf16",), 8, _TMA, 2e-2, _SM90_SM100, "bf16 activations and weights"),
    Mode("fp16", "a16", "w16", ("fp16",), 8, _TMA, 5e-3, _SM90_SM100, "fp16 activations and weights"),
    Mode("fp8", "fp8_row", "e4m3", _BOTH, 16, _TMA, 5e-2, _SM90_SM100,
         "FP8 per token (or static per tensor) x E4M3 per tensor or channel"),
    Mode("fp8_block", "fp8_row128", "e4m3_block128", _BOTH, 128, "whole 128-wide scale blocks",
         5e-2, _SM90_SM100, "FP8 per token per 128 columns x E4M3 128x128 blocks (DeepSeek-V3)"),
    Mode("w4a16_int4", "a16", "int4", _BOTH, 128, "whole scale groups of 128 along K", 2e-2, _SM90_SM100,
         "16-bit activations x INT4 weights in groups of 32-128, optional zero points "
         "(GPTQ, AWQ, compressed-tensors)"),
    Mode("w4a16_mxfp4", "a16", "mxfp4", _BOTH, 32, "whole scale groups of 32 along K", 2e-2, _SM90_SM100,
         "16-bit activations x MXFP4 weights (gpt-oss)"),
    Mode("w4a8_int4", "fp8_row", "int4", _BOTH, 128, "whole scale groups of 128 along K", 5e-2, _SM90_SM100,
         "FP8 per token (or static per tensor) x INT4 weights as w4a16_int4's"),
    Mode("w4a8_mxfp4", "fp8_row", "mxfp4", _BOTH, 32, "whole scale groups of 32 along K", 5e-2, _SM90_SM100,
         "FP8 per token (or static per tensor) x MXFP4 weights (gpt-oss)"),
    # Declared, no kernels yet: asking for them gives the "no kernels in this build" error.
    Mode("mxfp8", "mxfp8", "mxfp8", _BOTH, 32, "whole 32-wide scale groups", 5e-2, (),
         "MXFP8 activations and weights (Blackwell)"),
    Mode("nvfp4", "nvfp4", "nvfp4", _BOTH, 16, "whole 16-wide scale groups", 1e-1, (),
         "NVFP4 activations and weights (Blackwell)"),
)}


def mode_for_formats(act: str, weight: str, hidden: str) -> Mode | None:
    """The mode of a (activation format, weight format) pair with this hidden dtype."""
    return next((m for m in MODES.values() if (m.act, m.weight) == (act, weight) and hidden in m.hidden), None)


class _Choice(str, enum.Enum):
    """A str-valued enum that parses its members' values case-insensitively."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _parse(cls, value, argument: str, noun: str):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"{argument}={value!r} is not {noun}; expected one of "
                             f"{[m.value for m in cls]}") from None


class _ModeChoice(_Choice):
    @classmethod
    def parse(cls, value, argument: str = "quant") -> "QuantMode":
        return cls._parse(value, argument, "a quantization mode")

    @property
    def spec(self) -> Mode:
        """This mode's row of MODES."""
        return MODES[self.value]


# QuantMode.BF16, QuantMode.W4A16_INT4, ...: the members are the table's rows.
QuantMode = _ModeChoice("QuantMode", [(name.upper(), name) for name in MODES], module=__name__)
QuantMode.__doc__ = "What the GEMMs compute in (a row of MODES). Pass a member or its string value."


class Activation(_Choice):
    """Activation between GEMM1 and GEMM2. Values of `code` are the C ABI's moek_activation."""

    SWIGLU = "swiglu"          # silu(gate) * up
    GEGLU = "geglu"            # gelu(gate) * up, erf gelu
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss clamped SwiGLU with alpha and limit, (up + 1)
    SILU = "silu"
    GELU = "gelu"
    RELU2 = "relu2"            # relu(x) ** 2
    IDENTITY = "identity"
    # Appended (the C codes are positions): Gemma's experts (gelu_pytorch_tanh), and the plain
    # ReLU of Switch Transformers and NLLB-MoE.
    GEGLU_TANH = "geglu_tanh"  # gelu(gate, tanh approximation) * up
    RELU = "relu"

    @property
    def gated(self) -> bool:
        return self in (Activation.SWIGLU, Activation.GEGLU, Activation.SWIGLU_OAI, Activation.GEGLU_TANH)

    @property
    def code(self) -> int:
        return list(Activation).index(self)

    @classmethod
    def parse(cls, value, argument: str = "activation") -> "Activation":
        return cls._parse(value, argument, "an activation")
