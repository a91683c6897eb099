"""The portable Triton kernels (under the interpreter on a CPU machine) against the reference
on inputs the feature grid of test_attention.py does not build: strided views, empty
batches and sequences, and fp32 (which the portable kernels decline by name; the backend
list then computes it elsewhere, gradients included). Tiny odd shapes: the interpreter is
slow."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, reference_pair

from asymflash import flash_attn_func, flash_attn_varlen_func
from asymflash.runtime.dispatch import backend_names, use_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("portable" not in backend_names(DEVICE),
                                reason="no portable backend on this machine")


def _check(q, k, v, sink=None, **kw):
    """Forward and backward on the portable kernels (forced: a refusal raises) against the
    fp32 reference, by the FA rule; the inputs may be views of any layout."""
    with use_backend("portable"):
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
        dout = torch.randn_like(out)
        wanted = [q, k, v] + ([sink] if sink is not None else [])
        grads = torch.autograd.grad(out, wanted, dout)
    ref32, ref_low = reference_pair(q, k, v, dout, sink=sink, **kw)
    assert out.shape == ref32[0].shape and out.dtype == q.dtype
    assert_fa_close("out", out, ref32[0], ref_low[0], atol=1e-3)
    assert_lse_close(lse, ref32[1])
    for name, g, t, r32, rlow in zip(("dq", "dk", "dv", "dsink"), grads, wanted, ref32[2:],
                                     ref_low[2:]):
        assert g.shape == t.shape, name
        atol = 2e-3 if name != "dsink" else 1e-2 * max(1.0, r32.abs().max().item())
        assert_fa_close(name, g, r32, rlow, atol=atol)


def _leaf(t):
    return t.requires_grad_(True)


@pytest.mark.parametrize("b,sq,sk,causal", [(1, 17, 113, True), (1, 113, 17, False),
                                            (2, 1, 17, False)])
def test_strided_views_match_reference(b, sq, sk, causal):
    """q the first columns of a (batch, heads, rows, d + 8) tensor seen as (batch, rows,
    heads, d); k and v halves of one packed (batch, rows, 2, heads, d) tensor; v narrower
    than its rows (a column slice)."""
    hq, hkv, d, dv = 2, 1, 32, 24
    q = _leaf(torch.randn(b, hq, sq, d + 8, dtype=torch.bfloat16, device=DEVICE))
    q = q.transpose(1, 2)[..., :d]
    kv = _leaf(torch.randn(b, sk, 2, hkv, d, dtype=torch.bfloat16, device=DEVICE))
    k, v = kv[:, :, 0], kv[:, :, 1, :, :dv]
    assert not any(t.is_contiguous() for t in (q, k, v))
    _check(q, k, v, causal=causal)


def test_strided_views_with_window_softcap_and_sink():
    b, s, hq, hkv, d = 1, 17, 2, 1, 16
    qkv = _leaf(torch.randn(b, s, hq + 2 * hkv, d, dtype=torch.float16, device=DEVICE))
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    sink = _leaf(torch.randn(hq, device=DEVICE))
    assert not any(t.is_contiguous() for t in (q, k, v))
    _check(q, k, v, sink=sink, window_size=(5, 2), softcap=3.0)


def test_strided_varlen_matches_reference_per_sequence():
    lens_q, lens_k, hq, hkv, d = (1, 17, 0), (17, 1, 3), 2, 1, 32
    cu_q, cu_k = (torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
                  for lens in (lens_q, lens_k))
    # rows of q every other row of a wider buffer; k and v interleaved in one tensor
    q = _leaf(torch.randn(2 * sum(lens_q), hq, d, dtype=torch.bfloat16, device=DEVICE))[::2]
    kv = _leaf(torch.randn(sum(lens_k), hkv, 2 * d, dtype=torch.bfloat16, device=DEVICE))
    k, v = kv[..., :d], kv[..., d:]
    assert not any(t.is_contiguous() for t in (q, k, v))
    with use_backend("portable"):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          causal=True, return_lse=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        ref32, ref_low = reference_pair(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None],
                                        dout[q0:q1][None], causal=True)
        assert_fa_close("out", out[q0:q1][None], ref32[0], ref_low[0], atol=1e-3)
        assert_lse_close(lse[:, q0:q1][None], ref32[1])
        for name, g, r32, rlow in zip(("dq", "dk", "dv"), (grads[0][q0:q1], grads[1][k0:k1],
                                                           grads[2][k0:k1]),
                                      ref32[2:], ref_low[2:]):
            assert_fa_close(name, g[None], r32, rlow, atol=2e-3)
    # keys no query row sees (the last sequence has no rows) get zero gradients
    assert torch.all(grads[1][cu_k[2]:] == 0) and torch.all(grads[2][cu_k[2]:] == 0)


@pytest.mark.parametrize("shape", [(0, 17, 17), (2, 0, 17), (2, 17, 0), (2, 0, 0), (1, 1, 0)])
def test_empty_inputs(shape):
    """No batch, no query rows or no keys: the right shapes, a zero output and -inf lse for
    rows without keys, zero gradients, never NaN."""
    b, sq, sk = shape
    hq, hkv, d = 2, 1, 16
    q, k, v = (_leaf(torch.randn(b, n, h, d, dtype=torch.bfloat16, device=DEVICE))
               for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    with use_backend("portable"):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and torch.all(g == 0)


def test_empty_varlen_sequences():
    """Sequences of no rows or no keys among others in one varlen call."""
    lens_q, lens_k, h, d = (0, 17, 1, 0), (17, 0, 1, 0), 2, 16
    cu_q, cu_k = (torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
                  for lens in (lens_q, lens_k))
    q = _leaf(torch.randn(sum(lens_q), h, d, dtype=torch.float16, device=DEVICE))
    k = _leaf(torch.randn(sum(lens_k), h, d, dtype=torch.float16, device=DEVICE))
    v = _leaf(torch.randn(sum(lens_k), h, d, dtype=torch.float16, device=DEVICE))
    with use_backend("portable"):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, return_lse=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    # the second sequence's 17 rows see no key; the third is one row on one key
    assert torch.all(out[:17] == 0) and torch.all(lse[:, :17] == float("-inf"))
    assert torch.all(dq[:17] == 0)
    torch.testing.assert_close(out[17], v[17], atol=0, rtol=0)  # softmax over one key
    assert lse[:, 17].isfinite().all()
    assert torch.all(dk[:17] == 0) and torch.all(dv[:17] == 0)  # no query row saw them
    torch.testing.assert_close(dv[17], dout[17], atol=0, rtol=0)


def test_fp32_is_declined_by_name_and_computed_by_the_backend_list():
    """The portable kernels take fp16 and bf16 only: forced, an fp32 call is refused with the
    dtype as the reason (not computed wrongly); unforced, the CPU's backend list (which holds
    the portable kernels) gives fp32 results, backward included, close to the fp32
    reference."""
    b, sq, sk, hq, hkv, d = 2, 17, 113, 4, 2, 24
    q = _leaf(torch.randn(b, sq, hq, d, device=DEVICE))
    k = _leaf(torch.randn(b, sk, hkv, d, device=DEVICE))
    v = _leaf(torch.randn(b, sk, hkv, d, device=DEVICE))
    if DEVICE != "cpu":  # fp32 is a CPU-path feature: refused before any backend is asked
        with pytest.raises(TypeError, match="dtype"):
            flash_attn_func(q, k, v)
        return
    with use_backend("portable"), pytest.raises(NotImplementedError, match="portable: dtype"):
        flash_attn_func(q, k, v)
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(31, 0), return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref32, _ = reference_pair(q, k, v, dout, causal=True, window_size=(31, 0))
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    torch.testing.assert_close(out, ref32[0], atol=1e-5, rtol=1e-5)
    assert_lse_close(lse, ref32[1], atol=1e-5)
    for g, r in zip(grads, ref32[2:]):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
