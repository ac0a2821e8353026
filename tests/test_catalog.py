"""The catalog, the generator and the built registry agree (CPU only)."""
import dataclasses
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "cmake" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    import sys
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


catalog = _load("catalog")
generate = _load("generate_kernels")


def test_every_row_is_legal_and_names_unique():
    for subset in catalog.CATALOG:
        configs = catalog.select(subset, list(catalog.ARCHS))
        keys = [(c.arch, c.name) for c in configs]  # unique within each arch's library
        assert len(keys) == len(set(keys))
        assert configs


def test_archs_of_a_family_build_the_same_kernels():
    by_arch = {}
    for c in catalog.CATALOG["full"]:
        by_arch.setdefault(c.arch, set()).add(c.name)
    for family in catalog.SCHEDULES:
        sets = [by_arch[a] for a, v in catalog.ARCHS.items() if v["family"] == family]
        assert sets and all(s == sets[0] for s in sets), family


def test_minimal_is_a_subset_of_full():
    full = {(c.arch, c.name) for c in catalog.CATALOG["full"]}
    assert {(c.arch, c.name) for c in catalog.CATALOG["minimal"]} <= full
    # Both 4-bit decode block widths (split K, a warp per 16 columns) in every 4-bit mode and output
    widths = {}
    for c in catalog.CATALOG["minimal"]:
        if c.schedule == "decode" and c.weight_dtype in ("int4", "e2m1"):
            widths.setdefault((c.quant, c.out), set()).add(c.tile_n)
    assert len(widths) == 8 and all(w == {16, 64} for w in widths.values()), widths


def test_four_bit_kernels_on_every_arch():
    # Every 4-bit mode: on SM90 the contiguous wgmma kernel besides the decode and tiled ones (in
    # both subsets, so CI and the GPU suite build and test it); on SM100/SM103 the mma.sync decode
    # and tiled kernels, its only ones.
    for subset in ("minimal", "full"):
        rows = catalog.select(subset, list(catalog.ARCHS))
        for arch in catalog.ARCHS:
            for mode in ("w4a16_int4", "w4a16_mxfp4", "w4a8_int4", "w4a8_mxfp4"):
                schedules = {c.schedule for c in rows if c.arch == arch and c.mode == mode}
                assert {"decode", "tiled"} <= schedules, (subset, arch, mode, schedules)
                assert ("contig" in schedules) == (arch == "90a"), (subset, arch, mode, schedules)


def test_full_catalog_is_deliberate_size():
    per_mode = {}  # by arch, mode and output type
    for c in catalog.CATALOG["full"]:
        per_mode[c.arch, c.quant, c.out] = per_mode.get((c.arch, c.quant, c.out), 0) + 1
    assert all(2 <= n <= 20 for n in per_mode.values()), per_mode
    # Every (mode, output) that has full kernels on SM90 has minimal ones too (CI builds and tests them).
    assert {(m, o) for a, m, o in per_mode if a == "90a"} == {
        (c.quant, c.out) for c in catalog.CATALOG["minimal"] if c.arch == "90a"}


def test_names_are_stable():
    # Names are an API: tuned tables and user code refer to them.
    c = catalog.GemmConfig("90a", "bf16", 128, 256, 64, 2, 1, "coop")
    assert c.name == "sm90_bf16xbf16_128x256x64_2x1_coop"
    f = catalog.GemmConfig("90a", "fp8_block", 128, 128, 128, 1, 1, "coop", "bf16", "blockwise")
    assert f.name == "sm90_e4m3xe4m3_bf16_128x128x128_1x1_coop_blockwise"
    h = catalog.GemmConfig("90a", "fp8", 64, 128, 128, 1, 1, "pingpong", "fp16", "fastaccum")
    assert h.name == "sm90_e4m3xe4m3_fp16_64x128x128_1x1_pingpong_fastaccum"
    assert (c.quant, f.quant, h.quant) == ("bf16", "fp8_block", "fp8")
    s = dataclasses.replace(f, tile_m=8, schedule="coop_swapab")
    assert s.name == "sm90_e4m3xe4m3_bf16_8x128x128_1x1_coop_swapab_blockwise" and s.swapped
    w = catalog.GemmConfig("90a", "fp8_block", 0, 0, 0, 1, 1, "one_token", "fp16", "blockwise")
    assert w.name == "sm90_fp8_block_fp16_one_token" and w.kind == "forward"


