"""flash-attn 2's packed entry points against the reference on the unpacked tensors, with
gradients into the packed tensor, on whatever device the tests run on."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, reference_pair

from asymflash import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16


def _check(out, grads, q, k, v, dout, **kw):
    (out32, _, *g32), (outlow, _, *glow) = reference_pair(q, k, v, dout, **kw)
    assert_fa_close("out", out, out32, outlow, atol=2e-3)
    for name, g, r32, rlow in zip(("dq", "dk", "dv"), grads, g32, glow):
        assert_fa_close(name, g, r32, rlow, atol=2e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_reference(causal):
    qkv = torch.randn(2, 17, 3, 2, 32, dtype=DTYPE, device=DEVICE, requires_grad=True)
    dout = torch.randn(2, 17, 2, 32, dtype=DTYPE, device=DEVICE)
    out = flash_attn_qkvpacked_func(qkv, causal=causal)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    _check(out, dqkv.unbind(2), *qkv.unbind(2), dout, causal=causal)


def test_kvpacked_gqa_with_window_matches_reference():
    q = torch.randn(1, 23, 4, 64, dtype=DTYPE, device=DEVICE, requires_grad=True)
    kv = torch.randn(1, 31, 2, 2, 64, dtype=DTYPE, device=DEVICE, requires_grad=True)
    dout = torch.randn(1, 23, 4, 64, dtype=DTYPE, device=DEVICE)
    out = flash_attn_kvpacked_func(q, kv, causal=True, window_size=(7, 0), softcap=5.0)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    _check(out, (dq, *dkv.unbind(2)), q, *kv.unbind(2), dout, causal=True, window_size=(7, 0),
           softcap=5.0)


def test_varlen_packed_functions_match_reference_per_sequence():
    lens = [5, 1, 19]
    cu = torch.tensor([0, 5, 6, 25], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(25, 3, 2, 32, dtype=DTYPE, device=DEVICE, requires_grad=True)
    q = torch.randn(25, 4, 32, dtype=DTYPE, device=DEVICE, requires_grad=True)
    kv = torch.randn(25, 2, 2, 32, dtype=DTYPE, device=DEVICE, requires_grad=True)
    dout2 = torch.randn(25, 2, 32, dtype=DTYPE, device=DEVICE)
    dout4 = torch.randn(25, 4, 32, dtype=DTYPE, device=DEVICE)
    out_a = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    (dqkv,) = torch.autograd.grad(out_a, qkv, dout2)
    out_b = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens))
    dq, dkv = torch.autograd.grad(out_b, (q, kv), dout4)
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [t[rows].unsqueeze(0) for t in qkv.unbind(1)]
        _check(out_a[rows].unsqueeze(0), [g[rows].unsqueeze(0) for g in dqkv.unbind(1)], *one,
               dout2[rows].unsqueeze(0), causal=True)
        one = [q[rows].unsqueeze(0)] + [t[rows].unsqueeze(0) for t in kv.unbind(1)]
        grads = [dq[rows].unsqueeze(0)] + [g[rows].unsqueeze(0) for g in dkv.unbind(1)]
        _check(out_b[rows].unsqueeze(0), grads, *one, dout4[rows].unsqueeze(0))


@pytest.mark.parametrize("call,match", [
    (lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 2, 32, dtype=DTYPE)), "qkv"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 32, dtype=DTYPE)), "qkv"),
    (lambda: flash_attn_kvpacked_func(torch.randn(2, 5, 2, 32, dtype=DTYPE),
                                      torch.randn(2, 5, 3, 2, 32, dtype=DTYPE)), "kv"),
    (lambda: flash_attn_varlen_qkvpacked_func([1.0], torch.zeros(2, dtype=torch.int32), 1),
     "qkv"),
])
def test_bad_packing_is_refused_with_a_clear_message(call, match):
    with pytest.raises((ValueError, TypeError), match=f"asymflash: {match} "):
        call()
