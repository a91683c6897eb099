"""Serving prefill shapes of flash_attn_varlen_func: seqused_q, and a padded batch given
only seqused_q / seqused_k (no cu_seqlens), against reference.attention_varlen_ref, on every
backend of the device (CPU, and the portable kernels under TRITON_INTERPRET; sm90 and
portable on a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, forced

from asymflash import flash_attn_varlen_func
from asymflash.core.params import split_unused_queries
from asymflash.reference import attention_ref, attention_varlen_ref
from asymflash.runtime.dispatch import backend_names

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = backend_names(DEVICE)
DTYPE = torch.bfloat16


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return _i32(cu)


def _leaves(*shapes):
    return [torch.randn(*s, dtype=DTYPE, device=DEVICE, requires_grad=True) for s in shapes]


def _references(q, k, v, dout, **kw):
    """(fp32, same-dtype) each (out, lse, dq, dk, dv) of attention_varlen_ref."""
    results = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True)
                  for t in (q, k, v)]
        out, lse = attention_varlen_ref(*leaves, upcast=upcast, **kw)
        results.append((out, lse, *torch.autograd.grad(out, leaves, dout.to(out.dtype))))
    return results


def _check(got, refs, names=("out", "lse", "dq", "dk", "dv")):
    ref32, low = refs
    for name, g, r, lo in zip(names, got, ref32, low):
        if name == "lse":
            assert_lse_close(g, r)
        else:
            assert_fa_close(name, g, r, lo, atol=1e-3)


# --------------------------------------------------------------------------------------------
# The reference's definition


def test_reference_seqused_q_rows_are_zero_and_minus_inf():
    q, k, v = _leaves((20, 2, 16), (9, 1, 16), (9, 1, 16))
    cu_q, cu_k, used_q = _cu([12, 8]), _cu([4, 5]), _i32([5, 0])
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_q=used_q, causal=True)
    # sequence 0: its first 5 rows, causal aligned to 5 queries over 4 keys
    want, want_lse = attention_ref(q[None, :5], k[None, :4], v[None, :4], causal=True)
    torch.testing.assert_close(out[:5], want[0])
    torch.testing.assert_close(lse[:, :5], want_lse[0])
    assert torch.all(out[5:] == 0) and torch.all(lse[:, 5:] == float("-inf"))
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.all(dq[5:] == 0) and dq[:5].abs().sum() > 0


def test_split_unused_queries_layout():
    cu_q, cu_k = _cu([3, 0, 5]), _cu([4, 2, 6])
    q2, k2, used = split_unused_queries(cu_q, cu_k, _i32([1, 0, 5]), _i32([4, 1, 2]))
    assert q2.tolist() == [0, 1, 3, 3, 3, 8, 8]
    assert k2.tolist() == [0, 4, 4, 6, 6, 12, 12]
    assert used.tolist() == [4, 0, 1, 0, 2, 0]
    assert q2.dtype == k2.dtype == used.dtype == torch.int32


# --------------------------------------------------------------------------------------------
# The API on each backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,window,with_used_k", [
    (True, (-1, -1), False), (False, (-1, -1), True), (True, (5, 0), True)])
def test_seqused_q_matches_reference(backend, causal, window, with_used_k):
    lens_q, used_q = [1, 17, 113, 9], [1, 0, 57, 9]
    lens_k = [17, 1, 113, 20]
    used_k = [3, 1, 113, 11] if with_used_k else None
    hq, hkv, d = 4, 2, 32
    q, k, v = _leaves((sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, d))
    cu_q, cu_k, sq = _cu(lens_q), _cu(lens_k), _i32(used_q)
    sk = _i32(used_k) if with_used_k else None
    kw = dict(causal=causal, window_size=window)
    with forced(backend):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          return_lse=True, seqused_k=sk, seqused_q=sq, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = _references(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=sq,
                       seqused_k=sk, **kw)
    _check((out, lse, *grads), refs)
    unused = torch.ones(sum(lens_q), dtype=torch.bool)
    for start, n in zip(cu_q.tolist(), used_q):
        unused[start:start + n] = False
    unused = unused.to(DEVICE)
    assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == float("-inf"))
    assert torch.all(grads[0][unused] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_used_q,with_used_k", [(True, True), (False, True),
                                                     (True, False), (False, False)])
def test_padded_batch_matches_reference(backend, with_used_q, with_used_k):
    batch, sq, sk, hq, hkv, d = 3, 17, 113, 2, 1, 32
    q, k, v = _leaves((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d))
    used_q = _i32([17, 1, 0]) if with_used_q else None
    used_k = _i32([113, 1, 40]) if with_used_k else None
    with forced(backend):
        out, lse = flash_attn_varlen_func(q, k, v, None, None, None, None, causal=True,
                                          return_lse=True, seqused_k=used_k, seqused_q=used_q)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == (batch, sq, hq, d) and lse.shape == (batch, hq, sq)
    rows = dict(cu_seqlens_q=_cu([sq] * batch), cu_seqlens_k=_cu([sk] * batch),
                seqused_q=used_q, seqused_k=used_k, causal=True)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    ref32, low = _references(*flat, dout.flatten(0, 1), **rows)
    as_rows = (out.flatten(0, 1), lse.transpose(0, 1).flatten(1), *(g.flatten(0, 1)
                                                                     for g in grads))
    _check(as_rows, (ref32, low))


def test_padded_batch_without_lengths_equals_flash_attn_func():
    from asymflash import flash_attn_func

    q, k, v = (torch.randn(2, 17, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(3))
    padded = flash_attn_varlen_func(q, k, v, None, None, None, None, causal=True)
    torch.testing.assert_close(padded, flash_attn_func(q, k, v, causal=True), atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Refusals, before any kernel


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(seqused_q=_i32([3, 1])), ValueError, r"seqused_q\[0\] is 3"),
    (dict(seqused_q=_i32([-1, 1])), ValueError, r"seqused_q\[0\] is -1"),
    (dict(seqused_q=_i32([1])), ValueError, r"seqused_q has shape \(1,\)"),
    (dict(seqused_q=torch.tensor([1, 1], device=DEVICE)), TypeError, "seqused_q has dtype"),
    (dict(seqused_q=_i32([1, 1]), page_table=_i32([[0], [1]])), NotImplementedError,
     "seqused_q was given with page_table"),
])
def test_packed_refusals(kwargs, exc, message):
    q = torch.randn(5, 2, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(exc, match=message):
        flash_attn_varlen_func(q, q, q, _cu([2, 3]), _cu([2, 3]), 3, 3, **kwargs)


@pytest.mark.parametrize("args,kwargs,message", [
    ((None, None), dict(seqused_q=_i32([4, 1])), r"seqused_q\[0\] is 4"),
    ((None, None), dict(seqused_k=_i32([1, 6])), r"seqused_k\[1\] is 6"),
    ((_cu([3, 3]), None), {}, "cu_seqlens_k is None while cu_seqlens_q is given"),
    ((None, _cu([3, 3])), {}, "cu_seqlens_q is None while cu_seqlens_k is given"),
])
def test_padded_refusals(args, kwargs, message):
    q = torch.randn(2, 3, 2, 16, dtype=DTYPE, device=DEVICE)
    k = torch.randn(2, 5, 2, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, k, k, *args, 3, 5, **kwargs)


def test_padded_needs_4d_tensors():
    q = torch.randn(6, 2, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="q has shape"):
        flash_attn_varlen_func(q, q, q, None, None, 3, 3, seqused_q=_i32([1, 2]))


def test_seqused_q_and_padded_forms_compile_fullgraph():
    """Under torch.compile the lengths are not read on the host (the checks that would read
    them are skipped, as for seqused_k) and the forms trace into one graph, forward and
    backward, with eager's values."""
    torch._dynamo.reset()
    q, k, v = _leaves((2, 17, 2, 32), (2, 17, 1, 32), (2, 17, 1, 32))
    used_q, used_k = _i32([17, 5]), _i32([9, 17])
    cu = _cu([17, 17])

    def both(q, k, v, used_q, used_k):
        padded = flash_attn_varlen_func(q, k, v, None, None, None, None, causal=True,
                                        seqused_q=used_q, seqused_k=used_k)
        packed = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                        cu, cu, 17, 17, causal=True, seqused_q=used_q)
        # fp32 sums: eager rounds a bf16 sum to bf16, inductor keeps its fp32 accumulator
        return padded.float().sum() + packed.float().pow(2).sum()

    compiled = torch.compile(both, fullgraph=True)
    got = compiled(q, k, v, used_q, used_k)
    grads = torch.autograd.grad(got, (q, k, v))
    want = both(q, k, v, used_q, used_k)
    want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)


