"""The scripts and the README agree with each other and with the catalog (CPU only)."""
import pathlib
import re

from test_catalog import catalog

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _normalize(cmd: str) -> str:
    cmd = cmd.replace("python3 -m pip", "pip").replace("python3 -m pytest", "pytest")
    return re.sub(r"\s+-rs\b", "", cmd).strip()


def test_ci_runs_the_readme_test_command():
    readme = [ln for ln in (ROOT / "README.md").read_text().splitlines()
              if 'pip install ".[test]"' in ln and "pytest tests" in ln]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if 'pip install ".[test]"' in ln and not ln.lstrip().startswith("#")]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    assert _normalize(ci[0]) == _normalize(readme[0])
    # and it builds every catalog arch, so compiled-only code keeps compiling
    archs = re.search(r'MOE_KERNELS_ARCHS="([^"]+)"', readme[0]).group(1).split(";")
    assert sorted(archs) == sorted(catalog.ARCHS)


def test_gpu_script_knows_every_catalog_arch():
    script = (ROOT / "ci" / "gpu-tests.sh").read_text()
    for arch, spec in catalog.ARCHS.items():
        major, minor = spec["cc"]
        assert f"{major}{minor}) MOE_KERNELS_ARCHS={arch} ;;" in script, arch
