"""ring_attention: the public entry of context parallelism, its checks and options."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..api import validation as check
from ..core.masks import normalize_window
from .comm import Ring
from .ring import RingSpec, run
from .rows import DenseRows, PackedRows
from .window import WindowPlan

LAYOUTS = ("zigzag", "contiguous")


def _fail(exc, msg):
    raise exc(f"asymflash: ring_attention: {msg}")


def _check_options(causal, window_size, layout):
    """(causal, window): the call's causal flag (window_size=(-1, 0) counting as causal, as
    flash-attn) and its sliding window (left, right) with causal as right = 0, or None when
    it has none (plain or causal attention keep their own schedule)."""
    if layout not in LAYOUTS:
        _fail(ValueError, f"layout is {layout!r}; allowed: {LAYOUTS}")
    mask = normalize_window(causal, window_size)
    if mask.window_left == -1 and mask.window_right in (-1, 0):
        return mask.causal, None
    return False, (mask.window_left, mask.window_right)


def _check(q, k, v, causal, window_size, layout, world):
    check.check_tensors(q, k, v, 4, "(batch, local_seqlen, nheads, headdim)")
    causal, window = _check_options(causal, window_size, layout)
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, f"k has batch {k.shape[0]}; must equal q's batch {q.shape[0]}")
    # both mask by global position: each rank's queries and keys must be the same tokens
    positional = causal or window is not None
    what = "causal" if causal else "windowed"
    if positional and k.shape[1] != q.shape[1]:
        _fail(ValueError, f"q holds {q.shape[1]} tokens and k {k.shape[1]}; {what} ring "
              "attention needs each rank's shard of q and of k/v to be the same tokens")
    if positional and layout == "zigzag" and world > 1 and q.shape[1] % 2:
        _fail(ValueError, f"the local shard has {q.shape[1]} tokens; a zigzag shard is two "
              "equal chunks (zigzag_shard makes one from a multiple of 2 * world tokens)")
    return causal, window


def _init_check():
    if not (dist.is_available() and dist.is_initialized()):
        _fail(RuntimeError, "torch.distributed is not initialised: call "
              "torch.distributed.init_process_group first (NCCL for CUDA tensors, gloo for "
              "CPU tensors)")


def _spec(q, ring, causal, softmax_scale, softcap, deterministic, layout, rows, window,
          segments):
    """segments: (first row, local length) of each sequence, for a window's plan."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    zigzag = layout == "zigzag"
    plan = None if window is None else WindowPlan(*window, segments, ring.rank, ring.world,
                                                  zigzag, q.device)
    return RingSpec(ring, scale, bool(causal), zigzag, float(softcap), bool(deterministic),
                    rows, plan)