def test_lengths_are_read_once_while_unchanged(monkeypatch):
    """The layers of a model pass the same seqused tensors: read (a GPU sync) once, again
    only when a tensor changes in place, and a changed value that is wrong still fails."""
    from asymflash.api import validation

    reads = []
    original = validation._check_seqused_values
    monkeypatch.setattr(validation, "_check_seqused_values",
                        lambda *a: (reads.append(a[2]), original(*a)))
    q = torch.randn(20, 2, 16, dtype=DTYPE, device=DEVICE)
    cu, used_q, used_k = _cu([12, 8]), _i32([5, 8]), _i32([12, 3])
    for _ in range(3):
        flash_attn_varlen_func(q, q, q, cu, cu, 12, 12, seqused_q=used_q, seqused_k=used_k)
    assert sorted(reads) == ["seqused_k", "seqused_q"]
    used_q[1] = 9  # past the second sequence's 8 rows
    with pytest.raises(ValueError, match=r"seqused_q\[1\] is 9"):
        flash_attn_varlen_func(q, q, q, cu, cu, 12, 12, seqused_q=used_q)
    other = _cu([12, 8])  # equal values, another tensor: read again
    flash_attn_varlen_func(q, q, q, other, other, 12, 12, seqused_k=used_k)
    assert reads.count("seqused_k") == 2
