"""ring_attention: the public entry of context parallelism, its checks and options."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..api import validation as check
from .comm import Ring
from .ring import RingSpec, run

LAYOUTS = ("zigzag", "contiguous")


def _fail(exc, msg):
    raise exc(f"asymflash: ring_attention: {msg}")


def _check(q, k, v, causal, window_size, layout, world):
    check.check_tensors(q, k, v, 4, "(batch, local_seqlen, nheads, headdim)")
    if layout not in LAYOUTS:
        _fail(ValueError, f"layout is {layout!r}; allowed: {LAYOUTS}")
    left, right = window_size
    if left != -1 or (right != -1 and not (causal and right == 0)):
        # A window needs each block's global offset in its mask; the blocks' masks here are
        # only full or causal-diagonal.
        _fail(NotImplementedError, f"window_size is {tuple(window_size)}; sliding windows "
              "are not implemented for ring attention (use (-1, -1), with causal=True for "
              "causal)")
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, f"k has batch {k.shape[0]}; must equal q's batch {q.shape[0]}")
    if causal and k.shape[1] != q.shape[1]:
        _fail(ValueError, f"q holds {q.shape[1]} tokens and k {k.shape[1]}; causal ring "
              "attention needs each rank's shard of q and of k/v to be the same tokens")
    if causal and layout == "zigzag" and world > 1 and q.shape[1] % 2:
        _fail(ValueError, f"the local shard has {q.shape[1]} tokens; a zigzag shard is two "
              "equal chunks (zigzag_shard makes one from a multiple of 2 * world tokens)")


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup] = None,
    causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
    softcap: float = 0.0, deterministic: bool = False, return_lse: bool = False,
    layout: str = "zigzag",
):
    """Exact attention of this rank's queries over the keys of every rank of `group`.

    q: (batch, local_seqlen, nheads_q, d), k/v: (batch, local_seqlen_k, nheads_kv, d / dv):
    this rank's shard of one sequence batch; every rank of the group calls with the same
    shapes (default group: the world). Returns out (batch, local_seqlen, nheads_q, dv) for
    the local queries, or (out, lse) with lse fp32 (batch, nheads_q, local_seqlen), natural
    log (not differentiable). Differentiable in q, k, v: the backward is another ring pass.

    causal=True masks by global position, so it depends on how the sequence was sharded:
    layout="zigzag" (default; `zigzag_shard`: rank r holds chunks r and 2W-1-r of 2W, which
    balances the causal work over the ranks) or "contiguous" (rank r holds the r-th of W
    slices; the last rank does W times the first's work). Without causal the layout does not
    matter. softmax_scale, softcap, GQA/MQA and dtypes as flash_attn_func; deterministic=True
    keeps the backward bitwise reproducible (every sum runs in a fixed order). Not
    implemented: sliding windows, learnable sinks, varlen (NotImplementedError / no argument).
    """
    if not (dist.is_available() and dist.is_initialized()):
        _fail(RuntimeError, "torch.distributed is not initialised: call "
              "torch.distributed.init_process_group first (NCCL for CUDA tensors, gloo for "
              "CPU tensors)")
    check.check_scalars(softmax_scale, window_size, softcap)
    ring = Ring(group)
    _check(q, k, v, causal, window_size, layout, ring.world)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    spec = RingSpec(ring, scale, bool(causal), layout == "zigzag", float(softcap),
                    bool(deterministic))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, lse = run(q, k, v, spec, grad)
    return (out, lse) if return_lse else out
