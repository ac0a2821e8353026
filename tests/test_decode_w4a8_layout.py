"""CPU checks of SM90's W4A8 decode kernel (src/gemm/sm90/decode_w4a8_wgmma.cuh): its 4-bit ->
E4M3 conversions, with the tables and selectors read from the header and `prmt` emulated, are
exact for every value; and one K step of weights in the prepared layout (quant4.prepare_packed)
with tokens written permuted as src/vec.cuh's store_fp8x8_permuted writes them, read as the
kernel reads them (its 32-byte pieces, its row selectors, the tokens' 16-byte copies, the wgmma A
fragment), multiplies to the plain dot products."""
import pathlib
import random
import re

import pytest
import torch

from moe_kernels import quant4

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "src/gemm/sm90/decode_w4a8_wgmma.cuh"
MASK = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): output byte j is byte (sel >> 4j) & 7 of b:a, sign-replicated
    where bit 3 of that selector nibble is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for j in range(4):
        s = (sel >> (4 * j)) & 0xF
        v = src[s & 7]
        if s & 8:
            v = 0xFF if v & 0x80 else 0
        out |= v << (8 * j)
    return out


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))


def e2m1(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * (0, 0.5, 1, 1.5, 2, 3, 4, 6)[nibble & 7]


def int4(nibble: int) -> int:
    return nibble - 16 if nibble >= 8 else nibble


def header_constant(name: str) -> int:
    m = re.search(rf"\b{name} = (0x[0-9A-Fa-f]+)u", HEADER.read_text())
    assert m, f"{name} not found in {HEADER.name}"
    return int(m.group(1), 16)


def int4_to_e4m3(x: int) -> tuple:
    p0, p1, n0, n1 = (header_constant(n) for n in ("kP0", "kP1", "kN0", "kN1"))
    index = x & 0x77777777
    pick = ((x >> 1) & 0x44444444) | 0x32103210
    lo = prmt(prmt(p0, p1, index), prmt(n0, n1, index), pick)
    hi = prmt(prmt(p0, p1, index >> 16), prmt(n0, n1, index >> 16), pick >> 16)
    return lo, hi


def e2m1_to_e4m3(x: int) -> tuple:
    def place(y):  # the header's lop3 0xEA: (y << 2 & 0x1C1C1C1C) | (y << 4 & 0x80808080)
        return ((y << 2) & MASK & 0x1C1C1C1C) | ((y << 4) & MASK & 0x80808080)
    xs = x >> 4
    return place(prmt(x, xs, 0x5140)), place(prmt(x, xs, 0x7362))


def values(lo: int, hi: int) -> list:
    return [e4m3((lo >> (8 * j)) & 0xFF) for j in range(4)] + [e4m3((hi >> (8 * j)) & 0xFF) for j in range(4)]


def test_the_selectors_in_the_header_are_the_ones_checked():
    text = HEADER.read_text()
    for needle in ("prmt(x, xs, 0x5140u)", "prmt(x, xs, 0x7362u)", "0x1C1C1C1Cu", "(y << 4) & 0x80808080u",
                   "0xEA", "x & 0x77777777u", "((x >> 1) & 0x44444444u) | 0x32103210u"):
        assert needle in text, needle


def test_conversions_are_exact_for_every_value_in_every_position():
    rng = random.Random(0)
    words = [sum(((v + i) % 16) << (4 * i) for i in range(8)) for v in range(16)]  # each value at each position
    words += [rng.getrandbits(32) for _ in range(4000)]
    for x in words:
        nibbles = [(x >> (4 * i)) & 15 for i in range(8)]
        assert values(*int4_to_e4m3(x)) == [float(int4(n)) for n in nibbles], hex(x)
        assert [v * 64 for v in values(*e2m1_to_e4m3(x))] == [e2m1(n) for n in nibbles], hex(x)


def permuted_slot(j: int) -> int:
    """store_fp8x8_permuted: where column j of a row lands (the pair 2t, 2t + 1 of an aligned eight
    at bytes 16b + 2u + 4t of its 32-column block)."""
    b, u, t, e = (j >> 4) & 1, (j >> 3) & 1, (j >> 1) & 3, j & 1
    return (j & ~31) + 16 * b + 2 * u + 4 * t + e


def test_the_token_permutation_in_vec_is_the_one_checked():
    text = (ROOT / "src/vec.cuh").read_text()
    assert "row + (j & ~int64_t(31)) + 16 * ((j >> 4) & 1) + 2 * ((j >> 3) & 1)" in text
    assert "dst + 4 * t) = pairs[t]" in text
    assert sorted(permuted_slot(j) for j in range(64)) == list(range(64))


def row_selectors(fmt: str) -> tuple:
    m = re.search(r"E2M1>\) \{\s*row = prmt\(lo, hi, (0x[0-9A-F]+)u\);\s*row8 = prmt\(lo, hi, (0x[0-9A-F]+)u\);"
                  r"\s*\} else \{\s*row = prmt\(lo, hi, (0x[0-9A-F]+)u\);\s*row8 = prmt\(lo, hi, (0x[0-9A-F]+)u\);",
                  HEADER.read_text())
    assert m, "rows_of's selectors not found"
    sel = [int(g, 16) for g in m.groups()]
    return (sel[0], sel[1]) if fmt == "mxfp4" else (sel[2], sel[3])


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_one_step_of_the_layout_gives_the_plain_dot_products(fmt):
    """64 weight rows x 16 tokens, one K step of 128 values, addresses as the kernel computes them."""
    rng = random.Random(1)
    kN = 16
    W = [[rng.randrange(16) for _ in range(128)] for _ in range(64)]  # 4-bit codes
    X = [[rng.randrange(-5, 6) for _ in range(128)] for _ in range(kN)]
    packed = quant4.pack_nibbles(torch.tensor(W, dtype=torch.uint8)[None])
    weights = quant4.prepare_packed(packed, fmt)[0, 0].reshape(-1).tolist()  # K step 0 of rows 0-63: 4 KB
    assert len(weights) == 4096
    row = [[0] * 128 for _ in range(kN)]  # the tokens as the quantizing step writes them
    for m in range(kN):
        for j in range(128):
            row[m][permuted_slot(j)] = X[m][j]
    tokens = [None] * (kN * 128)
    for m in range(kN):  # copy_step: 16-byte k block c of token m
        for c in range(8):
            dst = c * (kN // 8) * 128 + (m >> 3) * 128 + (m & 7) * 16
            tokens[dst:dst + 16] = row[m][16 * c:16 * c + 16]

    def b(c, k, m):  # wgmma c's B operand, K-major without swizzle: LBO = kN / 8 * 128, SBO = 128
        return tokens[(2 * c + k // 16) * (kN // 8) * 128 + (m >> 3) * 128 + (m & 7) * 16 + k % 16]

    convert = e2m1_to_e4m3 if fmt == "mxfp4" else int4_to_e4m3
    value = e2m1 if fmt == "mxfp4" else int4
    sel_row, sel_row8 = row_selectors(fmt)
    acc = [[0.0] * kN for _ in range(64)]
    for tid in range(128):
        lane, r, q = tid & 31, (tid & 31) >> 2, tid & 3
        row0 = 16 * (tid >> 5) + r
        piece = weights[32 * tid:32 * tid + 32]
        a = {}
        for c in range(4):
            for h in range(2):
                word = sum(piece[4 * (2 * c + h) + i] << (8 * i) for i in range(4))
                lo, hi = convert(word)
                a[c, 2 * h], a[c, 2 * h + 1] = prmt(lo, hi, sel_row), prmt(lo, hi, sel_row8)
        # The A fragment of wgmma m64nNk32 (mma.sync m16n8k32's per warp): a0 row r, k 4q..;
        # a1 row r + 8, k 4q..; a2 row r, k 16 + 4q..; a3 row r + 8, k 16 + 4q..
        for c in range(4):
            for reg, (dr, k0) in enumerate(((0, 4 * q), (8, 4 * q), (0, 16 + 4 * q), (8, 16 + 4 * q))):
                for j in range(4):
                    v = e4m3((a[c, reg] >> (8 * j)) & 0xFF) * (64 if fmt == "mxfp4" else 1)
                    for m in range(kN):
                        acc[row0 + dr][m] += v * b(c, k0 + j, m)
    for n in range(64):
        for m in range(kN):
            assert acc[n][m] == sum(value(W[n][k]) * X[m][k] for k in range(128)), (n, m)
