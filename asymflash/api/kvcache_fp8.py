"""flash_attn_with_kvcache over an fp8 (e4m3) KV cache, as FlashAttention-3 takes one.

The caller quantises: new k/v arrive in e4m3 already, in the scale of the cache's
k_descale/v_descale for their sequence (FA3 leaves the quantisation to the caller too, e.g.
vLLM writes its fp8 cache itself), and are written as given. The attention then runs on a
16-bit copy of the cache with the descales folded (api/fp8.py): a first step that copies the
whole cache per call, until the decode kernel loads e4m3 tiles itself.
"""

from __future__ import annotations

import torch

from ..core.fp8 import is_fp8
from . import fp8
from . import validation as check


def kvcache_fp8(entry, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                descales, out_dtype, rotary_cos, kw):
    """entry: flash_attn_with_kvcache; kw: its other keyword arguments."""
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
    q16, kc16, vc16, work = fp8.rewrite(q, k_cache, v_cache, descales)
    k16 = None if k is None else k.to(work)
    v16 = None if v is None else v.to(work)
    # The 16-bit call checks every argument and index value, then appends to the copies; a
    # refused call raises here and leaves the fp8 cache untouched.
    result = entry(q16, kc16, vc16, k16, v16, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, page_table=page_table,
                   rotary_cos=rotary_cos, **kw)
    if k is not None:
        from .kvcache import _append

        lens = cache_seqlens
        if not isinstance(lens, torch.Tensor):
            lens = torch.full((q.shape[0],), int(lens), dtype=torch.int32, device=q.device)
        _append(k_cache, v_cache, k, v, lens, page_table, cache_batch_idx)
    return fp8.finish(result, descales[2], None, out_dtype or work)
