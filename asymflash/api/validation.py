"""Input checks for the public API: every bad input is refused before any kernel runs.

Each error names the argument, what was received and what is allowed.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..runtime.tensor_memo import TensorMemo

MAX_HEAD_DIM = 256


def _fail(exc, arg, got, allowed):
    raise exc(f"asymflash: {arg} {got}; {allowed}")


_GPU_DTYPES = (torch.float16, torch.bfloat16)  # allowed_dtypes on CUDA (the CPU adds fp32)


def allowed_dtypes(device: torch.device):
    # fp32 only on the CPU path: the GPU kernels are tensor-core kernels for 16-bit inputs.
    base = (torch.float16, torch.bfloat16)
    return base + (torch.float32,) if device.type == "cpu" else base


def _tensors_ok(q, k, v, rank: int, q_rank: int, kv_dtype=None) -> bool:
    """True when check_tensors has nothing to report: every call pays for this one pass
    (host time is what short calls are bound by); only a bad input takes the slower pass
    that names the problem."""
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k, T) and isinstance(v, T)):
        return False
    if q.dim() != q_rank or k.dim() != rank or v.dim() != rank:
        return False
    device, dtype = q.device, q.dtype
    if k.device != device or v.device != device:
        return False
    if dtype not in _GPU_DTYPES and not (dtype == torch.float32 and device.type == "cpu"):
        return False
    if k.dtype != (kv_dtype or dtype) or v.dtype != (kv_dtype or dtype):
        return False
    k_shape, v_shape = k.shape, v.shape
    d, dv = q.shape[-1], v_shape[-1]
    if k_shape[:-1] != v_shape[:-1] or k_shape[-1] != d:
        return False
    if not (0 < d <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM) or d % 8 or dv % 8:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    nheads_kv = k_shape[-2]
    return nheads_kv != 0 and q.shape[-2] % nheads_kv == 0


def check_tensors(q, k, v, rank: int, layout: str, names=("q", "k", "v"), q_rank=None,
                  q_layout=None, kv_dtype=None):
    """dtype, device, shape and head-dim rules shared by q and the k/v pair.

    `names` are the argument names used in messages (k_cache, v_cache for a KV cache);
    q_rank/q_layout describe q when its rank differs from k/v's (varlen q over a paged cache);
    kv_dtype is the dtype k/v must have when it is not q's (an fp8 cache the fp8 entry
    checked already, api/kvcache_fp8.py).
    """
    if _tensors_ok(q, k, v, rank, q_rank or rank, kv_dtype):
        return
    q_name, k_name, v_name = names
    for name, t, want, how in ((q_name, q, q_rank or rank, q_layout or layout),
                               (k_name, k, rank, layout), (v_name, v, rank, layout)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, f"is a {type(t).__name__}", "expected a torch.Tensor")
        if t.dim() != want:
            _fail(ValueError, name, f"has shape {tuple(t.shape)}", f"expected {want} dims {how}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.device != q.device:
            _fail(ValueError, name, f"is on {t.device}",
                  f"{q_name} is on {q.device}: use one device")
    ok = allowed_dtypes(q.device)
    if q.dtype not in ok:
        _fail(TypeError, q_name, f"has dtype {q.dtype}", f"allowed on {q.device.type}: {ok}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != (kv_dtype or q.dtype):
            _fail(TypeError, name, f"has dtype {t.dtype}",
                  f"must match {q_name}'s dtype {q.dtype}" if kv_dtype is None else
                  f"expected {kv_dtype}")
        if t.shape[:-1] != k.shape[:-1]:
            _fail(ValueError, name, f"has shape {tuple(t.shape)}",
                  f"{k_name} and {v_name} must agree except in the last dim "
                  f"({k_name}: {tuple(k.shape)})")
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if t.shape[-1] > 0 and t.stride(-1) != 1:
            _fail(ValueError, name, f"has last-dim stride {t.stride(-1)}",
                  "the head dim must be contiguous (stride 1): call .contiguous()")
    nheads_q, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads_q % nheads_kv != 0:
        _fail(ValueError, "nheads",
              f"{q_name} has {nheads_q} heads and {k_name}/{v_name} have {nheads_kv}",
              "nheads_q must be a positive multiple of nheads_kv")
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        _fail(ValueError, k_name, f"has head_dim {k.shape[-1]}",
              f"must equal {q_name}'s head_dim {d}")
    for name, hd in ((q_name, d), (v_name, dv)):
        if hd <= 0 or hd % 8 != 0 or hd > MAX_HEAD_DIM:
            _fail(ValueError, f"{name} head_dim", f"is {hd}",
                  f"allowed: a multiple of 8 from 8 to {MAX_HEAD_DIM}")


def check_scalars(softmax_scale, window_size, softcap):
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or \
                not math.isfinite(softmax_scale):
            _fail(ValueError, "softmax_scale", f"is {softmax_scale!r}",
                  "expected a finite float or None")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        _fail(ValueError, "window_size", f"is {window_size!r}", "expected a pair of ints")
    if min(window_size) < -1:
        _fail(ValueError, "window_size", f"is {tuple(window_size)}",
              "each side must be >= 0, or -1 for unbounded")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or \
            not math.isfinite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", f"is {softcap!r}", "expected a finite float >= 0 (0 = off)")


def check_sink(sink, q, nheads_q: int):
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        _fail(TypeError, "learnable_sink", f"is a {type(sink).__name__}",
              "expected a torch.Tensor or None")
    if tuple(sink.shape) != (nheads_q,):
        _fail(ValueError, "learnable_sink", f"has shape {tuple(sink.shape)}",
              f"expected ({nheads_q},): one logit per q head")
    if not sink.is_floating_point():
        _fail(TypeError, "learnable_sink", f"has dtype {sink.dtype}", "expected a float dtype")
    if sink.device != q.device:
        _fail(ValueError, "learnable_sink", f"is on {sink.device}", f"q is on {q.device}")


def check_int_vector(t, name, length, device):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, f"is a {type(t).__name__}", "expected an int32 torch.Tensor")
    if t.dtype != torch.int32:
        _fail(TypeError, name, f"has dtype {t.dtype}", "expected torch.int32")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        _fail(ValueError, name, f"has shape {tuple(t.shape)}", f"expected {want}")
    if t.device != device:
        _fail(ValueError, name, f"is on {t.device}", f"q is on {device}")


# cu_seqlens whose values passed `check_cu_seqlens`: an unchanged tensor is not read again
# (a varlen model's layers share one; each read waits for the GPU, see tensor_memo).
_PASSED = TensorMemo()


def check_cu_seqlens(cu, name, total, max_seqlen, max_name):
    """Values checks need the numbers on the host: one small copy (once per unmodified
    tensor, `_PASSED`), skipped under compile."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        _fail(ValueError, max_name, f"is {max_seqlen!r}", "expected an int >= 0")
    if torch.compiler.is_compiling():
        return
    what = ("cu_seqlens", total, max_seqlen)
    if _PASSED.get(cu, what, False):
        return
    _check_cu_seqlens_values(cu, name, total, max_seqlen, max_name)
    _PASSED.put(cu, what, True)


