"""CPU checks of quant4's fragment layout: a round trip, the MMA fragment each lane's word holds,
and a 64-row block's K step in one 4 KB piece."""
import pytest
import torch

from moe_kernels import quant4


def _weights(E, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("E,N,K", [(1, 16, 128), (2, 64, 256), (3, 48, 384)])
def test_round_trip(E, N, K, shuffle):
    w = _weights(E, N, K)
    tiled = quant4.to_fragment_layout(w, shuffle)
    assert tiled.shape == (E, K // 128, N // 16, 1024)
    assert torch.equal(quant4.from_fragment_layout(tiled, shuffle), w)


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_word_is_a_fragment(shuffle):
    E, N, K = 2, 32, 256
    w = _weights(E, N, K, seed=1)
    codes = quant4.unpack_nibbles(w)  # [E, N, K]
    tiled = quant4.to_fragment_layout(w, shuffle)
    lo, hi = ((0, 1, 2, 3), (4, 5, 6, 7)) if shuffle else ((0, 2, 4, 6), (1, 3, 5, 7))
    for e in range(E):
        for s in range(K // 128):
            for a in range(N // 16):
                atom = tiled[e, s, a]
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for j in range(8):
                        word = atom[32 * lane + 4 * j: 32 * lane + 4 * j + 4]
                        nib = quant4.unpack_nibbles(word)  # nibbles 0..7 of the 32-bit word
                        k0 = 128 * s + 16 * j
                        for i, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):  # a0..a3
                            row = 16 * a + g + dr
                            assert nib[lo[i]] == codes[e, row, k0 + 2 * t + dk]      # the register's low half
                            assert nib[hi[i]] == codes[e, row, k0 + 2 * t + dk + 1]  # its high half


def test_a_decode_blocks_k_step_is_one_piece():
    E, N, K = 1, 128, 384
    w = _weights(E, N, K, seed=2)
    codes = quant4.unpack_nibbles(w)
    flat = quant4.to_fragment_layout(w).reshape(E, -1)
    for b in range(N // 64):
        for s in range(K // 128):
            start = 1024 * (4 * b + (N // 16) * s)
            piece = quant4.unpack_nibbles(flat[0, start:start + 4096])
            want = codes[0, 64 * b:64 * b + 64, 128 * s:128 * s + 128]
            assert torch.equal(piece.sort().values, want.flatten().sort().values)
            assert piece.numel() == want.numel()


def test_refuses_shapes_off_the_atom():
    with pytest.raises(ValueError, match="multiples of 16 and 128"):
        quant4.to_fragment_layout(_weights(1, 24, 128))
    with pytest.raises(ValueError, match="multiples of 16 and 128"):
        quant4.to_fragment_layout(_weights(1, 16, 192))


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) as the bf16 values they are, in float32 (a bf16 is a float32's top half)."""
    b = (bits << 16).to(torch.int64)
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def _fp16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) as the fp16 values they are, in float32."""
    return torch.where(bits >= 2 ** 15, bits - 2 ** 16, bits).to(torch.int16).view(torch.float16).float()


def _placed_registers(x: torch.Tensor, fp16: bool = False) -> list:
    """decode_w4::fragment<T, E2M1Placed> emulated on 32-bit words (int64 0 .. 2^32 - 1): the
    four registers, as src/gemm/decode_w4a16.cuh computes them (bf16, or fp16)."""
    m = 0xFFFFFFFF
    rotl10 = ((x << 10) | (x >> 22)) & m
    regs = [x & 0x81C081C0, (x << 4) & 0x81C081C0, rotl10 & 0x81C081C0,
            ((x << 6) & 0x80C080C0) | ((x >> 2) & 0x01000100)]
    return [(((r << 3) & m) | r) & 0x8E008E00 for r in regs] if fp16 else regs


def test_placed_bits_use_each_bit_of_a_word_once():
    bits = sorted(b for reg in quant4.PLACED_BITS for el in reg for b in el)
    assert bits == list(range(32))


@pytest.mark.parametrize("E,N,K", [(1, 16, 128), (2, 48, 384)])
def test_placed_round_trip(E, N, K):
    w = _weights(E, N, K, seed=3)
    prepared = quant4.prepare_packed(w, quant4.PLACED)
    assert prepared.shape == quant4.prepared_shape(E, N, K)
    assert not torch.equal(prepared, quant4.prepare_packed(w, "mxfp4"))
    assert torch.equal(quant4.unplace_e2m1(prepared), quant4.prepare_packed(w, "mxfp4"))
    assert torch.equal(quant4.unprepare(prepared, K, quant4.PLACED), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_placed_conversion_gives_each_register_its_values_exactly(dtype):
    # Every code in every position: 16 codes x 8 nibbles, plus random words; the kernel's mask
    # and shift conversion of the placed word, times 2^126, is the fragment word's E2M1 values.
    g = torch.Generator().manual_seed(4)
    words = [torch.randint(0, 2 ** 32, (4096,), dtype=torch.int64, generator=g)]
    for code in range(16):
        words.append(torch.tensor([sum(code << (4 * p) for p in range(8))], dtype=torch.int64))
    x = torch.cat(words)
    as_bytes = torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32).view(torch.uint8)
    placed = quant4.place_e2m1(as_bytes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lut = torch.tensor(quant4.E2M1_VALUES + tuple(-v for v in quant4.E2M1_VALUES))
    as_float = _fp16 if dtype == torch.float16 else _bf16
    for r, reg in enumerate(_placed_registers(placed, fp16=dtype == torch.float16)):
        for e in range(2):
            got = as_float((reg >> (16 * e)) & 0xFFFF).double() * 2.0 ** quant4.PLACED_FOLD[dtype]
            want = lut[(x >> (4 * (2 * r + e))) & 15].double()
            assert torch.equal(got, want), (r, e)


def test_placed_scales_fold_and_refuse_what_the_dtype_cannot_hold():
    e = torch.tensor([[[0, 120, 127, 128]]], dtype=torch.uint8)  # [E, N, K/32]
    s = quant4.mxfp4_scales(e, torch.bfloat16, placed=True)
    assert torch.equal(s.float().flatten(), torch.tensor([2.0 ** -1, 2.0 ** 119, 2.0 ** 126, 2.0 ** 127]))
    e16 = torch.tensor([[[89, 120, 128]]], dtype=torch.uint8)
    s16 = quant4.mxfp4_scales(e16, torch.float16, placed=True)
    assert torch.equal(s16.float().flatten(), torch.tensor([2.0 ** -24, 2.0 ** 7, 2.0 ** 15]))
    with pytest.raises(ValueError, match="w13_scale: got E8M0 exponents 2\\^2 .. 2\\^2, expected at most 2\\^1"):
        quant4.mxfp4_scales(torch.tensor([[[129]]], dtype=torch.uint8), torch.bfloat16, "w13_scale", placed=True)
    with pytest.raises(ValueError, match="expected 2\\^-38 .. 2\\^1 for float16"):
        quant4.mxfp4_scales(torch.tensor([[[88]]], dtype=torch.uint8), torch.float16, placed=True)