_SM90_ROW = dict(arch="90a", mode="bf16", tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=1,
                schedule="coop")
_SM100_ROW = dict(_SM90_ROW, arch="100a", tile_n=256, schedule="1sm")
_E4M3 = dict(mode="fp8", out="bf16")
_BLOCK = dict(mode="fp8_block", out="bf16", tile_k=128, mainloop="blockwise")
_DECODE_ROW = dict(_SM90_ROW, tile_m=8, tile_n=16, schedule="decode")
_SWAP_ROW = dict(_SM90_ROW, **_BLOCK, tile_m=8, tile_n=128, schedule="coop_swapab")
_RING_ROW = dict(_SM90_ROW, tile_m=16, tile_n=64, tile_k=128, schedule="ring")
_FORWARD_ROW = dict(_SM90_ROW, mode="fp8", tile_m=0, tile_n=0, tile_k=0, schedule="one_token")


@pytest.mark.parametrize("base,bad", [
    (_SM90_ROW, dict(schedule="coop", tile_m=64)),
    (_SM90_ROW, dict(tile_m=96)),
    (_SM90_ROW, dict(cluster_m=2, cluster_n=2)),
    (_SM90_ROW, dict(schedule="swizzle")),
    (_SM90_ROW, dict(mainloop="fastaccum")),                 # FP8 mainloops are for E4M3 only
    (_SM90_ROW, dict(_BLOCK, tile_n=64)),                    # splits a 128-column block
    (_SM90_ROW, dict(_E4M3, tile_k=128, mainloop="blockwise")),  # blockwise is for 128x128 weight blocks
    (_SM90_ROW, dict(_BLOCK, mainloop="")),                  # ... and they need it
    (_SM90_ROW, dict(mode="w4a16_int4")),                    # modes.py builds it for no arch yet
    (_SM90_ROW, dict(mode="bf16", out="fp16")),              # not one of the mode's hidden dtypes
    (_FORWARD_ROW, dict(mode="bf16")),                       # one_token is fp8/fp8_block
    (_FORWARD_ROW, dict(tile_m=64)),                         # and has no tiles
    (_SM100_ROW, dict(schedule="coop")),                     # an SM90 schedule
    (_SM100_ROW, dict(schedule="2sm", tile_m=256, cluster_m=1)),  # a CTA pair needs cluster M of 2
    (_SM100_ROW, dict(schedule="2sm", tile_m=64, cluster_m=2)),   # 32 rows per CTA
    (_SM100_ROW, dict(schedule="1sm", tile_m=256)),          # one CTA does at most 128 rows
    (_SM100_ROW, dict(_E4M3, tile_k=64)),                    # 64 bytes of K
    (_DECODE_ROW, dict(tile_n=32)),                          # 16 (split K) or 64 columns
    (_DECODE_ROW, dict(tile_m=12)),                          # whole 8-token mma tiles
    (_DECODE_ROW, dict(cluster_n=2)),
    (_DECODE_ROW, dict(_E4M3, tile_k=128, mainloop="fastaccum")),  # it accumulates in fp32
    (_SM100_ROW, dict(_E4M3, tile_k=128, mainloop="fastaccum")),  # an SM90 mainloop
    (_SM100_ROW, dict(_BLOCK, tile_n=64)),                   # splits a block
    (_RING_ROW, dict(tile_n=128)),                           # 64 weight rows, 16 per warp
    (_RING_ROW, dict(tile_m=32)),                            # 16 or 64 tokens a pass
    (_RING_ROW, dict(tile_k=96)),                            # steps of 128 or 256 bytes
    (_RING_ROW, dict(_E4M3, tile_k=64)),                     # ... so E4M3's tile_k is 256 or 128
    (_RING_ROW, dict(_BLOCK, tile_m=64)),                    # block scales: 16 tokens a pass
    (_RING_ROW, dict(mode="w4a16_int4")),                    # 16-bit or E4M3 weights only
    (_SWAP_ROW, dict(tile_n=64)),                            # wgmma M = tile_n: coop needs 128
    (_SWAP_ROW, dict(tile_m=12)),                            # wgmma N = tile_m: multiples of 8
    (_SM100_ROW, dict(_E4M3, tile_k=128, tile_m=8, tile_n=128, schedule="coop_swapab")),  # SM90 only
])
def test_illegal_rows_are_rejected(base, bad):
    catalog.GemmConfig(**base).check()  # the base row itself is legal
    with pytest.raises(AssertionError):
        catalog.GemmConfig(**dict(base, **bad)).check()


