"""The sm90 kernels' mask bounds (`backends/sm90/bounds.py`, Gluon) against `core/masks.py`.

The device functions themselves run here, on the CPU (`tests/kernel_code.py`): their Python
bodies are called with `gl` replaced by scalar stand-ins (min/max) and integers whose `//`
truncates toward zero as the GPU's does, so what is checked is the kernels' own arithmetic,
not a transcription.
"""

from __future__ import annotations

import itertools

import pytest
from kernel_code import I32 as _I32
from kernel_code import python_body as _on_cpu

from asymflash.backends.sm90 import bounds
from asymflash.core import masks
from asymflash.core.params import MaskSpec

pytestmark = pytest.mark.skipif(bounds.GLUON_ERROR is not None, reason=str(bounds.GLUON_ERROR))


key_blocks = _on_cpu(bounds.key_blocks) if bounds.GLUON_ERROR is None else None
query_range = _on_cpu(bounds.query_range) if bounds.GLUON_ERROR is None else None
mask_edges = _on_cpu(bounds.mask_edges) if bounds.GLUON_ERROR is None else None
step_needs_mask = _on_cpu(bounds.step_needs_mask) if bounds.GLUON_ERROR is None else None

LENGTHS = [(1, 1), (1, 300), (64, 64), (100, 37), (37, 100), (128, 500), (500, 128),
           (255, 257), (1000, 1000)]
WINDOWS = [(-1, -1), (-1, 0), (-1, 5), (0, 0), (10, 0), (100, -1), (3, 70), (200, 200)]


def _cases(blocks_m, blocks_n):
    for (sq, sk), (wl, wr), bm, bn in itertools.product(LENGTHS, WINDOWS, blocks_m, blocks_n):
        yield sq, sk, MaskSpec(wl, wr), bm, bn


def test_forward_key_blocks_cover_the_mask_and_skip_it_only_where_full():
    for sq, sk, mask, bm, bn in _cases((64, 128, 192), (64, 128)):
        wl, wr = mask.window_left, mask.window_right
        for m0 in range(0, sq, bm):
            rows = (m0, min(m0 + bm, sq))
            n_lo, n_a, n_b, n_hi = key_blocks(_I32(m0), _I32(sq), _I32(sk), _I32(wl), _I32(wr),
                                              wl >= 0, wr >= 0, bn, bm)
            k_lo, k_hi = masks.key_range(*rows, sq, sk, mask)
            k_lo, k_hi = max(k_lo, 0), min(k_hi, sk)
            case = (sq, sk, mask, bm, bn, m0)
            assert n_lo <= n_a <= n_b <= n_hi and n_hi >= n_lo + 1, case
            if k_lo < k_hi:  # every key a row of the tile sees is visited, no block more
                assert n_lo == k_lo // bn and n_hi == -(-k_hi // bn), case
            for n in range(n_a, n_b):  # the unmasked middle: every pair allowed, keys exist
                assert (n + 1) * bn <= sk, case
                assert masks.tile_is_full(*rows, n * bn, (n + 1) * bn, sq, sk, mask), case


def test_backward_query_range_and_step_masks_match_the_host():
    for sq, sk, mask, bm, bn in _cases((64, 128), (64, 128)):
        wl, wr = mask.window_left, mask.window_right
        shift = sk - sq
        for n0 in range(0, sk, bn):
            m_lo, blocks = query_range(_I32(n0), _I32(sq), _I32(shift), _I32(wl), _I32(wr), bm,
                                       bn, wl >= 0, wr >= 0)
            q_lo, q_hi = masks.query_range(n0, min(n0 + bn, sk), sq, sk, mask)
            q_lo, q_hi = max(q_lo, 0), min(q_hi, sq)
            case = (sq, sk, mask, bm, bn, n0)
            assert m_lo % bm == 0 and blocks >= 0, case
            if q_lo < q_hi:  # the walk holds every row that sees a key of the block
                assert m_lo <= q_lo and q_hi <= m_lo + blocks * bm, case
                assert m_lo == q_lo // bm * bm, case
            edges = mask_edges(_I32(n0), _I32(sk), _I32(shift), _I32(wl), _I32(wr), bm, bn)
            for m0 in range(m_lo, m_lo + blocks * bm, bm):
                need = step_needs_mask(_I32(m0), *edges, wl >= 0, wr >= 0)
                full = n0 + bn <= sk and masks.tile_is_full(m0, m0 + bm, n0, n0 + bn, sq, sk,
                                                            mask)
                assert bool(need) == (not full), (*case, m0)


def test_integer_division_truncates_toward_zero():
    assert _I32(-7) // 2 == -3 and _I32(7) // 2 == 3 and _I32(-8) // 4 == -2
