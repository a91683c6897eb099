"""The fp8 forward's K/V loads (no GPU): `kernel._load_kv`'s own Python body, its TMA loads
recorded, against the transposed V the host writes (`host.transpose_v_fp8`).

Vᵀ is (kv heads · dv, batch · v_cols): sequence b's keys start at column b · v_cols (v_cols:
seqlen_k rounded up to 32). The loader gets a key block's row in the packed (batch ·
seqlen_k) rows of K and must find that block's Vᵀ columns from it; K is read by rows as in
the 16-bit build.
"""

from __future__ import annotations

import types

import pytest
from kernel_code import gluon_module

kernel = gluon_module("asymflash.backends.sm90.fwd.kernel", "_load_kv")


class _Bars:
    def index(self, i):
        return i


class _Desc(str):
    """A descriptor stand-in: its name, and the box bytes `expect` reads."""

    block_type = types.SimpleNamespace(nbytes=0)


def _run_load_kv(cfg, call, pos, row, kv_head):
    loads = []

    def tma_load(desc, coords, bar, dst, pred=True):
        loads.append((desc, list(coords)))

    def copy_rows(desc, row_, head, width, bar, dst, pred):
        loads.append((desc, [row_, head * width]))

    fn = kernel._load_kv.fn
    env = dict(fn.__globals__, tma_load=tma_load, copy_rows=copy_rows,
               mbarrier=types.SimpleNamespace(wait=lambda *a, **k: None,
                                              expect=lambda *a, **k: None))
    bufs = types.SimpleNamespace(k_empty=_Bars(), k_ready=_Bars(), v_empty=_Bars(),
                                 v_ready=_Bars(), k=_Bars(), v=_Bars())
    types.FunctionType(fn.__code__, env)(bufs, call, cfg, pos, row, kv_head)
    return loads


@pytest.mark.parametrize("seqlen_k,block_n", [(2048, 128), (1000, 128), (3001, 64), (17, 64)])
def test_fp8_v_columns_follow_the_sequence(seqlen_k, block_n):
    d, batch = 128, 3
    v_cols = -(-seqlen_k // 32) * 32
    cfg = types.SimpleNamespace(STAGES=2, PIECES=False, FP8=True, HEAD_DIM=d, HEAD_DIM_V=d,
                                BLOCK_N=block_n)
    call = types.SimpleNamespace(k_desc=_Desc("k"), v_desc=_Desc("v"), seqlen_k=seqlen_k,
                                 v_cols=v_cols)
    for b in range(batch):
        for n in range(-(-seqlen_k // block_n)):
            for kv_head in (0, 5):
                row = b * seqlen_k + n * block_n  # the loader's row of this key block
                loads = _run_load_kv(cfg, call, b + n, row, kv_head)
                assert loads == [("k", [row, kv_head * d]),
                                 ("v", [kv_head * d, b * v_cols + n * block_n])], loads


def test_16bit_v_rows_unchanged():
    cfg = types.SimpleNamespace(STAGES=2, PIECES=False, FP8=False, HEAD_DIM=128,
                                HEAD_DIM_V=128, BLOCK_N=128)
    call = types.SimpleNamespace(k_desc=_Desc("k"), v_desc=_Desc("v"), seqlen_k=1000,
                                 v_cols=0)
    assert _run_load_kv(cfg, call, 3, 1128, 2) == [("k", [1128, 256]), ("v", [1128, 256])]
