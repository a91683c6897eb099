"""GPU suite at realistic sizes (marker `gpu`, skipped without CUDA): scripts/gpu-check.sh.

Every CUDA backend of the machine against the reference. Long cases are checked on slices
whose answer does not depend on the rest: the last query rows (which keep the bottom-right
causal alignment) and single batch elements.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, forced, make_qkv, reference_pair

from asymflash import flash_attn_func
from asymflash.reference import attention_ref
from asymflash.runtime.dispatch import backend_names

pytestmark = pytest.mark.gpu
BACKENDS = backend_names("cuda") if torch.cuda.is_available() else []

# (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, d, dv, causal, window, softcap, sink, dtype)
CASES = [
    (4, 2048, 2048, 16, 16, 128, 128, False, (-1, -1), 0.0, False, torch.bfloat16),
    (4, 2048, 2048, 16, 16, 128, 128, True, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 8192, 8192, 8, 1, 64, 64, True, (-1, -1), 0.0, False, torch.bfloat16),
    (2, 4096, 4096, 8, 2, 256, 256, True, (-1, -1), 0.0, False, torch.bfloat16),
    (8, 1024, 1024, 32, 32, 64, 64, False, (-1, -1), 0.0, False, torch.float16),
    (2, 1000, 3001, 16, 4, 96, 96, True, (-1, -1), 0.0, False, torch.bfloat16),
    (2, 3001, 1000, 16, 4, 128, 128, True, (-1, -1), 0.0, False, torch.bfloat16),
    (2, 2048, 2048, 16, 16, 192, 128, True, (-1, -1), 0.0, False, torch.bfloat16),
    (4, 2048, 2048, 8, 8, 128, 128, False, (256, 0), 0.0, False, torch.bfloat16),
    (4, 2048, 2048, 8, 8, 64, 64, True, (-1, -1), 30.0, True, torch.bfloat16),
    (2, 4096, 4096, 8, 1, 128, 128, False, (512, 512), 50.0, True, torch.float16),
    (16, 113, 203, 16, 2, 64, 64, True, (-1, -1), 0.0, True, torch.bfloat16),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:9]))
def test_realistic_sizes(backend, case):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, has_sink, dtype = case
    q, k, v = make_qkv(batch, sq, sk, hq, hkv, d, dv, dtype, "cuda")
    sink = torch.randn(hq, device="cuda", requires_grad=True) if has_sink else None
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    with forced(backend):
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, k, v] + ([sink] if has_sink else []), dout)
    ref32, ref_low = reference_pair(q, k, v, dout, sink=sink, **kw)
    assert_fa_close("out", out, ref32[0], ref_low[0], atol=1e-3)
    assert_lse_close(lse, ref32[1])
    for name, g, r32, rlow in zip(("dq", "dk", "dv", "dsink"), grads, ref32[2:], ref_low[2:]):
        atol = 2e-3 if name != "dsink" else 1e-2 * max(1.0, r32.abs().max().item())
        assert_fa_close(name, g, r32, rlow, atol=atol)


def _check_last_rows(q, k, v, out, lse, rows, causal, dq=None, dout=None):
    """Reference on the last `rows` queries (their answer needs only them and all keys)."""
    qs = q[:, -rows:].detach().float().requires_grad_(True)
    r_out, r_lse = attention_ref(qs, k.detach().float(), v.detach().float(), causal=causal)
    assert (out[:, -rows:].float() - r_out).abs().max() < 2e-2
    assert (lse[:, :, -rows:] - r_lse).abs().max() < 1e-3
    if dq is not None:
        (r_dq,) = torch.autograd.grad(r_out, qs, dout[:, -rows:].float())
        assert (dq[:, -rows:].float() - r_dq).abs().max() < 3e-2 * max(1, r_dq.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_sequence_128k(backend):
    q, k, v = make_qkv(1, 131072, 131072, 4, 2, 128, 128, torch.bfloat16, "cuda")
    with forced(backend):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, [q, k, v], dout)
    _check_last_rows(q, k, v, out, lse, 256, True, dq, dout)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_than_2_pow_31_elements(backend):
    """q holds 2^31 + 2^21 elements: offsets must be computed in 64 bits."""
    batch, seqlen, nheads, d = 8200, 256, 8, 128
    assert batch * seqlen * nheads * d > 2 ** 31
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, d, d, torch.bfloat16, "cuda")
    with forced(backend):
        out = flash_attn_func(q, k, v, causal=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, [q, k, v], dout)
    for b in (0, batch - 1):  # the last element lies past 2^31
        sl = slice(b, b + 1)
        r_out, _ = attention_ref(q[sl], k[sl], v[sl], causal=True)
        r_grads = torch.autograd.grad(r_out, [q, k, v], dout[sl].float())
        assert (out[sl].float() - r_out).abs().max() < 2e-2
        for g, r in zip((dq, dk, dv), r_grads):
            assert (g[sl].float() - r[sl]).abs().max() < 3e-2 * max(1, r[sl].abs().max())

