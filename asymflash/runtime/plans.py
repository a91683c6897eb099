"""Call plans: what a call's signature decides, worked out once per signature.

Short attention calls are bound by host time: at 512 rows a `flash_attn_func` call spent 90 to
150 us in Python on the H200 machines against 100 to 200 us of GPU time (docs/tuning.md).
Most of that Python re-derives facts that depend only on the call's signature: the input
checks, the packed-row bookkeeping (SeqInfo, AttnParams), the dispatcher's choice of a
forward and a backward backend, the backend's launch plan. So `flash_attn_func` names the
signature (`dense_key`); the first call with a new signature takes the full path, checks
included, and once it has succeeded stores a `CallPlan` (`remember`); a later call with an
equal key runs the plan: reshape, allocate, launch.

The key holds everything the skipped steps read: shapes, strides (so contiguity), dtypes,
devices, whether q, k, v are 16-byte aligned, the scalars, the sink's class, whether a
gradient can flow, the backend forced by `dispatch.use_backend` and the per-call environment
switches (`env.PER_CALL`). Only exact types form a key (a bool is not taken for an int: True ==
1 would let a refused `softcap=True` find the plan of an accepted `softcap=1`), and a plan is
stored only after its call passed the checks, so an input the checks refuse never finds one.

`flash_attn_varlen_func` plans too (`varlen_key`, `remember_varlen`): its key adds the
offsets tensors by identity and version counter (a model passes one cu_seqlens tensor to all
its layers; an in-place change bumps the version and takes the full path, checks included),
and the max_seqlen values. The plan holds those tensors, so no other tensor can take their id
while the key exists.
"""

from __future__ import annotations

import torch

from ..api import cache_checks
from ..core.params import AttnParams, MaskSpec, SeqInfo
from . import dispatch, env

_Tensor = torch.Tensor
# ASYMFLASH_CALL_PLANS=0 sends every call through the full path (A/B timing, bug reports).
ENABLED = env.get("ASYMFLASH_CALL_PLANS") != "0"
_PLANS: dict = {}
_LIMIT = 256  # plans kept; cleared when full (a bound, not an LRU: signatures rarely vary)


def rows(t: _Tensor) -> _Tensor:
    """(batch, seqlen, heads, dim) -> (batch * seqlen, heads, dim), the packed row form."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def plain_scalars(softmax_scale, causal, window_size, softcap) -> bool:
    """Whether the scalar arguments have the exact types a key may hold (see the module doc:
    a bool is not taken for an int, nor an int for a bool)."""
    if type(causal) is not bool:
        return False
    if type(window_size) is not tuple or len(window_size) != 2 or \
            type(window_size[0]) is not int or type(window_size[1]) is not int:
        return False
    return (softmax_scale is None or type(softmax_scale) in (float, int)) and \
        type(softcap) in (float, int)


def dense_key(q, k, v, softmax_scale, causal, window_size, softcap, sink, deterministic):
    """flash_attn_func's call signature as a dict key, or None where calls are not planned
    (torch.compile tracing, tensor subclasses, arguments of other types than the usual)."""
    if not ENABLED or type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if type(deterministic) is not bool or \
            not plain_scalars(softmax_scale, causal, window_size, softcap):
        return None
    if torch.compiler.is_compiling():
        return None
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    if sink is None:
        sink_key = None
    elif isinstance(sink, _Tensor):  # a learnable sink is usually an nn.Parameter
        grad = grad or sink.requires_grad
        sink_key = (sink.shape, sink.stride(), sink.dtype, sink.device,
                    sink.data_ptr() % 16 == 0)
    else:
        return None
    grad = grad and torch.is_grad_enabled()
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
    return (grad, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
            k.dtype, v.dtype, q.device, k.device, v.device, aligned, softmax_scale, causal,
            window_size, softcap, sink_key, deterministic, dispatch.forced_backend(),
            env.per_call_values())


def _offsets_key(t):
    """An offsets tensor by identity and content version, () for a missing one; None where
    it is not a plain tensor (no plan)."""
    if t is None:
        return ()
    if type(t) is not _Tensor:
        return None
    return (id(t), t._version, t.shape, t.dtype, t.device)


def varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
               softmax_scale, causal, window_size, softcap, sink, deterministic):
    """flash_attn_varlen_func's call signature as a dict key (dense_key's, plus the offsets
    by identity and version and the max_seqlen values), or None where it is not planned."""
    base = dense_key(q, k, v, softmax_scale, causal, window_size, softcap, sink, deterministic)
    if base is None or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    offsets = tuple(_offsets_key(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_k))
    if None in offsets:
        return None
    return ("varlen", base, offsets, max_seqlen_q, max_seqlen_k)


def tensor_class(t):
    """What may not change in a tensor argument between calls of one planned signature."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                softmax_scale, causal, window_size, softcap, learnable_sink, num_splits,
                return_lse, check_values, cache_leftpad, descales=(None, None)):
    """flash_attn_with_kvcache's call signature as a dict key, or None (not planned: calls
    that read values on the host, whose checks cannot be skipped). descales: an e4m3 cache's
    (k_descale, v_descale) as the decode kernels take them."""
    if not ENABLED or type(q) is not _Tensor or type(k_cache) is not _Tensor or \
            type(v_cache) is not _Tensor:
        return None
    if type(return_lse) is not bool or type(check_values) is not bool or \
            type(num_splits) is not int or \
            not plain_scalars(softmax_scale, causal, window_size, softcap):
        return None
    tables = (cache_batch_idx, page_table, cache_leftpad)
    # Values checked on the host cannot be planned; on CUDA they are checked on the device
    # (api/cache_checks.py), which the plan repeats on every call.
    host_checks = check_values and not cache_checks.on_device(q)
    if cache_seqlens is None or type(cache_seqlens) is int:
        lens = cache_seqlens
        if host_checks and any(t is not None for t in tables):
            return None
    elif type(cache_seqlens) is _Tensor and not host_checks:
        lens = tensor_class(cache_seqlens)
    else:
        return None
    extra = []
    for t in (k, v, learnable_sink, *tables, *descales):
        if t is None:
            extra.append(None)
        elif type(t) is _Tensor or (t is learnable_sink and isinstance(t, _Tensor)):
            extra.append(tensor_class(t))
        else:
            return None
    if torch.compiler.is_compiling():
        return None
    return ("kvcache", tensor_class(q), tensor_class(k_cache), tensor_class(v_cache), lens, *extra,
            softmax_scale, causal, window_size, softcap, num_splits, return_lse,
            check_values, dispatch.forced_backend(), env.per_call_values())


