"""The public dense entry points: flash_attn_func and flash_attn_varlen_func.

Each validates its arguments (`validation.py`), then runs through the op layer (`ops.py`);
a repeated call signature runs its call plan (runtime/plans.py) instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..core.masks import normalize_window
from ..core.params import SeqInfo
from ..runtime import plans
from . import fp8
from . import validation as check
from .ops import call, call_planned, call_planned_varlen


def _check_common(q, k, v, softmax_scale, window_size, softcap, learnable_sink):
    check.check_scalars(softmax_scale, window_size, softcap)
    check.check_sink(learnable_sink, q, q.shape[-2])
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def flash_attn_func(
    q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
    return_lse: bool = False, *, dropout_p: float = 0.0, alibi_slopes=None,
    return_attn_probs: bool = False, score_mod=None, mask_mod=None,
    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None, out_dtype=None,
):
    """Exact attention on (batch, seqlen, nheads, headdim) tensors, flash-attn compatible.

    q: (batch, seqlen_q, nheads_q, d); k: (batch, seqlen_k, nheads_kv, d);
    v: (batch, seqlen_k, nheads_kv, dv). fp16 or bf16 (fp32 too on the CPU). nheads_q must be
    a multiple of nheads_kv (GQA/MQA); d and dv multiples of 8 up to 256.
    softmax_scale defaults to 1/sqrt(d). causal and window_size=(left, right) masks are
    aligned to the bottom-right corner when seqlen_q != seqlen_k; -1 means unbounded.
    softcap > 0 applies s = softcap * tanh(s / softcap). learnable_sink: (nheads_q,) logits
    added to each row's softmax denominator (differentiable). deterministic=True makes the
    backward bitwise reproducible. Returns out (batch, seqlen_q, nheads_q, dv), or
    (out, lse) with lse fp32 (batch, nheads_q, seqlen_q) in natural log if return_lse.
    A query with nothing to attend to gets out = 0 and lse = -inf.

    flash-attn 2's keywords: dropout_p must be 0 (NotImplementedError otherwise);
    alibi_slopes (fp32, (nheads,) or (batch, nheads)) adds -slope * |i + seqlen_k - seqlen_q
    - j| to the scaled, soft-capped score; return_attn_probs=True returns (out, lse, None),
    its (out, softmax_lse, S_dmask) without the probabilities.
    score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) are
    FlexAttention's mods (asymflash.flex_attention), applied after softcap and ALiBi and
    together with causal/window_size; h is the query head.

    fp8 (FlashAttention-3's keywords; forward only, api/fp8.py): q, k, v in
    torch.float8_e4m3fn, or only k and v beside a 16-bit q, with q_descale, k_descale,
    v_descale fp32 (batch, nheads_kv) or None (= 1): attention of q * q_descale, k *
    k_descale, v * v_descale, query head h using its KV head's descale. out is bf16 (q's
    dtype for 16-bit q) unless out_dtype says otherwise; lse fp32.
    """
    descales = (q_descale, k_descale, v_descale)
    if fp8.wanted(q, k, v, descales, out_dtype):
        batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else None
        fp8.check_inputs(q, k, v, descales, out_dtype, batch)
        if score_mod is None and mask_mod is None and alibi_slopes is None and not dropout_p:
            result = fp8.kernel_forward(q, k, v, descales, softmax_scale, causal, window_size,
                                        softcap, learnable_sink)
            if result is not None:  # the sm90 fp8 kernel (descales applied)
                out, lse = result
                if return_lse or return_attn_probs:
                    lse = lse.view(q.shape[2], q.shape[0], q.shape[1]).transpose(0, 1)
                    result = (out, lse, None) if return_attn_probs else (out, lse)
                else:
                    result = out
                return fp8.finish(result, None, None, out_dtype or torch.bfloat16)
        q, k, v, work = fp8.rewrite(q, k, v, descales)
        result = flash_attn_func(
            q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink,
            deterministic, return_lse, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
            return_attn_probs=return_attn_probs, score_mod=score_mod, mask_mod=mask_mod)
        return fp8.finish(result, v_descale, None, out_dtype or work)
    if dropout_p:
        _refuse_fa2_features(dropout_p, None)
    if score_mod is not None or mask_mod is not None or alibi_slopes is not None:
        from .flex import flash_attn_with_mods

        out = flash_attn_with_mods(q, k, v, softmax_scale, causal, window_size, softcap,
                                   learnable_sink, return_lse or return_attn_probs,
                                   score_mod, mask_mod, alibi_slopes, deterministic)
        if return_attn_probs:
            return (*out, None)
        return out
    # A repeated signature runs its plan (plans.py: checks, dispatch and launch decisions
    # made by the first call of that signature); a new one takes the full path.
    key = plans.dense_key(q, k, v, softmax_scale, causal, window_size, softcap,
                          learnable_sink, deterministic)
    plan = plans.find(key)
    if plan is not None:
        out, lse = call_planned(plan, q, k, v, learnable_sink)
    else:
        out, lse = _dense_call(q, k, v, softmax_scale, causal, window_size, softcap,
                               learnable_sink, deterministic, key)
    if not (return_lse or return_attn_probs):
        return out
    batch, seqlen_q, nheads_q = q.shape[0], q.shape[1], q.shape[2]
    lse = lse.view(nheads_q, batch, seqlen_q).transpose(0, 1)
    return (out, lse, None) if return_attn_probs else (out, lse)


def _refuse_fa2_features(dropout_p, alibi_slopes):
    if alibi_slopes is not None:
        raise NotImplementedError("asymflash: alibi_slopes was given; ALiBi biases are not "
                                  "implemented (pass None)")
    raise NotImplementedError(f"asymflash: dropout_p is {dropout_p!r}; attention dropout is "
                              "not implemented (pass 0.0, e.g. at inference)")


def _dense_call(q, k, v, softmax_scale, causal, window_size, softcap, sink, deterministic,
                key):
    """flash_attn_func's full path: check everything, run, then plan the signature."""
    check.check_tensors(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"asymflash: k has batch {k.shape[0]}; must equal q's batch "
                         f"{q.shape[0]}")
    scale = _check_common(q, k, v, softmax_scale, window_size, softcap, sink)
    seq = SeqInfo.dense(q.shape[0], q.shape[1], k.shape[1], q.device)
    out, lse = call(q, k, v, seq, scale, causal, window_size, softcap, sink, deterministic,
                     dense=True)
    plans.remember(key, q, k, v, scale, normalize_window(causal, window_size), softcap,
                   None if sink is None else sink.float().contiguous(), deterministic)
    return out, lse


