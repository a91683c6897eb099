"""fp8 (e4m3) inputs through the public API on the default backend of the machine, against
the fp64 reference of the dequantised tensors; and every bad fp8 input refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from fp8_cases import (
    DEVICE,
    assert_fp8_close,
    check_fp8_result,
    expected,
    fp8_inputs,
    page,
    rms,
)

from asymflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from asymflash.core.fp8 import dequantize, quantize
from asymflash.reference import attention_ref, attention_varlen_ref

SHAPES = [  # batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, d, dv
    (1, 1, 1, 1, 1, 32, 32),
    (2, 17, 113, 4, 2, 64, 64),
    (1, 113, 17, 3, 1, 64, 32),
    (2, 113, 113, 2, 2, 128, 128),
]
MASKS = [dict(), dict(causal=True), dict(window_size=(9, 3)), dict(causal=True, softcap=4.0)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_dense_matches_reference(shape, mask):
    _, (q8, k8, v8), ds = fp8_inputs(*shape)
    copies = [t.clone() for t in (q8, k8, v8, *ds)]
    out, lse = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                               return_lse=True, **mask)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    check_fp8_result(out, lse, q8, k8, v8, ds, **mask)  # (e4m3 P on the sm90 fp8 kernel)
    for before, after in zip(copies, (q8, k8, v8, *ds)):  # inputs never modified
        assert torch.equal(before.view(torch.uint8) if before.dtype != torch.float32 else
                           before, after.view(torch.uint8) if after.dtype != torch.float32
                           else after)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_kv_beside_16bit_q(q_dtype):
    _, (q, k8, v8), (_, kd, vd) = fp8_inputs(2, 17, 113, 4, 2, 64, 64, q_fp8=False)
    q = q.to(q_dtype)
    out = flash_attn_func(q, k8, v8, causal=True, k_descale=kd, v_descale=vd)
    assert out.dtype == q_dtype  # 16-bit q: out in q's dtype unless out_dtype says otherwise
    assert_fp8_close(out, None, expected(q, k8, v8, (None, kd, vd), causal=True))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_out_dtype_and_missing_descales(out_dtype):
    _, (q8, k8, v8), _ = fp8_inputs(1, 17, 17, 2, 1, 32, 32)
    out = flash_attn_func(q8, k8, v8, out_dtype=out_dtype)  # no descales: 1
    assert out.dtype == out_dtype
    assert_fp8_close(out, None, expected(q8, k8, v8, (None, None, None)))


def test_outlier_channels_error_reported_against_bf16():
    """fp8 (per-head scales) vs the bf16 path, both against fp64 of the original inputs."""
    for outliers in (False, True):
        (q, k, v), (q8, k8, v8), ds = fp8_inputs(2, 113, 113, 4, 2, 128, 128,
                                                  outliers=outliers)
        truth, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
        bf16 = flash_attn_func(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=True)
        out = flash_attn_func(q8, k8, v8, causal=True, q_descale=ds[0], k_descale=ds[1],
                              v_descale=ds[2])
        quant_only, _ = attention_ref(*(dequantize(t, s, dtype=torch.float64)
                                        for t, s in zip((q8, k8, v8), ds)), causal=True,
                                      compute_dtype=torch.float64)
        print(f"\nfp8 error vs fp64 of the original inputs (outliers={outliers}): "
              f"fp8 rms {rms(out, truth):.2e} max {(out.double() - truth).abs().max():.2e}; "
              f"bf16 rms {rms(bf16, truth):.2e} max {(bf16.double() - truth).abs().max():.2e}; "
              f"quantisation alone rms {rms(quant_only, truth):.2e}")
        # The kernel adds little to what the quantisation itself costs.
        assert rms(out, truth) <= 1.2 * rms(quant_only, truth) + 2 * rms(bf16, truth)
        assert rms(bf16, truth) < rms(out, truth)


def _packed(lens_q, lens_k, hq, hkv, d):
    total_q, total_k = sum(lens_q), sum(lens_k)
    cu = [torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
          for lens in (lens_q, lens_k)]
    batch_of_row = torch.repeat_interleave(torch.arange(len(lens_q), device=DEVICE),
                                           torch.tensor(lens_q, device=DEVICE))
    batch_of_key = torch.repeat_interleave(torch.arange(len(lens_k), device=DEVICE),
                                           torch.tensor(lens_k, device=DEVICE))
    q8, qd = quantize(torch.randn(total_q, hq, d, device=DEVICE), hkv, batch_of_row,
                      len(lens_q))
    k8, kd = quantize(torch.randn(total_k, hkv, d, device=DEVICE), None, batch_of_key,
                      len(lens_k))
    v8, vd = quantize(torch.randn(total_k, hkv, d, device=DEVICE), None, batch_of_key,
                      len(lens_k))
    deq = [dequantize(t, s, rows, torch.float64) for t, s, rows in
           ((q8, qd, batch_of_row), (k8, kd, batch_of_key), (v8, vd, batch_of_key))]
    return cu, (q8, k8, v8), (qd, kd, vd), deq


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(5, 0))],
                         ids=str)
def test_varlen_matches_reference(mask):
    lens_q, lens_k = [1, 17, 113], [17, 113, 113]
    (cu_q, cu_k), (q8, k8, v8), ds, deq = _packed(lens_q, lens_k, 4, 2, 64)
    out, lse = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k),
                                      return_lse=True, q_descale=ds[0], k_descale=ds[1],
                                      v_descale=ds[2], **mask)
    ref, ref_lse = attention_varlen_ref(*deq, cu_q, cu_k, compute_dtype=torch.float64, **mask)
    low, low_lse = attention_varlen_ref(*(t.to(torch.bfloat16) for t in deq), cu_q, cu_k,
                                        upcast=False, **mask)
    assert_fp8_close(out, lse, (ref, ref_lse, low, low_lse))


def test_padded_varlen_form():
    _, (q8, k8, v8), ds = fp8_inputs(3, 17, 17, 2, 2, 32, 32)
    used = torch.tensor([17, 5, 1], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q8, k8, v8, None, None, 17, 17, causal=True,
                                 seqused_k=used, q_descale=ds[0], k_descale=ds[1],
                                 v_descale=ds[2])
    for b, n in enumerate(used.tolist()):
        ref = expected(q8[b:b + 1], k8[b:b + 1, :n], v8[b:b + 1, :n],
                       [d[b:b + 1] for d in ds], causal=True)
        assert_fp8_close(out[b:b + 1], None, ref)


def _cache_case(paged, q_fp8, seqlen_q=1, new=1, lens=(0, 40, 100), hq=4, hkv=2, d=32,
                page_size=16, capacity=128):
    batch = len(lens)
    q = torch.randn(batch, seqlen_q, hq, d, device=DEVICE)
    kc8, kd = quantize(torch.randn(batch, capacity, hkv, d, device=DEVICE))
    vc8, vd = quantize(torch.randn(batch, capacity, hkv, d, device=DEVICE))
    # New tokens in the cache's scale, as the caller of an fp8 cache writes them.
    k_new = (torch.randn(batch, new, hkv, d, device=DEVICE) / kd[:, None, :, None])
    v_new = (torch.randn(batch, new, hkv, d, device=DEVICE) / vd[:, None, :, None])
    k_new, v_new = (t.clamp(-448, 448).to(torch.float8_e4m3fn) for t in (k_new, v_new))
    q, qd = quantize(q, hkv) if q_fp8 else (q.to(torch.bfloat16), None)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = {}
    # The cache after the append, contiguous (batch, capacity, ...) whatever the layout.
    want_k, want_v = kc8.clone(), vc8.clone()
    for b, n in enumerate(lens):
        want_k[b, n:n + new], want_v[b, n:n + new] = k_new[b], v_new[b]
    if paged:
        perm = torch.randperm(batch * capacity // page_size, device=DEVICE).to(torch.int32)
        perm = perm.view(batch, -1)
        kc8, vc8 = page(kc8, page_size, perm), page(vc8, page_size, perm)
        kw = dict(page_table=perm)
    return (q, kc8, vc8, k_new, v_new, seqlens, kw, (qd, kd, vd), want_k, want_v, perm
            if paged else None)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_fp8", [True, False], ids=["fp8-q", "bf16-q"])
@pytest.mark.parametrize("seqlen_q", [1, 17])
def test_kvcache_matches_reference(paged, q_fp8, seqlen_q):
    (q, kc, vc, k_new, v_new, seqlens, kw, ds, want_k, want_v, perm) = _cache_case(
        paged, q_fp8, seqlen_q=seqlen_q, new=seqlen_q)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                       causal=True, return_lse=True, q_descale=ds[0],
                                       k_descale=ds[1], v_descale=ds[2], **kw)
    # The fp8 values were appended as given, in the right pages.
    stored_k, stored_v = (page(t, 16, perm) if paged else t for t in (want_k, want_v))
    assert torch.equal(kc.view(torch.uint8), stored_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), stored_v.view(torch.uint8))
    for b, n in enumerate((seqlens + seqlen_q).tolist()):
        ref = expected(q[b:b + 1], want_k[b:b + 1, :n], want_v[b:b + 1, :n],
                       [None if d is None else d[b:b + 1] for d in ds], causal=True)
        assert_fp8_close(out[b:b + 1], lse[b:b + 1], ref)


def test_paged_varlen_prefill_over_fp8_cache():
    (q, kc, vc, _, _, seqlens, kw, ds, want_k, want_v, perm) = _cache_case(
        True, True, seqlen_q=17, new=0, lens=(17, 40, 100))
    batch = q.shape[0]
    cu_q = torch.arange(0, 17 * (batch + 1), 17, dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, None, 17, None,
                                 causal=True, seqused_k=seqlens, page_table=perm,
                                 q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    out = out.view(batch, 17, *out.shape[1:])
    for b, n in enumerate(seqlens.tolist()):
        ref = expected(q[b:b + 1], want_k[b:b + 1, :n], want_v[b:b + 1, :n],
                       [d[b:b + 1] for d in ds], causal=True)
        assert_fp8_close(out[b:b + 1], None, ref)


# ---- refusals: each before any kernel runs, naming the argument --------------------------

def _bad_calls():
    _, (q8, k8, v8), (qd, kd, vd) = fp8_inputs(2, 5, 5, 4, 2, 32, 32)
    q16 = q8.to(torch.bfloat16)
    e5 = k8.to(torch.float8_e5m2)
    return {
        "descale shape (batch, nheads_q)": (ValueError, "k_descale",
                                            lambda: flash_attn_func(q8, k8, v8, k_descale=qd.
                                                                    repeat(1, 2))),
        "descale dtype": (TypeError, "v_descale", lambda: flash_attn_func(
            q8, k8, v8, v_descale=vd.to(torch.bfloat16))),
        "descale device": (ValueError, "q_descale", lambda: flash_attn_func(
            q8, k8, v8, q_descale=torch.ones(2, 2, device="meta"))),
        "descale not a tensor": (TypeError, "k_descale", lambda: flash_attn_func(
            q8, k8, v8, k_descale=1.0)),
        "e5m2": (TypeError, "e4m3fn", lambda: flash_attn_func(q8, e5, e5)),
        "k fp8, v bf16": (TypeError, "both fp8", lambda: flash_attn_func(
            q8, k8, v8.to(torch.bfloat16))),
        "q fp8, k/v bf16": (TypeError, "fp8 queries", lambda: flash_attn_func(
            q8, k8.to(torch.bfloat16), v8.to(torch.bfloat16))),
        "descale with bf16 inputs": (ValueError, "k_descale", lambda: flash_attn_func(
            q16, k8.to(torch.bfloat16), v8.to(torch.bfloat16), k_descale=kd)),
        "q_descale with bf16 q": (ValueError, "q_descale", lambda: flash_attn_func(
            q16, k8, v8, q_descale=qd)),
        "q of rank 3 in flash_attn_func": (ValueError, "expected (batch, seqlen", lambda:
                                            flash_attn_func(q8[0], k8, v8, k_descale=kd)),
        "out_dtype int": (TypeError, "out_dtype", lambda: flash_attn_func(
            q8, k8, v8, out_dtype=torch.int8)),
        "fp8 with grad": (NotImplementedError, "backward", lambda: flash_attn_func(
            q8.detach().requires_grad_(), k8, v8)),
        "bf16 q with grad over fp8 kv": (NotImplementedError, "backward", lambda:
                                         flash_attn_func(q16.requires_grad_(), k8, v8)),
        "varlen descale batch": (ValueError, "expected (batch, nheads_kv) = (1, 2)", lambda:
                                 flash_attn_varlen_func(
                                     q8[0], k8[0], v8[0],
                                     torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
                                     torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
                                     5, 5, k_descale=kd)),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_inputs_are_refused(name, monkeypatch):
    exc, words, call = _bad_calls()[name]
    from asymflash.runtime import dispatch

    def no_kernel(*a, **k):
        raise AssertionError("a kernel was picked before the input was refused")
    monkeypatch.setattr(dispatch, "pick_forward", no_kernel)
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_refused_cache_calls_leave_the_fp8_cache_untouched():
    (q, kc, vc, k_new, v_new, seqlens, kw, ds, *_rest) = _cache_case(False, True)
    before = kc.clone(), vc.clone()
    bad = {
        "k": (TypeError, dict(k=k_new.to(torch.bfloat16), v=v_new)),
        "rotary": (NotImplementedError, dict(
            rotary_cos=torch.ones(128, 16, device=DEVICE),
            rotary_sin=torch.zeros(128, 16, device=DEVICE))),
        "k_descale": (ValueError, dict(k_descale=ds[1][:1])),
    }
    if not seqlens.is_cuda:  # on CUDA index values fail a device-side assert instead, which
        # loses the context (tests/gpu/test_decode_no_sync_gpu.py runs it in a subprocess)
        bad["capacity"] = (ValueError, dict(cache_seqlens=seqlens + 200))
    for name, (exc, change) in bad.items():
        args = dict(k=k_new, v=v_new, cache_seqlens=seqlens, q_descale=ds[0],
                    k_descale=ds[1], v_descale=ds[2])
        args.update(change)
        with pytest.raises(exc, match=None if name == "capacity" else name):
            flash_attn_with_kvcache(q, kc, vc, **args)
        assert torch.equal(kc.view(torch.uint8), before[0].view(torch.uint8)), name
        assert torch.equal(vc.view(torch.uint8), before[1].view(torch.uint8)), name


def test_no_forward_backend_takes_raw_fp8_kv():
    """Dispatch never hands e4m3 k/v to a forward kernel (none reads them: sm90's wgmma
    path included); the API casts them first. Every backend of the device says why."""
    from asymflash.core.params import AttnParams, SeqInfo
    from asymflash.runtime import dispatch

    _, (q8, k8, v8), _ = fp8_inputs(1, 17, 17, 2, 2, 32, 32)
    q = q8.to(torch.bfloat16).flatten(0, 1)
    seq = SeqInfo.dense(1, 17, 17, q.device)
    params = AttnParams(softmax_scale=0.125)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        dispatch.pick_forward(q, k8.flatten(0, 1), v8.flatten(0, 1), seq, params, None)


def test_fp8_under_torch_compile():
    kc, kd = quantize(torch.randn(2, 64, 2, 32, device=DEVICE))
    vc, vd = quantize(torch.randn(2, 64, 2, 32, device=DEVICE))
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([10, 64], dtype=torch.int32, device=DEVICE)

    def decode(q, kc, vc, lens, kd, vd):
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=kd,
                                       v_descale=vd)
    eager = decode(q, kc, vc, lens, kd, vd)
    assert torch.equal(torch.compile(decode, fullgraph=True)(q, kc, vc, lens, kd, vd), eager)
    b = 1
    assert_fp8_close(eager[b:], None, expected(q[b:], kc[b:], vc[b:], (None, kd[b:], vd[b:])))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpus_without_e4m3_loads_attend_over_a_cast_copy(paged, monkeypatch):
    """sm_80 has no e4m3 type in Triton: the cache is cast (exactly) to a 16-bit copy and
    the new e4m3 rows still land in the real cache. Forced here on the CPU."""
    from asymflash.api import fp8 as fp8_api

    monkeypatch.setattr(fp8_api, "reads_e4m3", lambda device: False)
    (q, kc, vc, k_new, v_new, seqlens, kw, ds, want_k, want_v, perm) = _cache_case(
        paged, True, seqlen_q=3, new=3)
    out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                  causal=True, q_descale=ds[0], k_descale=ds[1],
                                  v_descale=ds[2], **kw)
    stored_k = page(want_k, 16, perm) if paged else want_k
    assert torch.equal(kc.view(torch.uint8), stored_k.view(torch.uint8))
    for b, n in enumerate((seqlens + 3).tolist()):
        ref = expected(q[b:b + 1], want_k[b:b + 1, :n], want_v[b:b + 1, :n],
                       [d[b:b + 1] for d in ds], causal=True)
        assert_fp8_close(out[b:b + 1], None, ref)
    if paged:  # paged prefill takes the cast too
        cu_q = torch.arange(0, 3 * (q.shape[0] + 1), 3, dtype=torch.int32, device=DEVICE)
        out2 = flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, None, 3, None,
                                      causal=True, seqused_k=(seqlens + 3), page_table=perm,
                                      q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        assert torch.equal(out2.view_as(out), out)


def test_empty_inputs_and_strided_descales():
    _, (q8, k8, v8), ds = fp8_inputs(2, 5, 0, 4, 2, 32, 32)  # no keys: out 0, lse -inf
    out, lse = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                               return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    _, (q8, k8, v8), ds = fp8_inputs(0, 5, 5, 4, 2, 32, 32)  # no sequences
    assert flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1],
                           v_descale=ds[2]).shape == (0, 5, 4, 32)
    _, (q8, k8, v8), ds = fp8_inputs(2, 17, 33, 4, 2, 32, 32)
    strided = [d.t().contiguous().t() for d in ds]  # FA3 reads descales through strides
    assert torch.equal(
        flash_attn_func(q8, k8, v8, q_descale=strided[0], k_descale=strided[1],
                        v_descale=strided[2]),
        flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2]))


def test_hadamard_rotation_keeps_scores_and_pays_with_outliers():
    from asymflash.core.fp8 import hadamard_rotate

    (q, k, v), _, _ = fp8_inputs(2, 113, 113, 4, 2, 128, 128, outliers=True)
    qr, kr = hadamard_rotate(q), hadamard_rotate(k)
    truth, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    rotated, _ = attention_ref(qr, kr, v, causal=True, compute_dtype=torch.float64)
    assert (rotated - truth).abs().max() < 1e-4  # the scores are the same
    errs = {}
    for name, (qq, kk) in {"per-head": (q, k), "hadamard + per-head": (qr, kr)}.items():
        q8, qd = quantize(qq, 2)
        k8, kd = quantize(kk)
        v8, vd = quantize(v)
        out = flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                              v_descale=vd)
        errs[name] = rms(out, truth)
    print(f"\nfp8 rms error with outlier channels: {errs}")
    assert errs["hadamard + per-head"] < errs["per-head"] / 1.5
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(torch.randn(2, 96))