def find(key):
    """The plan stored under `key` (any kind: dense, varlen, kvcache), or None."""
    return None if key is None else _PLANS.get(key)


def keep(key, plan):
    """Store `plan` under `key` and return it (the store is bounded: cleared when full)."""
    if len(_PLANS) >= _LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


class CallPlan:
    """What one signature decided. `forward(q_rows, k_rows, v_rows, sink)` runs the
    chosen forward backend; `args(sink)` is the argument tail the autograd Function and the
    custom op take after q, k, v; `backward` is (backend.backward, seq, params), or None
    where no backend can differentiate the call (its backward then raises as usual)."""

    __slots__ = ("grad", "seq", "params", "forward", "backward", "_head", "_tail")

    def __init__(self, grad, seq, params, forward, backward, head, tail):
        self.grad, self.seq, self.params = grad, seq, params
        self.forward, self.backward = forward, backward
        self._head, self._tail = head, tail

    def args(self, sink) -> tuple:
        return (*self._head, sink, *self._tail)


def remember(key, q, k, v, scale: float, mask: MaskSpec, softcap, sink, deterministic) -> None:
    """Store the plan of a call that has just succeeded through the full path (`sink` as the
    kernels read it: fp32, contiguous). Calls without query or key rows are not planned."""
    if key is None or q.numel() == 0 or k.numel() == 0:
        return
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    seq = SeqInfo.dense(batch, seqlen_q, seqlen_k, q.device)
    params = AttnParams(scale, mask, float(softcap), deterministic)
    _store(key, key[0], rows(q), rows(k), rows(v), seq, params, sink)  # grad: dense_key's 1st


def remember_varlen(key, q, k, v, seq: SeqInfo, scale: float, mask: MaskSpec, softcap, sink,
                    deterministic) -> None:
    """remember's counterpart for flash_attn_varlen_func (packed q, k, v; its SeqInfo)."""
    if key is None or q.numel() == 0 or k.numel() == 0:
        return
    _store(key, key[1][0], q, k, v, seq, AttnParams(scale, mask, float(softcap), deterministic),
           sink)


def _store(key, grad, q, k, v, seq: SeqInfo, params: AttnParams, sink) -> None:
    """Pick the backends of a call that has just succeeded (q, k, v as packed rows) and keep
    them under `key`."""
    backend = dispatch.pick_forward(q, k, v, seq, params, sink)
    make_runner = getattr(backend, "forward_runner", None)
    forward = make_runner(q, k, v, seq, params, sink) if make_runner else None
    if forward is None:
        def forward(q, k, v, sink, _run=backend.forward):
            return _run(q, k, v, seq, params, sink)
    backward = None
    if grad:
        try:
            backward_backend = dispatch.pick_backward(q, k, v, seq, params, sink)
        except NotImplementedError:
            backward_backend = None
        if backward_backend is not None:
            make_runner = getattr(backward_backend, "backward_runner", None)
            run = make_runner(q, k, v, seq, params, sink) if make_runner else None
            backward = (run or backward_backend.backward, seq, params)
    mask = params.mask
    head = (seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_k)
    tail = (seq.max_seqlen_q, seq.max_seqlen_k, params.softmax_scale, mask.window_left,
            mask.window_right, params.softcap, seq.uniform, params.deterministic)
    keep(key, CallPlan(grad, seq, params, forward, backward, head, tail))


def clear() -> None:
    """Forget every plan (tests; a process that changed something a key does not hold)."""
    _PLANS.clear()
