"""The autotuner: buckets, cache keys and files (CPU); isolation, validation, graphs (GPU)."""
import json

import pytest
import torch

import moe_kernels
from moe_kernels import Tactic, cache, fused_moe, tuning
from moe_kernels.cache import BUCKETS, ProblemSpec, TuningCache, bucket_for
from helpers import TOLERANCE, make_problem, reference_out, rel_error

KEY = {"gpu": "NVIDIA H200", "sm_count": 132, "cuda": 13000, "version": "0.1.0"}
SPEC = ProblemSpec("bf16", "swiglu", 8, 2, 256, 128)


def test_bucket_mapping():
    assert [bucket_for(t) for t in (1, 2, 3, 5, 129, 256, 257, 513, 1024, 1025, 4097, 5000, 8193, 16384,
                                    99999)] == \
        [1, 2, 4, 8, 256, 256, 512, 1024, 1024, 2048, 8192, 8192, 16384, 16384, 16384]
    assert list(BUCKETS) == [2 ** i for i in range(15)]
    with pytest.raises(ValueError, match="num_tokens: got 0"):
        bucket_for(0)


def test_signature_round_trip():
    assert ProblemSpec.parse(SPEC.signature) == SPEC
    # FP8 with fp16 hidden states and output: its own entries (other kernels), "/fp16" appended.
    half = ProblemSpec("fp8_block", "swiglu", 256, 8, 7168, 2048, "fp16")
    assert half.signature == "fp8_block/swiglu/E256/k8/H7168/I2048/fp16"
    assert ProblemSpec.parse(half.signature) == half and half.hidden_dtype == torch.float16
    assert ProblemSpec("fp8", "swiglu", 8, 2, 64, 32).hidden_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="out_dtype: got 'fp16'"):  # bf16 takes bf16 only
        ProblemSpec("bf16", "swiglu", 8, 2, 64, 32, "fp16")
    with pytest.raises(ValueError, match="problem signature"):
        ProblemSpec.parse("fp8/swiglu/E8/k2/H64/I32/fp16/x")
    with pytest.raises(ValueError, match="problem signature"):
        ProblemSpec.parse("bf16/swiglu/8")


def test_cache_round_trip(tmp_path):
    path = str(tmp_path / "tuned.json")
    c = TuningCache(KEY, path)
    rec = {"tactic": "a+b", "us": 1.0}
    c.put(SPEC, 16, rec)
    c.save()
    again = TuningCache(KEY, path)
    assert Tactic.parse(again.get(SPEC, 16)) == Tactic("a", "b")
    assert again.get(SPEC, 32) is None
    data = json.loads(open(path).read())
    assert data["key"] == KEY and data["entries"][SPEC.signature]["16"] == rec
    assert data["format"] == cache.CACHE_FORMAT


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H100 80GB HBM3"), ("sm_count", 114),
                                         ("cuda", 12080), ("version", "0.0.9")])
def test_mismatched_key_is_ignored_with_a_warning(tmp_path, field, value):
    path = str(tmp_path / "tuned.json")
    c = TuningCache({**KEY, field: value}, path)
    c.put(SPEC, 16, {"tactic": "a+b"})
    c.save()
    with pytest.warns(UserWarning, match="ignoring tuning cache"):
        mine = TuningCache(KEY, path)
    assert mine.get(SPEC, 16) is None


def test_an_older_format_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "key": KEY, "entries": {SPEC.signature: {"16": {"gemm1": "a"}}}}))
    with pytest.warns(UserWarning, match="ignoring tuning cache"):
        assert TuningCache(KEY, str(path)).entries == {}


def test_a_bucket_without_a_record_takes_the_default_rule(monkeypatch):
    """A table made before a bucket existed: T in that bucket gets None (the default rule), not
    the pick of the bucket above (tuned for up to twice the tokens)."""
    c = TuningCache(KEY)
    monkeypatch.setattr(cache, "cache_for", lambda device: c)
    monkeypatch.setattr(cache, "tuners", [])  # outside autotune(): nothing is tuned here
    c.put(SPEC, 16384, {"tactic": "a+b"})
    assert cache.lookup(SPEC, 6000, 0) is None
    assert cache.lookup(SPEC, 9000, 0) == "a+b"


def test_lookup_tunes_a_new_bucket_through_the_innermost_tuner(monkeypatch):
    c = TuningCache(KEY)
    monkeypatch.setattr(cache, "cache_for", lambda device: c)
    asked = []
    monkeypatch.setattr(cache, "tuners", [lambda *a: pytest.fail("outer"),
                                          lambda spec, b, d: asked.append(b) or {"tactic": "x+y"}])
    assert cache.lookup(SPEC, 9, 0) == "x+y" and asked == [16]
    assert cache.lookup(SPEC, 12, 0) == "x+y" and asked == [16]  # kept: not tuned again


