"""attention_backward: the backward of attention given an external out and lse.

What ring attention and torch's context parallel call for each key block. With the keys
split into disjoint blocks, the final (merged) out and lse are those of attention over all
keys, and the gradients split block by block:

    P_b = exp(S_b - lse)            (the block's share of the final softmax)
    dV_b = P_b^T dO,  dS_b = P_b * (dO V_b^T - D),  D = rowsum(dO * out)
    dQ = sum_b dS_b K_b * scale,  dK_b = dS_b^T Q * scale

which is exactly what every backend's backward computes from (q, k, v, out, lse): it never
assumes that lse came from these keys alone. So this entry only checks its inputs and runs
the op layer's backward (`ops._bwd_impl`), through dispatch like any other call.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..core.masks import normalize_window
from ..core.params import SeqInfo
from . import validation as check
from .ops import _bwd_impl


def _fail(exc, msg):
    raise exc(f"asymflash: attention_backward: {msg}")


def _check_like(name, t, shape, dtype, device):
    if not isinstance(t, Tensor):
        _fail(TypeError, f"{name} is a {type(t).__name__}; expected a torch.Tensor")
    if tuple(t.shape) != tuple(shape):
        _fail(ValueError, f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.dtype != dtype:
        _fail(TypeError, f"{name} has dtype {t.dtype}; expected {dtype}")
    if t.device != device:
        _fail(ValueError, f"{name} is on {t.device}; q is on {device}")


def _dense_seq(q, k):
    if k.shape[0] != q.shape[0]:
        _fail(ValueError, f"k has batch {k.shape[0]}; must equal q's batch {q.shape[0]}")
    return SeqInfo.dense(q.shape[0], q.shape[1], k.shape[1], q.device)


def _varlen_seq(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is None or cu_seqlens_k is None:
        _fail(ValueError, "packed (3-D) q needs cu_seqlens_q and cu_seqlens_k")
    check.check_int_vector(cu_seqlens_q, "cu_seqlens_q", None, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    check.check_int_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1, q.device)
    check.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q,
                           "max_seqlen_q")
    check.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k,
                           "max_seqlen_k")
    return SeqInfo(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, False)


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    softmax_scale: Optional[float] = None, causal: bool = False, window_size=(-1, -1),
    softcap: float = 0.0, deterministic: bool = False, *,
    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    dlse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of attention of q over the keys k/v, given the final out and lse.

    Dense: q (batch, seqlen_q, nheads_q, d), k/v (batch, seqlen_k, nheads_kv, d / dv),
    out/dout (batch, seqlen_q, nheads_q, dv), lse fp32 (batch, nheads_q, seqlen_q) as
    flash_attn_func(return_lse=True) gives. Packed (varlen): q (total_q, nheads_q, d), k/v
    (total_k, ...), out/dout (total_q, nheads_q, dv), lse (nheads_q, total_q), with
    cu_seqlens_q/k and max_seqlen_q/k as in flash_attn_varlen_func.

    out and lse are those of the whole attention (e.g. merged over key blocks with
    flash_attn_combine); k/v may be one block of the keys: the result is then that block's
    contribution (dq's share, and dk/dv of the block), and summing over blocks gives the full
    gradients. The mask (causal, window_size, bottom-right aligned) applies to this call's
    q and k as in flash_attn_func. dlse (lse's shape, fp32), if given, is the gradient
    flowing into the final lse (lse is linear in each block's share, so it splits too).
    Returned in q's dtype; deterministic=True makes the backward bitwise reproducible.
    """
    check.check_scalars(softmax_scale, window_size, softcap)
    packed = isinstance(q, Tensor) and q.dim() == 3
    if packed:
        check.check_tensors(q, k, v, 3, "(total_tokens, nheads, headdim)")
        seq = _varlen_seq(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        lse_shape = (q.shape[1], q.shape[0])
    else:
        check.check_tensors(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
        seq = _dense_seq(q, k)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    out_shape = (*q.shape[:-1], v.shape[-1])
    _check_like("out", out, out_shape, q.dtype, q.device)
    _check_like("dout", dout, out_shape, q.dtype, q.device)
    _check_like("lse", lse, lse_shape, torch.float32, q.device)
    if dlse is not None:
        _check_like("dlse", dlse, lse_shape, torch.float32, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    mask = normalize_window(causal, window_size)
    if packed:
        rows = q, k, v, out, dout
        lse_rows, dlse_rows = lse, dlse
    else:  # the op layer's packed form: free reshapes, lse to (nheads, total_q)
        rows = tuple(t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v, out, dout))
        lse_rows = lse.transpose(0, 1).reshape(lse.shape[1], -1)
        dlse_rows = None if dlse is None else dlse.transpose(0, 1).reshape(lse.shape[1], -1)
    q_r, k_r, v_r, out_r, dout_r = (t.contiguous() for t in rows)
    if dlse_rows is not None:
        dlse_rows = dlse_rows.contiguous()
    dq, dk, dv, _ = _bwd_impl(
        dout_r, dlse_rows, q_r, k_r, v_r, out_r, lse_rows.contiguous(), seq.cu_seqlens_q,
        seq.cu_seqlens_k, None, None, seq.max_seqlen_q, seq.max_seqlen_k, scale,
        mask.window_left, mask.window_right, float(softcap), seq.uniform, bool(deterministic))
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
