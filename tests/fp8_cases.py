"""fp8 test inputs and checks shared by tests/unit/test_fp8.py and the interpreted kernels.

The ground truth is reference.attention_fp8_ref in fp64: attention of the dequantised
tensors. The tolerance is the FA rule of helpers.py with the same-dtype baseline computed in
bf16 on the dequantised tensors: an fp8 call may be off by what a bf16 computation of the
same values is, not by the quantisation (that is the input's, not the kernel's).
"""

from __future__ import annotations

import torch
from helpers import assert_fa_close, max_err

from asymflash.core.fp8 import dequantize, quantize
from asymflash.reference import attention_fp8_ref, attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def activations(*shape, outliers=False):
    """randn, or with outlier channels: a few head-dim channels 30x larger, in every token
    and head, as the key/query activations of real models have (what per-head scales
    handle worst: the outliers set the scale, the rest lose precision)."""
    x = torch.randn(*shape, device=DEVICE)
    if outliers:
        x[..., 1::17] *= 30.0
    return x


def fp8_inputs(batch, sq, sk, hq, hkv, d, dv, outliers=False, q_fp8=True):
    """(originals fp32 (q, k, v), fp8 (q8, k8, v8), descales (qd, kd, vd)); with q_fp8=False
    q stays bf16 (an fp8 KV cache beside 16-bit queries) and qd is None."""
    q = activations(batch, sq, hq, d, outliers=outliers)
    k = activations(batch, sk, hkv, d, outliers=outliers)
    v = activations(batch, sk, hkv, dv)
    k8, kd = quantize(k)
    v8, vd = quantize(v)
    if q_fp8:
        q8, qd = quantize(q, hkv)
    else:
        q8, qd = q.to(torch.bfloat16), None
    return (q, k, v), (q8, k8, v8), (qd, kd, vd)


def expected(q8, k8, v8, descales, **kw):
    """(out fp64, lse fp64, out of a bf16 computation of the dequantised tensors)."""
    out64, lse64 = attention_fp8_ref(q8, k8, v8, *descales, compute_dtype=torch.float64, **kw)
    deq = [dequantize(t, s).to(torch.bfloat16) for t, s in zip((q8, k8, v8), descales)]
    low, low_lse = attention_ref(*deq, upcast=False, **kw)
    return out64, lse64, low, low_lse


def assert_fp8_close(out, lse, ref):
    """out (and lse unless None) within the FA rule of expected()'s results."""
    out64, lse64, low, low_lse = ref
    assert_fa_close("out", out, out64, low, atol=1e-3)
    if lse is None:
        return
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    finite = ~torch.isinf(lse64)
    if finite.any():
        bound = 2 * max_err(low_lse[finite], lse64[finite]) + 1e-3
        assert max_err(lse[finite], lse64[finite]) <= bound


def rms(a, b):
    return ((a.double() - b.double()) ** 2).mean().sqrt().item()


def page(cache, page_size, perm):
    """A contiguous (batch, capacity, ...) cache as pages in the order perm (a page table)."""
    batch, cap = cache.shape[:2]
    pages = cache.reshape(batch * cap // page_size, page_size, *cache.shape[2:])
    out = torch.empty_like(pages)
    out[perm.long().flatten()] = pages
    return out
