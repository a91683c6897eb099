"""The one-launch index checks (backends/portable/cache_checks.py) against their definition,
api.cache_checks.clamped: the same clamped copies and the same verdict, on random values in
and out of range, page tables wider than one block and as strided views. Interpreted on the
CPU here; on CUDA it is what every paged or cache-row decode step runs."""

from __future__ import annotations

import pytest
import torch

from asymflash.api.cache_checks import MESSAGE, CacheGeometry, clamped
from asymflash.backends.portable.cache_checks import BLOCK, OneLaunchChecks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _draw(gen, batch, geom, cols, wrong):
    """(lens, page_table, batch_idx, leftpad), each with a few wrong entries if `wrong`."""
    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)

    top = geom.capacity - geom.extra
    lens = ints(0, top + 1, batch)
    table = ints(0, geom.num_rows, batch, cols)
    rows = torch.randperm(geom.batch_cache, generator=gen)[:batch].to(torch.int32)
    pad = (lens.double() * torch.rand(batch, generator=gen, dtype=torch.float64)).to(torch.int32)
    if wrong:
        which = torch.randint(0, 4, (1,), generator=gen).item()
        b = torch.randint(0, batch, (1,), generator=gen).item()
        if which == 0:
            lens[b] = top + 1 + ints(0, 5).item() if b % 2 else -1 - ints(0, 5).item()
        elif which == 1:
            used = (int(lens[b]) + geom.extra + geom.page_size - 1) // geom.page_size
            col = min(cols - 1, int(ints(0, max(used, 1)).item()))
            table[b, col] = geom.num_rows + 3 if col % 2 else -2
        elif which == 2:
            rows[b] = geom.batch_cache if b % 2 else -1
            if batch > 1 and geom.appending and b % 3 == 0:
                rows[b] = rows[(b + 1) % batch]  # a repeated row instead
        else:
            pad[b] = int(lens[b]) + 1 if b % 2 else -3
    return lens, table, rows, pad


@pytest.mark.parametrize("batch,cols,appending", [(1, 1, False), (17, 3, True),
                                                  (113, BLOCK + 45, False), (203, 9, True)])
@pytest.mark.parametrize("parts", ["pages", "rows", "rows+pad", "pages+pad"])
def test_same_copies_and_verdict_as_the_torch_ops(batch, cols, appending, parts):
    gen = torch.Generator().manual_seed(batch * 31 + cols)
    page_size = 16
    geom = CacheGeometry(extra=3 if appending else 0, capacity=cols * page_size,
                         num_rows=batch * cols + 5, page_size=page_size,
                         batch_cache=batch + 7, appending=appending)
    for trial in range(6):
        lens, table, rows, pad = _draw(gen, batch, geom, cols, wrong=trial % 2 == 1)
        kw = dict(page_table=table if "pages" in parts else None,
                  batch_idx=rows if "rows" in parts else None,
                  leftpad=pad if "pad" in parts else None)
        if kw["page_table"] is not None and trial >= 4:  # a strided view of a wider table
            wide = torch.randint(0, geom.num_rows, (cols, batch), generator=gen,
                                 dtype=torch.int32)
            wide.t()[:] = table
            kw["page_table"] = wide.t()
        kw = {k: (v.to(DEVICE) if v is not None else None) for k, v in kw.items()}
        lens = lens.to(DEVICE)
        originals = [t.clone() if t is not None else None for t in (lens, *kw.values())]
        want, ok = clamped(lens, geom, **kw)
        run = OneLaunchChecks(geom, MESSAGE)
        if ok.item():
            got = run(lens, **kw)
        else:
            with pytest.raises(RuntimeError, match="out of range"):
                run(lens, **kw)
            continue
        for name, g, w in zip(("lens", "page_table", "batch_idx", "leftpad"), got, want):
            assert (g is None) == (w is None), name
            if w is not None:
                assert g.dtype == w.dtype and torch.equal(g, w), name
        for t, o in zip((lens, *kw.values()), originals):  # the inputs stay as they were
            assert o is None or torch.equal(t, o)


def test_an_empty_batch_launches_nothing():
    geom = CacheGeometry(extra=0, capacity=64, num_rows=6, page_size=16, batch_cache=4,
                         appending=False)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    lens, table, rows, pad = OneLaunchChecks(geom, MESSAGE)(
        empty, page_table=torch.zeros(0, 4, dtype=torch.int32, device=DEVICE),
        batch_idx=empty, leftpad=empty)
    assert lens.shape == (0,) and table.shape == (0, 4) and rows.shape == pad.shape == (0,)


def test_each_kind_of_wrong_value_fails():
    geom = CacheGeometry(extra=2, capacity=64, num_rows=6, page_size=16, batch_cache=4,
                         appending=True)

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=DEVICE)

    good = dict(lens=i32([0, 2, 17]), page_table=i32([[0, 1, 2, 3], [5, 0, 0, 0],
                                                      [4, 3, 77, -5]]),
                batch_idx=i32([3, 0, 1]), leftpad=i32([0, 1, 17]))
    lens = good.pop("lens")
    OneLaunchChecks(geom, MESSAGE)(lens, **good)  # unused page entries may be anything
    for key, value in [("lens", [0, 63, 1]), ("page_table", [[0, 1, 2, 3], [6, 0, 0, 0],
                                                             [0, 0, 0, 0]]),
                       ("page_table", [[0, 1, 2, 3], [0, 0, 0, 0], [0, -1, 0, 0]]),
                       ("batch_idx", [0, 4, 1]), ("batch_idx", [1, 0, 1]),
                       ("leftpad", [0, 3, 1])]:
        args = dict(good, lens=lens)
        args[key] = i32(value)
        given = args.pop("lens")
        with pytest.raises(RuntimeError, match="out of range"):
            OneLaunchChecks(geom, MESSAGE)(given, **args)
