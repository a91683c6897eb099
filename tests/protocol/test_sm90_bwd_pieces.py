"""The column arithmetic of the sm90 backward's 192-wide build (no GPU).

At kernel head dim 192 (`host.backward_widths`: DeepSeek-V3's 192/128) `attn_bwd_wide`
holds K, Q, dK and dQ as a 128- and a 64-wide piece, and reads and writes each head as
three 64-column boxes (`parts.load_pieces`, `parts.load_kv_pieces`, the dQ reduces). The
boxes' columns come from `parts.piece_col`, called here on plain integers
(`kernel_code.on_ints`) to gather a packed tensor the way the TMA unit would and to add
dQ pieces back the way the reduces do. The GPU tests (test_sm90_bwd_gpu.py, the d192
cases) check the kernel itself.
"""

from __future__ import annotations

import pytest
import torch
from kernel_code import on_ints

from asymflash.backends.sm90.bwd import host

parts = pytest.importorskip("asymflash.backends.sm90.bwd.parts")
if not hasattr(parts, "piece_col"):
    pytest.skip("triton's Gluon (the kernels' source) is not importable here",
                allow_module_level=True)

PIECE = int(getattr(parts.PIECE, "value", parts.PIECE))
WIDTH = 192
LO = WIDTH - PIECE  # the low piece: two boxes; the high piece: one


def box(flat, row, rows, col, cols, dim_end):
    """The TMA box of a (rows, heads·WIDTH) tensor at (row, col): zero past the tensor's
    rows and, for a (rows, heads, dim) descriptor, past the head's dim (dim_end)."""
    out = torch.zeros(rows, cols, dtype=flat.dtype)
    r = flat[row:row + rows, col:min(col + cols, dim_end)]
    out[:r.shape[0], :r.shape[1]] = r
    return out


def test_pieces_and_host_agree_on_widths():
    assert host.piece_cols(WIDTH) == PIECE == host.PIECE_HI
    assert host.backward_widths(WIDTH, 128) == (WIDTH, 128)
    assert LO == 128  # wgmma's and TMA's power-of-two piece


@pytest.mark.parametrize("heads,rows", [(1, 64), (3, 100), (16, 130)])
def test_three_boxes_gather_each_head(heads, rows):
    """The boxes of `load_pieces` (columns 0, PIECE, 2·PIECE of head h) hold exactly that
    head's columns, the low piece's two boxes side by side."""
    q = torch.randn(rows, heads, WIDTH)
    flat = q.reshape(rows, heads * WIDTH)
    for h in range(heads):
        for row in range(0, rows, 64):
            cols = [on_ints(parts.piece_col, h, c, WIDTH) for c in (0, PIECE, 2 * PIECE)]
            assert cols == [h * WIDTH, h * WIDTH + PIECE, h * WIDTH + 2 * PIECE]
            got = [box(flat, row, 64, c, PIECE, flat.shape[1]) for c in cols]
            lo, hi = torch.cat(got[:2], dim=1), got[2]
            want = q[row:row + 64, h]
            assert torch.equal(lo[:want.shape[0]], want[:, :LO])
            assert torch.equal(hi[:want.shape[0]], want[:, LO:])


def test_padded_head_dims_zero_fill_the_high_piece():
    """d in (128, 192) through (rows, heads, dim) boxes: the third box is zero past d."""
    d, heads = 160, 2
    q = torch.randn(64, heads, d)
    for h in range(heads):
        per_head = q[:, h]  # a (rows, heads, dim) box reads one head, columns [col, +64)
        hi = box(per_head, 0, 64, 2 * PIECE, PIECE, d)
        assert torch.equal(hi[:, :d - LO], per_head[:, LO:]) and not hi[:, d - LO:].any()


def test_dq_pieces_add_into_row_major_dq():
    """The three dQ reduces of a step (columns 0 and PIECE of the low piece's staging tile,
    the high piece's own tile at LO) add one row block of head h exactly once."""
    heads, rows = 4, 128
    acc = torch.zeros(rows, heads * WIDTH)
    want = torch.randn(rows, heads, WIDTH)
    for h in range(heads):
        for row in range(0, rows, 64):
            dq = want[row:row + 64, h]
            lo, hi = dq[:, :LO], dq[:, LO:]
            for tile, c in ((lo[:, :PIECE], 0), (lo[:, PIECE:], PIECE), (hi, LO)):
                col = on_ints(parts.piece_col, h, c, WIDTH)
                acc[row:row + 64, col:col + PIECE] += tile
    assert torch.equal(acc, want.reshape(rows, heads * WIDTH))