def _check_cu_seqlens_values(cu, name, total, max_seqlen, max_name):
    vals = cu.tolist()
    if vals and vals[0] < 0:
        _fail(ValueError, name, f"starts at {vals[0]}", "offsets must be >= 0")
    steps = [b - a for a, b in zip(vals, vals[1:])]
    if any(s < 0 for s in steps):
        _fail(ValueError, name, f"is {vals[:8]}...", "must be non-decreasing")
    if vals and vals[-1] > total:
        _fail(ValueError, name, f"ends at {vals[-1]}", f"beyond the tensor's {total} tokens")
    if steps and max(steps) > max_seqlen:
        _fail(ValueError, max_name, f"is {max_seqlen}",
              f"below the longest sequence in {name} ({max(steps)})")


def check_seqused(seqused, cu, name="seqused_k"):
    """0 <= seqused[b] <= the rows sequence b has in cu (cu_seqlens_k for seqused_k,
    cu_seqlens_q for seqused_q), or in the padded length when cu is an int. A pair that
    passed is not read again while both tensors are unchanged (`_PASSED`: the layers of a
    model share them, and each read waits for the GPU)."""
    if torch.compiler.is_compiling():
        return
    against = cu if isinstance(cu, int) else (id(cu), cu._version)
    seen = _PASSED.get(seqused, ("seqused", name, against))
    if seen is True or (seen is not None and seen() is cu):
        return
    _check_seqused_values(seqused, cu, name)
    # the offsets tensor by weak reference: a new tensor that reuses a freed one's id
    # must not find the old verdict
    _PASSED.put(seqused, ("seqused", name, against),
                True if isinstance(cu, int) else weakref.ref(cu))


def _check_seqused_values(seqused, cu, name):
    used = seqused.tolist()
    if isinstance(cu, int):
        cu, what = [b * cu for b in range(len(used) + 1)], "the padded length, dim 1"
    else:
        cu = cu.tolist()
        what = f"that sequence's rows in cu_seqlens_{name[-1]}"
    for b, u in enumerate(used):
        if u < 0 or u > cu[b + 1] - cu[b]:
            _fail(ValueError, f"{name}[{b}]", f"is {u}",
                  f"allowed: 0..{cu[b + 1] - cu[b]} ({what})")


