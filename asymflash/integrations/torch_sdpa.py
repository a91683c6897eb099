"""torch's SDPA: asymflash as the kernel behind F.scaled_dot_product_attention's flash backend.

    from asymflash.integrations import torch_sdpa
    torch_sdpa.register()      # F.scaled_dot_product_attention now runs asymflash on CUDA
    torch_sdpa.unregister()    # back to torch's own kernels

What the registration covers. torch (>= 2.11) lets a library replace the kernels of SDPA's
flash backend: `torch.nn.attention.register_flash_attention_impl(name, register_fn=...)`
stores a function, `activate_flash_attention_impl(name)` calls it, and it registers CUDA
kernels for aten ops with the dispatcher (torch's own FA4 hook does exactly this). The ops
are `aten::_scaled_dot_product_flash_attention` (forward: (batch, heads, seq, dim) q, k, v,
dropout_p, is_causal, return_debug_mask, scale; returns out, logsumexp fp32 (batch, heads,
seqlen_q), cum_seq_q/k, max_q/k, the dropout rng state, a debug mask) and its backward
`aten::_scaled_dot_product_flash_attention_backward`, whose derivative formula torch's
autograd already records: so training, torch.compile (the op's meta function is torch's)
and torch's context parallel (which calls these ops per key block and merges by the lse)
run through asymflash unchanged. Call register() before torch.compile traces the model: a
compiled graph keeps the SDPA backend chosen when it was traced, and Inductor's FX-graph and
AOTAutograd caches can hand back a graph traced before register() (torch._dynamo.reset()
does not clear them). We replace these two and nothing else: NestedTensor and
varlen calls (`aten::_flash_attention_forward` with cumulative lengths) keep torch's kernels.

Which calls reach the flash backend is torch's decision, made before the op: no attn_mask
(masked calls take cuDNN, memory-efficient or math), is_causal only with seqlen_q ==
seqlen_k (torch sends top-left non-square causal elsewhere, since FA2's causal is
bottom-right), head dims equal and at most 256 (padded to a multiple of 8 and scale fixed
from the original dim before the op), fp16/bf16, sm80+, k/v with fewer heads only under
enable_gqa. Inside the op, asymflash takes dropout_p == 0 with 4-D same-device fp16/bf16
inputs that its kernels accept (head dims multiples of 8 up to 256, nheads_q a multiple of
nheads_kv, head dim stride 1, non-empty, no row left without keys); everything else
(dropout, return_debug_mask, causal with seqlen_q > seqlen_k called on the op directly)
goes to torch's own FA2 kernel through `aten::_flash_attention_forward` / `_backward`, the
ops torch's flash SDPA kernel itself calls, with the same arguments: the result and rng
stream are torch's. The backward makes the same decision from the same inputs, so a
dropout forward on torch's kernel gets torch's backward. causal inside the op is
bottom-right aligned (FA2's meaning, and asymflash's), so it maps to asymflash's causal as is.

Priority: on sm90/sm100 with a recent cuDNN torch tries its cuDNN backend before flash.
register() therefore moves the flash backend to the front of SDPA's priority order (the
other backends stay enabled and ordered behind it, for the calls flash cannot take), and
unregister() restores the previous order. `register(prefer_flash=False)` leaves it alone.

On torch without the registry (< 2.11) register() installs the same kernels directly.
`stats` counts the calls each side took (a check that asymflash runs, and how often not).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import torch
import torch.nn.attention

from ..api.backward import attention_backward
from ..api.dense import flash_attn_func
from ..api.validation import MAX_HEAD_DIM

NAME = "asymflash"
logger = logging.getLogger(__name__)

# Calls taken by each side: asymflash_forward/backward, torch_forward/backward.
stats: Counter = Counter()

_FORWARD_OP = "_scaled_dot_product_flash_attention"
_BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"


def unsupported_reason(query, key, value, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False):
    """Why asymflash does not take this flash-op call (None when it does).

    A function of the arguments only, so the forward and the backward of one call decide
    alike (the backward passes return_debug_mask=False: a debug-mask forward ran torch's
    kernel without dropout, and any backward of exact attention is exact for it).
    """
    if dropout_p != 0.0:
        return "dropout_p > 0"
    if return_debug_mask:
        return "return_debug_mask"
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors):
        return "inputs not 4-D"
    if any(t.is_nested or t.layout != torch.strided for t in tensors):
        return "nested or non-strided input"
    if key.device != query.device or value.device != query.device:
        return "inputs on different devices"
    if query.dtype not in (torch.float16, torch.bfloat16) and not (
            query.device.type == "cpu" and query.dtype == torch.float32):
        return f"dtype {query.dtype}"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "mixed dtypes"
    b, hq, sq, d = query.shape
    bk, hk, sk, dk = key.shape
    if value.shape[:3] != key.shape[:3] or bk != b:
        return "batch/heads/seqlen of q, k, v disagree"
    if hk == 0 or hq % hk != 0:
        return "nheads_q not a multiple of nheads_kv"
    dv = value.shape[-1]
    if dk != d or any(x <= 0 or x % 8 or x > MAX_HEAD_DIM for x in (d, dv)):
        return f"head dims ({d}, {dk}, {dv})"
    if min(b, sq, sk) == 0:
        return "empty input"
    if any(t.stride(-1) != 1 for t in tensors):
        return "head dim not contiguous"
    if is_causal and sq > sk:
        return "causal with seqlen_q > seqlen_k (rows without keys)"
    return None


def _like(result, ref):
    """result in ref's layout (torch's meta functions give outputs empty_like(input))."""
    if result.stride() == ref.stride():
        return result
    return torch.empty_like(ref).copy_(result)


def _no_rng(device):
    # What torch's flash kernel returns as (rng_state, unused) without dropout.
    return (torch.zeros((2,), dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.uint64, device=device))


def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False, *, scale=None):
    """The kernel registered for aten::_scaled_dot_product_flash_attention."""
    reason = unsupported_reason(query, key, value, dropout_p, is_causal, return_debug_mask)
    if reason is not None:
        logger.debug("asymflash SDPA: torch's kernel takes the forward (%s)", reason)
        stats["torch_forward"] += 1
        return _torch_forward(query, key, value, dropout_p, is_causal, return_debug_mask,
                              scale)
    stats["asymflash_forward"] += 1
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=bool(is_causal),
                                   return_lse=True)
    rng_state, unused = _no_rng(query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_like(out.transpose(1, 2), query), lse.contiguous(), None, None,
            query.shape[2], key.shape[2], rng_state, unused, debug_mask)


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                        scale=None):
    """The kernel registered for aten::_scaled_dot_product_flash_attention_backward."""
    reason = unsupported_reason(query, key, value, dropout_p, is_causal)
    if reason is None and (grad_out.dtype != query.dtype or out.dtype != query.dtype
                           or logsumexp.dtype != torch.float32):
        reason = "dtypes of grad_out, out or logsumexp"
    if reason is not None:
        logger.debug("asymflash SDPA: torch's kernel takes the backward (%s)", reason)
        stats["torch_backward"] += 1
        return _torch_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
                               cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                               philox_offset, scale)
    stats["asymflash_backward"] += 1
    q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
    with torch.no_grad():
        dq, dk, dv = attention_backward(
            do.contiguous(), q, k, v, o.contiguous(), logsumexp.float().contiguous(),
            softmax_scale=scale, causal=bool(is_causal),
            deterministic=torch.are_deterministic_algorithms_enabled())
    return tuple(_like(g.transpose(1, 2), t) for g, t in ((dq, query), (dk, key), (dv, value)))


def _torch_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale):
    """torch's flash SDPA forward, as its CUDA kernel computes it (FA2 via
    aten::_flash_attention_forward, which we do not replace)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse, rng_state, unused, debug_mask = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, query.shape[2], key.shape[2], dropout_p, is_causal,
        return_debug_mask, scale=scale)
    return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], rng_state,
            unused, debug_mask)


