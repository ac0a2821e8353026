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
