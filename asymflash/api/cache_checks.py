"""flash_attn_with_kvcache's index checks on the device, so a decode step never waits for it.

The host checks (`validation.check_cache_values`) copy cache_seqlens, page_table,
cache_batch_idx and cache_leftpad to the host: on CUDA that waits for every kernel queued
before the call, once per call (engines pass cache_seqlens as a tensor). On CUDA the checks
run here instead, as device ops only:

- every index tensor is clamped into its range (lengths to [0, capacity - new tokens],
  cache rows to [0, rows), start positions to [0, length], page indices to [0, pages)), and
  the kernels and the append use the clamped copies: no value, however wrong, makes them
  read or write outside the cache;
- `torch._assert_async` on the original values, so a wrong value still fails: on CUDA as a
  device-side assert (asynchronously: the error surfaces at a later synchronisation, and
  the CUDA context is lost, as with torch's own index errors); on the CPU at once.

The CPU keeps the host checks, whose errors name the argument, the entry and its value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MESSAGE = ("asymflash: flash_attn_with_kvcache: a value of cache_seqlens, page_table, "
           "cache_batch_idx or cache_leftpad is out of range (checked on the device; the "
           "same call on CPU tensors names the entry)")


def on_device(q: torch.Tensor) -> bool:
    """Whether the checks run on the device (CUDA: a host check costs a sync per call)."""
    return q.device.type != "cpu"


@dataclass(frozen=True)
class CacheGeometry:
    """The host-side sizes the checks compare against (one decode signature's)."""

    extra: int  # new tokens appended by the call
    capacity: int  # keys a sequence can hold
    num_rows: int  # pages (paged) or cache rows (contiguous)
    page_size: int
    batch_cache: int  # k_cache.shape[0]: the rows cache_batch_idx may pick
    appending: bool


def clamped(lens, geom: CacheGeometry, page_table=None, batch_idx=None, leftpad=None):
    """((lens, page_table, batch_idx, leftpad) clamped into range, ok): ok a 0-dim bool
    tensor, True when nothing needed clamping (and no cache row repeats while appending).
    Only the pages a sequence uses are judged; the rest of its page-table row may hold
    anything (engines pad it), it is clamped too but never read."""
    # Each check compares a value with its clamped copy: the fewest launches (a decode call
    # is short, and every launch is host time).
    top = max(geom.capacity - geom.extra, 0)
    given, lens = lens, lens.clamp(0, top)
    conds = [(lens == given).all()]
    if batch_idx is not None:
        given, batch_idx = batch_idx, batch_idx.clamp(0, max(geom.batch_cache - 1, 0))
        conds.append((batch_idx == given).all())
        if geom.appending and batch_idx.shape[0] > 1:  # colliding writes
            rows = given.sort().values
            conds.append((rows[1:] != rows[:-1]).all())
    if leftpad is not None:
        given, leftpad = leftpad, torch.minimum(leftpad.clamp(min=0), lens)
        conds.append((leftpad == given).all())
    if page_table is not None:
        pages_used = (lens + (geom.extra + geom.page_size - 1)) // geom.page_size
        cols = torch.arange(page_table.shape[1], device=page_table.device)
        unused = cols.unsqueeze(0) >= pages_used.unsqueeze(1)
        given, page_table = page_table, page_table.clamp(0, max(geom.num_rows - 1, 0))
        conds.append(((page_table == given) | unused).all())
    ok = conds[0] if len(conds) == 1 else torch.stack(conds).all()
    return (lens, page_table, batch_idx, leftpad), ok


def checked(lens, geom: CacheGeometry, page_table=None, batch_idx=None, leftpad=None):
    """`clamped`'s tensors, with torch._assert_async(ok): reads nothing on the host."""
    safe, ok = clamped(lens, geom, page_table, batch_idx, leftpad)
    torch._assert_async(ok, MESSAGE)
    return safe


def device_checks(geom: CacheGeometry, device: torch.device, page_table=None, batch_idx=None):
    """What one call signature runs on every call, as `checked` takes its arguments: on CUDA
    with a page table or cache rows, one kernel (backends/portable/cache_checks.py: those
    make `clamped`'s torch ops a dozen launches); else `checked`'s few torch ops."""
    if device.type != "cuda" or (page_table is None and batch_idx is None):
        return functools.partial(checked, geom=geom)
    from ..backends.portable.cache_checks import OneLaunchChecks

    return OneLaunchChecks(geom, MESSAGE)
