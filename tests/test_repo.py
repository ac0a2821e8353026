"""The scripts and the README agree with each other and with the catalog (CPU only)."""
import os
import pathlib
import re
import subprocess
import sys

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


def test_gpu_scripts_know_every_catalog_arch(tmp_path):
    # ci/gpu-arch.sh (used by gpu-tests.sh and gpu-ab.sh) under a stand-in nvidia-smi
    smi = tmp_path / "nvidia-smi"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}
    for cc, arch in [("%d.%d" % spec["cc"], arch) for arch, spec in catalog.ARCHS.items()] + [("12.0", None)]:
        smi.write_text(f"#!/bin/sh\necho {cc}\n")
        smi.chmod(0o755)
        r = subprocess.run([str(ROOT / "ci" / "gpu-arch.sh")], env=env, capture_output=True, text=True)
        if arch:
            assert (r.returncode, r.stdout.strip()) == (0, arch), (cc, r.stderr)
        else:
            assert r.returncode != 0 and "no catalog arch for compute capability 120" in r.stderr
    for script in ("gpu-tests.sh", "gpu-ab.sh"):
        assert "$(ci/gpu-arch.sh)" in (ROOT / "ci" / script).read_text(), script


def test_cuda_toolkit_build_requirements_are_all_pinned():
    # cmake/cuda_from_pypi.cmake builds with the toolkit these wheels install: the metapackage
    # pinned, and each component it pulls for the extras named pinned exactly (the metapackage's
    # own "==x.y.z.*" ranges once resolved to mismatched components), under the same marker.
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("[build-system]"):text.index("build-backend")]
    reqs = re.findall(r'^\s*"([^"]+)"', block, re.M)
    meta = [r for r in reqs if r.startswith("cuda-toolkit[")]
    assert len(meta) == 1 and re.search(r"\]==13\.\d+\.\d+;", meta[0]), meta
    extras = re.search(r"\[([^\]]+)\]", meta[0]).group(1).split(",")
    component = {"nvcc": "nvidia-cuda-nvcc", "nvvm": "nvidia-nvvm", "crt": "nvidia-cuda-crt",
                 "cudart": "nvidia-cuda-runtime", "cccl": "nvidia-cuda-cccl", "culibos": "nvidia-cuda-culibos"}
    assert sorted(extras) == sorted(component), extras
    marker = meta[0].split(";", 1)[1].strip()
    for extra, name in component.items():
        pinned = [r for r in reqs if re.match(rf"{name}==13\.\d+\.\d+;", r)]
        assert len(pinned) == 1 and pinned[0].split(";", 1)[1].strip() == marker, (extra, pinned)
    # the cu12 renaming (ci/build-wheel.sh, ci/cibuildwheel.sh) drops exactly these lines
    for script in ("build-wheel.sh", "cibuildwheel.sh"):
        assert '/^  "cuda-toolkit\\[/d; /^  "nvidia-cuda-\\|^  "nvidia-nvvm/d' in (ROOT / "ci" / script).read_text()
