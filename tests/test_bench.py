"""The benchmark's arithmetic, arguments and routing generators (CPU), and a tiny GPU run; the
transformers benchmark's command line (CPU) and a tiny GPU run of it."""
import argparse
import json
import math
import subprocess
import sys
import time

import pytest
import torch

import moe_kernels
from moe_kernels import profiling
from moe_kernels.cli import bench, bench_transformers, build_parser


def parse(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_presets_match_design_table():
    assert bench.PRESETS["deepseek-v3"] == (256, 8, 7168, 2048)
    assert bench.PRESETS["mixtral-8x7b"] == (8, 2, 4096, 14336)
    assert set(bench.DEFAULT_PRESETS) <= set(bench.PRESETS)


def test_shapes_and_parallel_variants():
    shapes = bench.shapes_from_args(parse("--preset", "deepseek-v3", "--tp", "4", "--ep", "8"))
    assert shapes == [bench.Shape("deepseek-v3-tp4-ep8", 32, 8, 7168, 512)]
    custom = bench.shapes_from_args(parse("--experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "32"))
    assert custom == [bench.Shape("custom", 4, 2, 64, 32)]
    with pytest.raises(SystemExit, match="give all of"):
        bench.shapes_from_args(parse("--experts", "4"))
    with pytest.raises(SystemExit):  # argparse rejects it, listing the presets
        parse("--preset", "gpt-5")
    with pytest.raises(SystemExit, match="expected one of"):  # arguments built in code
        bench.shapes_from_args(argparse.Namespace(preset=["gpt-5"], experts=None, top_k=None, hidden=None,
                                                  intermediate=None, tp=1, ep=1))
    with pytest.raises(SystemExit, match="must divide"):
        bench.shapes_from_args(parse("--preset", "mixtral-8x7b", "--ep", "3"))
    assert bench.parse_tokens("1,16, 128") == [1, 16, 128]
    with pytest.raises(SystemExit):
        bench.parse_tokens("1,x")
    assert parse("--sweep-only", "_64x").sweep_only == "_64x"
    with pytest.raises(SystemExit):
        parse("--sweep-only", "(")
    assert parse("--sweep-rounds", "3").sweep_rounds == 3
    with pytest.raises(SystemExit):
        parse("--sweep-rounds", "0")
    assert [str(t) for t in parse("--compare", "a+b,c+d").compare] == ["a+b", "c+d"]
    for bad in ("a+b", "a+b,c", "a+b,,c+d"):
        with pytest.raises(SystemExit):
            parse("--compare", bad)


def test_sweep_rounds_interleave_and_take_medians():
    """Each slot's candidates are timed round-robin (a, b, a, b, ...), scored by the median."""
    from types import SimpleNamespace
    kernels = SimpleNamespace(list_kernels=lambda **_: [SimpleNamespace(name=n, gemm=True) for n in ("a", "b", "c")])
    calls, times = [], {"a": iter([5.0, 1.0, 6.0]), "b": iter([2.0, 9.0, 3.0])}

    def ours(*args, tactic):
        calls.append(str(tactic))

    def timed(fn):
        fn()
        g1, g2 = calls[-1].split("+")
        name = g1 if g2 == "d" else g2
        return {"status": "ok", "us": next(times[name]) if name in times and len(calls) <= 6 else 4.0}
    sw = bench._sweep(kernels, "a+d", "bf16", None, ours, timed, only="^[ab]$", rounds=3)
    assert calls[:6] == ["a+d", "b+d"] * 3
    assert sw["gemm1_us"] == {"a": 5.0, "b": 3.0} and sw["gemm1_times_us"]["b"] == [2.0, 9.0, 3.0]
    assert sw["rounds"] == 3 and sw["best"].startswith("b+")


def test_compare_times_pairs_round_robin():
    """--compare: the pairs timed in turn, rounds times over, scored by the median."""
    from moe_kernels import Tactic
    calls, times = [], {"a+b": iter([3.0, 1.0, 2.0]), "c+d": iter([5.0, 4.0, 9.0])}

    def ours(*args, tactic):
        calls.append(str(tactic))

    def timed(fn):
        fn()
        return {"status": "ok", "us": next(times[calls[-1]])}
    cmp = bench._compare([Tactic("a", "b"), Tactic("c", "d")], ours, timed, rounds=3)
    assert calls == ["a+b", "c+d"] * 3
    assert cmp["us"] == {"a+b": 2.0, "c+d": 5.0} and cmp["times_us"]["c+d"] == [5.0, 4.0, 9.0]


def test_floor_arithmetic():
    f = bench.floors(tokens=2, top_k=2, hidden=4, inter=3, gated=True, experts_hit=1.5,
                     elem_bytes=2, copy_bw=100.0, gemm_rate=10.0)
    weight_bytes = 1.5 * (6 * 4 + 4 * 3) * 2            # 108
    act_bytes = 2 * 2 * 4 * 2 + 2 * 2 * 8               # 32 + 32
    assert f["bytes"] == weight_bytes + act_bytes == 172
    assert f["flops"] == 2 * 2 * 2 * (4 * 6 + 3 * 4) == 288
    assert math.isclose(f["bw_floor_s"], 1.72) and math.isclose(f["flop_floor_s"], 28.8)
    assert f["floor_s"] == f["flop_floor_s"]
    # The weights at the read-only rate, the activations at the copy rate; the copy floor beside.
    g = bench.floors(tokens=2, top_k=2, hidden=4, inter=3, gated=True, experts_hit=1.5,
                     elem_bytes=2, copy_bw=100.0, gemm_rate=1000.0, read_bw=200.0)
    assert g["weight_bytes"] == weight_bytes
    assert math.isclose(g["bw_floor_s"], 108 / 200 + 64 / 100) and math.isclose(g["copy_floor_s"], 1.72)
    assert g["floor_s"] == g["bw_floor_s"]


def test_read_ceiling_measures_each_size_once(monkeypatch):
    calls = []

    def fake_rates(nbytes, windows):  # a second, faster method that runs only past 1 MiB
        calls.append((nbytes, windows))
        return {"vector loads": 4.0e12, "other": 4.4e12 if nbytes > 1 << 20 else None}
    monkeypatch.setattr(profiling, "read_rates", fake_rates)
    ceiling = bench.ReadCeiling()
    assert ceiling(3 << 20)[0] == 4.4e12 and ceiling(3.2 * (1 << 20))[0] == 4.4e12   # one MiB bucket
    assert ceiling(100)[0] == 4.0e12                                              # a method that did not run
    assert ceiling(40 << 30)[0] == 4.4e12                                         # capped at 2 GiB
    assert calls == [(3 << 20, bench.ROUTING_SETS), (1 << 20, bench.ROUTING_SETS), (2 << 30, 1)]


def test_uniform_and_balanced_routing():
    ids, w = profiling.routing(64, 16, 4, "uniform")
    assert ids.shape == (64, 4) and ids.dtype == torch.int32
    assert all(len(set(row.tolist())) == 4 for row in ids)  # distinct experts per token
    torch.testing.assert_close(w.sum(1), torch.ones(64))
    ids, _ = profiling.routing(64, 16, 4, "balanced")
    assert torch.bincount(ids.flatten().long(), minlength=16).tolist() == [16] * 16
    assert all(len(set(row.tolist())) == 4 for row in ids)


def test_skewed_routing_is_skewed():
    ids, _ = profiling.routing(4096, 64, 2, "skewed", skew=1.2)
    counts = torch.bincount(ids.flatten().long(), minlength=64).sort(descending=True).values
    assert counts[0] > 8 * counts[32], counts[:8]       # head far above the median
    u, _ = profiling.routing(4096, 64, 2, "uniform")
    cu = torch.bincount(u.flatten().long(), minlength=64)
    assert cu.max() < 2 * cu.float().mean()


def test_histogram_reproduces_counts(tmp_path):
    counts = [10, 0, 3, 7, 0, 4]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"counts": counts}))
    assert profiling.load_histogram(str(path)) == counts
    ids, _ = profiling.routing(12, 6, 2, "uniform", counts=counts)  # 24 pairs == sum(counts)
    assert torch.bincount(ids.flatten().long(), minlength=6).tolist() == counts
    assert all(len(set(row.tolist())) == 2 for row in ids)
    ids, _ = profiling.routing(24, 6, 2, "uniform", counts=counts)  # scaled x2, capped at T
    got = torch.bincount(ids.flatten().long(), minlength=6).tolist()
    assert sum(got) == 48 and got[1] == got[4] == 0 and max(got) <= 24
    bad = tmp_path / "bad.json"
    bad.write_text("[1, -2]")
    with pytest.raises(ValueError, match="non-negative"):
        profiling.load_histogram(str(bad))


