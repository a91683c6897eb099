"""flash_attn_varlen_func as serving engines call it for prefill (FA3/FA4's forms).

- seqused_q (int32, (batch,)): only the first seqused_q[b] query rows of sequence b are
  used; the causal / window masks are aligned to that length. Unused rows are not computed:
  out is 0 and lse -inf there, and their dq is 0 (FA3 leaves them unspecified; this is the
  reference's definition, `reference.attention_varlen_ref`).
- A padded batch: cu_seqlens_q and cu_seqlens_k None, q (batch, seqlen_q, nheads, d) and
  k/v (batch, seqlen_k, nheads_kv, d / dv); seqused_q / seqused_k give the used lengths
  (all rows when None). out is then (batch, seqlen_q, nheads, dv) and lse (batch, nheads,
  seqlen_q), as flash_attn_func returns them.

Both become an ordinary varlen call (`core.params.split_unused_queries` for seqused_q), so
every backend that computes varlen computes them, forward and backward; these calls take
the full path (validation reads the lengths on the host, as for seqused_k), not a plan.
"""

from __future__ import annotations

import math

import torch

from ..core.params import SeqInfo, split_unused_queries
from . import validation as check
from .ops import call


def _offsets(batch: int, seqlen: int, device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def _check_padded(q, k, v, seqused_q, seqused_k):
    check.check_tensors(q, k, v, 4, "(batch, seqlen, nheads, headdim): with cu_seqlens_q and "
                        "cu_seqlens_k None the batch is padded")
    batch = q.shape[0]
    if k.shape[0] != batch:
        check._fail(ValueError, "k", f"has batch {k.shape[0]}", f"must equal q's batch {batch}")
    for name, used, rows in (("seqused_q", seqused_q, q.shape[1]),
                             ("seqused_k", seqused_k, k.shape[1])):
        if used is not None:
            check.check_int_vector(used, name, batch, q.device)
            check.check_seqused(used, rows, name)


def _check_packed(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k):
    check.check_tensors(q, k, v, 3, "(total_tokens, nheads, headdim)")
    check.check_int_vector(cu_q, "cu_seqlens_q", None, q.device)
    batch = cu_q.shape[0] - 1
    if batch < 0:
        check._fail(ValueError, "cu_seqlens_q", "is empty", "expected batch + 1 >= 1 offsets")
    check.check_int_vector(cu_k, "cu_seqlens_k", batch + 1, q.device)
    check.check_cu_seqlens(cu_q, "cu_seqlens_q", q.shape[0], max_q, "max_seqlen_q")
    check.check_cu_seqlens(cu_k, "cu_seqlens_k", k.shape[0], max_k, "max_seqlen_k")
    for name, used, cu in (("seqused_q", seqused_q, cu_q), ("seqused_k", seqused_k, cu_k)):
        if used is not None:
            check.check_int_vector(used, name, batch, q.device)
            check.check_seqused(used, cu, name)


def serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   seqused_q, seqused_k, softmax_scale, causal, window_size, softcap, sink,
                   deterministic, return_lse):
    """The seqused_q and padded-batch forms of flash_attn_varlen_func, validated here."""
    padded = cu_seqlens_q is None
    if padded != (cu_seqlens_k is None):
        given, missing = ("cu_seqlens_k", "cu_seqlens_q") if padded else \
            ("cu_seqlens_q", "cu_seqlens_k")
        check._fail(ValueError, missing, f"is None while {given} is given",
                    "pass both (packed sequences) or neither (a padded batch, lengths from "
                    "seqused_q / seqused_k)")
    if padded:
        _check_padded(q, k, v, seqused_q, seqused_k)
        batch, max_seqlen_q, max_seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_seqlens_q = _offsets(batch, max_seqlen_q, q.device)
        cu_seqlens_k = _offsets(batch, max_seqlen_k, q.device)
    else:
        _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_q, seqused_k)
    check.check_scalars(softmax_scale, window_size, softcap)
    check.check_sink(sink, q, q.shape[-2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if seqused_q is not None:
        cu_seqlens_q, cu_seqlens_k, seqused_k = split_unused_queries(
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    # A padded batch using every row is the dense layout: backends may specialise on it.
    uniform = padded and seqused_q is None and seqused_k is None
    seq = SeqInfo(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, uniform)
    out, lse = call(q, k, v, seq, scale, causal, window_size, softcap, sink, deterministic,
                    dense=padded)
    if padded:
        lse = lse.view(lse.shape[0], q.shape[0], q.shape[1]).transpose(0, 1)
    return (out, lse) if return_lse else out
