"""dQ in the wgmma accumulator's order (sm90/dq_fragments.py): the layout is a bijection, and
the portable kernel that puts the rows back inverts what the backward's tiles hold.

The buffer is filled here from `fragment_bases` alone (the layout the Gluon kernel stores
with), so the conversion's own bit order is checked against it, not against itself. Runs
in the interpreter on CPU machines, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from asymflash.backends.sm90.bwd import dq_fragments as frag

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def coords(cols: int) -> torch.Tensor:
    """(64·cols, 2): the (row, column) that each offset of a tile holds, from the bases."""
    bases = torch.tensor(frag.fragment_bases(cols))
    offsets = torch.arange(64 * cols)
    bits = (offsets[:, None] >> torch.arange(len(bases))) & 1
    return bits @ bases


@pytest.mark.parametrize("cols", [32, 64, 128])
def test_fragment_layout_is_a_bijection(cols):
    rc = coords(cols)
    assert rc[:, 0].max() == 63 and rc[:, 1].max() == cols - 1
    assert len({(int(r), int(c)) for r, c in rc}) == 64 * cols


def test_two_warpgroup_tile_is_two_64_row_tiles():
    """bwd.py's 128-row dQ tile (d=64): its first 64·cols offsets are warpgroup 0's 64-row
    tile, the rest warpgroup 1's, in the same order, so one box covers two buffer blocks."""
    bases = torch.tensor(frag.fragment_bases(64, 128))
    offsets = torch.arange(128 * 64)
    rc = ((offsets[:, None] >> torch.arange(len(bases))) & 1) @ bases
    assert torch.equal(rc[:4096], coords(64))
    assert torch.equal(rc[4096:], coords(64) + torch.tensor([64, 0]))


def test_sequences_never_share_a_block():
    """Even a 128-row step's two blocks past a sequence's end stay clear of the next one."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        lens = (torch.randint(1, 400, (int(torch.randint(1, 6, (1,), generator=gen)),),
                              generator=gen)).tolist()
        starts = [sum(lens[:b]) for b in range(len(lens))]
        last = -1
        for b, (start, n) in enumerate(zip(starts, lens)):
            first = start // 64 + 2 * b
            assert first > last, (lens, b)
            last = first + 2 * -(-n // 128) - 1  # the highest block a 128-row step reaches
        assert last < frag.num_blocks(sum(lens), len(lens))


def fill_fragments(dq_true, lens, cols, width):
    """The buffer the backward would leave for dQ = dq_true (rows past a sequence's end hold
    noise the conversion must not read)."""
    total_q, heads, _ = dq_true.shape
    batch = len(lens)
    buf = frag.fragment_buffer(total_q, batch, heads, width, torch.device("cpu"))
    buf.normal_()  # tiles of nobody's rows: noise, never read
    acc = frag.tiles_view(buf)  # the kernel's view: (rows, heads, 32)
    rc = coords(cols)
    starts = [sum(lens[:b]) for b in range(batch)]
    for b, (start, n) in enumerate(zip(starts, lens)):
        for block in range(-(-n // 64)):
            g = start // 64 + 2 * b + block
            rows = block * 64 + rc[:, 0]
            live = rows < n
            for part in range(width // cols):
                acc_rows = (g * (width // cols) + part) * 2 * cols + torch.arange(64 * cols) // 32
                lane = torch.arange(64 * cols) % 32
                vals = torch.randn(64 * cols, heads)  # past the end: noise
                vals[live] = dq_true[start + rows[live], :, part * cols + rc[live, 1]]
                acc[acc_rows, :, lane] = vals
    return buf


@pytest.mark.parametrize("lens,heads,d,width,cols", [
    ([203], 2, 128, 128, 64),              # d=128: two column parts per block
    ([1, 17, 113, 203], 3, 128, 128, 64),  # varlen, odd lengths
    ([64, 128], 2, 96, 128, 64),           # d=96 runs at width 128: columns cut
    ([17, 203], 2, 64, 64, 64),            # 128-row steps: one 64-column part per block
    ([113, 1], 2, 64, 64, 32),             # d=64 with 64-row steps: 32-column parts
    ([203, 17], 2, 256, 256, 128),         # d=256: two 128-column halves per block
    ([70], 1, 192, 256, 128),              # d=192 runs at width 256: the second half cut
])
def test_dq_from_fragments_restores_rows(lens, heads, d, width, cols):
    torch.manual_seed(0)
    total_q = sum(lens)
    dq_true = torch.randn(total_q, heads, width)
    acc = fill_fragments(dq_true, lens, cols, width).to(DEVICE)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        dq = frag.dq_from_fragments(acc, cu, max(lens), total_q, heads, d, width, cols, dtype)
        assert dq.shape == (total_q, heads, d) and dq.dtype == dtype
        # fp32 exact; bf16 within one unit in the last place (the interpreter's conversion
        # truncates where the GPU rounds to nearest)
        torch.testing.assert_close(dq.float().cpu(), dq_true[..., :d].to(dtype).float(),
                                   rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
