"""flash_attn_combine: merge partial attention results (FlashAttention-3's signature)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.merge import merge_partials

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(exc, msg):
    raise exc(f"asymflash: flash_attn_combine: {msg}")


def _check(out_partial, lse_partial, out, out_dtype):
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, Tensor):
            _fail(TypeError, f"{name} is a {type(t).__name__}; expected a torch.Tensor")
        if not t.is_floating_point():
            _fail(TypeError, f"{name} has dtype {t.dtype}; expected a float dtype")
    if out_partial.dim() not in (4, 5):
        _fail(ValueError, f"out_partial has shape {tuple(out_partial.shape)}; expected "
              "(num_splits, batch, seqlen, nheads, headdim) or (num_splits, total_q, nheads, "
              "headdim)")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        _fail(ValueError, f"lse_partial has shape {tuple(lse_partial.shape)}; expected "
              f"{tuple(out_partial.shape[:-1])} (out_partial's without headdim; an lse of "
              "asymflash's (batch, nheads, seqlen) layout, stacked, is passed as "
              ".transpose(-1, -2))")
    if lse_partial.device != out_partial.device:
        _fail(ValueError, f"lse_partial is on {lse_partial.device}; out_partial is on "
              f"{out_partial.device}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        _fail(TypeError, f"out_dtype is {out_dtype}; allowed: {_OUT_DTYPES}")
    if out is not None:
        want = out_dtype or out_partial.dtype
        if not isinstance(out, Tensor) or tuple(out.shape) != tuple(out_partial.shape[1:]) \
                or out.dtype != want or out.device != out_partial.device:
            got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, Tensor) \
                else type(out).__name__
            _fail(ValueError, f"out is {got}; expected a {want} tensor of shape "
                  f"{tuple(out_partial.shape[1:])} on {out_partial.device}")


def flash_attn_combine(out_partial: Tensor, lse_partial: Tensor, out: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None):
    """Merge attention results computed over disjoint sets of keys, exactly.

    out_partial: (num_splits, batch, seqlen, nheads, headdim), or (num_splits, total_q,
    nheads, headdim) for packed rows: split i's normalised output. lse_partial: out_partial's
    shape without headdim, fp32 natural log (FlashAttention-3's layout; asymflash's lse is
    (batch, nheads, seqlen), so pass `torch.stack(lses).transpose(-1, -2)`).
    Returns (out, lse): out (batch, seqlen, nheads, headdim) in out_dtype (default
    out_partial's dtype), written into `out` if given; lse (batch, seqlen, nheads) fp32
    ((total_q, nheads) for packed rows), a transposed view as in FA3.
    A split with lse = -inf (it saw no key of that row) has no weight, whatever its out
    holds; a row no split saw gets out = 0 and lse = -inf. Computed in fp32 with torch ops:
    differentiable, on any device.
    """
    _check(out_partial, lse_partial, out, out_dtype)
    merged, lse = merge_partials(out_partial, lse_partial)
    merged = merged.to(out_dtype or out_partial.dtype)
    # FA3's memory layout too: heads before rows, so lse.transpose(-1, -2) is contiguous
    # (asymflash's (batch, nheads, seqlen), or (nheads, total_q) for packed rows)
    lse = lse.transpose(-1, -2).contiguous().transpose(-1, -2)
    if out is None:
        return merged, lse
    out.copy_(merged)
    return out, lse