def flash_attn_varlen_func(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int | None, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
    return_lse: bool = False, seqused_k: Optional[Tensor] = None,
    page_table: Tensor | None = None, *, seqused_q: Optional[Tensor] = None,
    dropout_p: float = 0.0, alibi_slopes=None, return_attn_probs: bool = False,
    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None, out_dtype=None,
):
    """Exact attention on packed sequences: q (total_q, nheads_q, d), k/v (total_k, ...).

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:
    cu_seqlens_k[b+1] of k/v (int32, length batch + 1, non-decreasing); max_seqlen_q/k must be
    at least the longest sequence. seqused_k (int32, (batch,)) optionally uses only the first
    seqused_k[b] keys of each sequence. Other arguments as flash_attn_func; lse is
    (nheads_q, total_q).

    Paged KV (prefill over a cache): with page_table int32 (batch, max_pages), k and v are
    the paged caches (num_pages, page_size, nheads_kv, d / dv), page_size a multiple of 16,
    and key j of sequence b is row j % page_size of page page_table[b, j // page_size]. The
    key lengths come from seqused_k, else from cu_seqlens_k's differences (cu_seqlens_k and
    max_seqlen_k may then be None). This form is forward only: it runs under no_grad.

    Serving prefill (FA3/FA4's forms, api/serving.py): seqused_q (int32, (batch,)) uses only
    the first seqused_q[b] query rows of each sequence (masks aligned to that length; unused
    rows get out = 0, lse = -inf and zero gradients). With cu_seqlens_q and cu_seqlens_k None
    the batch is padded: q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_kv, d /
    dv), lengths from seqused_q / seqused_k (all rows when None), max_seqlen_* ignored; out is
    then (batch, seqlen_q, nheads, dv) and lse (batch, nheads, seqlen_q).

    dropout_p, alibi_slopes and return_attn_probs: as in flash_attn_func.

    fp8: q_descale, k_descale, v_descale and out_dtype as in flash_attn_func, batch being
    the number of sequences (len(cu_seqlens_q) - 1, or the padded batch); with page_table
    the paged caches may be fp8 (k_descale/v_descale per sequence and KV head).
    """
    descales = (q_descale, k_descale, v_descale)
    if fp8.wanted(q, k, v, descales, out_dtype):
        return _varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, softcap, learnable_sink,
                           deterministic, return_lse, seqused_k, page_table, seqused_q,
                           dropout_p, alibi_slopes, return_attn_probs, descales, out_dtype)
    if dropout_p or alibi_slopes is not None:
        _refuse_fa2_features(dropout_p, alibi_slopes)
    if return_attn_probs:
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_size, softcap, learnable_sink, deterministic, True, seqused_k,
            page_table, seqused_q=seqused_q)
        return out, lse, None
    if page_table is not None and seqused_q is not None:
        raise NotImplementedError("asymflash: seqused_q was given with page_table; paged "
                                  "prefill uses every query row (pass seqused_q=None)")
    if page_table is None and (seqused_q is not None or cu_seqlens_q is None or
                               cu_seqlens_k is None):
        from .serving import serving_varlen

        return serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              seqused_q, seqused_k, softmax_scale, causal, window_size, softcap,
                              learnable_sink, deterministic, return_lse)
    if page_table is not None:
        from .kvcache import paged_varlen

        return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k, page_table, softmax_scale, causal, window_size, softcap,
                            learnable_sink, return_lse)
    # A repeated signature (the same offsets tensors, unchanged) runs its plan (plans.py).
    key = plans.varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_k, softmax_scale, causal, window_size, softcap,
                           learnable_sink, deterministic)
    plan = plans.find(key)
    if plan is not None:
        out, lse = call_planned_varlen(plan, q, k, v, learnable_sink)
        return (out, lse) if return_lse else out
    check.check_tensors(q, k, v, 3, "(total_tokens, nheads, headdim)")
    check.check_int_vector(cu_seqlens_q, "cu_seqlens_q", None, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("asymflash: cu_seqlens_q is empty; expected batch + 1 >= 1 offsets")
    check.check_int_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1, q.device)
    check.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q,
                           "max_seqlen_q")
    check.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k,
                           "max_seqlen_k")
    if seqused_k is not None:
        check.check_int_vector(seqused_k, "seqused_k", batch, q.device)
        check.check_seqused(seqused_k, cu_seqlens_k)
    scale = _check_common(q, k, v, softmax_scale, window_size, softcap, learnable_sink)
    seq = SeqInfo(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, False)
    out, lse = call(q, k, v, seq, scale, causal, window_size, softcap, learnable_sink,
                     deterministic)
    plans.remember_varlen(key, q, k, v, seq, scale, normalize_window(causal, window_size),
                          softcap, None if learnable_sink is None else
                          learnable_sink.float().contiguous(), deterministic)
    return (out, lse) if return_lse else out