# ---- KV cache (flash_attn_with_kvcache, paged varlen) --------------------------------------

def values_checkable(t: torch.Tensor) -> bool:
    """Value checks copy small tensors to the host; that is impossible while torch.compile
    traces or a CUDA graph captures, so there they are skipped (shape checks still run)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_int_arg(value, name, lo=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        _fail(ValueError if isinstance(value, int) else TypeError, name, f"is {value!r}",
              f"expected an int >= {lo}")


def check_page_table(page_table, batch, device):
    if not isinstance(page_table, torch.Tensor):
        _fail(TypeError, "page_table", f"is a {type(page_table).__name__}",
              "expected an int32 torch.Tensor (batch, max_pages)")
    if page_table.dtype != torch.int32:
        _fail(TypeError, "page_table", f"has dtype {page_table.dtype}", "expected torch.int32")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        _fail(ValueError, "page_table", f"has shape {tuple(page_table.shape)}",
              f"expected (batch, max_pages) with batch {batch}")
    if page_table.device != device:
        _fail(ValueError, "page_table", f"is on {page_table.device}", f"q is on {device}")
    if page_table.shape[1] > 0 and page_table.stride(1) != 1:
        _fail(ValueError, "page_table", f"has stride {page_table.stride()}",
              "each row must be contiguous: call .contiguous()")


def check_page_size(page_size: int, cache_name: str):
    # The kernels read whole 16-row tiles; a page is never smaller than one.
    if page_size <= 0 or page_size % 16 != 0:
        _fail(ValueError, f"{cache_name} page size (dim 1)", f"is {page_size}",
              "with page_table it must be a positive multiple of 16")


def check_cache_values(lens, lens_name, extra, capacity, page_table, num_pages, page_size,
                       batch_idx, batch_cache, appending, leftpad=None):
    """Refuse lengths past the cache, page indices out of range, cache rows out of range and
    sequence starts (leftpad) past the sequence's end.

    lens: int32 (batch,) keys already in each sequence's cache; `extra` new ones follow.
    Only the pages a sequence uses are checked: the rest of its page-table row may hold
    anything (serving engines pad it). One host copy for all the tensors.
    """
    parts = [lens] + ([batch_idx] if batch_idx is not None else []) + \
        ([leftpad] if leftpad is not None else []) + \
        ([page_table.flatten()] if page_table is not None else [])
    host = torch.cat([p.to(torch.int64) for p in parts]).cpu()
    batch = lens.shape[0]
    lens_h = host[:batch]
    for b, n in enumerate(lens_h.tolist()):
        if n < 0:
            _fail(ValueError, f"{lens_name}[{b}]", f"is {n}", "lengths must be >= 0")
        if n + extra > capacity:
            what = f"is {n}" + (f" and {extra} new tokens are appended" if extra else "")
            _fail(ValueError, f"{lens_name}[{b}]", what,
                  f"sequences must fit the cache's capacity of {capacity} tokens")
    off = batch
    if batch_idx is not None:
        idx = host[off:off + batch]
        off += batch
        bad = ((idx < 0) | (idx >= batch_cache)).nonzero()
        if bad.numel():
            b = bad[0, 0].item()
            _fail(ValueError, f"cache_batch_idx[{b}]", f"is {idx[b].item()}",
                  f"allowed: 0..{batch_cache - 1} (rows of k_cache)")
        if appending and idx.unique().numel() != batch:
            _fail(ValueError, "cache_batch_idx", f"is {idx.tolist()[:16]}",
                  "repeats a cache row while k/v are appended: the writes would collide")
    if leftpad is not None:
        starts = host[off:off + batch]
        off += batch
        bad = ((starts < 0) | (starts > lens_h)).nonzero()
        if bad.numel():
            b = bad[0, 0].item()
            _fail(ValueError, f"cache_leftpad[{b}]", f"is {starts[b].item()}",
                  f"allowed: 0..{lens_h[b].item()} (the sequence's {lens_name})")
    if page_table is not None:
        table = host[off:].view(batch, -1)
        pages_used = (lens_h + extra + page_size - 1) // page_size
        used = torch.arange(table.shape[1]).unsqueeze(0) < pages_used.unsqueeze(1)
        bad = (used & ((table < 0) | (table >= num_pages))).nonzero()
        if bad.numel():
            b, j = bad[0].tolist()
            _fail(ValueError, f"page_table[{b}, {j}]", f"is {table[b, j].item()}",
                  f"allowed: 0..{num_pages - 1} (pages of the cache)")
    return int((lens_h + extra).max().item()) if batch else 0
