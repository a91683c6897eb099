"""The op layer under the public functions: torch.library custom ops and autograd.

Dense BSHD calls are packed into the varlen form of `core.params` (a free reshape), so one
implementation pair (`_fwd_impl`, `_bwd_impl`) serves every call. Under torch.compile they are
reached through the custom ops `asymflash::fwd` / `asymflash::bwd` (fake implementations and
registered autograd: fullgraph compiles); eager calls use a plain autograd.Function over the
same functions and rules, which costs far less host time per call.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from ..core.masks import normalize_window
from ..core.params import AttnParams, MaskSpec, SeqInfo
from ..runtime import dispatch, plans


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


def call(q, k, v, seq: SeqInfo, scale, causal, window_size, softcap, sink, deterministic,
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


def call_planned(plan: plans.CallPlan, q, k, v, sink):
    """flash_attn_func's (out, lse) through a call plan: what `call` does, decided already."""
    if sink is not None:
        sink = sink.float().contiguous()
    if plan.grad:
        return _DenseAttnFunction.apply(q, k, v, *plan.args(sink), plan)
    out, lse = plan.forward(_rows(q), _rows(k), _rows(v), sink)
    return out.view(q.shape[0], q.shape[1], out.shape[1], out.shape[2]), lse


def call_planned_varlen(plan: plans.CallPlan, q, k, v, sink):
    """flash_attn_varlen_func's (out, lse) through a call plan (packed rows)."""
    if sink is not None:
        sink = sink.float().contiguous()
    if plan.grad:
        return _AttnFunction.apply(q, k, v, *plan.args(sink), plan)
    return plan.forward(q, k, v, sink)
