"""The mode table (moe_kernels.modes) and the module layout that reads it (CPU only)."""
import ast
import pathlib

import pytest
import torch

import moe_kernels
from moe_kernels import FusedMoE, QuantMode, fused_moe, modes, problem
from moe_kernels.prepare import prepare_weights

PKG = pathlib.Path(moe_kernels.__file__).parent
FOUR_BIT = ("w4a16_int4", "w4a16_mxfp4", "w4a8_int4", "w4a8_mxfp4")
NOT_BUILT = ("mxfp8", "nvfp4")  # declared; their kernels come later


def test_every_mode_is_a_pair_of_declared_formats():
    assert [m.value for m in QuantMode] == list(modes.MODES)
    for name, m in modes.MODES.items():
        assert m.name == name and QuantMode.parse(name).spec is m
        assert m.act in modes.ACT_FORMATS and m.weight in modes.WEIGHT_FORMATS
        assert m.hidden and set(m.hidden) <= {"bf16", "fp16"}
        assert m.align > 0 and m.why_align and 0 < m.tolerance < 1
        # A mode's alignment holds whole scale groups of its weights along K.
        fmt = m.weight_format
        assert not fmt.groups or m.align % fmt.groups[0] == 0 or fmt.groups[0] % m.align == 0, name
    pairs = [(m.act, m.weight, h) for m in modes.MODES.values() for h in m.hidden]
    assert len(pairs) == len(set(pairs)), "two modes share formats and a hidden dtype"
    for m in modes.MODES.values():
        for h in m.hidden:
            assert modes.mode_for_formats(m.act, m.weight, h) is m


def test_the_four_bit_modes_are_declared_with_their_formats():
    assert {m: (modes.MODES[m].act, modes.MODES[m].weight) for m in FOUR_BIT} == {
        "w4a16_int4": ("a16", "int4"), "w4a16_mxfp4": ("a16", "mxfp4"),
        "w4a8_int4": ("fp8_row", "int4"), "w4a8_mxfp4": ("fp8_row", "mxfp4")}
    int4, mxfp4 = modes.WEIGHT_FORMATS["int4"], modes.WEIGHT_FORMATS["mxfp4"]
    assert (int4.bits, int4.storage, int4.groups[0], int4.zero_point) == (4, "uint8", 128, True)
    assert (mxfp4.element, mxfp4.scale.dtype, mxfp4.groups) == ("e2m1", "e8m0", (32,))
    assert problem.accepted_scale_shapes(mxfp4, E=2, N=64, K=256) == [(2, 64, 8)]
    assert problem.accepted_scale_shapes(int4, E=2, N=64, K=256, group=64) == [(2, 4, 64)]


@pytest.mark.parametrize("quant", NOT_BUILT)
def test_declared_modes_without_kernels_say_so(quant):
    spec = QuantMode.parse(quant).spec
    assert quant not in problem.built_modes()
    E, H, I, T, k = 4, 256, 128, 3, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    packed = torch.zeros(E, 2 * I, H // spec.weight_format.per_byte, dtype=torch.uint8)
    w2 = torch.zeros(E, H, I // spec.weight_format.per_byte, dtype=torch.uint8)
    ids = torch.zeros(T, k, dtype=torch.int32)
    wts = torch.ones(T, k)
    with pytest.raises(NotImplementedError, match=rf"quant='{quant}' has no kernels.* in this build"):
        fused_moe(x, packed, w2, wts, ids, quant=quant)
    with pytest.raises(NotImplementedError, match="has no kernels"):
        moe_kernels.workspace_size(T, k, E, H, I, quant=quant)
    with pytest.raises(NotImplementedError, match=rf"prepare_weights: quant='{quant}' is not supported yet"):
        prepare_weights(packed, w2, quant=quant)
    with pytest.raises(NotImplementedError, match=rf"quant='{quant}' has no kernels"):  # as fused_moe
        FusedMoE(E, H, I, quant=quant)


def test_scale_shapes_come_from_the_weight_format():
    fp8 = modes.WEIGHT_FORMATS["e4m3"]
    for shape in ((4,), (4, 1), (4, 1, 1)):
        assert problem.weight_scale("w13_scale", torch.ones(shape), fp8, 4, 64, 32).shape == (4,)
    for shape in ((4, 64), (4, 64, 1)):
        assert problem.weight_scale("w13_scale", torch.ones(shape), fp8, 4, 64, 32).shape == (4, 64)
    block = modes.WEIGHT_FORMATS["e4m3_block128"]
    assert problem.weight_scale("w2_scale", torch.ones(4, 2, 1), block, 4, 256, 128).shape == (4, 2, 1)
    with pytest.raises(ValueError, match=r"w2_scale: got shape \(4, 2\), expected one of \[\(4, 2, 1\)\]"):
        problem.weight_scale("w2_scale", torch.ones(4, 2), block, 4, 256, 128)
    with pytest.raises(TypeError, match="w2_scale: got dtype torch.float16"):
        problem.weight_scale("w2_scale", torch.ones(4, 2, 1, dtype=torch.float16), block, 4, 256, 128)
    with pytest.raises(ValueError, match="non-positive"):
        problem.weight_scale("w2_scale", torch.zeros(4), fp8, 4, 64, 32, values=True)


def test_alignment_is_checked_once_from_the_table():
    for m in modes.MODES.values():
        problem.check_alignment(m, 2 * m.align, m.align)
        with pytest.raises(ValueError, match=rf"multiples of {m.align} for quant='{m.name}' \({m.why_align}\)"):
            problem.check_alignment(m, m.align + m.align // 2, m.align)


def _imports(path: pathlib.Path) -> set:
    """Package modules `path` imports (module level or inside functions), as dotted names."""
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = base + tuple(node.module.split(".")) if node.module else base
                names = [mod + (a.name,) for a in node.names] if not node.module else [mod]
                found.update(".".join(n) for n in names)
            elif node.module and node.module.startswith("moe_kernels"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("moe_kernels"))
    mods = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).replace(".__init__", "")
            for p in PKG.rglob("*.py")}
    return {m for m in found if m in mods}


def test_library_modules_import_no_cli_and_no_circle():
    graph = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).replace(".__init__", "")
        graph[name] = _imports(path) - {name}
    library = {m for m in graph if not m.startswith("moe_kernels.cli") and m not in ("moe_kernels", "moe_kernels.__main__")}
    for m in library:
        assert not any(d.startswith("moe_kernels.cli") for d in graph[m]), f"{m} imports the CLI"

    def visit(m, stack):
        assert m not in stack, "import circle: " + " -> ".join(stack + [m])
        for d in graph[m]:
            if d in library:
                visit(d, stack + [m])
    for m in library:
        visit(m, [])


def test_selection_reads_fields_not_names():
    for name in ("tactic.py", "cache.py", "api.py", "tuning.py", "problem.py"):
        text = (PKG / name).read_text()
        for pattern in ('endswith("_', '"_swapab"', '"_fastaccum"', 'replace("_bf16_"', '"one_token"'):
            assert pattern not in text, f"{name} parses kernel names: {pattern}"
