"""flash_attn_varlen_func against the reference run on each sequence separately."""

from __future__ import annotations

import pytest
import torch
from helpers import forced

from asymflash import flash_attn_varlen_func
from asymflash.reference import attention_ref
from asymflash.runtime.dispatch import backend_names

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = backend_names(DEVICE)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def _per_sequence_reference(q, k, v, lens_q, lens_k, used_k, dout, sink, **kw):
    """Reference out/lse/grads, sequence by sequence, packed back like the inputs."""
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.detach().float().requires_grad_(True)
    outs, lses = [], []
    qo = ko = 0
    for sq, sk, su in zip(lens_q, lens_k, used_k):
        qs = leaves[0][qo:qo + sq].unsqueeze(0)
        ks, vs = (t[ko:ko + su].unsqueeze(0) for t in leaves[1:])
        o, lse = attention_ref(qs, ks, vs, learnable_sink=sink_leaf, **kw)
        outs.append(o[0])
        lses.append(lse[0])
        qo, ko = qo + sq, ko + sk
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    wanted = leaves + ([sink_leaf] if sink is not None else [])
    grads = torch.autograd.grad(out, wanted, dout.float(), allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted)]
    return out, lse, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,window,softcap,with_sink,with_used", [
    (False, (-1, -1), 0.0, False, False),
    (True, (-1, -1), 0.0, True, False),
    (False, (7, 2), 3.0, False, True),
    (True, (-1, -1), 0.0, False, True),
])
def test_varlen_matches_reference(backend, causal, window, softcap, with_sink, with_used):
    lens_q = [17, 0, 45, 1, 30]
    lens_k = [20, 5, 45, 0, 61]
    used_k = [13, 5, 40, 0, 61] if with_used else lens_k
    hq, hkv, d = 4, 2, 32
    q = torch.randn(sum(lens_q), hq, d, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    sink = torch.randn(hq, device=DEVICE, requires_grad=True) if with_sink else None
    seqused = torch.tensor(used_k, dtype=torch.int32, device=DEVICE) if with_used else None
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    with forced(backend):
        out, lse = flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q),
                                          max(lens_k), learnable_sink=sink, return_lse=True,
                                          seqused_k=seqused, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, k, v] + ([sink] if with_sink else []), dout)
    r_out, r_lse, r_grads = _per_sequence_reference(q, k, v, lens_q, lens_k, used_k, dout,
                                                    sink, **kw)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    assert (out.float() - r_out).abs().max() < 2e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = ~torch.isinf(r_lse)
    assert (lse[fin] - r_lse[fin]).abs().max() < 1e-3
    for g, r in zip(grads, r_grads):
        assert torch.isfinite(g).all()
        assert (g.float() - r).abs().max() < 3e-2 * max(1.0, r.abs().max().item())
    if with_used:  # keys past seqused_k take no part: their gradients are exactly zero
        assert torch.all(grads[1][20 + 5 + 40:20 + 5 + 45] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_equals_dense(backend):
    """Equal lengths packed as varlen give bitwise the dense call's answer."""
    from asymflash import flash_attn_func
    q = torch.randn(3, 33, 2, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(3, 21, 2, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(3, 21, 2, 64, dtype=torch.float16, device=DEVICE)
    with forced(backend):
        dense = flash_attn_func(q, k, v, causal=True)
        packed = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                        _cu([33] * 3), _cu([21] * 3), 33, 21, causal=True)
    assert torch.equal(dense.flatten(0, 1), packed)
