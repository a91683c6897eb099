"""Inference API: attention over a KV cache, contiguous or paged, with in-place append.

`flash_attn_with_kvcache` is flash-attn 2/3's decode entry point: validate, write the new
k/v into the cache, then attend over everything the cache holds for each sequence. The
paged form of `flash_attn_varlen_func` (prefill over a paged cache) shares the validation
and the kernels through `paged_varlen`.

Backends see one calling convention: packed q (total_q, nheads_q, d) plus a `CacheSpec`
describing where each sequence's keys are (core/params.py). The portable Triton kernel is in
`backends/portable/decode.py`; the CPU backend gathers the cache into packed tensors and runs
its tiled forward (the cache is only as big as the CPU can hold anyway).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..core.fp8 import is_fp8
from ..core.masks import normalize_window
from ..core.params import AttnParams, CacheSpec, SeqInfo
from ..runtime import dispatch, plans
from . import cache_checks
from . import fp8 as fp8_api
from . import validation as check


def _params(q, softmax_scale, causal, window_size, softcap) -> AttnParams:
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return AttnParams(scale, normalize_window(causal, window_size), float(softcap))


def _cache_geometry(k_cache, page_table):
    """(capacity per sequence, page size, number of pages or cache rows)."""
    if page_table is not None:
        return page_table.shape[1] * k_cache.shape[1], k_cache.shape[1], k_cache.shape[0]
    return k_cache.shape[1], k_cache.shape[1], k_cache.shape[0]


def _check_new_kv(k, v, q, k_cache, v_cache, kv_dtype=None):
    if (k is None) != (v is None):
        got = "k" if v is None else "v"
        check._fail(ValueError, "k/v", f"only {got} was given", "pass both new k and v, or neither")
    if k is None:
        return 0
    check.check_tensors(q, k, v, 4, "(batch, seqlen_new, nheads_kv, headdim)",
                        kv_dtype=kv_dtype)
    batch = q.shape[0]
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        want = (batch, t.shape[1], cache.shape[2], cache.shape[3])
        if tuple(t.shape) != want:
            check._fail(ValueError, name, f"has shape {tuple(t.shape)}",
                        f"expected (batch, seqlen_new, nheads_kv, headdim) = {want} to match "
                        f"q's batch and the cache")
    return k.shape[1]


# Lengths tensors for cache_seqlens None or an int, kept per (device, batch, value): decode
# calls repeat them layer after layer, and a torch.full is a launch and ~5 us of host time. A
# call being captured into a CUDA graph gets a tensor of its own (the graph reads that
# address at every replay: a kept tensor could be dropped with the table).
_UNIFORM_LENGTHS: dict = {}
_UNIFORM_LENGTHS_LIMIT = 1024


def _uniform_lengths(batch, value, device):
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    key = (device, batch, value)
    lens = _UNIFORM_LENGTHS.get(key)
    if lens is None:
        if len(_UNIFORM_LENGTHS) >= _UNIFORM_LENGTHS_LIMIT:
            _UNIFORM_LENGTHS.clear()
        lens = _UNIFORM_LENGTHS[key] = torch.full((batch,), value, dtype=torch.int32,
                                                  device=device)
    return lens


def _check_seqlens(cache_seqlens, batch, device, capacity, seqlen_new):
    """The cache lengths as an int32 (batch,) tensor; None means every cache is full. None
    and ints are checked here, on the host (the value checks then skip them)."""
    if cache_seqlens is None:
        if seqlen_new:
            check._fail(ValueError, "cache_seqlens", "is None (every cache full)",
                        f"{seqlen_new} new tokens need room: pass the lengths")
        return _uniform_lengths(batch, capacity, device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0 or cache_seqlens + seqlen_new > capacity:
            check._fail(ValueError, "cache_seqlens", f"is {cache_seqlens}",
                        f"allowed: 0..{capacity - seqlen_new} (capacity {capacity} minus "
                        f"{seqlen_new} new tokens)")
        return _uniform_lengths(batch, cache_seqlens, device)
    check.check_int_vector(cache_seqlens, "cache_seqlens", batch, device)
    return cache_seqlens


def _check_rotary(cos, sin, q, k, capacity, leftpad):
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, Tensor):
            check._fail(TypeError, name, f"is a {type(t).__name__}",
                        "pass rotary_cos and rotary_sin together, as tensors")
    if k is None:
        check._fail(ValueError, "rotary_cos", "was given without new k/v",
                    "the rotation applies to the tokens appended in this call")
    if leftpad is not None:
        check._fail(ValueError, "rotary_cos", "was given with cache_leftpad",
                    "rotary positions of a left-padded cache are not defined here")
    if cos.dim() != 2 or sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= q.shape[-1]:
        check._fail(ValueError, "rotary_cos/rotary_sin",
                    f"have shapes {tuple(cos.shape)}/{tuple(sin.shape)}",
                    f"expected equal (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim "
                    f"{q.shape[-1]}")
    if cos.shape[0] < capacity:
        check._fail(ValueError, "rotary_cos", f"covers {cos.shape[0]} positions",
                    f"at least the cache's capacity {capacity} are needed")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if t.device != q.device or not t.is_floating_point():
            check._fail(TypeError, name, f"is {t.dtype} on {t.device}",
                        f"expected a floating tensor on {q.device}")


def _rotated(q, k, cos, sin, seqlens, params, interleaved):
    """(q, k) rotated as flash_attn_with_kvcache documents (new tensors)."""
    from ..core.rotary import apply_rotary

    start = seqlens.to(torch.int64).unsqueeze(1)
    k_pos = start + torch.arange(k.shape[1], device=k.device)
    mask = params.mask
    moving = mask.window_left >= 0 or mask.window_right >= 0  # causal or local
    q_pos = start + torch.arange(q.shape[1], device=q.device) if moving else \
        start.expand(q.shape[0], q.shape[1])
    return (apply_rotary(q, cos, sin, q_pos, interleaved),
            apply_rotary(k, cos, sin, k_pos, interleaved))


# Calls with at least this many query rows per sequence (a prefill chunk over a cached prefix)
# run the attention forward kernels where those are the Hopper fast path: the decode kernel
# is built for a few rows.
PREFILL_MIN_Q = 128


def prefill_on_forward_kernels(q, k_cache, v_cache, k, v, seqlens, params, sink,
                               backends=("sm90",)):
    """(out, lse) of a long-query call on a contiguous cache through the varlen forward
    (the cache as packed rows, the lengths as seqused_k: the same keys, masks aligned to the
    same last key), appending k/v first; None where this does not apply or the forward
    backend picked is not in `backends` (the decode path then runs as before)."""
    batch, seqlen_q, nheads_q, d = q.shape
    rows, capacity = k_cache.shape[:2]
    if seqlen_q < PREFILL_MIN_Q or rows != batch:
        return None
    # The cache as (batch * capacity, heads, dim) rows: a view where rows follow each other.
    if any(c.stride(0) != capacity * c.stride(1) for c in (k_cache, v_cache)):
        return None
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    seqlen_new = 0 if k is None else k.shape[1]
    steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    seq = SeqInfo(steps * seqlen_q, steps * capacity, seqlen_q, capacity,
                  (seqlens + seqlen_new).to(torch.int32), False)
    q_rows = q.reshape(batch * seqlen_q, nheads_q, d)
    try:
        backend = dispatch.pick_forward(q_rows, k_rows, v_rows, seq, params, sink)
    except NotImplementedError:
        return None
    if backend.NAME not in backends:
        return None
    with torch.no_grad():
        if seqlen_new:
            _append(k_cache, v_cache, k, v, seqlens, None, None)
        out, lse = backend.forward(q_rows, k_rows, v_rows, seq, params, sink)
    return out.view(batch, seqlen_q, nheads_q, out.shape[-1]), lse


def _pick(q, spec, params, sink):
    return dispatch.pick_decode(q, spec, params, sink)


# Call plans (runtime/plans.py): a decode step is host-bound at small batch, and nearly all
# of its Python re-derives what the call's signature decides. The first call of a signature
# takes the full path and, once it has succeeded, stores a `_KvPlan`; an equal key later runs
# the plan: allocate, launch. Only calls that read no values on the host are planned (lengths
# None or an int, or check_values=False): a value check cannot be skipped.
class _KvPlan:
    """A planned signature's decode: the backend's runner (`decode_runner`) and what the
    full path derived for the CacheSpec."""

    __slots__ = ("runner", "lens", "k_extra", "seqlen_q", "max_k", "batch", "return_lse",
                 "checks")

    def __init__(self, runner, lens, spec: CacheSpec, return_lse, checks=None):
        # lens: the uniform length of cache_seqlens None / an int, None for a tensor
        self.runner, self.lens, self.return_lse = runner, lens, return_lse
        self.checks = checks
        self.k_extra, self.seqlen_q = spec.k_extra, spec.max_seqlen_q
        self.max_k, self.batch = spec.max_seqlen_k, spec.batch

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                 learnable_sink, cache_leftpad, descales):
        lens = cache_seqlens if self.lens is None else \
            _uniform_lengths(self.batch, self.lens, q.device)
        if self.checks is not None and not torch.compiler.is_compiling() and not (
                q.is_cuda and torch.cuda.is_current_stream_capturing()):
            lens, page_table, cache_batch_idx, cache_leftpad = self.checks(
                lens, page_table=page_table, batch_idx=cache_batch_idx, leftpad=cache_leftpad)
        spec = CacheSpec(k_cache, v_cache, lens, self.k_extra, page_table, cache_batch_idx,
                         None, self.seqlen_q, self.max_k, self.batch, k, v, cache_leftpad,
                         *descales)
        sink = None if learnable_sink is None else \
            learnable_sink.detach().float().contiguous()
        out, lse = self.runner(q, spec, sink)
        return _returned(out, lse, self.return_lse)


def _remember(key, backend, q, spec, params, sink, num_splits, return_lse, uniform_len,
              checks=None):
    """Store the plan of a call the full path has just validated (None where the backend
    has no runner, and while a CUDA graph captures: the runner's first launch binds the
    compiled kernel, which belongs outside a capture). uniform_len: the length of
    cache_seqlens None / an int, or None for a lengths tensor. checks: the device checks
    (cache_checks.device_checks for the call's geometry) the plan runs on every call, or None."""
    make = getattr(backend, "decode_runner", None)
    if key is None or make is None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return plans.keep(key, _KvPlan(make(q, spec, params, sink, num_splits, need_lse=return_lse),
                                   uniform_len, spec, return_lse, checks))


@torch.no_grad()
def _append(k_cache, v_cache, k, v, seqlens, page_table, batch_idx):
    """Write k/v (batch, n, ...) at positions seqlens[b]..seqlens[b] + n of each sequence."""
    batch, n = k.shape[:2]
    pos = seqlens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=k.device)
    if page_table is not None:
        page_size = k_cache.shape[1]
        rows = torch.gather(page_table.to(torch.int64), 1, pos // page_size)
        slots = pos % page_size
    else:
        rows = batch_idx.to(torch.int64) if batch_idx is not None else \
            torch.arange(batch, device=k.device)
        rows, slots = rows.unsqueeze(1).expand(batch, n), pos
    k_cache.index_put_((rows, slots), k)
    v_cache.index_put_((rows, slots), v)


def flash_attn_with_kvcache(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
    v: Tensor | None = None, *, cache_seqlens: Tensor | int | None = None,
    cache_batch_idx: Tensor | None = None, page_table: Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
    softcap: float = 0.0, learnable_sink: Tensor | None = None, num_splits: int = 0,
    return_lse: bool = False, check_values: bool = True, cache_leftpad: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
    rotary_interleaved: bool = True, block_table: Tensor | None = None,
    return_softmax_lse: bool | None = None, q_descale: Tensor | None = None,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None, out_dtype=None,
):
    """Attention of q over a KV cache, appending new k/v to the cache first (flash-attn 2/3).

    q: (batch, seqlen_q, nheads_q, d). The cache is either contiguous, k_cache
    (batch_cache, seqlen_cache, nheads_kv, d) and v_cache (..., dv), or paged: k_cache
    (num_pages, page_size, nheads_kv, d) with page_table int32 (batch, max_pages) listing
    each sequence's pages in order (page_size a multiple of 16). cache_seqlens (int32
    (batch,) or an int; None = the whole cache) is how many tokens each sequence already
    has. cache_batch_idx (int32 (batch,), contiguous caches only) picks the cache row of
    each sequence (default: row b). cache_leftpad (int32 (batch,), contiguous caches only,
    as in flash-attn): sequence b's cache starts at position cache_leftpad[b] (a left-padded
    batch): it attends to positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1,
    cache_seqlens still counting from position 0.

    Rotary embedding (flash-attn's): with rotary_cos and rotary_sin (seqlen_ro, rotary_dim / 2),
    seqlen_ro at least the cache's capacity, the new k (required) is rotated at positions
    cache_seqlens[b] + i before it is written, and q at the same positions with causal or
    window masks, else every query row at position cache_seqlens[b]. The first rotary_dim
    channels rotate in pairs, (2i, 2i + 1) with rotary_interleaved (GPT-J), else (i, i +
    rotary_dim / 2) (GPT-NeoX); q itself is not modified (`core/rotary.py`).

    In place: the new k, v (batch, seqlen_new, nheads_kv, d / dv), if given, are written
    into the cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1. This
    is the only effect on the inputs; cache_seqlens itself is not advanced (the caller does
    that). A refused call (any ValueError/TypeError) leaves the cache untouched.

    Each sequence then attends to its first cache_seqlens[b] + seqlen_new keys; causal and
    window_size masks are aligned to the bottom-right corner (the last query is the newest
    token). softcap, learnable_sink (nheads_q,) as in flash_attn_func. num_splits: 0 picks
    the split-KV count by a heuristic (SM count, lengths), 1 disables splitting, n > 1
    forces n. Index values (cache_seqlens, page_table, cache_batch_idx, cache_leftpad) are
    checked: on CPU tensors on the host, a ValueError naming the entry; on CUDA on the
    device, without waiting for it (api/cache_checks.py): the kernels read clamped copies,
    so no value reads or writes outside the cache, and a wrong value fails a device-side
    assert (asynchronously). check_values=False skips both (the checks are skipped anyway
    under torch.compile and CUDA graph capture): then out-of-range values are undefined
    behaviour.

    flash-attn 2's names are accepted too: block_table for page_table, return_softmax_lse
    for return_lse.

    Under torch.compile, a call without k/v and rotary (and without return_lse) is one custom
    op, asymflash::kvcache_attend, so fullgraph compiles; others run as Python (a graph break).

    Forward only: runs under no_grad, as flash-attn's does. Returns out
    (batch, seqlen_q, nheads_q, dv), or (out, lse) with lse fp32 (batch, nheads_q, seqlen_q).

    fp8 cache (FA3's keywords, api/kvcache_fp8.py): k_cache/v_cache in torch.float8_e4m3fn
    with k_descale, v_descale fp32 (batch, nheads_kv), q fp8 with q_descale or 16-bit; new
    k/v must be e4m3 already, quantised by the caller in the cache's scale, and are written
    as given; out bf16 (q's dtype for 16-bit q) or out_dtype. Rotary with new fp8 k is
    refused (rotate before quantising).
    """
    if block_table is not None:
        if page_table is not None:
            check._fail(ValueError, "block_table", "was given with page_table",
                        "they are two names of one argument: pass one")
        page_table = block_table
    if return_softmax_lse is not None:
        return_lse = bool(return_softmax_lse)
    descales = (q_descale, k_descale, v_descale)
    if fp8_api.wanted(q, k_cache, v_cache, descales, out_dtype):
        from .kvcache_fp8 import kvcache_fp8

        return kvcache_fp8(
            _with_kvcache, q, k_cache, v_cache, k, v, cache_seqlens,
            cache_batch_idx, page_table, descales, out_dtype, rotary_cos,
            dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                 softcap=softcap, learnable_sink=learnable_sink, num_splits=num_splits,
                 return_lse=return_lse, check_values=check_values,
                 cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 rotary_interleaved=rotary_interleaved))
    return _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                         softmax_scale, causal, window_size, softcap, learnable_sink,
                         num_splits, return_lse, check_values, cache_leftpad, rotary_cos,
                         rotary_sin, rotary_interleaved)


