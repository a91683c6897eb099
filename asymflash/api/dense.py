"""Public entry points: validation, packing, torch.library custom ops and autograd.

Dense BSHD calls are packed into the varlen form of `core.params` (a free reshape), so one
implementation pair (`_fwd_impl`, `_bwd_impl`) serves every call. Under torch.compile they are
reached through the custom ops `asymflash::fwd` / `asymflash::bwd` (fake implementations and
registered autograd: fullgraph compiles); eager calls use a plain autograd.Function over the
same functions and rules, which costs far less host time per call.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

from ..core.masks import normalize_window
from ..core.params import AttnParams, MaskSpec, SeqInfo
from ..runtime import dispatch, plans
from . import validation as check


def _params(scale, window_left, window_right, softcap, deterministic=False) -> AttnParams:
    return AttnParams(scale, MaskSpec(window_left, window_right), softcap, deterministic)


def _seq(cu_q, cu_k, seqused_k, max_q, max_k, uniform) -> SeqInfo:
    return SeqInfo(cu_q, cu_k, max_q, max_k, seqused_k, uniform)


def _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, uniform,
                 deterministic):
    """(out, lse, seq, params) of one call; seq and params are None for no query rows."""
    total_q, nheads_q = q.shape[0], q.shape[1]
    if total_q == 0:
        return (q.new_empty(0, nheads_q, v.shape[-1]),
                torch.empty(nheads_q, 0, dtype=torch.float32, device=q.device), None, None)
    seq = _seq(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, uniform)
    params = _params(softmax_scale, window_left, window_right, softcap, deterministic)
    backend = dispatch.pick_forward(q, k, v, seq, params, sink)
    return (*backend.forward(q, k, v, seq, params, sink), seq, params)


def _fwd_impl(*inputs):
    """(out, lse): the custom op's implementation and the no-grad eager path."""
    return _run_forward(*inputs)[:2]


@torch.library.custom_op("asymflash::fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor], sink: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, window_left: int, window_right: int, softcap: float, uniform: bool,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink, max_seqlen_q,
                     max_seqlen_k, softmax_scale, window_left, window_right, softcap, uniform,
                     deterministic)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink, max_seqlen_q,
              max_seqlen_k, softmax_scale, window_left, window_right, softcap, uniform,
              deterministic):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[-1]),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))


def _bwd_impl(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink,
              max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
              uniform, deterministic):
    nheads_q = q.shape[1]
    if q.shape[0] == 0 or k.shape[0] == 0:
        dsink = torch.zeros(nheads_q, dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink
    seq = _seq(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, uniform)
    params = _params(softmax_scale, window_left, window_right, softcap, deterministic)
    backend = dispatch.pick_backward(q, k, v, seq, params, sink)
    dq, dk, dv, dsink = backend.backward(dout, q, k, v, out, lse, dlse, seq, params, sink)
    if dsink is None:  # no sink: the op still returns a tensor (its schema's)
        dsink = torch.zeros(nheads_q, dtype=torch.float32, device=q.device)
    return dq, dk, dv, dsink


@torch.library.custom_op("asymflash::bwd", mutates_args=())
def _bwd_op(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor],
    sink: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    window_left: int, window_right: int, softcap: float, uniform: bool, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     sink, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                     window_right, softcap, uniform, deterministic)


@_bwd_op.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink,
              max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
              uniform, deterministic):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(q.shape[1], dtype=torch.float32))


_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sink",
             "max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_left", "window_right",
             "softcap", "uniform", "deterministic")


def _setup_context(ctx, inputs, output):
    named = dict(zip(_FWD_ARGS, inputs))
    ctx.save_for_backward(named["q"], named["k"], named["v"], output[0], output[1],
                          named["cu_seqlens_q"], named["cu_seqlens_k"], named["seqused_k"],
                          named["sink"])
    ctx.scalars = tuple(named[n] for n in _FWD_ARGS[7:])
    ctx.has_sink = named["sink"] is not None
    # use_backend lives in a context variable, and autograd runs CUDA backwards on a thread of
    # its own: carry the forward's choice over explicitly.
    ctx.forced_backend = dispatch.forced_backend()


def _backward(ctx, dout, dlse, bwd=_bwd_op):
    """The custom op's backward: itself an opaque op, so AOT autograd traces it with fake
    tensors and never into a kernel launch (torch.compiler.is_compiling() is False there).
    Eager calls pass bwd=_bwd_impl (see _AttnFunction)."""
    q, k, v, out, lse, cu_q, cu_k, seqused_k, sink = ctx.saved_tensors
    forced = ctx.forced_backend
    with dispatch.use_backend(forced) if forced else contextlib.nullcontext():
        grads = bwd(_dout(dout, out), dlse, q, k, v, out, lse, cu_q, cu_k, seqused_k, sink,
                    *ctx.scalars)
    return _input_grads(ctx, *grads)


