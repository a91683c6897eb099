"""flash_attn_with_kvcache over an fp8 (e4m3) KV cache, as FlashAttention-3 takes one.

The caller quantises: new k/v arrive in e4m3 already, in the scale of the cache's
k_descale/v_descale for their sequence (FA3 leaves the quantisation to the caller too, e.g.
vLLM writes its fp8 cache itself), and are written as given. The decode kernels then read
the e4m3 cache in place, widening each tile exactly to 16 bits in registers, and apply the
descales themselves (k_descale to the scores, v_descale to the output): no copy of the cache
and no tensor op around the call.
"""

from __future__ import annotations

import torch

from ..core.fp8 import is_fp8
from . import fp8
from . import validation as check


def kvcache_fp8(body, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                descales, out_dtype, rotary_cos, kw):
    """body: kvcache._with_kvcache; kw: its other arguments by name."""
    batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    fp8.check_inputs(q, k_cache, v_cache, descales, out_dtype, batch,
                     names=("q", "k_cache", "v_cache"), forward_only=True)
    if (k is None) != (v is None):
        check._fail(ValueError, "k/v", "only one was given", "pass both new k and v, or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not is_fp8(t) or t.dtype != k_cache.dtype:
                check._fail(TypeError, name, f"has dtype {getattr(t, 'dtype', type(t))}",
                            f"must be {k_cache.dtype} like the cache: quantise new tokens with "
                            "the cache's descale (x / k_descale[b, h]) before the call, as FA3")
        if rotary_cos is not None:
            raise NotImplementedError(
                "asymflash: rotary_cos/sin with new k on an fp8 cache; rotate k before "
                "quantising it and pass the rotated fp8 k (q may still be rotated here)")
    if fp8.reads_e4m3(q.device):
        # The decode kernels read the e4m3 cache (and new rows) as they are, widened exactly
        # in registers, and apply k_descale to the scores and v_descale to the output (as
        # tensor ops around the call they cost a decode step ~8 launches); the new rows are
        # appended in e4m3, as given. Only an fp8 q is dequantised here.
        q16, work = fp8.fold_q(q, (descales[0], None, None))
        kernel_descales = tuple(None if d is None else d.contiguous() for d in descales[1:])
        result = body(q16, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                      page_table, **kw, descales=kernel_descales)
        return fp8.finish(result, None, None, out_dtype or work)
    # A GPU without e4m3 loads: the descales folded into q and the output.
    q16, work = fp8.fold_q(q, descales)
    result = _on_a_cast_cache(body, q16, k_cache, v_cache, k, v, cache_seqlens,
                              cache_batch_idx, page_table, work, kw)
    return fp8.finish(result, descales[2], None, out_dtype or work)


def _on_a_cast_cache(body, q16, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                     page_table, work, kw):
    """A GPU without e4m3 loads: attend over a 16-bit copy of the cache (exact), appending
    to the copy; then write the new e4m3 rows into the real cache. The 16-bit call checks
    every value first, so a refused call leaves the cache untouched."""
    from .kvcache import _append

    k16 = None if k is None else k.to(work)
    v16 = None if v is None else v.to(work)
    result = body(q16, k_cache.to(work), v_cache.to(work), k16, v16, cache_seqlens,
                  cache_batch_idx, page_table, **kw)
    if k is not None:
        lens = cache_seqlens
        if not isinstance(lens, torch.Tensor):
            lens = torch.full((q16.shape[0],), int(lens), dtype=torch.int32, device=q16.device)
        _append(k_cache, v_cache, k, v, lens, page_table, cache_batch_idx)
    return result