def _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                  softmax_scale, causal, window_size, softcap, learnable_sink, num_splits,
                  return_lse, check_values, cache_leftpad, rotary_cos, rotary_sin,
                  rotary_interleaved, descales=(None, None)):
    """flash_attn_with_kvcache after its argument aliases and the fp8 entry: a cache in e4m3
    arrives here only from kvcache_fp8, which checked it, with q in 16 bits and descales
    (k_descale, v_descale) for the decode kernels to apply, or (None, None)."""
    kv_dtype = k_cache.dtype if is_fp8(k_cache) else None
    if torch.compiler.is_compiling():
        if k is None and v is None and rotary_cos is None and rotary_sin is None and \
                not return_lse:
            return _traced_attend(q, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                                  page_table, softmax_scale, causal, window_size, softcap,
                                  learnable_sink, num_splits, cache_leftpad, descales)
        # What follows runs as Python (a graph break; under fullgraph=True, this error).
        torch._dynamo.graph_break(
            msg="asymflash: flash_attn_with_kvcache with new k/v (an in-place append), "
                "rotary_cos/sin or return_lse runs as Python under torch.compile; only a call "
                "without them is one custom op (write the cache first, then attend)")
    key = None
    if rotary_cos is None and rotary_sin is None:
        key = plans.kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                page_table, softmax_scale, causal, window_size, softcap,
                                learnable_sink, num_splits, return_lse, check_values,
                                cache_leftpad, descales)
        plan = plans.find(key)
        if plan is not None:
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                        learnable_sink, cache_leftpad, descales)
    check.check_tensors(q, k_cache, v_cache, 4, "(batch, seqlen, nheads, headdim)",
                        names=("q", "k_cache", "v_cache"), kv_dtype=kv_dtype)
    batch, seqlen_q, nheads_q, _ = q.shape
    seqlen_new = _check_new_kv(k, v, q, k_cache, v_cache, kv_dtype)
    if page_table is not None:
        if cache_batch_idx is not None:
            check._fail(ValueError, "cache_batch_idx", "was given with page_table",
                        "a paged cache names each sequence's pages in page_table: use one")
        check.check_page_table(page_table, batch, q.device)
        check.check_page_size(k_cache.shape[1], "k_cache")
    elif cache_batch_idx is not None:
        check.check_int_vector(cache_batch_idx, "cache_batch_idx", batch, q.device)
    elif k_cache.shape[0] != batch:
        check._fail(ValueError, "k_cache", f"has batch {k_cache.shape[0]}",
                    f"must equal q's batch {batch} (or pass cache_batch_idx)")
    if cache_leftpad is not None:
        if page_table is not None:
            check._fail(ValueError, "cache_leftpad", "was given with page_table",
                        "a paged cache lists each sequence's own pages: leave the padding out")
        check.check_int_vector(cache_leftpad, "cache_leftpad", batch, q.device)
    capacity, page_size, num_rows = _cache_geometry(k_cache, page_table)
    seqlens = _check_seqlens(cache_seqlens, batch, q.device, capacity, seqlen_new)
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(rotary_cos, rotary_sin, q, k, capacity, cache_leftpad)
    check.check_scalars(softmax_scale, window_size, softcap)
    check.check_sink(learnable_sink, q, nheads_q)
    check.check_int_arg(num_splits, "num_splits")
    max_k = capacity
    # Lengths given as None (full caches) or an int were checked on the host already; with
    # no page table or batch index either, there is nothing to read back (a device sync).
    lens_on_host = cache_seqlens is None or isinstance(cache_seqlens, int)
    if lens_on_host:
        max_k = capacity if cache_seqlens is None else cache_seqlens + seqlen_new
    checks = None
    if check_values and check.values_checkable(q) and not (
            lens_on_host and page_table is None and cache_batch_idx is None and
            cache_leftpad is None):
        if cache_checks.on_device(q):
            # No host read (cache_checks): clamped copies, a device-side assert on the
            # originals; max_k stays an upper bound (the capacity, or int lengths + new).
            if seqlen_new > capacity:
                check._fail(ValueError, "k", f"appends {seqlen_new} tokens",
                            f"more than the cache's capacity of {capacity}")
            checks = cache_checks.device_checks(cache_checks.CacheGeometry(
                seqlen_new, capacity, num_rows, page_size, k_cache.shape[0], seqlen_new > 0),
                q.device, page_table, cache_batch_idx)
            seqlens, page_table, cache_batch_idx, cache_leftpad = checks(
                seqlens, page_table=page_table, batch_idx=cache_batch_idx,
                leftpad=cache_leftpad)
        else:
            max_k = check.check_cache_values(
                seqlens, "cache_seqlens", seqlen_new, capacity, page_table, num_rows,
                page_size, cache_batch_idx, k_cache.shape[0], seqlen_new > 0, cache_leftpad)

    params = _params(q, softmax_scale, causal, window_size, softcap)
    if rotary_cos is not None:
        q, k = _rotated(q, k, rotary_cos, rotary_sin, seqlens, params, rotary_interleaved)
    sink = None if learnable_sink is None else learnable_sink.detach().float().contiguous()
    # The forward kernels read 16-bit caches only: an fp8 cache takes the decode kernels.
    if page_table is None and cache_batch_idx is None and cache_leftpad is None and \
            kv_dtype is None:
        done = prefill_on_forward_kernels(q, k_cache, v_cache, k, v, seqlens, params, sink)
        if done is not None:
            return _returned(*done, return_lse)
    spec = CacheSpec(k_cache, v_cache, seqlens, seqlen_new, page_table, cache_batch_idx, None,
                     seqlen_q, max_k, batch, leftpad=cache_leftpad, k_descale=descales[0],
                     v_descale=descales[1])
    # Backends look only at q's device and dtype here. Picked before the write: a refusal
    # changes nothing.
    backend = _pick(q, spec, params, sink)
    if getattr(backend, "KVCACHE_FUSED", False) and batch * seqlen_q > 0:
        # One launch appends and attends; q and out stay (batch, seqlen_q, heads, d).
        if seqlen_new:
            spec.k_new, spec.v_new = k, v
        plan = _remember(key, backend, q, spec, params, sink, num_splits, return_lse,
                         (capacity if cache_seqlens is None else cache_seqlens)
                         if lens_on_host else None, checks)
        if plan is not None:
            return _returned(*plan.runner(q, spec, sink), return_lse)
        return _returned(*backend.decode(q, spec, params, sink, num_splits,
                                         need_lse=return_lse), return_lse)
    q_packed = q.reshape(batch * seqlen_q, nheads_q, q.shape[-1])
    with torch.no_grad():
        if seqlen_new:
            _append(k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx)
        out, lse = backend.decode(q_packed, spec, params, sink, num_splits)
    return _returned(out.view(batch, seqlen_q, nheads_q, v_cache.shape[-1]), lse, return_lse)