def test_fp16_output_problems_take_the_bf16_records_kernels_in_their_fp16_form():
    """An FP8 problem with fp16 output and no record of its own takes the bf16 record's kernels
    in their fp16 form: the same instantiation by its fields (tile, schedule, mainloop, ...)."""
    from moe_kernels import _native
    from moe_kernels.tactic import _other_output
    kernels = next(lib["kernels"] for lib in _native.libraries() if lib["arch"] == "sm90a")
    bf16 = [k for k in kernels if k.mode == "fp8" and k.out_dtype == "bf16"]
    for k in bf16:
        twin = [o for o in kernels if o.out_dtype == "fp16" and o.same_kernel(k)]
        if not twin:
            continue
        tactic = Tactic(forward=k.name) if not k.gemm else Tactic(k.name, k.name)
        other = _other_output(tactic, kernels, "fp16")
        assert other is not None and set(other.kernels) == {twin[0].name}, (k.name, other)
    forward = next(k for k in bf16 if not k.gemm)
    assert _other_output(Tactic(forward=forward.name), kernels, "fp16").forward == forward.name.replace("bf16", "fp16")
    assert _other_output(Tactic("not-a-kernel", bf16[0].name), kernels, "fp16") is None


def test_report_prints_forward_kernels_and_records_without_a_default(capsys):
    from moe_kernels.cli.tune import report
    whole = {"tactic": "sm90_fp8_bf16_one_token", "us": 17.0, "search": None, "search_us": None,
             "default": None, "default_us": None, "runner_up": None, "runner_up_us": None,
             "rejected": {}, "faulted": {}, "forwards": {"sm90_fp8_bf16_one_token": 17.0}}
    grouped = {**whole, "tactic": "a+b", "us": 20.0, "search_us": 20.0, "default_us": 25.0,
               "rejected": {"c+c": "wrong result"}, "forwards": {"sm90_fp8_bf16_one_token": "not applicable: 2 tokens"}}
    results = {SPEC.signature: {"1": whole, "16": grouped, "64": None}}
    for exhaustive in (False, True):
        report([SPEC], results, "skewed", exhaustive)
    out = capsys.readouterr().out
    assert "sm90_fp8_bf16_one_token: 17.0 us" in out and "sm90_fp8_bf16_one_token: not applicable: 2 tokens" in out
    assert "rejected c+c: wrong result" in out and "no valid tactic" in out
    assert "     1       17.0           -" in out  # no default where only the forward kernel ran
    assert "1.250" in out  # default / best at bucket 16, exhaustive table


