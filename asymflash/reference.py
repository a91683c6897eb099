"""The plain-math definition of asymflash's attention: every feature, scores materialised.

Used by the tests, the demo and the benchmark as the ground truth. Slow and memory-hungry
(O(seqlen_q * seqlen_k) per head) by design: it is written to be obviously right.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .core.fp8 import dequantize  # noqa: F401 - part of the definition of fp8 attention
from .core.masks import allowed, normalize_window


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    upcast: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    p_dtype: Optional[torch.dtype] = None,
):
    """Attention on BSHD tensors; returns (out, lse).

    q: (batch, seqlen_q, nheads_q, d), k: (batch, seqlen_k, nheads_kv, d),
    v: (batch, seqlen_k, nheads_kv, dv); nheads_q a multiple of nheads_kv (GQA/MQA).
    s = softmax_scale * q.k (default scale 1/sqrt(d)); with softcap > 0,
    s = softcap * tanh(s / softcap); masked keys (causal / local window, bottom-right aligned)
    get -inf; a learnable sink adds exp(sink[h]) to the softmax denominator of head h (the
    sink logit is in the same units as s and carries no value). Rows with nothing to attend to
    give out = 0 and lse = -inf.

    upcast=True computes in `compute_dtype` (fp32, or fp64 for tests of the reference itself)
    and returns out in that dtype; upcast=False computes the matmuls in the input dtype with
    the softmax in fp32, the same-dtype baseline of the FlashAttention tolerance rule.
    p_dtype (an 8-bit float, with upcast=False) rounds P to it before P·V, as fp8 kernels
    run P·V (FlashAttention-3): the weights scaled so a row's largest is 256 (inside e4m3's
    normal range), rounded through fp16, the denominator from the unrounded weights; the
    baseline of such kernels.
    lse is (batch, nheads_q, seqlen_q) in fp32 (natural log) — or compute_dtype when upcast.
    """
    batch, seqlen_q, nheads_q, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    work = compute_dtype if upcast else q.dtype
    qf, kf, vf = (t.to(work) for t in (q, k, v))
    group = nheads_q // nheads_kv
    kf = kf.repeat_interleave(group, dim=2)
    vf = vf.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf)
    stat = compute_dtype if upcast else torch.float32
    scores = scores.to(stat) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    ok = allowed(seqlen_q, seqlen_k, normalize_window(causal, window_size), q.device)
    scores = scores.masked_fill(~ok, float("-inf"))

    row_max = scores.amax(dim=-1, keepdim=True) if seqlen_k > 0 else torch.full(
        (batch, nheads_q, seqlen_q, 1), float("-inf"), dtype=stat, device=q.device)
    if learnable_sink is not None:
        sink = learnable_sink.to(stat).view(1, nheads_q, 1, 1)
        row_max = torch.maximum(row_max, sink)
    # A row with no allowed key has max -inf: shift by 0 instead so exp gives 0, not NaN.
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - safe_max)
    denom = p.sum(dim=-1, keepdim=True)
    if learnable_sink is not None:
        denom = denom + torch.exp(sink - safe_max)
    lse = (safe_max + torch.log(denom)).squeeze(-1)
    if p_dtype is not None:
        p = (p * 256).to(torch.float16).to(p_dtype).to(stat) / 256
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(work), vf)
    if not upcast:
        lse = lse.float()
    return out, lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    **kw,
):
    """Packed (varlen) attention, sequence by sequence through attention_ref; (out, lse).

    q: (total_q, nheads_q, d), k/v: (total_k, nheads_kv, d / dv). Sequence b's queries are
    rows cu_seqlens_q[b] : cu_seqlens_q[b] + seqused_q[b] (all of its rows without
    seqused_q), its keys rows cu_seqlens_k[b] : cu_seqlens_k[b] + seqused_k[b] (likewise);
    masks are aligned to those used lengths. Query rows outside every sequence's used rows
    (past seqused_q, or past the last offset) are not computed: out = 0 and lse = -inf there,
    and no gradient flows through them (their dq is 0). lse is (nheads_q, total_q). kw as
    attention_ref (softmax_scale, causal, window_size, softcap, learnable_sink, upcast, ...).
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    hq, dv = q.shape[1], v.shape[2]
    outs, lses, row = [], [], 0

    def gap(n, out_dtype, lse_dtype):
        outs.append(torch.zeros(n, hq, dv, dtype=out_dtype, device=q.device))
        lses.append(torch.full((hq, n), float("-inf"), dtype=lse_dtype, device=q.device))

    for b in range(len(cu_q) - 1):
        sq = used_q[b] if used_q is not None else cu_q[b + 1] - cu_q[b]
        sk = used_k[b] if used_k is not None else cu_k[b + 1] - cu_k[b]
        o, lse = attention_ref(q[cu_q[b]:cu_q[b] + sq].unsqueeze(0),
                               k[cu_k[b]:cu_k[b] + sk].unsqueeze(0),
                               v[cu_k[b]:cu_k[b] + sk].unsqueeze(0), **kw)
        if cu_q[b] > row:
            gap(cu_q[b] - row, o.dtype, lse.dtype)
        outs.append(o[0])
        lses.append(lse[0])
        row = cu_q[b] + sq
    if q.shape[0] > row:
        dtype = outs[0].dtype if outs else (torch.float32 if kw.get("upcast", True) else q.dtype)
        gap(q.shape[0] - row, dtype, lses[0].dtype if lses else torch.float32)
    return torch.cat(outs), torch.cat(lses, dim=1)