def test_format_row_names_missing_peers():
    row = {"preset": "p", "tokens": 1, "experts_hit": 2.0, "bw_floor_us": 10.0, "flop_floor_us": 1.0,
           "results": {"moe_kernels": {"status": "ok", "us": 12.5, "tb_s": 3.0, "tflop_s": 1.0, "of_floor": 0.8},
                       "torch._grouped_mm": {"status": "ok", "us": 25.0},
                       "vllm-triton": {"status": "not installed"}}}
    line = bench.format_row(row, ["torch._grouped_mm", "vllm-triton"])
    assert "2.00x" in line and "not installed" in line and "80%" in line
    assert bench.format_row({**row, "read_bw_bytes_s": 4.41e12}, []).split()[3] == "4.41"  # the read-only ceiling
    assert len(bench.header([]).split()) == len(bench.format_row(row, []).split())


def test_fp8_block_peer_dequantizes_the_block_scales():
    # The peer runs torch._grouped_mm on the weights dequantized once to bf16; it must match
    # the float32 reference on weights dequantized here (scales per 128 x 128 block, I not a
    # multiple of 128), keep one copy per shape, and take fp16 hidden states through bf16
    # (torch._grouped_mm's fp16 path cannot be graph-captured), returning fp16.
    from moe_kernels import fp8, reference
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    gen = torch.Generator().manual_seed(1)
    E, k, H, I, T = 4, 2, 256, 192, 16
    q13, s13 = fp8.quantize_weight(torch.randn(E, 2 * I, H, generator=gen) * 0.05, "block")
    q2, s2 = fp8.quantize_weight(torch.randn(E, H, I, generator=gen) * 0.05, "block")
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    wts = torch.rand(T, k, generator=gen)
    (name, peer, _), = bench.peers("swiglu", "fp8_block")
    assert "bf16 weights" in name and peer is not None
    out = peer(x, q13, q2, wts, ids, "swiglu", w13_scale=s13, w2_scale=s2)
    deq13 = q13.float() * fp8.weight_scale_full(s13, 2 * I, H)
    deq2 = q2.float() * fp8.weight_scale_full(s2, H, I)
    ref = reference.fused_moe(x, deq13, deq2, wts, ids, activation="swiglu")
    assert ((out.float() - ref).norm() / ref.norm()).item() < peer.tolerance
    first = peer.weights(q13, q2, s13, s2)
    assert peer.weights(q13, q2, s13, s2) is first and first[0].dtype == torch.bfloat16
    out16 = peer(x.half(), q13, q2, wts, ids, "swiglu", w13_scale=s13, w2_scale=s2)
    assert out16.dtype == torch.float16
    assert ((out16.float() - ref).norm() / ref.norm()).item() < peer.tolerance
    assert peer.weights(q13, q2, s13, s2) is first


