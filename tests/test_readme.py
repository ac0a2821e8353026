"""The README's modes table and activation list are the mode table's and the full catalog's
(CPU only). `python tests/test_readme.py` prints them as the README holds them."""
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