def attention_fp8_ref(q, k, v, q_descale=None, k_descale=None, v_descale=None,
                      compute_dtype: torch.dtype = torch.float32, **kw):
    """fp8 attention's definition: attention_ref of the dequantised q, k, v (BSHD).

    q may be fp8 or already 16-bit (an fp8 KV cache beside bf16 queries, q_descale None).
    Returns (out, lse) in compute_dtype; kw as attention_ref.
    """
    qd, kd, vd = (dequantize(t, s, dtype=compute_dtype)
                  for t, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
    return attention_ref(qd, kd, vd, compute_dtype=compute_dtype, **kw)


def flex_attention_ref(query, key, value, score_mod=None, block_mask=None, scale=None,
                       enable_gqa: bool = False, compute_dtype: torch.dtype = torch.float32):
    """torch FlexAttention's semantics (core/flex.py), on (batch, heads, seqlen, dim) tensors.

    The mods are called directly (vectorised with torch.vmap), never through asymflash's
    traced form, so this checks the tracing too. Returns (out, lse) in compute_dtype, lse
    (batch, heads_q, seqlen_q) in natural log; differentiable in q, k, v and in tensors the
    mods captured.
    """
    from .core import flex

    batch, heads_q, seqlen_q, d = query.shape
    heads_kv, seqlen_k = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qf, kf, vf = (t.to(compute_dtype) for t in (query, key, value))
    if heads_q != heads_kv:
        kf = kf.repeat_interleave(heads_q // heads_kv, dim=1)
        vf = vf.repeat_interleave(heads_q // heads_kv, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    scores = flex.apply_score_mod(score_mod, scores).to(compute_dtype)
    layout = flex.block_layout(block_mask, seqlen_q, seqlen_k)
    ok = flex.allowed_matrix(layout, batch, heads_q, seqlen_q, seqlen_k, query.device)
    scores = scores.masked_fill(~ok, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if seqlen_k else torch.full(
        (batch, heads_q, seqlen_q, 1), float("-inf"), dtype=compute_dtype, device=query.device)
    # A row with no allowed key has max -inf: shift by 0 instead so exp gives 0, not NaN.
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - safe_max)
    denom = p.sum(dim=-1, keepdim=True)
    lse = (safe_max + torch.log(denom)).squeeze(-1)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("bhqk,bhkd->bhqd", p, vf), lse