def _run(q, k, v, sink, spec, return_lse):
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sink is not None and sink.requires_grad))
    out, lse = run(q, k, v, sink, spec, grad)
    return (out, lse) if return_lse else out


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup] = None,
    causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
    softcap: float = 0.0, deterministic: bool = False, return_lse: bool = False,
    layout: str = "zigzag", learnable_sink: Optional[Tensor] = None,
):
    """Exact attention of this rank's queries over the keys of every rank of `group`.

    q: (batch, local_seqlen, nheads_q, d), k/v: (batch, local_seqlen_k, nheads_kv, d / dv):
    this rank's shard of one sequence batch; every rank of the group calls with the same
    shapes (default group: the world). Returns out (batch, local_seqlen, nheads_q, dv) for
    the local queries, or (out, lse) with lse fp32 (batch, nheads_q, local_seqlen), natural
    log. Differentiable in q, k, v (through out and lse): the backward is another ring pass,
    so every rank of the group must run it.

    causal=True masks by global position, so it depends on how the sequence was sharded:
    layout="zigzag" (default; `zigzag_shard`: rank r holds chunks r and 2W-1-r of 2W, which
    balances the causal work over the ranks) or "contiguous" (rank r holds the r-th of W
    slices; the last rank does 2W-1 times the first's work). Without causal the layout does not
    matter. softmax_scale, softcap, GQA/MQA and dtypes as flash_attn_func; deterministic=True
    keeps the backward bitwise reproducible (every sum runs in a fixed order).
    learnable_sink (nheads_q,) as flash_attn_func, the same tensor on every rank: its
    gradient is this rank's share (sum it over the group, as for any parameter under context
    parallelism).

    window_size=(left, right) as flash_attn_func, over global positions (the query at i sees
    keys i - left .. i + right; -1 unbounded; causal=True sets right = 0): the result equals
    flash_attn_func(..., window_size=...) over the unsharded sequence. Needs q and k/v to
    be the same tokens on each rank (as causal does). Chunk pairs (one local run of
    positions: the zigzag chunks or the contiguous slice, by one of the held block's) that
    the window does not reach are skipped, and the others cut to the rows and keys it
    reaches, so a window much shorter than the sequence costs about its own width in
    compute per query chunk; K/V still go round the whole ring. Zigzag balances a causal
    window's work only roughly; contiguous shards suit a window shorter than a shard
    (each rank needs little more than its own and its predecessor's keys).
    """
    _init_check()
    check.check_scalars(softmax_scale, window_size, softcap)
    ring = Ring(group)
    causal, window = _check(q, k, v, causal, window_size, layout, ring.world)
    check.check_sink(learnable_sink, q, q.shape[2])
    n = q.shape[1]
    spec = _spec(q, ring, causal, softmax_scale, softcap, deterministic, layout,
                 DenseRows(n), window, [(b * n, n) for b in range(q.shape[0])])
    return _run(q, k, v, learnable_sink, spec, return_lse)


def ring_attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    group: Optional[dist.ProcessGroup] = None, causal: bool = False,
    softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
    deterministic: bool = False, return_lse: bool = False, layout: str = "zigzag",
    learnable_sink: Optional[Tensor] = None,
):
    """ring_attention over packed sequences (self-attention): q (total, nheads_q, d), k/v
    (total, nheads_kv, d / dv) hold this rank's shard of every sequence, sequence b at rows
    cu_seqlens[b]:cu_seqlens[b+1] (int32, the LOCAL offsets, the same on every rank, e.g.
    from zigzag_shard_varlen); max_seqlen the longest local shard. Returns out (total,
    nheads_q, dv), or (out, lse) with lse (nheads_q, total). Each sequence is sharded on its
    own: layout="zigzag" (every local length even: chunks r and 2W-1-r of that sequence) or
    "contiguous" (the r-th slice of each). Other arguments, window_size included (over each
    sequence's global positions), as ring_attention.
    """
    _init_check()
    check.check_scalars(softmax_scale, window_size, softcap)
    ring = Ring(group)
    check.check_tensors(q, k, v, 3, "(total_tokens, nheads, headdim)")
    causal, window = _check_options(causal, window_size, layout)
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, f"q holds {q.shape[0]} tokens and k {k.shape[0]}; the varlen ring "
              "is self-attention: each rank's q, k and v are the same tokens")
    check.check_int_vector(cu_seqlens, "cu_seqlens", None, q.device)
    check.check_cu_seqlens(cu_seqlens, "cu_seqlens", q.shape[0], max_seqlen, "max_seqlen")
    cu = cu_seqlens.tolist()
    if cu and (cu[0] != 0 or cu[-1] != q.shape[0]):
        _fail(ValueError, f"cu_seqlens runs from {cu[0]} to {cu[-1]}; expected 0 to the "
              f"{q.shape[0]} local tokens")
    if (causal or window is not None) and layout == "zigzag" and ring.world > 1:
        odd = [z - a for a, z in zip(cu, cu[1:]) if (z - a) % 2]
        if odd:
            _fail(ValueError, f"local sequence lengths {odd[:4]} are odd; a zigzag shard of a "
                  "sequence is two equal chunks (zigzag_shard_varlen makes them)")
    check.check_sink(learnable_sink, q, q.shape[1])
    spec = _spec(q, ring, causal, softmax_scale, softcap, deterministic, layout,
                 PackedRows(cu_seqlens, max_seqlen), window,
                 [(a, z - a) for a, z in zip(cu, cu[1:])])
    return _run(q, k, v, learnable_sink, spec, return_lse)
