"""CPU check of the contiguous kernel's W4A8 MXFP4 converter (src/gemm/sm90/contiguous_w4.cuh,
e2m1_row_to_e4m3 as convert_atom calls it): for every code in every position of a prepared-layout
word and every scale offset's table, the E4M3 bytes of each row are those of the E2M1 values
times 2^-d, as the two-table lookup it replaced gave them. `prmt` is emulated (all selectors here
have bit 3 clear, where __byte_perm and prmt agree)."""
import pathlib
import random
import re

from test_decode_w4a8_layout import e2m1, e4m3, prmt

HEADER = pathlib.Path(__file__).resolve().parents[1] / "src/gemm/sm90/contiguous_w4.cuh"


def tables() -> list:
    """e2m1_to_e4m3's kTable: per offset d, the E4M3 codes of the eight magnitudes times 2^-d."""
    body = re.search(r"kTable\[16\]\[2\] = \{(.*?)\};", HEADER.read_text(), re.S).group(1)
    words = [int(w, 16) for w in re.findall(r"0x([0-9a-fA-F]+)u", body)]
    assert len(words) == 32
    return [(words[2 * d], words[2 * d + 1]) for d in range(16)]


def calls() -> list:
    """convert_atom's two calls: (spread, gather) for row g, then row g + 8."""
    found = re.findall(r"e2m1_row_to_e4m3\(x, xs, xm, pos8?, (0x[0-9A-F]+)u, (0x[0-9A-F]+)u\)", HEADER.read_text())
    assert len(found) == 2, found
    return [(int(a, 16), int(b, 16)) for a, b in found]


def row_to_e4m3(x: int, table: tuple, spread: int, gather: int) -> int:
    xs, xm = x >> 4, x & 0x77777777
    codes = prmt(x, xs, spread)
    magnitude = prmt(table[0], table[1], prmt(xm, 0, gather) & 0xFFFF)
    return magnitude | ((codes << 4) & 0x80808080)


def lookup8(x: int, pos: tuple, neg: tuple) -> tuple:
    """The two-table form: magnitudes from pos or neg by the code's sign bit."""
    index = x & 0x77777777
    pick = ((x >> 1) & 0x44444444) | 0x32103210
    lo = prmt(prmt(pos[0], pos[1], index), prmt(neg[0], neg[1], index), pick)
    hi = prmt(prmt(pos[0], pos[1], index >> 16), prmt(neg[0], neg[1], index >> 16), pick >> 16)
    return lo, hi


def test_the_converter_in_the_header_is_the_one_emulated():
    text = HEADER.read_text()
    for needle in ("const uint32_t codes = __byte_perm(x, xs, spread);",
                   "__byte_perm(table.x, table.y, __byte_perm(xm, 0u, gather));",
                   "return magnitude | ((codes << 4) & 0x80808080u);",
                   "const uint32_t xs = x >> 4, xm = x & 0x77777777u;"):
        assert needle in text, needle


def test_rows_are_the_two_table_lookups_and_the_values():
    rng = random.Random(0)
    (sg, gg), (s8, g8) = calls()
    words = [sum(((v + i) % 16) << (4 * i) for i in range(8)) for v in range(16)]  # each code at each position
    words += [rng.getrandbits(32) for _ in range(500)]
    tabs = tables()
    for d in range(16):
        pos = tabs[d]
        neg = (pos[0] | 0x80808080, pos[1] | 0x80808080)
        for x in words:
            e = lookup8(x, pos, neg)
            row, row8 = row_to_e4m3(x, pos, sg, gg), row_to_e4m3(x, pos, s8, g8)
            assert row == prmt(e[0], e[1], 0x5410), (d, hex(x))
            assert row8 == prmt(e[0], e[1], 0x7632), (d, hex(x))
            codes = [(x >> (4 * i)) & 15 for i in range(8)]
            got = [e4m3((row >> (8 * j)) & 0xFF) for j in range(4)] + [e4m3((row8 >> (8 * j)) & 0xFF) for j in range(4)]
            want = [e2m1(codes[i]) for i in (0, 1, 4, 5, 2, 3, 6, 7)]
            if d <= 8:  # exact up to 2^-8 (the table's own range, e2m1_to_e4m3)
                assert got == [v * 2.0 ** -d for v in want], (d, hex(x))