def test_fp16_peer_runs_on_a_bf16_copy():
    # torch._grouped_mm's fp16 path cannot be graph-captured: the fp16 peer casts the weights
    # to bf16 once per weight tensor and the hidden states in and out
    from moe_kernels import reference
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    gen = torch.Generator().manual_seed(2)
    E, k, H, I, T = 4, 2, 128, 64, 16
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).half()
    w2 = (torch.randn(E, H, I, generator=gen) * 0.05).half()
    x = torch.randn(T, H, generator=gen).half()
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    wts = torch.rand(T, k, generator=gen)
    name, peer, _ = bench.peers("swiglu", "fp16")[0]
    assert "bf16 copy" in name and peer is not None
    out = peer(x, w13, w2, wts, ids, "swiglu")
    assert out.dtype == torch.float16
    ref = reference.fused_moe(x, w13, w2, wts, ids, activation="swiglu")
    assert ((out.float() - ref).norm() / ref.norm()).item() < peer.tolerance
    first = peer.weights(w13, w2)
    assert first[0].dtype == torch.bfloat16 and peer.weights(w13, w2) is first
    assert bench.peers("swiglu", "bf16")[0][0] == "torch._grouped_mm"  # bf16 runs it directly


def test_format_row_prints_the_clock_it_ran_at():
    ours = {"status": "ok", "us": 12.5, "tb_s": 3.0, "tflop_s": 1.0, "of_floor": 0.8,
            "sm_mhz": 1425.0, "power_w": 697.4, "samples": 31}
    row = {"preset": "p", "tokens": 1, "experts_hit": 2.0, "bw_floor_us": 10.0, "flop_floor_us": 1.0,
           "results": {"moe_kernels": ours}}
    assert "ours ran at 1425 MHz, 697 W (31 samples)" in bench.format_row(row, [])
    del ours["sm_mhz"], ours["power_w"], ours["samples"]
    assert "MHz" not in bench.format_row(row, [])
    assert parse("--clocks").clocks and not parse().clocks


