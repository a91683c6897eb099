"""flash_attn_with_kvcache's device-side index checks (api/cache_checks.py) in one launch.

`api.cache_checks.clamped` states the checks as torch ops. With a page table they are about
thirteen launches, and a launch is host time: a paged batch-8 decode step spent more than
twice the contiguous step's Python and measured the host, not the kernel (docs/tuning.md,
models suite). This kernel computes the same clamped copies and the same verdict in one
launch (plus the verdict's fill and its assert): program b judges sequence b.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime.launch import DirectLaunch

BLOCK = 256  # page-table columns (and cache rows, for the repeat check) per step


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _check_kernel(lens_in, lens_out, pages_in, pages_out, rows_in, rows_out, pad_in, pad_out,
                  ok, batch, top, pages_stride, pages_col_stride, pages_cols, last_page,
                  page_size, extra, last_row,
                  HAS_PAGES: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_PAD: tl.constexpr,
                  NO_REPEATS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    given = tl.load(lens_in + b)
    lens = _clamp(given, 0, top)
    tl.store(lens_out + b, lens)
    bad = lens != given
    if HAS_ROWS:
        row_given = tl.load(rows_in + b)
        row = _clamp(row_given, 0, last_row)
        tl.store(rows_out + b, row)
        bad = bad | (row != row_given)
        if NO_REPEATS:  # appending: two sequences writing one cache row
            for start in range(0, batch, BLOCK):
                j = start + tl.arange(0, BLOCK)
                other = tl.load(rows_in + j, mask=j < batch, other=0)
                clash = (j < batch) & (j != b) & (other == row_given)
                bad = bad | (tl.max(clash.to(tl.int32), axis=0) > 0)
    if HAS_PAD:
        pad_given = tl.load(pad_in + b)
        pad = _clamp(pad_given, 0, lens)
        tl.store(pad_out + b, pad)
        bad = bad | (pad != pad_given)
    if HAS_PAGES:
        # Only the pages the sequence uses are judged (engines pad the rest of the row);
        # every column is clamped all the same.
        used = (lens + extra + page_size - 1) // page_size
        for start in range(0, pages_cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            inside = c < pages_cols
            page_given = tl.load(pages_in + b * pages_stride + c * pages_col_stride,
                                 mask=inside, other=0)
            page = _clamp(page_given, 0, last_page)
            tl.store(pages_out + b * pages_cols + c, page, mask=inside)
            wrong = inside & (c < used) & (page != page_given)
            bad = bad | (tl.max(wrong.to(tl.int32), axis=0) > 0)
    tl.atomic_and(ok, 0, mask=bad)


_CHECK = DirectLaunch(_check_kernel)


class OneLaunchChecks:
    """`api.cache_checks.checked` for one geometry as one kernel: call it with (lens,
    page_table, batch_idx, leftpad) as `checked` takes them; returns the clamped copies and
    queues torch._assert_async on the verdict. After its first launch it binds the binary
    (`DirectLaunch.bind`; False where it cannot): kvcache's call plans, which keep it, fix
    every tensor's class."""

    __slots__ = ("geom", "message", "bound")

    def __init__(self, geom, message: str):
        self.geom, self.message, self.bound = geom, message, None

    def __call__(self, lens, page_table=None, batch_idx=None, leftpad=None):
        geom = self.geom
        dev = lens.device
        ok = torch.ones(1, dtype=torch.int32, device=dev)
        lens_out = torch.empty_like(lens)
        pages_out = None if page_table is None else torch.empty(
            page_table.shape, dtype=page_table.dtype, device=dev)
        rows_out = None if batch_idx is None else torch.empty_like(batch_idx)
        pad_out = None if leftpad is None else torch.empty_like(leftpad)
        pages = (page_table, pages_out) if page_table is not None else (lens, lens_out)
        rows = (batch_idx, rows_out) if batch_idx is not None else (lens, lens_out)
        pad = (leftpad, pad_out) if leftpad is not None else (lens, lens_out)
        pt_strides = page_table.stride() if page_table is not None else (0, 0)
        pt_cols = page_table.shape[1] if page_table is not None else 0
        args = (lens, lens_out, *pages, *rows, *pad, ok, lens.shape[0],
                max(geom.capacity - geom.extra, 0), *pt_strides, pt_cols,
                max(geom.num_rows - 1, 0), geom.page_size, geom.extra,
                max(geom.batch_cache - 1, 0))
        grid = (lens.shape[0],)
        if grid[0] == 0:  # no sequence: nothing to judge
            return lens_out, pages_out, rows_out, pad_out
        bound = self.bound
        if not (bound and bound(grid, args)):
            kwargs = dict(HAS_PAGES=page_table is not None, HAS_ROWS=batch_idx is not None,
                          HAS_PAD=leftpad is not None,
                          NO_REPEATS=geom.appending and batch_idx is not None,
                          BLOCK=BLOCK, num_warps=2)
            _CHECK[grid](*args, **kwargs)
            if bound is None and dev.type == "cuda":
                self.bound = _CHECK.bind(args, kwargs) or False
        torch._assert_async(ok, self.message)
        return lens_out, pages_out, rows_out, pad_out
