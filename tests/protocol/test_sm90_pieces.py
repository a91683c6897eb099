"""The column arithmetic of the sm90 kernels' 192-wide builds (no GPU).

At kernel head dim 192 (`common.forward_widths`: DeepSeek-V3's 192/128) the forward and
the backward (bwd_ws, bwd_wide) hold Q and K (and the backward dK, dQ) as a 128- and a 64-wide piece, and
read each head of q and k as three 64-column boxes (`common.load_pieces`; the backward
writes dQ back the same way). `load_pieces` runs here on stand-ins (its Python body, the
TMA loads recorded instead of issued) for both descriptor kinds, and the recorded boxes
are gathered from a packed tensor the way the TMA unit would; `piece_col` also places the
backward's dQ reduces. The GPU tests (test_sm90_gpu.py, test_sm90_bwd_gpu.py, the d192
cases) check the kernels themselves.
"""

from __future__ import annotations

import types

import pytest
import torch
from kernel_code import on_ints

from asymflash.backends.sm90 import common
from asymflash.backends.sm90.bwd import host as bwd
from asymflash.backends.sm90.fwd import host as fwd

if common.GLUON_ERROR is not None or not hasattr(common, "load_pieces"):
    pytest.skip("triton's Gluon (the kernels' source) is not importable here",
                allow_module_level=True)

PIECE = int(getattr(common.PIECE, "value", common.PIECE))
WIDTH = 192
LO = WIDTH - PIECE  # the low piece: two boxes; the high piece: one


def box(flat, row, rows, col, cols, dim_end):
    """The TMA box of a (rows, heads·WIDTH) tensor at (row, col): zero past the tensor's
    rows and, for a (rows, heads, dim) descriptor, past the head's dim (dim_end)."""
    out = torch.zeros(rows, cols, dtype=flat.dtype)
    r = flat[row:row + rows, col:min(col + cols, dim_end)]
    out[:r.shape[0], :r.shape[1]] = r
    return out


def test_pieces_and_hosts_agree_on_widths():
    assert common.piece_cols(WIDTH) == PIECE == common.PIECE_HI
    assert LO == 128  # wgmma's and TMA's power-of-two piece
    for d in (136, 160, 190, 192):
        assert fwd.forward_widths(d, 128) == bwd.backward_widths(d, 128) == (WIDTH, 128)


class _Smem:
    """A shared tile stand-in: `_reinterpret` to [2, ROWS, 64] gives the column halves of a
    [ROWS, 128] tile, `.index(i)` names them."""

    def __init__(self, name):
        self.name, self.layout = name, None

    def _reinterpret(self, dtype, shape, layout):
        if self.name == "lo":
            assert list(shape)[0] == 2 and list(shape)[2] == PIECE
            return types.SimpleNamespace(index=lambda i: _Smem(f"lo{i}"))
        return self  # a 3-D box's view of the same tile


class _Desc:
    def __init__(self, block_shape):
        self.block_shape, self.dtype, self.layout = block_shape, None, None
        n = 2
        for x in block_shape:
            n *= x
        self.block_type = types.SimpleNamespace(nbytes=n)


class _Log:
    def __init__(self):
        self.loads, self.expects = [], []

    def expect(self, bar, nbytes, pred=True):
        self.expects.append(nbytes)

    def tma_load(self, desc, coords, bar, dst, pred=True):
        self.loads.append((list(coords), dst.name))


def run_load_pieces(desc, row, head, rows):
    """`common.load_pieces` on stand-ins: [(coordinates, destination)] of its TMA loads and
    the bytes it expects."""
    log = _Log()
    body = types.FunctionType(common.load_pieces.fn.__code__,
                              dict(common.load_pieces.fn.__globals__,
                                   copy_pieces=_copy_pieces(log),
                                   mbarrier=types.SimpleNamespace(expect=log.expect),
                                   PIECE=PIECE))
    body(desc, _Smem("lo"), _Smem("hi"), None, row, head, rows, WIDTH, True)
    return log.loads, log.expects


def _copy_pieces(log):
    """`common.copy_pieces`'s body on stand-ins, its TMA loads recorded in `log`."""
    copy_env = dict(common.copy_piece.fn.__globals__, tma_load=log.tma_load,
                    heads_axis=lambda shape: len(shape) == 3,
                    piece_col=lambda h, c, w: on_ints(common.piece_col, h, c, w))
    copy = types.FunctionType(common.copy_piece.fn.__code__, copy_env)
    return types.FunctionType(common.copy_pieces.fn.__code__,
                              dict(common.copy_pieces.fn.__globals__, copy_piece=copy,
                                   PIECE=PIECE))


@pytest.mark.parametrize("heads,rows,box_rows", [(1, 64, 64), (3, 100, 64), (16, 300, 128)])
@pytest.mark.parametrize("d,heads_axis", [(192, False), (192, True), (160, True),
                                          (136, True)])
def test_three_boxes_gather_each_head(heads, rows, box_rows, d, heads_axis):
    """The boxes `load_pieces` issues hold exactly a head's columns: the low piece's two
    halves side by side (0-63, 64-127), the high piece 128-191; a (rows, heads, dim)
    descriptor's box zero-fills past dim (padded head dims)."""
    torch.manual_seed(heads * rows + d)
    q = torch.randn(rows, heads, d)
    if heads_axis:
        desc = _Desc([box_rows, 1, PIECE])
    else:
        assert d == WIDTH  # a (rows, heads·dim) descriptor only at the kernel's width
        desc = _Desc([box_rows, PIECE])
    for h in range(heads):
        for row in range(0, rows, box_rows):
            loads, expects = run_load_pieces(desc, row, h, box_rows)
            assert expects == [3 * box_rows * PIECE * 2]  # all three boxes on one barrier
            assert [dst for _, dst in loads] == ["lo0", "lo1", "hi"]
            tiles = {}
            for coords, dst in loads:
                if heads_axis:
                    r, head, col = coords
                    tiles[dst] = box(q[:, head], r, box_rows, col, PIECE, d)
                else:
                    r, col = coords
                    flat = q.reshape(rows, heads * WIDTH)
                    tiles[dst] = box(flat, r, box_rows, col, PIECE, flat.shape[1])
            lo = torch.cat([tiles["lo0"], tiles["lo1"]], dim=1)
            want = torch.zeros(box_rows, WIDTH)
            part = q[row:row + box_rows, h]
            want[:part.shape[0], :d] = part
            assert torch.equal(lo, want[:, :LO]) and torch.equal(tiles["hi"], want[:, LO:])


def test_dq_pieces_add_into_row_major_dq():
    """The three dQ reduces of a backward step (columns 0 and PIECE of the low piece's
    staging tile, the high piece's own tile at LO) add one row block of head h exactly
    once."""
    heads, rows = 4, 128
    acc = torch.zeros(rows, heads * WIDTH)
    want = torch.randn(rows, heads, WIDTH)
    for h in range(heads):
        for row in range(0, rows, 64):
            dq = want[row:row + 64, h]
            lo, hi = dq[:, :LO], dq[:, LO:]
            for tile, c in ((lo[:, :PIECE], 0), (lo[:, PIECE:], PIECE), (hi, LO)):
                col = on_ints(common.piece_col, h, c, WIDTH)
                acc[row:row + 64, col:col + PIECE] += tile
    assert torch.equal(acc, want.reshape(rows, heads * WIDTH))