def test_every_arch_has_its_own_library_name_and_family():
    assert len({a["lib"] for a in catalog.ARCHS.values()}) == len(catalog.ARCHS)
    for a in catalog.ARCHS.values():
        assert a["family"] in catalog.SCHEDULES
        assert (ROOT / "src" / "gemm" / a["family"] / "grouped_gemm.cuh").exists()


def test_unknown_subset_or_arch():
    with pytest.raises(ValueError, match="subset"):
        catalog.select("huge", ["90a"])
    with pytest.raises(ValueError, match="archs"):
        catalog.select("minimal", ["75"])


def test_generator_output(tmp_path):
    assert generate.main(["--archs", "90a", "--catalog", "minimal", "--out", str(tmp_path)]) == 0
    rows = catalog.select("minimal", ["90a"])
    names = [c.name for c in rows]
    gemms = [c.name for c in rows if c.kind != "forward"]  # forward kernels: src/one_token.cu
    assert len(gemms) < len(names)
    files = sorted(p.stem for p in (tmp_path / "90a").glob("*.cu"))
    assert files == sorted(gemms)
    registry = (tmp_path / "90a" / "registry.cpp").read_text()
    for n in names:
        assert f'"{n}"' in registry
    manifest = (tmp_path / "manifest.cmake").read_text()
    assert manifest.count(".cu\"") == len(gemms)
    info = json.loads((tmp_path / "build_info.json").read_text())
    assert info == {"catalog": "minimal", "archs": {"sm90a": names}}
    # The C view of the mode table: every format and mode, codes in the table's order.
    header = (tmp_path / "include" / "moe_kernels" / "modes.h").read_text()
    modes = catalog.modes
    for code, name in enumerate(modes.ACT_FORMATS):
        assert f"MOEK_ACT_FORMAT_{name.upper()} = {code}," in header
    for code, name in enumerate(modes.WEIGHT_FORMATS):
        assert f"MOEK_WEIGHT_FORMAT_{name.upper()} = {code}," in header
    for a in modes.Activation:
        assert f"MOEK_ACT_{a.value.upper()} = {a.code}," in header
    for m in modes.MODES.values():
        assert (f'{{"{m.name}", MOEK_ACT_FORMAT_{m.act.upper()}, MOEK_WEIGHT_FORMAT_{m.weight.upper()}, '
                f'{str("bf16" in m.hidden).lower()}, {str("fp16" in m.hidden).lower()}, {m.align},') in header
    # re-running rewrites nothing (no spurious rebuilds)
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    generate.main(["--archs", "90a", "--catalog", "minimal", "--out", str(tmp_path)])
    assert mtimes == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}


def _weight_tag(c) -> str:
    """The 4-bit weight tag a kernel's source must name: E2M1 read with 16-bit tokens (W4A16) is
    the placed layout's, with E4M3 tokens (W4A8) the fragment layout's."""
    if c.weight_dtype == "int4":
        return "Int4"
    return "E2M1Placed" if c.act_dtype in ("bf16", "fp16") else "E2M1"