def _torch_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                    max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale):
    """torch's flash SDPA backward, as its CUDA kernel computes it."""
    go, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        go, q, k, v, o, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        philox_seed, philox_offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _Handle:
    """The dispatcher registration; remove() gives the ops back to torch's kernels."""

    def __init__(self, dispatch_key):
        self.dispatch_key = dispatch_key
        self.library = torch.library.Library("aten", "IMPL", dispatch_key)
        with warnings.catch_warnings():  # replacing torch's CUDA kernels is the point
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")
            self.library.impl(_FORWARD_OP, sdpa_flash_forward, dispatch_key)
            self.library.impl(_BACKWARD_OP, sdpa_flash_backward, dispatch_key)

    def remove(self):
        # torch's restore_flash_attention_impl() (or activating another impl) calls this:
        # the priority order register() changed goes back with the kernels.
        if self.library is not None:
            self.library._destroy()
            self.library = None
            if self.dispatch_key == "CUDA":
                _restore_priority()


_direct_handle = None       # torch without the registry: our own handle
_saved_priority = None      # SDPA's priority order before register(prefer_flash=True)


def install(dispatch_key: str = "CUDA") -> _Handle:
    """Register the two kernels for `dispatch_key` and return the handle (register() uses
    "CUDA"; the CPU tests use "CPU", where these ops have no kernel of torch's)."""
    return _Handle(dispatch_key)