def test_corrupt_file_is_ignored(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring tuning cache"):
        assert TuningCache(KEY, str(path)).entries == {}


def test_shipped_tables_are_well_formed():
    import os
    d = os.path.join(os.path.dirname(moe_kernels.__file__), "tuned")
    for name in (os.listdir(d) if os.path.isdir(d) else []):
        data = json.load(open(os.path.join(d, name)))
        assert data["format"] == cache.CACHE_FORMAT and set(data["key"]) == set(KEY)
        for sig, buckets in data["entries"].items():
            ProblemSpec.parse(sig)
            # every bucket: one left out would fall to the default rule, not to a neighbour's pick
            assert sorted(map(int, buckets)) == list(BUCKETS), (name, sig)
            for b, rec in buckets.items():
                assert Tactic.parse(rec["tactic"]).kernels


# ---- GPU --------------------------------------------------------------------------------------

def _check_tactic(tactic, T=16):
    p = make_problem(T=T, E=SPEC.experts, k=SPEC.top_k, H=SPEC.hidden, I=SPEC.inter)
    out = fused_moe(p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"], tactic=tactic)
    assert rel_error(out, reference_out(p)) < TOLERANCE["bf16"]


def test_confirm_retimes_the_finalists_interleaved():
    # "a" had a lucky first timing; timed again it is slower than "b". "d" is no finalist.
    first = {"a+a": 100.0, "b+b": 101.0, "c+c": 105.0, "d+d": 200.0}
    again = {"a+a": iter([112.0, 110.0, 111.0]), "b+b": iter([101.0, 102.0, 100.0]),
             "c+c": iter([104.0, 106.0, 105.0])}
    calls = []

    def time_again(key):
        calls.append(key)
        return next(again[key])
    ranked = tuning.confirm(first, time_again, finalists=3, rounds=3)
    assert calls == ["a+a", "b+b", "c+c"] * 3  # round-robin, so drift hits all alike
    assert list(ranked) == ["b+b", "c+c", "a+a"]
    assert ranked["b+b"] == 101.0 and ranked["a+a"] == 111.0  # medians of the 3 re-timings


def test_confirm_always_retimes_the_default_pair():
    # "d" (the default rule's pair) had an unlucky first timing, fourth of four: it joins the
    # finalists anyway, and timed again it wins.
    first = {"a+a": 100.0, "b+b": 101.0, "c+c": 105.0, "d+d": 120.0}
    again = {"a+a": iter([110.0] * 3), "b+b": iter([108.0] * 3), "c+c": iter([106.0] * 3),
             "d+d": iter([99.0, 98.0, 99.0])}
    calls = []

    def time_again(key):
        calls.append(key)
        return next(again[key])
    ranked = tuning.confirm(first, time_again, finalists=3, rounds=3, default="d+d")
    assert calls == ["a+a", "b+b", "c+c", "d+d"] * 3
    assert next(iter(ranked)) == "d+d" and ranked["d+d"] == 99.0
    # A lucky first timing is not scored: "a" first at 50, then 112, 110, 111.
    again = {"a+a": iter([112.0, 110.0, 111.0]), "b+b": iter([101.0, 102.0, 100.0])}
    ranked = tuning.confirm({"a+a": 50.0, "b+b": 101.0}, time_again, finalists=3, rounds=3)
    assert list(ranked) == ["b+b", "a+a"] and ranked["a+a"] == 111.0
    # Already a finalist, or never timed (rejected): no extra candidate.
    assert list(tuning.confirm(first, lambda k: first[k], finalists=3, rounds=3, default="b+b")) == \
        ["a+a", "b+b", "c+c"]
    assert list(tuning.confirm(first, lambda k: first[k], finalists=3, rounds=3, default="x+x")) == \
        ["a+a", "b+b", "c+c"]


def test_confirm_with_one_candidate_times_nothing_again():
    assert tuning.confirm({"a+a": 5.0}, lambda k: pytest.fail("timed again")) == {"a+a": 5.0}


@pytest.mark.gpu
def test_list_tactics_reports_filtered():
    ts = moe_kernels.list_tactics("bf16")
    assert ts.kernels and len(ts.tactics) == len(ts.kernels) ** 2
    assert all(isinstance(t, Tactic) for t in ts.tactics)
    assert all(isinstance(why, str) and why for why in ts.filtered.values())


@pytest.mark.gpu
def test_tuning_picks_a_tactic_that_passes_the_reference():
    res = tuning.tune([SPEC], [16], replays=3, progress=False)
    rec = res[SPEC.signature]["16"]
    assert rec["us"] > 0 and rec["default_us"] >= rec["us"] * 0.5
    assert rec["candidates"] >= 1 and not rec["rejected"] and not rec["faulted"]
    assert rec["default"] in rec["finalists"], rec  # re-timed with the others, whatever it ranked
    _check_tactic(Tactic.parse(rec["tactic"]))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["w4a16_int4", "w4a16_mxfp4", "w4a8_int4", "w4a8_mxfp4"])
def test_tuning_four_bit_modes_and_the_tuned_forward(quant):
    """The tuner lists, validates and times the 4-bit modes' tactics like the others (the upstream
    profiler crashed on a mixed-input mode exactly there); the tuned tactic's forward matches the
    reference, and is bitwise the forward of that tactic asked for by name."""
    spec = ProblemSpec(quant, "swiglu", 8, 2, 256, 128)
    for T in (4, 200):
        res = tuning.tune([spec], [T], replays=3, progress=False)
        rec = res[spec.signature][str(T)]
        assert rec["candidates"] >= 1 and not rec["rejected"] and not rec["faulted"], rec
        p = make_problem(T=T, E=8, k=2, H=256, I=128, dtype=quant, group=32 if quant.endswith("mxfp4") else 128)
        args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
        kw = dict(quant=quant, w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
        with moe_kernels.autotune(cache=None):
            tuned = fused_moe(*args, **kw)
            chosen = moe_kernels.api.choose_tactic(*args, **kw)
        named = fused_moe(*args, tactic=chosen, **kw)
        assert torch.equal(tuned, named), f"{quant} T={T}: the tuned forward differs from {chosen}'s"
        assert rel_error(named, reference_out(p)) < TOLERANCE[quant]


@pytest.mark.gpu
def test_corrupted_candidate_is_rejected_not_chosen():
    bad = moe_kernels.list_tactics("bf16").kernels[0]
    res = tuning.tune([SPEC], [16], replays=3, progress=False,
                      env={tuning.TEST_CORRUPT_ENV: bad})
    rec = res[SPEC.signature]["16"]
    assert bad not in Tactic.parse(rec["tactic"]).kernels
    assert any(bad in k and "wrong result" in why for k, why in rec["rejected"].items())
    _check_tactic(Tactic.parse(rec["tactic"]))  # and this process keeps working


@pytest.mark.gpu
def test_isolated_tuner_survives_a_faulting_kernel():
    kernels = moe_kernels.list_tactics("bf16").kernels
    if len(kernels) < 2:
        pytest.skip("needs two kernels: one to fault, one to choose")
    bad = kernels[-1]
    res = tuning.tune([SPEC], [16, 64], replays=3, progress=False,
                      env={"MOE_KERNELS_TEST_FAULT_KERNEL": bad})
    for b in ("16", "64"):
        rec = res[SPEC.signature][b]
        assert bad in rec["faulted"], rec["faulted"]
        assert bad not in Tactic.parse(rec["tactic"]).kernels
    _check_tactic(Tactic.parse(rec["tactic"]))


@pytest.mark.gpu
def test_tuned_choice_is_used_inside_a_cuda_graph(tmp_path):
    path = str(tmp_path / "tuned.json")
    T = 40
    p = make_problem(T=T, E=SPEC.experts, k=SPEC.top_k, H=SPEC.hidden, I=SPEC.inter)
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    ws = torch.empty(moe_kernels.workspace_size(T, SPEC.top_k, SPEC.experts, SPEC.hidden, SPEC.inter),
                     dtype=torch.uint8, device="cuda")
    out = torch.empty_like(p["hidden_states"])
    with moe_kernels.autotune(cache=path, routing="skewed"):
        fused_moe(*args, workspace=ws, out=out)  # first sight of this bucket: tuned now
        rec = json.load(open(path))["entries"][SPEC.signature][str(bucket_for(T))]
        tuned = Tactic.parse(rec["tactic"])
        assert moe_kernels.api.choose_tactic(*args) == tuned
        eager = out.clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert moe_kernels.api.choose_tactic(*args) == tuned  # cached only, no tuning
            fused_moe(*args, workspace=ws, out=out)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    # outside the context the in-memory choice still applies
    assert moe_kernels.api.choose_tactic(*args) == tuned


# One token of this fp8 problem fits the one-token forward kernel (tests/test_gpu.py ONE_TOKEN_SHAPES).
ONE_TOKEN_SPEC = ProblemSpec("fp8", "swiglu", 8, 1, 512, 1024)


@pytest.mark.gpu
def test_forward_kernels_are_candidates_at_one_token():
    ts = moe_kernels.list_tactics("fp8")
    assert ts.forwards and Tactic(forward=ts.forwards[0]) in ts.tactics
    whole = Tactic(forward=ts.forwards[0])
    res = tuning.tune([ONE_TOKEN_SPEC], [1], replays=3, progress=False)
    rec = res[ONE_TOKEN_SPEC.signature]["1"]
    assert isinstance(rec["forwards"][whole.forward], float) and rec["forwards"][whole.forward] > 0, rec
    assert str(whole) not in rec["rejected"] and not rec["faulted"]
    # One launch against the grouped path's six: among the fastest three on this small problem.
    assert str(whole) in rec["finalists"], rec["finalists"]
    p = make_problem(T=1, E=ONE_TOKEN_SPEC.experts, k=ONE_TOKEN_SPEC.top_k, H=ONE_TOKEN_SPEC.hidden,
                     I=ONE_TOKEN_SPEC.inter, dtype="fp8")
    args = (p["hidden_states"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    kw = dict(quant="fp8", w13_scale=p["w13_scale"], w2_scale=p["w2_scale"])
    grouped = ts.kernels[0]
    mem = cache.cache_for(torch.cuda.current_device())
    saved = mem.entries.get(ONE_TOKEN_SPEC.signature, {}).get("1")
    try:
        # The record is used, whichever tactic won; without one the default rule takes the forward.
        mem.put(ONE_TOKEN_SPEC, 1, {**rec, "tactic": f"{grouped}+{grouped}"})
        assert moe_kernels.api.choose_tactic(*args, **kw) == Tactic(grouped, grouped)
        mem.put(ONE_TOKEN_SPEC, 1, {**rec, "tactic": str(whole)})
        assert moe_kernels.api.choose_tactic(*args, **kw) == whole
        mem.entries.get(ONE_TOKEN_SPEC.signature, {}).pop("1", None)
        assert moe_kernels.api.choose_tactic(*args, **kw) == whole
    finally:
        if saved is None:
            mem.entries.get(ONE_TOKEN_SPEC.signature, {}).pop("1", None)
        else:
            mem.put(ONE_TOKEN_SPEC, 1, saved)


# What every fake child starts with: the worker's arguments and its event printer.
WORKER_PREAMBLE = r'''
import argparse, json, sys
p = argparse.ArgumentParser()
for a in ("--worker", "--buckets", "--routing", "--skew", "--replays", "--device", "--exclude", "--histogram"):
    p.add_argument(a)
p.add_argument("--exhaustive", action="store_true")
args = p.parse_args()
excluded = json.loads(args.exclude)
def emit(**e):
    print(json.dumps(e), flush=True)
'''

FAKE_WORKER = WORKER_PREAMBLE + r'''
for b in map(int, args.buckets.split(",")):
    for i, k in enumerate(["good", "faulty", "slow"]):
        if k in excluded:
            continue
        emit(event="try", bucket=b, tactic=f"{k}+{k}", suspect=k, index=i, count=3)
        if k == "faulty":
            print("CUDA error: an illegal memory access was encountered", file=sys.stderr)
            sys.exit(134)  # what a kernel fault does to the child
    emit(event="bucket", bucket=b, record={"tactic": "good+good", "us": 1.0,
                                           "faulted": excluded, "rejected": {}})
emit(event="done", peak_bytes=1, weight_bytes=1, workspace_bytes=1)
'''


def test_parent_survives_a_faulting_child_and_excludes_the_suspect(tmp_path, monkeypatch):
    """CPU check of the isolation logic: a child that dies while trying a kernel is
    replaced, the kernel is excluded and reported, and every bucket still gets a choice."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(tuning, "WORKER", [__import__("sys").executable, str(script)])
    res = tuning.tune([SPEC], [16, 64], device="cuda:0", progress=False)
    for b in ("16", "64"):
        rec = res[SPEC.signature][b]
        assert rec["tactic"] == "good+good"
        assert "faulty" in rec["faulted"] and "illegal memory access" in rec["faulted"]["faulty"]


HANGING_WORKER = WORKER_PREAMBLE + r'''
import time
for b in map(int, args.buckets.split(",")):
    if "stuck" not in excluded:
        emit(event="try", bucket=b, tactic="stuck+stuck", suspect="stuck", index=0, count=2)
        time.sleep(60)  # what a deadlocked kernel does to the child (past HANG_S below)
    emit(event="try", bucket=b, tactic="good+good", suspect="good", index=1, count=2)
    emit(event="bucket", bucket=b, record={"tactic": "good+good", "us": 1.0, "faulted": excluded, "rejected": {}})
emit(event="done", peak_bytes=1, weight_bytes=1, workspace_bytes=1)
'''


def test_parent_kills_a_hung_child_and_excludes_the_suspect(tmp_path, monkeypatch):
    """A child that stops reporting while it tries a kernel (a kernel that never finishes) is
    killed after HANG_S, the kernel is excluded as hung, and a fresh child finishes the bucket."""
    script = tmp_path / "hanging_worker.py"
    script.write_text(HANGING_WORKER)
    monkeypatch.setattr(tuning, "WORKER", [__import__("sys").executable, str(script)])
    monkeypatch.setattr(tuning, "HANG_S", 2.0)
    res = tuning.tune([SPEC], [16], device="cuda:0", progress=False)
    rec = res[SPEC.signature]["16"]
    assert rec["tactic"] == "good+good"
    assert rec["faulted"]["stuck"].startswith("hung: no report for 2 s")


def test_parent_reports_a_child_that_hangs_outside_any_candidate(tmp_path, monkeypatch):
    script = tmp_path / "silent.py"
    script.write_text("import time; time.sleep(60)\n")
    monkeypatch.setattr(tuning, "WORKER", [__import__("sys").executable, str(script)])
    monkeypatch.setattr(tuning, "HANG_S", 1.0)
    with pytest.raises(RuntimeError, match="hung \\(no report for 1 s, killed\\) outside any candidate"):
        tuning.tune([SPEC], [16], device="cuda:0", progress=False)


def test_parent_reports_a_child_that_dies_outside_any_candidate(tmp_path, monkeypatch):
    script = tmp_path / "crash.py"
    script.write_text("import sys; print('boom', file=sys.stderr); sys.exit(3)\n")
    monkeypatch.setattr(tuning, "WORKER", [__import__("sys").executable, str(script)])
    with pytest.raises(RuntimeError, match="failed \\(exit 3\\) outside any candidate"):
        tuning.tune([SPEC], [16], device="cuda:0", progress=False)