def _dout(dout, out):
    """Eager calls do not materialise unused output gradients: dout is None when only lse
    reaches the loss (dlse is None when only out does, the usual case: no zero fill)."""
    return torch.zeros_like(out) if dout is None else dout.contiguous()


def _input_grads(ctx, dq, dk, dv, dsink):
    """One gradient per forward input (_FWD_ARGS): q, k, v, the sink; None elsewhere."""
    return (dq, dk, dv) + (None,) * 3 + (dsink if ctx.has_sink else None,) + (None,) * 8

torch.library.register_autograd("asymflash::fwd", _backward, setup_context=_setup_context)


def _eager_forward(ctx, inputs, plan=None):
    """The eager Functions' forward: (out, lse), with the backward's backend picked now, on
    the caller's thread. Autograd runs a CUDA backward on a device thread of its own, where
    the same Python measured about twice as slow as on the calling thread (H200: 250-311
    vs 116-137 us for the sm90 backward's host work). A call no backend can
    differentiate still raises in the backward (NotImplementedError from the dispatcher).
    With a call plan (`plans.CallPlan`) both backends were picked when the plan was made."""
    if plan is not None:
        out, lse = plan.forward(inputs[0], inputs[1], inputs[2], inputs[6])
        _setup_context(ctx, inputs, (out, lse))
        ctx.set_materialize_grads(False)
        ctx.eager_backward = plan.backward
        return out, lse
    out, lse, seq, params = _run_forward(*inputs)
    _setup_context(ctx, inputs, (out, lse))
    ctx.set_materialize_grads(False)
    ctx.eager_backward = None
    q, k, v, sink = inputs[0], inputs[1], inputs[2], inputs[6]
    if seq is not None and k.shape[0] > 0:
        try:
            backend = dispatch.pick_backward(q, k, v, seq, params, sink)
            ctx.eager_backward = (backend.backward, seq, params)
        except NotImplementedError:
            pass
    return out, lse


def _eager_backward(ctx, dout, dlse):
    """The eager Functions' backward: the backend picked in the forward, called directly."""
    if ctx.eager_backward is None:
        return _backward(ctx, dout, dlse, bwd=_bwd_impl)
    backward, seq, params = ctx.eager_backward
    q, k, v, out, lse, _, _, _, sink = ctx.saved_tensors
    return _input_grads(ctx, *backward(_dout(dout, out), q, k, v, out, lse, dlse, seq, params,
                                       sink))


class _AttnFunction(torch.autograd.Function):
    """The eager path: the same implementation and autograd rules as the custom op, without
    the op layer's per-call Python cost (torch.library's autograd wrapper measured ~90 of
    ~370 us host time per call on the CI CPU; the whole eager call ~120 us)."""

    @staticmethod
    def forward(ctx, *inputs):
        *inputs, plan = inputs  # the call's plan (flash_attn_varlen_func), or None
        return _eager_forward(ctx, tuple(inputs), plan)

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_eager_backward(ctx, dout, dlse), None)


_rows = plans.rows


class _DenseAttnFunction(torch.autograd.Function):
    """flash_attn_func's eager path: as _AttnFunction, but on (batch, seqlen, heads, dim)
    tensors, reshaped inside. Reshaping outside would put four ViewBackward nodes around the
    attention node, ~14 us of host time each per backward (H200 profile), and
    short backwards are host-bound. The last argument is the call's plan, or None."""

    @staticmethod
    def forward(ctx, q, k, v, *rest):
        *rest, plan = rest
        out, lse = _eager_forward(ctx, (_rows(q), _rows(k), _rows(v), *rest), plan)
        ctx.dense_shapes = q.shape, k.shape, v.shape
        return out.view(q.shape[0], q.shape[1], out.shape[1], out.shape[2]), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = _eager_backward(ctx, None if dout is None else _rows(dout), dlse)
        q_shape, k_shape, v_shape = ctx.dense_shapes
        return (grads[0].view(q_shape), grads[1].view(k_shape), grads[2].view(v_shape),
                *grads[3:], None)