def test_gpu_sampler_takes_medians_and_never_fails_the_run(monkeypatch):
    values = iter([(1400.0, 690.0), (1500.0, 700.0), (1600.0, 710.0)] * 10_000)
    sampler = profiling.GpuSampler(read=lambda: next(values), period_s=0.001)
    with sampler.window() as w:
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline and len(w) == 0:
            time.sleep(0.005)
    assert w["samples"] >= 1 and 1400.0 <= w["sm_mhz"] <= 1600.0 and 690.0 <= w["power_w"] <= 710.0

    def broken():
        raise RuntimeError("NVML clock or power query failed")
    with profiling.GpuSampler(read=broken).window() as w:
        pass
    assert w == {}  # a failing query leaves the window empty, nothing raised

    def no_nvml():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    monkeypatch.setattr(profiling, "_nvml_reader", no_nvml)
    sampler = profiling.GpuSampler()
    assert not sampler.available
    with sampler.window() as w:
        pass
    assert w == {}


@pytest.mark.parametrize("host", [{}, {"host_us": 41.25},
                                  {"host_us": 41.25, "host_runtime": {"runtime_us": 20.04, "launches": 7}}])
@pytest.mark.parametrize("clocks", [{}, {"sm_mhz": 1530.0, "power_w": 548.0, "samples": 9}])
@pytest.mark.parametrize("peers", [{}, {"torch._grouped_mm": {"status": "ok", "us": 25.0}}])
def test_markdown_columns_line_up(peers, clocks, host):
    row = {"preset": "p", "tokens": 1, "experts_hit": 2.0, "bw_floor_us": 10.0, "flop_floor_us": 1.0,
           "results": {"moe_kernels": {"status": "ok", "us": 12.5, "tb_s": 3.0, "tflop_s": 500.0,
                                       "of_floor": 0.8, **clocks}, **peers}, **host}
    result = {"gpu": "g", "driver": "d", "torch": "t", "cuda": "c", "version": "v", "commit": "x",
              "quant": "bf16", "activation": "swiglu", "routing": "uniform", "copy_bw_bytes_s": 1e12,
              "gemm_flop_s": 1e15, "rows": [row]}
    table = [line for line in bench.markdown(result).splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1
    assert table[0].count("|") == 12 + len(peers) + bool(clocks) + bool(host)
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[3] == "-"    # no read-only ceiling in rows from before it was measured
    assert cells[10] == "50%"  # of the dense rate: 500 of 1000 TFLOP/s
    assert (cells[-1 - bool(host)] == "1530 MHz, 548 W") == bool(clocks)
    assert cells[-1].startswith("41.2") == bool(host)
    assert (cells[-1] == "41.2 (CUDA runtime 20.0, 7 launches)") == ("host_runtime" in host)
    assert "catalog" not in bench.markdown(result).splitlines()[0]  # results from before it was recorded
    assert "at x (minimal catalog); bf16" in bench.markdown({**result, "catalog": "minimal"}).splitlines()[0]


def test_short_kernel_names_stay_distinct():
    # Two decode kernels differ only in template arguments near the end of their names; a
    # fixed head-and-tail cut once showed them as one kernel with the sum of both times.
    a = ("void moe_kernels::decode::decode_gemm_kernel<__nv_fp8_e4m3, __nv_bfloat16, true, true, 2>"
         "(moe_kernels::decode::Params)")
    b = a.replace("true, true, 2", "true, false, 1")
    mangled = "_ZN7cutlass13device_kernelI" + "X" * 300 + "{}" + "EEEvNT_6ParamsE"
    names = [a, b, mangled.format("AAAA"), mangled.format("BBBB")]
    short = profiling.short_kernel_names(names)
    assert short[a] == "decode::decode_gemm_kernel<__nv_fp8_e4m3, __nv_bfloat16, true, true, 2>"
    assert len(set(short.values())) == len(names)
    assert all(len(v) <= 110 for v in short.values())


def test_tactic_argument():
    assert bench.parse_tactic(None) is None
    assert bench.parse_tactic("a+b") == moe_kernels.Tactic("a", "b")
    assert bench.parse_tactic("whole") == moe_kernels.Tactic(forward="whole")
    for bad in ("a+", "+b", "a+b+c"):
        with pytest.raises(SystemExit, match="two GEMM kernel names"):
            bench.parse_tactic(bad)


def test_fp16_out_argument():
    ns = argparse.Namespace
    assert bench.hidden_dtype(ns(quant="fp8", fp16_out=True)) == torch.float16
    assert bench.hidden_dtype(ns(quant="fp8_block", fp16_out=False)) == torch.bfloat16
    assert bench.hidden_dtype(ns(quant="fp16", fp16_out=False)) == torch.float16
    with pytest.raises(SystemExit, match="--fp16-out is for modes with bf16 or fp16 hidden states, not bf16"):
        bench.hidden_dtype(ns(quant="bf16", fp16_out=True))


def test_git_commit_marks_a_changed_tree(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    assert bench.git_commit(cwd=tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = bench.git_commit(cwd=tmp_path)
    assert len(head) == 40 and not head.endswith("-dirty")
    (tmp_path / "g").write_text("untracked files do not count")
    assert bench.git_commit(cwd=tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert bench.git_commit(cwd=tmp_path) == head + "-dirty"


def test_bench_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench"], capture_output=True, text=True)
    assert r.returncode == 2  # as profile and tune
    assert "No CUDA GPU is visible" in r.stderr and "nothing to time" in r.stderr


def test_dequantized_peer_unprepares_to_the_unpadded_k():
    """The bf16 peer's copy of prepared 4-bit weights whose K is no multiple of 128 (padded in
    the prepared layout): each GEMM's K from the scales, the values those of the checkpoint."""
    from moe_kernels import quant4
    from moe_kernels.prepare import prepare_weights
    g = torch.Generator().manual_seed(1)
    E, H, I = 2, 160, 96
    (q13, e13), (q2, e2) = (quant4.quantize_mxfp4(torch.randn(*s, generator=g)) for s in ((E, 2 * I, H), (E, H, I)))
    p = prepare_weights(q13, q2, quant="w4a16_mxfp4", w13_scale=e13, w2_scale=e2)
    assert p["w13"].shape == (E, 2, 2 * I // 16, 1024) and p["w2"].shape == (E, 1, H // 16, 1024)
    assert bench.unpadded_ks(p["w13"], p["w2"], p["w13_scale"], p["w2_scale"]) == (H, I)
    b13, b2 = bench.DequantizedGroupedMM(quant4.PLACED).weights(p["w13"], p["w2"], p["w13_scale"], p["w2_scale"])
    assert torch.equal(b13, quant4.dequantize_mxfp4(q13, e13).bfloat16())
    assert torch.equal(b2, quant4.dequantize_mxfp4(q2, e2).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("quant,extra,peer", [
    ("bf16", [], "torch._grouped_mm"),
    ("fp16", [], "torch._grouped_mm (bf16 copy)"),
    ("fp8_block", ["--fp16-out"], "torch._grouped_mm (bf16 weights)")])
def test_tiny_bench_run(tmp_path, quant, extra, peer):
    # every mode's PyTorch peer must be timed under graph capture, not reported as failed
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench", "--experts", "8", "--top-k", "2",
                        "--hidden", "256", "--intermediate", "128", "--tokens", "1,64", "--replays", "3",
                        "--quant", quant, *extra, "--breakdown", "--clocks", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["copy_bw_bytes_s"] > 0 and data["gemm_flop_s"] > 0 and data["gemm_flop_s_burst"] > 0
    nvml = profiling.GpuSampler().available  # --clocks: the dense rounds last long enough to be sampled
    assert ("gemm_sm_mhz" in data) == nvml and (not nvml or 100 < data["gemm_sm_mhz"] < 5000)
    for row in data["rows"]:
        ours = row["results"]["moe_kernels"]
        assert ours["status"] == "ok" and math.isfinite(ours["us"]) and ours["us"] > 0
        assert "sm_mhz" not in ours or 100 < ours["sm_mhz"] < 5000
        assert ours["rel_err"] < moe_kernels.QuantMode.parse(quant).spec.tolerance
        assert set(row["breakdown_us"]) == set(bench.STEPS)
        if hasattr(torch, "_grouped_mm"):
            assert row["results"][peer]["status"] == "ok", row["results"][peer]


def test_profile_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "profile", "--tokens", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "nothing to profile" in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_tiny_bench_run_fp16_out(quant, tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench", "--experts", "8", "--top-k", "2",
                        "--hidden", "256", "--intermediate", "128", "--tokens", "1,64", "--replays", "3",
                        "--quant", quant, "--fp16-out", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["hidden_dtype"] == "fp16" and "fp16 in and out" in r.stdout
    for row in data["rows"]:
        ours = row["results"]["moe_kernels"]
        assert ours["status"] == "ok" and ours["rel_err"] < 5e-2
        assert all("_fp16_" in name for name in row["tactic"].split("+"))


@pytest.mark.gpu
def test_tiny_profile_run():
    # Runs the forwards (what ncu or nsys would capture); without a profiler attached the
    # start/stop calls do nothing.
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "profile", "--experts", "8", "--top-k", "2",
                        "--hidden", "256", "--intermediate", "128", "--tokens", "1,64", "--quant", "fp8",
                        "--forwards", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if "forward(s) in the profiled range" in ln]
    assert len(lines) == 2 and all("2 forward(s)" in ln and "tactic sm90_" in ln for ln in lines)


def test_four_bit_modes_have_the_dequantized_and_own_fp8_peers():
    from moe_kernels import reference
    from moe_kernels.prepare import quantize_weights
    peers = bench.peers("swiglu", "w4a16_int4")
    assert [n for n, _, _ in peers] == ["torch._grouped_mm (bf16 weights)", "moe_kernels bf16 (same weights dequantized)",
                                        "moe_kernels fp8 (same weights)", "humming-kernels"]
    assert peers[1][1].dequantized is peers[0][1]  # one bf16 copy of the weights for both
    assert [n for n, _, _ in bench.peers("swiglu", "w4a8_mxfp4")] == [
        "torch._grouped_mm (bf16 weights)", "moe_kernels fp8 (same weights)", "moe_kernels w4a16 (same weights)",
        "humming-kernels"]
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 4, 256, 128, 5, 2
    p = quantize_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g),
                         quant="w4a16_int4")
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    wts = torch.rand(T, k, generator=g)
    own = bench.OwnFp8("int4")
    # its weights: the 4-bit ones dequantized, then E4M3 per channel; its reference: the fp8 one on them
    (q13, s13), _ = own.weights(p["w13"], p["w2"], p["w13_scale"], p["w2_scale"])
    assert q13.dtype == torch.float8_e4m3fn and s13.shape == (E, 2 * I)
    deq = reference.dequantize_weight(p["w13"][1], "int4", p["w13_scale"][1], K=H)
    back = q13[1].float() * s13[1][:, None]
    assert ((back - deq).norm() / deq.norm()).item() < 0.05
    ref = own.reference(x, p["w13"], p["w2"], wts, ids, "swiglu", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    w4 = reference.fused_moe(x, p["w13"], p["w2"], wts, ids, quant="w4a16_int4", w13_scale=p["w13_scale"],
                             w2_scale=p["w2_scale"])
    assert ((ref - w4).norm() / w4.norm()).item() < 0.1  # the same weights, E4M3 on top of INT4
    # the bf16 peer's reference: the 16-bit one on the dequantized weights
    ref16 = peers[1][1].reference(x, p["w13"], p["w2"], wts, ids, "swiglu", w13_scale=p["w13_scale"],
                                  w2_scale=p["w2_scale"])
    assert ((ref16.float() - w4.float()).norm() / w4.float().norm()).item() < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("method", sorted(profiling.READ_METHODS))
@pytest.mark.parametrize("size", [16, 4096 + 48, 16384 * 3, (5 << 20) + 16 * 17])
def test_read_probe_checksum(method, size):
    """The read-only probe reads every 16-byte word once: its XOR checksum equals torch's, and
    flipping one byte anywhere (here the last and a middle one) changes it."""
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    checksum = torch.zeros(2, dtype=torch.int64, device="cuda")
    profiling.read_probe(buf, method, checksum)
    assert torch.equal(checksum, profiling.xor_fold(buf))
    for at in (size - 1, size // 2):
        before = checksum.clone()
        buf[at] ^= 0x5A
        checksum.zero_()
        profiling.read_probe(buf, method, checksum)
        assert torch.equal(checksum, profiling.xor_fold(buf)) and not torch.equal(checksum, before)


@pytest.mark.gpu
def test_read_probe_refuses_bad_buffers():
    buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
    checksum = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="multiple of 16"):
        profiling.read_probe(buf[:40], 0, checksum)
    with pytest.raises(ValueError, match="aligned"):
        profiling.read_probe(buf[1:33], 0, checksum)
    with pytest.raises(ValueError, match="method 2"):
        profiling.read_probe(buf, 2, checksum)


@pytest.mark.gpu
def test_read_rates_are_checked_and_plausible():
    rates = profiling.read_rates(64 << 20, windows=2, replays=3)
    assert set(rates) == set(profiling.READ_METHODS.values())
    assert all(r is None or 1e11 < r < 1e14 for r in rates.values()), rates


def test_benchmark_runs_parse(tmp_path):
    """Every named run of benchmarks/run.sh is a valid `bench` command line ("transformers": a
    valid `bench-transformers` one)."""
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    out = subprocess.run(["bash", str(root / "benchmarks" / "run.sh"), "--list"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) >= 12 and {"w4a8_int4", "decode", "host", "transformers"} <= {line.split(":")[0] for line in out}
    for line in out:
        name, argv = line.split(":", 1)
        if name == "transformers":
            args = parse_transformers(*argv.split(), "--json", str(tmp_path / "x.json"), "--markdown", "x.md")
            assert args.models == list(bench_transformers.MODELS) and args.prefill_tokens == 2048, line
            continue
        args = parse(*argv.split(), "--json", str(tmp_path / "x.json"))
        assert args.preset and all(p in bench.PRESETS for p in args.preset), line


# ---- bench-transformers: the command line ---------------------------------------------------

def parse_transformers(*argv):
    p = argparse.ArgumentParser()
    bench_transformers.add_arguments(p)
    return p.parse_args(list(argv))


def test_bench_transformers_arguments():
    args = build_parser().parse_args(["bench-transformers"])
    assert args.command == "bench-transformers"
    assert args.models == ["qwen3-30b-a3b", "gpt-oss-20b"] and set(args.models) <= set(bench.PRESETS)
    assert (args.layers, args.decode_context, args.prefill_tokens, args.repeats) == (2, 512, 2048, 20)
    assert args.graphs and args.json is None and args.markdown is None
    args = parse_transformers("--models", "gpt-oss-20b", "--layers", "4", "--decode-context", "256",
                              "--prefill-tokens", "128", "--repeats", "5", "--no-graphs", "--json", "t.json")
    assert args.models == ["gpt-oss-20b"] and not args.graphs and args.json == "t.json"
    assert (args.layers, args.decode_context, args.prefill_tokens, args.repeats) == (4, 256, 128, 5)
    assert parse_transformers("--models", "gpt-oss-20b,qwen3-30b-a3b").models == ["gpt-oss-20b", "qwen3-30b-a3b"]
    for bad in (["--models", "gpt-5"], ["--models", ","], ["--layers", "0"], ["--repeats", "x"],
                ["--decode-context", "-1"]):
        with pytest.raises(SystemExit):
            parse_transformers(*bad)


def test_bench_transformers_help():
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench-transformers", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert all(o in r.stdout for o in ("--models", "--layers", "--decode-context", "--prefill-tokens", "--repeats",
                                       "--no-graphs", "--json", "--markdown"))
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench-transformers" in r.stdout


def test_bench_transformers_without_gpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench-transformers", "--json", "t.json"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2  # as bench, profile and tune
    assert "No CUDA GPU is visible" in r.stderr and "nothing to time" in r.stderr
    assert not (tmp_path / "t.json").exists()


def test_bench_transformers_needs_a_cache_longer_than_its_steps():
    pytest.importorskip("transformers")
    args = parse_transformers("--decode-context", "40", "--repeats", "20")
    with pytest.raises(SystemExit, match="--decode-context 40: must be more than the 48 decode steps"):
        bench_transformers.main(args)


def test_bench_transformers_table_and_speedups():
    rows = [{"model": "m", "attention": "sdpa", "implementation": impl, "decode_ms": d, "decode_graph_ms": g,
             "prefill_ms": p, "notes": notes}
            for impl, d, g, p, notes in [("grouped_mm", 4.0, 1.0, 30.0, []),
                                         ("batched_mm", 2.0, 0.5, None, ["prefill not timed"]),
                                         ("moe_kernels", 2.0, 0.25, 10.0, [])]]
    bench_transformers.speedups(rows)
    assert rows[0]["moe_kernels_speedup"] == {"decode_ms": 2.0, "decode_graph_ms": 4.0, "prefill_ms": 3.0}
    assert rows[1]["moe_kernels_speedup"] == {"decode_ms": 1.0, "decode_graph_ms": 2.0}
    assert "moe_kernels_speedup" not in rows[2]
    result = {"gpu": "NVIDIA H100", "driver": "1", "torch": "2", "cuda": "13", "transformers": "5.17.0",
              "version": "0.1.0", "commit": "c" * 40, "catalog": "full", "layers": 2, "decode_context": 512,
              "prefill_tokens": 2048, "repeats": 20, "graphs": True, "rows": rows}
    lines = bench_transformers.markdown(result).splitlines()
    assert lines[4] == "| m | sdpa | grouped_mm | 4.00 | 1.00 | 30.00 | 2.00x, 4.00x, 3.00x |  |"
    assert lines[5] == "| m | sdpa | batched_mm | 2.00 | 0.500 | - | 1.00x, 2.00x, - | prefill not timed |"
    assert lines[6] == "| m | sdpa | moe_kernels | 2.00 | 0.250 | 10.00 |  |  |"


@pytest.mark.gpu
def test_tiny_bench_transformers_run(tmp_path):
    """A short run of both models, two layers: every implementation timed (64 tokens' gathered
    weights fit batched_mm's prefill), ours with its kernels rather than a fallback, and its
    decode step captured in a CUDA graph wherever grouped_mm's is (gpt-oss's sliding-window cache
    layers past their window make a tensor on the device in each step, which a capture may
    refuse: the row then says so)."""
    pytest.importorskip("transformers.integrations.moe")
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "moe_kernels", "bench-transformers", "--layers", "2",
                        "--decode-context", "256", "--prefill-tokens", "64", "--repeats", "3", "--json", str(out),
                        "--markdown", str(tmp_path / "t.md")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {(row["model"], row["implementation"]): row for row in data["rows"]}
    assert list(rows) == [(m, i) for m in bench_transformers.MODELS for i in bench_transformers.IMPLEMENTATIONS]
    for (model, impl), row in rows.items():
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0, row
        graphed = row["decode_graph_ms"] is not None
        assert graphed or any(n.startswith("no CUDA graph") for n in row["notes"]), row
        assert graphed or model != "qwen3-30b-a3b", row
        if impl == "moe_kernels":
            assert not any("fell back" in n for n in row["notes"]), row
            assert graphed == (rows[model, "grouped_mm"]["decode_graph_ms"] is not None), row
    assert (tmp_path / "t.md").read_text().count("| moe_kernels |") == 2


def test_peers_that_need_the_most_memory_run_first():
    """humming-kernels builds its layers with an int32 per weight value: it runs before the
    peers that keep copies of the weights; the others keep their order (and the columns theirs)."""
    from moe_kernels.cli import bench as b
    humming = b.HummingMoE("int4")
    listed = [("copy", b.DequantizedGroupedMM("int4"), None), ("fp8", b.OwnFp8("int4"), None),
              ("missing", None, "not installed"), ("humming-kernels", humming, None)]
    assert [n for n, _, _ in b.run_order(listed)] == ["humming-kernels", "copy", "fp8", "missing"]
    assert [n for n, _, _ in listed][-1] == "humming-kernels"  # the list itself is left as it was
    assert b.run_order(b.peers("swiglu", "bf16")) == b.peers("swiglu", "bf16")


def test_free_other_peers_keeps_the_peer_and_the_copy_it_reads():
    """A peer whose weights do not fit beside the others' gets the others' copies dropped (bench
    retries it once so): each other peer with a release() loses its copy, the peer itself and the
    dequantized copy it reads through keep theirs."""
    from moe_kernels.cli import bench as b

    class Peer:
        def __init__(self, dequantized=None):
            self.released, self.dequantized = 0, dequantized

        def release(self):
            self.released += 1
    shared = Peer()
    keep, other = Peer(dequantized=shared), Peer()
    plain = lambda *a: None  # noqa: E731  a peer function with no copy
    b.free_other_peers([("a", shared, None), ("b", keep, None), ("c", other, None), ("d", plain, None),
                        ("e", None, "not installed")], keep)
    assert (shared.released, keep.released, other.released) == (0, 0, 1)
    b.free_other_peers([("a", shared, None), ("c", other, None)], other)
    assert (shared.released, other.released) == (1, 1)
