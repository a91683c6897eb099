"""fp8 (e4m3) inputs on the portable Triton kernels (in the interpreter on a CPU machine),
against the fp64 reference of the dequantised tensors.

The dense and varlen forwards see k/v cast on the host (api/fp8.py); the decode kernel reads
the e4m3 cache and the new e4m3 rows itself (contiguous and paged, split-KV, GQA packing),
which is what these cases exercise most.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cases import DEVICE, assert_fp8_close, expected, fp8_inputs, page
from helpers import forced

from asymflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from asymflash.core.fp8 import quantize
from asymflash.runtime import dispatch

pytestmark = pytest.mark.skipif("portable" not in dispatch.backend_names(DEVICE),
                                reason="the portable kernels need a GPU or TRITON_INTERPRET=1")
PAGE = 16


@pytest.mark.parametrize("shape,mask", [
    ((1, 1, 17, 2, 1, 32, 32), dict(causal=True)),
    ((2, 17, 113, 4, 2, 32, 32), dict(window_size=(9, 3), softcap=4.0)),
], ids=["q1-mqa-causal", "gqa-window-softcap"])
def test_dense(shape, mask):
    _, (q8, k8, v8), ds = fp8_inputs(*shape, outliers=True)
    with forced("portable"):
        out, lse = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1],
                                   v_descale=ds[2], return_lse=True, **mask)
    assert_fp8_close(out, lse, expected(q8, k8, v8, ds, **mask))


def test_varlen_packed():
    _, (q8, k8, v8), ds = fp8_inputs(1, 17, 17, 2, 2, 32, 32)
    cu = torch.tensor([0, 17], dtype=torch.int32, device=DEVICE)
    with forced("portable"):
        out = flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 17, 17, causal=True,
                                     q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert_fp8_close(out.unsqueeze(0), None, expected(q8, k8, v8, ds, causal=True))


def _cache(batch, hkv, d, capacity, paged):
    kc, kd = quantize(torch.randn(batch, capacity, hkv, d, device=DEVICE))
    vc, vd = quantize(torch.randn(batch, capacity, hkv, d, device=DEVICE))
    if not paged:
        return kc, vc, kd, vd, {}, None
    perm = torch.randperm(batch * capacity // PAGE, device=DEVICE).to(torch.int32)
    perm = perm.view(batch, -1)
    return page(kc, PAGE, perm), page(vc, PAGE, perm), kd, vd, dict(page_table=perm), (kc, vc)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_q,q_fp8,splits", [(1, True, 0), (1, False, 3), (5, True, 1)])
def test_kvcache_decode_kernel_reads_e4m3(paged, seqlen_q, q_fp8, splits):
    lens, hq, hkv, d, capacity = [0, 17, 100], 4, 2, 32, 128
    batch = len(lens)
    kc, vc, kd, vd, kw, contiguous = _cache(batch, hkv, d, capacity, paged)
    cont_k, cont_v = contiguous if paged else (kc.clone(), vc.clone())
    q = torch.randn(batch, seqlen_q, hq, d, device=DEVICE)
    q, qd = quantize(q, hkv) if q_fp8 else (q.to(torch.bfloat16), None)
    # New rows in the cache's scale, quantised by the caller as FA3 expects.
    k_new = (torch.randn(batch, seqlen_q, hkv, d, device=DEVICE) / kd[:, None, :, None])
    v_new = (torch.randn(batch, seqlen_q, hkv, d, device=DEVICE) / vd[:, None, :, None])
    k_new, v_new = (t.clamp(-448, 448).to(torch.float8_e4m3fn) for t in (k_new, v_new))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with forced("portable"):
        out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                           causal=True, num_splits=splits, return_lse=True,
                                           q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    for b, n in enumerate(lens):
        cont_k[b, n:n + seqlen_q], cont_v[b, n:n + seqlen_q] = k_new[b], v_new[b]
    stored = [page(t, PAGE, kw["page_table"]) if paged else t for t in (cont_k, cont_v)]
    assert torch.equal(kc.view(torch.uint8), stored[0].view(torch.uint8)), "append"
    assert torch.equal(vc.view(torch.uint8), stored[1].view(torch.uint8)), "append"
    for b, n in enumerate(lens):
        n += seqlen_q
        ref = expected(q[b:b + 1], cont_k[b:b + 1, :n], cont_v[b:b + 1, :n],
                       [None if s is None else s[b:b + 1] for s in (qd, kd, vd)], causal=True)
        assert_fp8_close(out[b:b + 1], lse[b:b + 1], ref)


def test_paged_varlen_prefill_reads_e4m3():
    lens, hq, hkv, d, capacity, sq = [17, 5, 64], 4, 2, 32, 64, 5
    batch = len(lens)
    kc, vc, kd, vd, kw, (cont_k, cont_v) = _cache(batch, hkv, d, capacity, paged=True)
    q8, qd = quantize(torch.randn(batch, sq, hq, d, device=DEVICE), hkv)
    cu_q = torch.arange(0, sq * (batch + 1), sq, dtype=torch.int32, device=DEVICE)
    seqused = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with forced("portable"):
        out = flash_attn_varlen_func(q8.flatten(0, 1), kc, vc, cu_q, None, sq, None,
                                     causal=True, seqused_k=seqused, q_descale=qd,
                                     k_descale=kd, v_descale=vd, **kw)
    out = out.view(batch, sq, hq, d)
    for b, n in enumerate(lens):
        ref = expected(q8[b:b + 1], cont_k[b:b + 1, :n], cont_v[b:b + 1, :n],
                       [s[b:b + 1] for s in (qd, kd, vd)], causal=True)
        assert_fp8_close(out[b:b + 1], None, ref)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_planned_decode_takes_each_calls_descales(paged):
    """A repeated signature runs as a call plan (check_values=False): the kernel must read
    the descales of this call, not the first call's (they are tensors of the signature, not
    part of it). Three calls with other descales each."""
    lens, hq, hkv, d, capacity = [9, 64], 4, 2, 32, 64
    batch = len(lens)
    kc, vc, kd, vd, kw, contiguous = _cache(batch, hkv, d, capacity, paged)
    cont_k, cont_v = contiguous if paged else (kc, vc)
    q = torch.randn(batch, 1, hq, d, device=DEVICE).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for scale in (1.0, 0.25, 3.0):
        kd_i, vd_i = kd * scale, vd * (2.0 - scale / 2)
        with forced("portable"):
            out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                               check_values=False, return_lse=True,
                                               k_descale=kd_i, v_descale=vd_i, **kw)
        for b, n in enumerate(lens):
            ref = expected(q[b:b + 1], cont_k[b:b + 1, :n], cont_v[b:b + 1, :n],
                           (None, kd_i[b:b + 1], vd_i[b:b + 1]))
            assert_fp8_close(out[b:b + 1], lse[b:b + 1], ref)