def _call(q, k, v, seq: SeqInfo, scale, causal, window_size, softcap, sink, deterministic,
          dense=False):
    """Attention over packed rows (varlen), or with dense=True over (batch, seqlen, heads,
    dim) tensors: then out is (batch, seqlen, heads, dv) too. lse is (heads, total_q)."""
    mask = normalize_window(causal, window_size)
    if sink is not None:  # kernels read fp32 logits; autograd casts the gradient back
        sink = sink.float().contiguous()
    # torch.compile traces the custom op (opaque to the compiler, with its fake and autograd
    # rules); eager calls go straight to the implementation, through autograd only when a
    # gradient can flow (the autograd.Function costs ~30 us of host time per call).
    rest = (seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_k, sink, seq.max_seqlen_q,
            seq.max_seqlen_k, float(scale), mask.window_left, mask.window_right,
            float(softcap), seq.uniform, bool(deterministic))
    compiling = torch.compiler.is_compiling()
    grad = not compiling and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or
        (sink is not None and sink.requires_grad))
    if dense and grad:
        return _DenseAttnFunction.apply(q, k, v, *rest, None)
    shape = q.shape
    if dense:
        q, k, v = _rows(q), _rows(k), _rows(v)
    if grad:
        out, lse = _AttnFunction.apply(q, k, v, *rest, None)
    else:
        fn = torch.ops.asymflash.fwd if compiling else _fwd_impl
        out, lse = fn(q, k, v, *rest)
    if dense:
        out = out.view(shape[0], shape[1], out.shape[1], out.shape[2])
    return out, lse


def _check_common(q, k, v, softmax_scale, window_size, softcap, learnable_sink):
    check.check_scalars(softmax_scale, window_size, softcap)
    check.check_sink(learnable_sink, q, q.shape[-2])
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _call_planned(plan: plans.CallPlan, q, k, v, sink):
    """flash_attn_func's (out, lse) through a call plan: what _call does, decided already."""
    if sink is not None:
        sink = sink.float().contiguous()
    if plan.grad:
        return _DenseAttnFunction.apply(q, k, v, *plan.args(sink), plan)
    out, lse = plan.forward(_rows(q), _rows(k), _rows(v), sink)
    return out.view(q.shape[0], q.shape[1], out.shape[1], out.shape[2]), lse


def _call_planned_varlen(plan: plans.CallPlan, q, k, v, sink):
    """flash_attn_varlen_func's (out, lse) through a call plan (packed rows)."""
    if sink is not None:
        sink = sink.float().contiguous()
    if plan.grad:
        return _AttnFunction.apply(q, k, v, *plan.args(sink), plan)
    return plan.forward(q, k, v, sink)


def flash_attn_func(
    q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
    learnable_sink: Optional[Tensor] = None, deterministic: bool = False,
    return_lse: bool = False, *, dropout_p: float = 0.0, alibi_slopes=None,
    return_attn_probs: bool = False,
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

    flash-attn 2's keywords: dropout_p must be 0 and alibi_slopes None (neither is
    implemented: NotImplementedError otherwise); return_attn_probs=True returns
    (out, lse, None), its (out, softmax_lse, S_dmask) without the probabilities.
    """
    if dropout_p or alibi_slopes is not None:
        _refuse_fa2_features(dropout_p, alibi_slopes)
    # A repeated signature runs its plan (plans.py: checks, dispatch and launch decisions
    # made by the first call of that signature); a new one takes the full path.
    key = plans.dense_key(q, k, v, softmax_scale, causal, window_size, softcap,
                          learnable_sink, deterministic)
    plan = plans.find(key)
    if plan is not None:
        out, lse = _call_planned(plan, q, k, v, learnable_sink)
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
    out, lse = _call(q, k, v, seq, scale, causal, window_size, softcap, sink, deterministic,
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
    page_table: Tensor | None = None, *, dropout_p: float = 0.0, alibi_slopes=None,
    return_attn_probs: bool = False,
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

    dropout_p, alibi_slopes and return_attn_probs: as in flash_attn_func.
    """
    if dropout_p or alibi_slopes is not None:
        _refuse_fa2_features(dropout_p, alibi_slopes)
    if return_attn_probs:
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_size, softcap, learnable_sink, deterministic, True, seqused_k,
            page_table)
        return out, lse, None
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
        out, lse = _call_planned_varlen(plan, q, k, v, learnable_sink)
        return (out, lse) if return_lse else out
    if cu_seqlens_k is None:
        raise ValueError("asymflash: cu_seqlens_k is None; it is required unless page_table "
                         "is given")
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
    out, lse = _call(q, k, v, seq, scale, causal, window_size, softcap, learnable_sink,
                     deterministic)
    plans.remember_varlen(key, q, k, v, seq, scale, normalize_window(causal, window_size),
                          softcap, None if learnable_sink is None else
                          learnable_sink.float().contiguous(), deterministic)
    return (out, lse) if return_lse else out