def _varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, window_size, softcap, sink, deterministic, return_lse, seqused_k,
                page_table, seqused_q, dropout_p, alibi_slopes, return_attn_probs, descales,
                out_dtype):
    """flash_attn_varlen_func on fp8 inputs: checked, rewritten in 16 bits (api/fp8.py), run."""
    batch, rows = None, None
    if isinstance(q, Tensor) and cu_seqlens_q is None and q.dim() == 4:
        batch = q.shape[0]  # the padded form: q (batch, seqlen, ...)
    elif isinstance(q, Tensor) and q.dim() == 3:
        check.check_int_vector(cu_seqlens_q, "cu_seqlens_q", None, q.device)
        batch = cu_seqlens_q.shape[0] - 1
    fp8.check_inputs(q, k, v, descales, out_dtype, batch)
    if q.dim() == 3:
        rows = fp8.rows_to_batch(cu_seqlens_q, q.shape[0], batch)
    if page_table is not None and fp8.reads_e4m3(q.device):
        # Paged prefill runs on the decode kernels, which read the e4m3 cache in place.
        if dropout_p or alibi_slopes is not None:
            _refuse_fa2_features(dropout_p, alibi_slopes)
        if seqused_q is not None:
            raise NotImplementedError("asymflash: seqused_q was given with page_table; paged "
                                      "prefill uses every query row (pass seqused_q=None)")
        from .kvcache import paged_varlen

        q, work = fp8.fold_q(q, descales, rows)
        result = paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              seqused_k, page_table, softmax_scale, causal, window_size,
                              softcap, sink, return_lse or return_attn_probs)
        if return_attn_probs:
            result = (*result, None)
        return fp8.finish(result, descales[2], rows, out_dtype or work)
    q, k, v, work = fp8.rewrite(q, k, v, descales, rows)
    result = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_size, softcap, sink, deterministic, return_lse, seqused_k, page_table,
        seqused_q=seqused_q, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs)
    return fp8.finish(result, descales[2], rows, out_dtype or work)