# Under torch.compile a call without new keys (what transformers' decode makes) is one opaque
# custom op, `asymflash::kvcache_attend`: the launches inside flash_attn_with_kvcache are not
# traceable (a graph break; an error with fullgraph=True), and the alternative transformers
# had, flash_attn_func over the whole cache, copies the cache in every layer of every step.
# The op only reads its inputs (appending calls keep the Python path); its implementation is
# the eager call, so it checks and dispatches as that does, with check_values=False (a
# traced call reads no values on the host).
def _traced_attend(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table,
                   softmax_scale, causal, window_size, softcap, learnable_sink, num_splits,
                   cache_leftpad, descales):
    check.check_scalars(softmax_scale, window_size, softcap)  # the rest: in the op, at run time
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    lens_int = -1
    if cache_seqlens is None or isinstance(cache_seqlens, (int, torch.SymInt)):
        lens_int = -1 if cache_seqlens is None else cache_seqlens
        cache_seqlens = None
    left, right = window_size
    sink = None if learnable_sink is None else learnable_sink.detach()
    return torch.ops.asymflash.kvcache_attend(
        q.detach(), k_cache.detach(), v_cache.detach(), cache_seqlens, lens_int,
        cache_batch_idx, page_table, cache_leftpad, sink, scale, bool(causal), int(left),
        int(right), float(softcap), int(num_splits), *descales)