def test_generator_covers_every_arch_and_schedule(tmp_path):
    archs = list(catalog.ARCHS)
    assert generate.main(["--archs", ";".join(archs), "--catalog", "full", "--out", str(tmp_path)]) == 0
    for arch in archs:
        family = catalog.ARCHS[arch]["family"]
        for c in catalog.select("full", [arch]):
            if c.kind == "forward":
                assert not (tmp_path / arch / f"{c.name}.cu").exists()
                continue
            text = (tmp_path / arch / f"{c.name}.cu").read_text()
            if c.schedule == "decode" and c.weight_dtype in ("int4", "e2m1"):
                weight = _weight_tag(c)
                types = f"{generate.CUDA_TYPES[c.act_dtype]}, {generate.CUDA_TYPES[c.out]}, decode_w4::{weight}"
                if family == "sm90" and c.tile_n == 64 and c.act_dtype == "e4m3":  # FP8 wgmma (W4A8)
                    assert '#include "gemm/sm90/decode_w4a8_wgmma.cuh"' in text
                    assert f"DecodeW4A8Wgmma<{types}, {c.tile_m}>::kOps" in text
                elif family == "sm90" and c.tile_n == 64:  # the register-sourced 16-bit wgmma block
                    assert '#include "gemm/sm90/decode_w4_wgmma.cuh"' in text
                    assert f"DecodeW4Wgmma<{types}, {c.tile_m}>::kOps" in text
                else:
                    assert '#include "gemm/decode_w4a16.cuh"' in text
                    assert f"DecodeW4A16<{types}, {c.tile_m}, {c.tile_n}>::kOps" in text
                continue
            if c.schedule == "tiled":
                assert '#include "gemm/tiled_w4a16.cuh"' in text
                weight = _weight_tag(c)
                assert (f"TiledW4A16<{generate.CUDA_TYPES[c.act_dtype]}, {generate.CUDA_TYPES[c.out]}, "
                        f"decode_w4::{weight}, {c.tile_m}>::kOps") in text
                continue
            if c.schedule == "decode":
                blockwise = "true" if c.mainloop == "blockwise" else "false"
                assert '#include "gemm/decode_gemm.cuh"' in text
                assert f"DecodeGemm<{generate.CUDA_TYPES[c.act_dtype]}, " in text
                assert f", {blockwise}, {c.tile_m}, {c.tile_n}>::kOps" in text
                continue
            if c.schedule == "ring":
                step_bytes = c.tile_k * (1 if c.act_dtype == "e4m3" else 2)
                assert '#include "gemm/decode_ring.cuh"' in text
                blockwise = "true" if c.mainloop == "blockwise" else "false"
                assert (f"DecodeRing<{generate.CUDA_TYPES[c.act_dtype]}, {generate.CUDA_TYPES[c.out]}, "
                        f"{blockwise}, {c.tile_m}, {step_bytes}>::kOps") in text
                continue
            if c.schedule == "contig":
                if c.weight_dtype != c.act_dtype:
                    weight = _weight_tag(c)
                    assert '#include "gemm/sm90/contiguous_w4.cuh"' in text
                    assert (f"ContiguousW4<{generate.CUDA_TYPES[c.act_dtype]}, {generate.CUDA_TYPES[c.out]}, "
                            f"contig_w4::{weight}>::kOps") in text
                    continue
                assert f'#include "gemm/{family}/contiguous_gemm.cuh"' in text
                assert f"ContiguousBlockwise<{c.tile_n}, {generate.CUDA_TYPES[c.out]}>::kOps" in text
                continue
            assert f'#include "gemm/{family}/grouped_gemm.cuh"' in text
            if c.weight_dtype != c.act_dtype:  # mixed input: our template over CUTLASS's RS mainloop
                assert (f"MixedGroupedGemm<{catalog.DTYPES[c.act_dtype]}, {catalog.DTYPES[c.weight_dtype]}, "
                        f"{catalog.DTYPES[c.out]}, {c.tile_m}, ") in text
                assert text.count("Cooperative>::kOps") == 1
                continue
            assert generate.SCHEDULE_TYPES[c.schedule] + generate.MAINLOOP_SUFFIX[c.mainloop] + ">" in text
    assert set(generate.SCHEDULE_TYPES) == {s for v in catalog.SCHEDULES.values() for s in v} - {"one_token"}
    assert set(generate.MAINLOOP_SUFFIX) == set(catalog.MAINLOOPS)


