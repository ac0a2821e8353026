"""The README's modes table and activation list are the mode table's and the full catalog's,
and its Python examples define what they use (CPU only). `python tests/test_readme.py` prints
the table and the activation list as the README holds them."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN = "<!-- modes table: generated from python/moe_kernels/modes.py and cmake/catalog.py; " \
        "tests/test_readme.py keeps it in step -->"
END = "<!-- end of modes table -->"


def _catalog():
    spec = importlib.util.spec_from_file_location("catalog", ROOT / "cmake" / "catalog.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("catalog", mod)
    spec.loader.exec_module(mod)
    return mod


def modes_table() -> str:
    from moe_kernels import modes
    catalog = _catalog()
    built = {}
    for c in catalog.CATALOG["full"]:
        built.setdefault(c.mode, set()).add(c.arch)
    rows = ["| mode | what | hidden / out | H, I multiple of | kernels for |", "|---|---|---|---|---|"]
    for name, m in modes.MODES.items():
        archs = ", ".join(a for a in catalog.ARCHS if a in built.get(name, ())) or "declared, none yet"
        rows.append(f"| `{name}` | {m.doc} | {' / '.join(m.hidden)} | {m.align} | {archs} |")
    return "\n".join(rows)


def activations_line() -> str:
    from moe_kernels.modes import Activation
    gated = [f"`{a.value}`" for a in Activation if a.gated]
    plain = [f"`{a.value}`" for a in Activation if not a.gated]
    return f"gated {', '.join(gated)}; non-gated {', '.join(plain)}"


def test_readme_modes_table_is_the_mode_table():
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text, "the README lost its generated modes table"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == modes_table(), "README modes table differs: python tests/test_readme.py prints it"
    assert f"Activations: {activations_line()}." in text


if __name__ == "__main__":
    print(BEGIN)
    print(modes_table())
    print(END)
    print(f"\nActivations: {activations_line()}.")


def _names(tree):
    """(names a block binds, names it reads) for a parsed README example."""
    import ast
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else read).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            bound.update(a.arg for a in node.args.args + node.args.kwonlyargs)
            if isinstance(node, ast.FunctionDef):
                bound.add(node.name)
        elif isinstance(node, ast.comprehension):
            bound.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return bound, read


def test_readme_examples_define_what_they_use():
    """Every Python example parses, and reads only names it defines or imports, builtins, or
    (where it says it continues the quick start) the quick start's."""
    import ast
    import builtins
    import re
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    quick_start, _ = _names(ast.parse(blocks[0]))
    for block in blocks:
        bound, read = _names(ast.parse(block))
        known = bound | set(dir(builtins)) | (quick_start if "as in the quick start" in block else set())
        assert read <= known, f"README example reads undefined names {sorted(read - known)}:\n{block}"