@torch.library.custom_op("asymflash::kvcache_attend", mutates_args=())
def _attend_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
    seqlens_int: int, cache_batch_idx: Optional[Tensor], page_table: Optional[Tensor],
    cache_leftpad: Optional[Tensor], learnable_sink: Optional[Tensor], softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, num_splits: int,
    k_descale: Optional[Tensor], v_descale: Optional[Tensor],
) -> Tensor:
    """flash_attn_with_kvcache without new keys; seqlens_int >= 0 stands for an int
    cache_seqlens (-1: the tensor, or None when that is None too). k/v_descale: an e4m3
    cache's, with q in 16 bits."""
    return flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens if seqlens_int < 0 else seqlens_int,
        cache_batch_idx=cache_batch_idx, page_table=page_table, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap,
        learnable_sink=learnable_sink, num_splits=num_splits, check_values=False,
        cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale)


@_attend_op.register_fake
def _attend_fake(q, k_cache, v_cache, *rest):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def _returned(out, lse, return_lse: bool):
    """out (batch, seqlen_q, nheads_q, dv), with lse (nheads_q, batch * seqlen_q) as flash-attn
    returns it, (batch, nheads_q, seqlen_q), when asked for."""
    if not return_lse:
        return out
    batch, seqlen_q, nheads_q = out.shape[:3]
    return out, lse.view(nheads_q, batch, seqlen_q).transpose(0, 1)


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 seqused_k, page_table, softmax_scale, causal, window_size, softcap,
                 learnable_sink, return_lse):
    """flash_attn_varlen_func over a paged cache (prefill): see its docstring.

    The keys of sequence b are its first seqused_k[b] (else cu_seqlens_k[b+1] -
    cu_seqlens_k[b]) cache positions, read through page_table[b]. Forward only (no_grad).
    """
    # An e4m3 cache arrives only from the fp8 entry (dense._varlen_fp8), which checked it.
    check.check_tensors(q, k_cache, v_cache, 4, "(num_pages, page_size, nheads_kv, headdim)",
                        names=("q", "k", "v"), q_rank=3, q_layout="(total_q, nheads, headdim)",
                        kv_dtype=k_cache.dtype if is_fp8(k_cache) else None)
    check.check_int_vector(cu_seqlens_q, "cu_seqlens_q", None, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        check._fail(ValueError, "cu_seqlens_q", "is empty", "expected batch + 1 >= 1 offsets")
    check.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q,
                           "max_seqlen_q")
    check.check_page_table(page_table, batch, q.device)
    check.check_page_size(k_cache.shape[1], "k")
    capacity = page_table.shape[1] * k_cache.shape[1]
    if seqused_k is None and cu_seqlens_k is None:
        check._fail(ValueError, "cu_seqlens_k", "is None and so is seqused_k",
                    "with page_table, give the key lengths in one of them")
    if cu_seqlens_k is not None:
        check.check_int_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1, q.device)
        # Keys live in the pages, not in a packed tensor: bound only by the page capacity.
        check.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", 2**62, max_seqlen_k,
                               "max_seqlen_k")
    if seqused_k is not None:
        check.check_int_vector(seqused_k, "seqused_k", batch, q.device)
        if cu_seqlens_k is not None:
            check.check_seqused(seqused_k, cu_seqlens_k)
        lens = seqused_k
    else:
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    check.check_scalars(softmax_scale, window_size, softcap)
    check.check_sink(learnable_sink, q, q.shape[1])
    max_k = capacity
    if check.values_checkable(q):
        name = "seqused_k" if seqused_k is not None else "cu_seqlens_k lengths"
        max_k = check.check_cache_values(lens, name, 0, capacity, page_table, k_cache.shape[0],
                                         k_cache.shape[1], None, 0, False)
    params = _params(q, softmax_scale, causal, window_size, softcap)
    sink = None if learnable_sink is None else learnable_sink.detach().float().contiguous()
    spec = CacheSpec(k_cache, v_cache, lens, 0, page_table, None, cu_seqlens_q, max_seqlen_q,
                     max_k, batch)
    backend = _pick(q, spec, params, sink)
    with torch.no_grad():
        out, lse = backend.decode(q, spec, params, sink, 0)
    return (out, lse) if return_lse else out
