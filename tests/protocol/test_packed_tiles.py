"""The forward's plain grid over packed sequences (no GPU): `sched.packed_tile`'s own Python
body on numpy stand-ins for the Gluon calls it makes.

The grid `host.packed_grid` sizes (hq · (total_q // 128 + batch) CTAs) must give every
(sequence, q head, 128-row query block) that holds rows exactly one CTA, and every other CTA
a query block past its sequence's end (the kernel skips those). The search runs from
cu_seqlens_q alone, in two levels over SEARCH_SPAN sequences at once: batches below, at and
far above that span, empty sequences, and packed rows that start past row 0.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from kernel_code import gluon_module

sched = gluon_module("asymflash.backends.sm90.sched", "packed_tile")

SPAN = int(getattr(sched.SEARCH_SPAN, "value", sched.SEARCH_SPAN))
BLOCK_M = 128


class _Vec(np.ndarray):
    """A tile of integers or booleans with the `.to(dtype)` Gluon tensors have."""

    def to(self, dtype):
        return np.asarray(self).astype(np.int64).view(_Vec)


class _Ptr:
    """A pointer into an int32 tensor: `ptr + offsets` and `gl.load(ptr, mask, other)`."""

    def __init__(self, data, offset=0):
        self.data, self.offset = data, offset

    def __add__(self, offset):
        return _Ptr(self.data, self.offset + offset)


def _load(ptr, mask=None, other=0):
    at = np.asarray(ptr.offset)
    if mask is None:
        assert np.all((0 <= at) & (at < len(ptr.data))), at
        return int(ptr.data[at]) if at.ndim == 0 else ptr.data[at].view(_Vec)
    safe = np.where(mask, at, 0)
    assert np.all((0 <= safe) & (safe < len(ptr.data))), "a masked-in load out of bounds"
    return np.where(mask, ptr.data[safe], other).view(_Vec)


def _scalar(x):
    return int(x) if np.ndim(x) == 0 else np.asarray(x).view(_Vec)


GL = types.SimpleNamespace(
    constexpr=lambda x: x, int32=np.int32,
    BlockedLayout=lambda *a, **k: None, num_warps=lambda: 4,
    arange=lambda lo, hi, layout=None: np.arange(lo, hi).view(_Vec),
    load=_load, sum=lambda x, axis: int(np.sum(x)),
    maximum=lambda a, b: _scalar(np.maximum(a, b)),
    minimum=lambda a, b: _scalar(np.minimum(a, b)),
    where=lambda c, a, b: _scalar(np.where(c, a, b)))


def _packed_tile():
    fn = sched.packed_tile.fn
    return types.FunctionType(fn.__code__, dict(fn.__globals__, gl=GL, SEARCH_SPAN=SPAN))


def _lengths(rng, batch):
    """Skewed document lengths (many short, a few long), some empty."""
    lens = np.minimum(rng.pareto(1.2, batch) * 200, 5000).astype(np.int64)
    lens[rng.random(batch) < 0.1] = 0
    return lens


@pytest.mark.parametrize("batch,hq,start", [(1, 1, 0), (2, 3, 0), (17, 4, 7), (113, 2, 300),
                                            (SPAN - 1, 2, 0), (SPAN + 1, 1, 64),
                                            (203, 3, 0), (3 * SPAN + 5, 1, 129)])
def test_every_query_block_gets_one_tile(batch, hq, start):
    rng = np.random.default_rng(batch * 7 + hq)
    lens = _lengths(rng, batch)
    cu = np.concatenate([[start], start + np.cumsum(lens)]).astype(np.int32)
    total_q = int(cu[-1]) + int(rng.integers(0, 50))  # rows past the last sequence too
    grid = hq * (total_q // BLOCK_M + batch)  # host.packed_grid
    tile_of = _packed_tile()
    seen = {}
    for t in range(grid):
        m_blk, head, b = tile_of(t, hq, batch, _Ptr(cu), BLOCK_M)
        assert 0 <= b < batch and 0 <= head < hq, (t, m_blk, head, b)
        if m_blk * BLOCK_M < lens[b]:  # a live tile: the kernel runs it
            key = (int(b), int(head), int(m_blk))
            assert key not in seen, (t, key, seen[key])
            seen[key] = t
    want = {(b, h, m) for b in range(batch) for h in range(hq)
            for m in range(-(-int(lens[b]) // BLOCK_M))}
    assert set(seen) == want
