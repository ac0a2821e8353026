"""What a first user meets without a GPU: calls that launch nothing, the errors, the command
line and the package metadata (CPU only)."""
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import moe_kernels
from moe_kernels import FusedMoE, _native, problem
from moe_kernels.cli import build_parser
from moe_kernels.modes import MODES

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILT = [m for m in MODES if m in problem.built_modes()]
NOT_BUILT = [m for m in MODES if m not in problem.built_modes()]
NO_GPU = "needs a CUDA GPU and none is visible"


class _NoGpu:
    """The native module as a machine without a GPU sees it, with this driver version."""

    _real = _native.C()

    def __init__(self, driver):
        self._driver = driver

    def __getattr__(self, name):
        return getattr(self._real, name)

    def device_count(self):
        return 0

    def driver_version(self):
        return self._driver


def _gpu_calls():
    return {
        "workspace_size": lambda: moe_kernels.workspace_size(16, 2, 8, 256, 128),
        "workspace_size on cuda:0": lambda: moe_kernels.workspace_size(16, 2, 8, 256, 128, device="cuda:0"),
        "list_kernels": lambda: moe_kernels.list_kernels(),
        "list_kernels for a mode": lambda: moe_kernels.list_kernels(quant="fp8"),
        "list_tactics": lambda: moe_kernels.list_tactics("bf16"),
    }


@pytest.mark.parametrize("driver,why", [(0, "no NVIDIA driver is loaded"),
                                        (13000, r"the NVIDIA driver \(CUDA 13\.0\) reports no GPU")])
def test_calls_that_need_a_gpu_say_none_is_visible(monkeypatch, driver, why):
    monkeypatch.setattr(_native, "C", lambda: _NoGpu(driver))
    for name, call in _gpu_calls().items():
        with pytest.raises(RuntimeError, match=NO_GPU + ": " + why):
            call()


def test_without_a_gpu_here_the_real_error_is_the_clear_one():
    if _native.C().device_count():
        pytest.skip("a GPU is visible")
    for name, call in _gpu_calls().items():
        with pytest.raises(RuntimeError, match=rf"^{name.split()[0]} {NO_GPU}"):
            call()


def test_a_driver_too_old_for_the_build_says_so(monkeypatch):
    monkeypatch.setattr(_native, "C", lambda: _NoGpu(12020))
    if not any(lib["cuda_version"] >= 13000 for lib in _native.libraries()):
        pytest.skip("this build's libraries take a CUDA 12 driver")
    with pytest.raises(RuntimeError, match=r"driver supports CUDA 12\.2; .* update the driver"):
        moe_kernels.workspace_size(16, 2, 8, 256, 128)


def test_workspace_size_checks_its_arguments_before_any_device(monkeypatch):
    def no_device():
        raise AssertionError("a device was looked at")
    monkeypatch.setattr(moe_kernels.api, "device_index", lambda *a, **k: no_device())
    with pytest.raises(ValueError, match=r"hidden_size/intermediate_size: got hidden_size=100, "
                                         r"intermediate_size=128, expected both multiples of 8 for quant='bf16'"):
        moe_kernels.workspace_size(16, 2, 8, 100, 128)
    with pytest.raises(ValueError, match="multiples of 128 for quant='fp8_block'"):
        moe_kernels.workspace_size(16, 2, 8, 7168, 1000, quant="fp8_block")
    with pytest.raises(ValueError, match="top_k: got 0"):
        moe_kernels.workspace_size(16, 0, 8, 256, 128)


def test_a_cpu_device_is_refused_by_name():
    with pytest.raises(ValueError, match="device: got cpu, expected a CUDA device"):
        moe_kernels.workspace_size(16, 2, 8, 256, 128, device="cpu")


def test_unknown_mode_lists_what_this_build_runs_first():
    x, w13, w2 = torch.zeros(2, 64), torch.zeros(4, 64, 64), torch.zeros(4, 64, 32)
    topk_w, topk_ids = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    for call in (lambda: moe_kernels.workspace_size(1, 1, 1, 64, 64, quant="int3"),
                 lambda: moe_kernels.list_kernels(quant="int3"),
                 lambda: moe_kernels.list_tactics("int3"),
                 lambda: FusedMoE(8, 64, 32, quant="int3"),
                 lambda: moe_kernels.fused_moe(x, w13, w2, topk_w, topk_ids, quant="int3"),
                 lambda: moe_kernels.prepare.prepare_weights(w13, w2, quant="int3"),
                 lambda: moe_kernels.prepare.quantize_weights(w13, w2, quant="int3")):
        with pytest.raises(ValueError, match=r"quant='int3' is not a quantization mode; this build runs") as e:
            call()
        runs = re.search(r"this build runs (\[[^\]]*\])", str(e.value)).group(1)
        assert runs == str(BUILT)
        if NOT_BUILT:
            assert f"without kernels in this build: {NOT_BUILT}" in str(e.value)


