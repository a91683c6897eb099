"""Hugging Face transformers: asymflash as an attention implementation.

    from asymflash.integrations.hf import register
    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="asymattn")

The name is "asymattn", not "asymflash": transformers treats any implementation name that
contains "flash" as a flash-attn kernel to import (from the package or the Hub) and fails
on ours (transformers 5.x, `is_flash_attention_requested`).

transformers (5.x) calls the registered function once per attention layer as
fn(module, query, key, value, attention_mask, scaling=..., dropout=..., sliding_window=...,
softcap=..., s_aux=..., **kwargs) with (batch, heads, seq, head_dim) tensors and expects
((batch, seq, heads, head_dim) output, attention weights or None). Its KV cache hands us the
whole key history at each decode step: q is then shorter than k, and asymflash's causal mask,
aligned to the bottom-right corner, lets the new tokens see every cached key and each other
causally, which is what the cache means.

Decode steps (a few query tokens, no gradient) go through `flash_attn_with_kvcache` on the
cache as transformers holds it: its (batch, heads, seq, head_dim) tensors, transposed, are
read in place by the split-KV decode kernel, with each kv head's query heads packed into one
tile. A left-padded batch (each mask row zeros, then ones: what `generate` makes of prompts
of different lengths) passes its padding as `cache_leftpad`. Otherwise `flash_attn_func`
would read the cache through a packed-row view that (batch > 1) copies all of it, and the
varlen path gathers it: a copy of the whole cache, every layer, every token.
"""

from __future__ import annotations

import torch

from ..api.dense import flash_attn_func, flash_attn_varlen_func
from ..api.kvcache import flash_attn_with_kvcache
from ..runtime.tensor_memo import TensorMemo

NAME = "asymattn"
# Calls with at most this many query tokens and a longer key history are decode steps (or
# short speculative chunks): they take the kvcache path when no gradient is needed.
DECODE_MAX_Q = 16


def _window(sliding_window, causal):
    # HF's sliding window keeps keys with kv_idx > q_idx - sliding_window: `sliding_window`
    # keys including the query's own position, i.e. a left window of sliding_window - 1.
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    left = sliding_window - 1
    return (left, 0 if causal else left)


# transformers passes the same 2-D padding mask to every layer of a forward pass. What the
# varlen call needs from it (row indices, offsets, longest lengths) is derived once per mask
# tensor and query length: each derivation reads the mask on the host, a wait for the GPU,
# and boolean indexing would wait once more per gather.
_OFFSETS = TensorMemo()
_MISSING = object()


def _padding_offsets(mask, seqlen_q):
    """((b_q, t_q), (b_k, t_k), cu_q, cu_k, max_q, max_k) of a 2-D padding mask (true for
    real tokens, (batch, kv_len)) with the queries at its last seqlen_q positions: the batch
    and position of every kept query and key, in order, and the varlen offsets."""
    found = _OFFSETS.get(mask, seqlen_q)
    if found is not None:
        return found
    keep = mask.bool()
    keep_q = keep[:, -seqlen_q:]
    lens_q = keep_q.sum(1, dtype=torch.int32)
    lens_k = keep.sum(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    cu_q = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    found = (keep_q.nonzero(as_tuple=True), keep.nonzero(as_tuple=True), cu_q, cu_k,
             int(lens_q.max()), int(lens_k.max()))
    _OFFSETS.put(mask, seqlen_q, found)
    return found


def _left_padding(mask):
    """int32 (batch,) leading zeros of each row of a 2-D padding mask, or None unless every
    row is zeros followed by ones (left padding). Derived once per mask tensor (a host read
    of a bool, a wait for the GPU)."""
    found = _OFFSETS.get(mask, "left", _MISSING)
    if found is not _MISSING:
        return found
    keep = mask.bool()
    pad = (keep.cumsum(1) == 0).sum(1)
    positions = torch.arange(keep.shape[1], device=keep.device)
    left_padded = bool((keep == (positions.unsqueeze(0) >= pad.unsqueeze(1))).all())
    found = pad.to(torch.int32) if left_padded else None
    _OFFSETS.put(mask, "left", found)
    return found


def _unpadded(q, k, v, mask, **kw):
    """Attention of a padded batch through varlen: only kept positions take part.

    mask: HF's 2-D padding mask (batch, kv_len), true for real tokens; the queries are the
    last seqlen_q positions (a static cache's k, v may be longer than the mask). Padded query
    rows come back as zeros.
    """
    batch, seqlen_q, nheads_q, _ = q.shape
    rows_q, rows_k, cu_q, cu_k, max_q, max_k = _padding_offsets(mask, seqlen_q)
    packed = flash_attn_varlen_func(q[rows_q], k[rows_k], v[rows_k], cu_q, cu_k, max_q, max_k,
                                    **kw)
    out = q.new_zeros(batch, seqlen_q, nheads_q, v.shape[-1])
    out[rows_q] = packed
    return out


def _decode_step(q, k, v, sink, reads_mask: bool = False) -> bool:
    """Whether a call is a decode step the kvcache path computes: a few new queries over a
    longer cache, and no gradient to flow (the kvcache path is forward only). While
    torch.compile traces, a step without a mask is one custom op (`asymflash::kvcache_attend`)
    and a padded step (`reads_mask`: its mask is read on the host) takes flash_attn_func, a
    custom op too; not while a CUDA graph captures."""
    if not (q.shape[1] <= DECODE_MAX_Q and k.shape[1] > q.shape[1]):
        return False
    # (cheapest first: this runs in every layer of every decode step)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    (sink is not None and sink.requires_grad)):
        return False
    if torch.compiler.is_compiling():
        return not reads_mask
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature on top of asymflash (see the module doc)."""
    if dropout and module.training:
        raise ValueError(f"asymflash: dropout is {dropout}; asymflash has no attention "
                         "dropout (use it at inference, or set attention_dropout=0)")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    sink = s_aux if s_aux is not None else kwargs.get("sinks")
    dtype = query.dtype
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if q.is_cuda and dtype == torch.float32:  # the GPU kernels are 16-bit tensor-core kernels
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, v))
    kw = dict(softmax_scale=scaling, causal=causal, window_size=_window(sliding_window, causal),
              softcap=float(softcap or 0.0), learnable_sink=sink)
    if attention_mask is None:
        if _decode_step(q, k, v, sink):
            out = flash_attn_with_kvcache(q, k, v, **kw)
        else:
            out = flash_attn_func(q, k, v, **kw)
    elif attention_mask.dim() == 2:
        leftpad = _left_padding(attention_mask) \
            if _decode_step(q, k, v, sink, reads_mask=True) else None
        if leftpad is not None:
            # A static cache may be longer than the mask: its slots past the mask are unused.
            used = attention_mask.shape[1]
            out = flash_attn_with_kvcache(q, k, v, cache_seqlens=None if used == k.shape[1]
                                          else used, cache_leftpad=leftpad,
                                          check_values=False, **kw)
        else:
            out = _unpadded(q, k, v, attention_mask, **kw)
    else:
        raise ValueError(f"asymflash: attention_mask has shape {tuple(attention_mask.shape)}; "
                         "expected None or a 2-D padding mask (register() installs the mask "
                         "function that produces one)")
    return (out if out.dtype == dtype else out.to(dtype)), None


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` select asymflash in transformers (idempotent).

    Also registers FlashAttention's mask function for `name`, so the layers receive None
    (no padding) or a 2-D padding mask instead of a dense 4-D one.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
