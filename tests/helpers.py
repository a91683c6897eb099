"""Shared test helpers: random inputs, the reference in two precisions, the FA tolerance rule.

The rule (as in flash-attn's tests): a kernel's error against the fp32 reference may be at
most twice the error of the same computation done plainly in the input dtype, plus a small
atol. It adapts to dtype, head dim and sequence length without hand-tuned constants.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from asymflash.reference import attention_ref
from asymflash.runtime.dispatch import use_backend


def make_qkv(batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, d, dv, dtype, device,
             requires_grad=True):
    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)

    return (rnd(batch, seqlen_q, nheads_q, d), rnd(batch, seqlen_k, nheads_kv, d),
            rnd(batch, seqlen_k, nheads_kv, dv))


def reference_pair(q, k, v, dout, sink=None, **kw):
    """(fp32 results, same-dtype results): each is (out, lse, dq, dk, dv[, dsink])."""
    results = []
    for upcast in (True, False):
        # fp32 leaves for the fp32 reference, so its gradients are not rounded to q's dtype
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True)
                  for t in (q, k, v)]
        sink_leaf = None if sink is None else sink.detach().clone().requires_grad_(True)
        out, lse = attention_ref(*leaves, learnable_sink=sink_leaf, upcast=upcast, **kw)
        wanted = leaves + ([sink_leaf] if sink_leaf is not None else [])
        grads = torch.autograd.grad(out, wanted, dout.to(out.dtype)) if dout is not None \
            else [None] * len(wanted)
        results.append((out, lse, *grads))
    return results


def max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def assert_fa_close(name, got, ref32, ref_low, atol):
    """err(got) <= 2 * err(same-dtype computation) + atol + 2 * rounding of ref to got.dtype.

    The last term (flash-attn's tests use the same) is the spacing of got's dtype at the
    reference's magnitude: a result stored in bf16 cannot be closer than that.
    """
    err, base = max_err(got, ref32), max_err(ref_low, ref32)
    rounding = max_err((ref32.float() + 0.3 - 0.3).to(got.dtype), ref32) if \
        got.dtype != torch.float32 else 0.0
    bound = 2 * base + atol + 2 * rounding
    assert err <= bound, f"{name}: error {err:.3g} > 2 x {base:.3g} + {atol} + 2 x {rounding:.3g}"
    assert not torch.isnan(got).any(), f"{name} has NaN"


def assert_lse_close(lse, ref_lse, atol=1e-3):
    """lse: equal -inf where the reference is -inf, close elsewhere."""
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse.float()))
    finite = ~torch.isinf(ref_lse)
    if finite.any():
        assert max_err(lse[finite], ref_lse[finite]) <= atol


@contextlib.contextmanager
def forced(backend):
    """Force a backend. A case the backend's own check declines (`unsupported...` named a
    reason, so the dispatcher would send the call elsewhere) is skipped with that reason; any
    other NotImplementedError, e.g. one raised by the backend after it took the call, is a
    failure like a wrong answer."""
    try:
        with use_backend(backend):
            yield
    except NotImplementedError as e:
        declined = f"{backend}: "
        if str(e).startswith("asymflash: no backend can run this") and declined in str(e):
            pytest.skip(f"{backend} declines this case: {e}")
        raise