def test_built_registry_matches_build_info_and_catalog():
    from moe_kernels import _native
    info = _native.build_info()
    assert info["catalog"] in catalog.CATALOG
    libs = {lib["arch"]: [k.name for k in lib["kernels"]] for lib in _native.libraries()}
    assert libs == info["archs"]
    expected = {(catalog.ARCHS[c.arch]["lib"], c.name): c for c in catalog.CATALOG[info["catalog"]]}
    for lib in _native.libraries():
        for k in lib["kernels"]:
            c = expected[lib["arch"], k.name]
            assert (k.tile, k.cluster, k.schedule, k.mode, k.out_dtype, k.act_format, k.weight_format,
                    k.kind, k.mainloop, k.swap_ab) == (
                (c.tile_m, c.tile_n, c.tile_k), (c.cluster_m, c.cluster_n), c.schedule, c.mode, c.out,
                c.spec.act, c.spec.weight, c.kind, c.mainloop, c.swapped)
            if k.gemm:
                assert 0 < k.smem_bytes <= 232448  # SM90's per-block opt-in limit


def test_fp8_kernels_come_in_both_output_types():
    # The FP8 modes take bf16 or fp16 hidden states: in the release catalog every FP8 kernel has an
    # fp16-output twin; the minimal one has the decode kernels of each mode in fp16 on every arch,
    # a prefill tile too on SM90 (where it runs here), and the contiguous kernel in both types.
    for subset in catalog.CATALOG:
        rows = catalog.select(subset, list(catalog.ARCHS))
        fp8 = [c for c in rows if c.act_dtype == "e4m3"]
        assert {c.out for c in fp8} == {"bf16", "fp16"}
        twins = {dataclasses.replace(c, out="bf16") for c in fp8 if c.out == "fp16"}
        assert twins <= set(fp8), "an fp16-output FP8 kernel without its bf16 form"
        assert {c.out for c in fp8 if c.schedule == "contig"} == {"bf16", "fp16"}
        if subset == "full":
            assert twins == {c for c in fp8 if c.out == "bf16"}
        for arch in catalog.ARCHS:
            for quant in ("fp8", "fp8_block"):
                fp16 = {c.schedule for c in fp8 if c.arch == arch and c.quant == quant and c.out == "fp16"}
                assert "decode" in fp16, (subset, arch, quant, fp16)
                if subset == "full" or arch == "90a":
                    assert len(fp16) > 1, (subset, arch, quant, fp16)
        assert len({(c.arch, c.name) for c in fp8}) == len(fp8)


def test_shipped_tables_name_full_catalog_kernels():
    # A record naming a kernel the wheel does not build is skipped at run time (the default
    # rule applies), so a renamed or dropped kernel would silently void the tuning.
    sm90 = {c.name: c for c in catalog.select("full", ["90a"])}
    tables = sorted((ROOT / "python" / "moe_kernels" / "tuned").glob("*.json"))
    assert tables
    for path in tables:
        for sig, buckets in json.loads(path.read_text())["entries"].items():
            quant = sig.split("/")[0]
            for b, rec in buckets.items():
                kernels = rec["tactic"].split("+")
                for name in kernels:
                    assert name in sm90, f"{path.name} {sig} bucket {b}: {name} is not in the full catalog"
                    assert sm90[name].mode == quant, (path.name, sig, b, name)
                    # a pair of GEMM kernels, or one forward kernel alone (at one token)
                    assert (sm90[name].kind == "forward") == (len(kernels) == 1), (path.name, sig, b, name)
                    assert sm90[name].kind != "forward" or b == "1", (path.name, sig, b, name)