def _has_registry() -> bool:
    return hasattr(torch.nn.attention, "activate_flash_attention_impl")


def _prefer_flash():
    global _saved_priority
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    set_ = getattr(torch._C, "_set_sdp_priority_order", None)
    if get is None or set_ is None:
        return
    if torch.cuda.is_available():
        # The first backend choice sets torch's default order (cuDNN first on sm90/sm100):
        # make it now so that it does not overwrite ours later.
        t = torch.zeros(1, 1, 1, 8, dtype=torch.float16, device="cuda")
        try:
            torch._fused_sdp_choice(t, t, t)
        except RuntimeError:  # every backend disabled by the user: nothing chosen
            pass
    order = list(get())
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    if _saved_priority is None:
        _saved_priority = order
    set_([flash] + [b for b in order if b != flash])


def _restore_priority():
    global _saved_priority
    if _saved_priority is not None:
        torch._C._set_sdp_priority_order(_saved_priority)
        _saved_priority = None


def register(prefer_flash: bool = True) -> None:
    """Make F.scaled_dot_product_attention's flash backend run asymflash on CUDA.

    Through torch's registry when it has one (then `torch.nn.attention.
    current_flash_attention_impl()` is "asymflash" and `restore_flash_attention_impl()`
    undoes it too); prefer_flash=True puts the flash backend first in SDPA's priority order.
    Calling it again is harmless.
    """
    global _direct_handle
    if _has_registry():
        attention = torch.nn.attention
        if attention.current_flash_attention_impl() != NAME:
            attention.register_flash_attention_impl(NAME, register_fn=install)
            attention.activate_flash_attention_impl(NAME)
    elif _direct_handle is None:
        _direct_handle = install()
    if prefer_flash:
        _prefer_flash()


def unregister() -> None:
    """Give SDPA's flash backend back to torch's kernels and restore the priority order."""
    global _direct_handle
    if _has_registry() and torch.nn.attention.current_flash_attention_impl() == NAME:
        torch.nn.attention.restore_flash_attention_impl()
    if _direct_handle is not None:
        _direct_handle.remove()
        _direct_handle = None
    _restore_priority()


def is_registered() -> bool:
    if _has_registry():
        return torch.nn.attention.current_flash_attention_impl() == NAME
    return _direct_handle is not None