@pytest.mark.parametrize("quant", NOT_BUILT)
def test_a_mode_without_kernels_is_refused_when_the_layer_is_built(quant):
    spec = MODES[quant]
    with pytest.raises(NotImplementedError, match=rf"quant='{quant}' has no kernels in this build of "
                                                  rf"moe_kernels; it supports {re.escape(str(BUILT))} \("):
        FusedMoE(8, 4 * spec.align, 2 * spec.align, quant=quant)


def test_the_no_kernels_error_names_each_librarys_modes_and_gpus():
    if not NOT_BUILT:
        pytest.skip("this build has kernels for every mode")
    with pytest.raises(NotImplementedError) as e:
        problem.require_built(moe_kernels.QuantMode.parse(NOT_BUILT[0]))
    for lib in _native.libraries():
        assert f"{lib['arch']} on {_native.arch_gpus(lib['arch'])}: " in str(e.value)


def test_layer_weights_without_a_gpu():
    w13 = torch.zeros(8, 64, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    for device in (None, "cpu"):  # validated and kept on the CPU
        layer = FusedMoE(8, 64, 32, device=device)
        layer.load_weights(w13, w2)
        assert layer.weights["w13"].device.type == "cpu"
        with pytest.raises(RuntimeError, match="FusedMoE.workspace_size: the weights are on cpu"):
            layer.workspace_size(16, 2)
    if torch.cuda.is_available():
        return
    layer = FusedMoE(8, 64, 32, device="cuda")
    with pytest.raises(RuntimeError, match=r"FusedMoE.load_weights: device='cuda' needs a CUDA GPU and torch "
                                           r"sees none \(torch.cuda.is_available\(\) is False\)"):
        layer.load_weights(w13, w2)


def test_info_names_the_modes_and_gpus_of_each_library():
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "info", "--json"], capture_output=True, text=True,
                       check=True)
    info = json.loads(r.stdout)
    assert info["modes"] == BUILT
    for lib in info["libraries"]:
        known = _native.ARCH_GPUS[lib["arch"]]
        assert lib["gpus"] == known["gpus"] and lib["compute_capability"] == known["compute_capability"]
        assert lib["modes"] and set(lib["modes"]) <= set(BUILT)
        assert set(lib["kernel_modes"]) == set(lib["kernels"])
    assert _native.ARCH_GPUS["sm90a"]["gpus"] == ["H100", "H200", "H20", "GH200"]
    assert _native.ARCH_GPUS["sm100a"]["gpus"] == ["B200", "GB200"]
    assert _native.ARCH_GPUS["sm103a"]["gpus"] == ["B300", "GB300"]
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "info"], capture_output=True, text=True, check=True)
    assert f"quant modes this build runs: {', '.join(BUILT)}" in r.stdout
    if any(lib["arch"] == "sm90a" for lib in info["libraries"]):
        assert "library sm90a: runs on H100, H200, H20, GH200 (compute capability 9.0)" in r.stdout


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def test_every_cli_option_has_help():
    commands = _subparsers()
    assert set(commands) == {"info", "bench", "bench-transformers", "profile", "tune"}
    for name, p in commands.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help text"


def test_preset_lists_the_presets_and_rejects_unknown_ones(capsys):
    from moe_kernels.cli.bench import PRESETS
    for name, p in _subparsers().items():
        if name in ("info", "bench-transformers"):  # the latter takes whole models (--models)
            continue
        preset = next(a for a in p._actions if a.dest == "preset")
        assert all(n in preset.help for n in PRESETS)
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--preset", "gpt-5"] + (["--out", "x"] if name == "tune" else []))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --preset: invalid choice: 'gpt-5'" in err and all(n in err for n in PRESETS)


@pytest.mark.parametrize("argv,verb", [(["bench"], "time"), (["profile", "--tokens", "1"], "profile"),
                                       (["tune", "--preset", "deepseek-v3", "--out", "t.json"], "tune")])
def test_gpu_commands_exit_2_without_a_gpu(argv, verb, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "moe_kernels", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert f"No CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to {verb}" in r.stderr
    assert not (tmp_path / "t.json").exists()


def test_tune_main_agrees_with_the_command_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from moe_kernels.cli import tune
    args = build_parser().parse_args(["tune", "--preset", "deepseek-v3", "--out", "t.json"])
    assert tune.main(args) == 2
    assert "nothing to tune" in capsys.readouterr().err


def test_license_and_project_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright The moe-kernels authors" in text
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    assert project["authors"] == [{"name": "The moe-kernels authors"}]
    repo = "https://github.com/moe-kernels/moe-kernels"
    assert project["urls"] == {"Homepage": repo, "Source": repo, "Issues": repo + "/issues"}


def test_shipped_tables_hold_no_development_notes():
    d = pathlib.Path(moe_kernels.__file__).parent / "tuned"
    for path in d.glob("*.json"):
        text = path.read_text()
        assert not re.search(r"session|\"why\"", text, re.I), path.name
