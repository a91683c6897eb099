"""bwd_ws's 192-wide build on stand-ins (no GPU): which boxes a ring slot loads and which dQ
pieces each warpgroup adds.

At kernel head dim 192 the warp-specialised backward holds Q, K and dK as a 128- and a
64-wide piece (`ws_roles.pieces`). Its load warp fills a ring slot with Q's three 64-column
boxes and dO on one `expect` (`parts.load_qdo_pieces`), and its warpgroups add dQ = dS·K
as 64-column pieces (`ws_roles._dq_pieces`): warpgroup 0 columns 0-127, warpgroup 1
columns 128-191. The functions' Python bodies run here with their TMA loads and MMAs
recorded; the GPU tests (test_sm90_bwd_gpu.py, the d192 cases) check the kernel itself.
"""

from __future__ import annotations

import types

import pytest
import torch
from kernel_code import gluon_module

parts = pytest.importorskip("asymflash.backends.sm90.bwd.parts")
ws_roles = gluon_module("asymflash.backends.sm90.bwd.ws_roles", "_dq_pieces")

PIECE = int(getattr(parts.PIECE, "value", parts.PIECE))
WIDTH = 192


def _body(jit_fn, **names):
    """`jit_fn`'s Python body with `names` replacing its globals."""
    fn = jit_fn.fn
    return types.FunctionType(fn.__code__, dict(fn.__globals__, **names), fn.__name__,
                              fn.__defaults__)


class _Tile:
    """A shared tile stand-in: slices, ring slots and column halves by name."""

    def __init__(self, name):
        self.name, self.layout = name, None

    def index(self, i):
        return _Tile(f"{self.name}[{i}]")

    def slice(self, start, size, dim=0):
        return _Tile(f"{self.name}[{'cols' if dim else 'rows'} {start}:{start + size}]")

    def _reinterpret(self, dtype, shape, layout):  # a [ROWS, 128] tile's two column halves
        assert list(shape)[0] == 2 and list(shape)[2] == PIECE
        return types.SimpleNamespace(index=lambda i: _Tile(f"{self.name}.half{i}"))


def test_ring_slot_takes_q_pieces_and_do_on_one_expect():
    """A ring slot: Q's boxes at columns 0, 64, 128 of head h into the slot's two low
    halves and its high piece, dO whole, all on the slot's one `expect` (the ready barrier
    counts that arrive and the statistics' one only)."""
    loads, expects = [], []

    def copy_piece(desc, row, head, col, width, bar, dst, pred):
        loads.append((bar, row, head * width + col, dst.name))

    def copy_rows(desc, row, head, width, bar, dst, pred):
        loads.append((bar, row, head * width, dst.name))

    copy_pieces = _body(parts.copy_pieces, copy_piece=copy_piece, PIECE=PIECE)
    body = _body(parts.load_qdo_pieces, copy_pieces=copy_pieces, copy_rows=copy_rows,
                 mbarrier=types.SimpleNamespace(
                     expect=lambda bar, nbytes, pred=True: expects.append((bar, nbytes))))
    q_desc = types.SimpleNamespace(dtype=None, block_type=types.SimpleNamespace(
        nbytes=64 * PIECE * 2))
    do_desc = types.SimpleNamespace(block_type=types.SimpleNamespace(nbytes=64 * 128 * 2))
    ready = types.SimpleNamespace(index=lambda slot: f"ready[{slot}]")
    h, row = 5, 320
    body(q_desc, do_desc, _Tile("q"), _Tile("q_hi"), _Tile("do"), ready, 1, h, row, 64, WIDTH,
         128, True)
    assert expects == [("ready[1]", 3 * 64 * PIECE * 2 + 64 * 128 * 2)]
    assert loads == [("ready[1]", row, h * WIDTH, "q[1].half0"),
                     ("ready[1]", row, h * WIDTH + PIECE, "q[1].half1"),
                     ("ready[1]", row, h * WIDTH + 2 * PIECE, "q_hi[1]"),
                     ("ready[1]", row, h * 128, "do[1]")]


@pytest.mark.parametrize("h", [0, 3])
def test_dq_pieces_cover_the_head_once(h):
    """Both warpgroups' dQ pieces of one step: every column of head h's row block added
    exactly once, each piece from the K columns it multiplies; each warpgroup releases the
    dSᵀ slot once, after its last piece (ds_free counts one arrive per warpgroup)."""
    torch.manual_seed(h)
    ds = torch.randn(64, 128)  # dS of one step: 64 query rows x the block's 128 keys
    k = torch.randn(128, WIDTH)
    columns = {"k[cols 0:64]": k[:, :PIECE], "k[cols 64:128]": k[:, PIECE:2 * PIECE],
               "k_hi": k[:, 2 * PIECE:]}
    dq = torch.zeros(64, 4 * WIDTH)
    releases = []
    row = 640
    for wg in (0, 1):
        pieces = []

        def dq_piece(smem, dq_buf, dq_desc, js, k_piece, row_, col, scale, dq_zero, last):
            pieces.append((k_piece.name, row_, col, last))

        body = _body(ws_roles._dq_pieces, _dq_piece=dq_piece, PIECE=PIECE)
        smem = types.SimpleNamespace(k=_Tile("k"), k_hi=_Tile("k_hi"))
        body(smem, None, None, 1, row, h * WIDTH, 1.0, None, wg)
        assert [p[3] for p in pieces][-1] and not any(p[3] for p in pieces[:-1]), pieces
        releases.append(sum(p[3] for p in pieces))
        for name, row_, col, _ in pieces:
            assert row_ == row
            dq[:, col:col + PIECE] += ds @ columns[name]
        assert len(pieces) == (2 if wg == 0 else 1)  # warpgroup 0: columns 0-127
    assert releases == [1, 1]
    want = torch.zeros(64, 4 * WIDTH)
    want[:, h * WIDTH:(h + 1) * WIDTH] = ds @ k
    assert torch.equal(dq, want)
