"""flash-attn 2's packed entry points: q, k, v (or k, v) stacked in one tensor, as a fused
QKV projection produces them.

Each is the unpacked function on views of the packed tensor (no copy here): gradients flow
back into the packed tensor through autograd's views. The views are strided (a row of q is
followed by that row's k and v): the Hopper kernels read them in place or as contiguous
copies (`backends/sm90/fwd.tma_ready`), the portable kernels take strides anyway.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .dense import flash_attn_func, flash_attn_varlen_func
from .validation import _fail


def _unpack(t, name: str, count: int, rank: int, layout: str) -> tuple:
    """The `count` tensors stacked along dim rank - 3 of `t` (views)."""
    if not isinstance(t, Tensor):
        _fail(TypeError, name, f"is a {type(t).__name__}", "expected a torch.Tensor")
    if t.dim() != rank or t.shape[rank - 3] != count:
        _fail(ValueError, name, f"has shape {tuple(t.shape)}", f"expected {layout}")
    return t.unbind(rank - 3)


def flash_attn_qkvpacked_func(
    qkv: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size=(-1, -1), softcap: float = 0.0, learnable_sink: Optional[Tensor] = None,
    deterministic: bool = False, return_lse: bool = False,
):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim): q, k, v = qkv[:, :, i]."""
    q, k, v = _unpack(qkv, "qkv", 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap,
                           learnable_sink, deterministic, return_lse)


def flash_attn_kvpacked_func(
    q: Tensor, kv: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size=(-1, -1), softcap: float = 0.0, learnable_sink: Optional[Tensor] = None,
    deterministic: bool = False, return_lse: bool = False,
):
    """flash_attn_func on q and kv (batch, seqlen_k, 2, nheads_kv, headdim): k, v =
    kv[:, :, 0], kv[:, :, 1] (GQA: nheads_q a multiple of nheads_kv)."""
    k, v = _unpack(kv, "kv", 2, 5, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    return flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap,
                           learnable_sink, deterministic, return_lse)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
    return_lse: bool = False,
):
    """flash_attn_varlen_func on qkv (total_tokens, 3, nheads, headdim), one set of offsets
    for queries and keys."""
    q, k, v = _unpack(qkv, "qkv", 3, 4, "(total_tokens, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  softmax_scale, causal, window_size, softcap, learnable_sink,
                                  deterministic, return_lse)


def flash_attn_varlen_kvpacked_func(
    q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size=(-1, -1), softcap: float = 0.0, learnable_sink: Optional[Tensor] = None,
    deterministic: bool = False, return_lse: bool = False,
):
    """flash_attn_varlen_func on q and kv (total_k, 2, nheads_kv, headdim)."""
    k, v = _unpack(kv, "kv", 2, 4, "(total_tokens, 2, nheads_kv, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                  learnable_sink, deterministic, return_lse)
