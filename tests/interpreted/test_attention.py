"""Every backend against the reference: forward, lse and gradients, over a grid of features.

On a CPU machine this runs the tiled CPU backend and the portable Triton kernels under the
interpreter (small shapes); on a GPU machine the same grid runs on the CUDA backends.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close, forced, make_qkv, reference_pair

from asymflash import flash_attn_func
from asymflash.runtime.dispatch import backend_names

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = backend_names(DEVICE)

# (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, d, dv, causal, window, softcap, sink, dtype)
CASES = [
    (1, 1, 1, 1, 1, 64, 64, False, (-1, -1), 0.0, False, torch.bfloat16),
    (2, 17, 17, 2, 2, 32, 32, True, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 113, 203, 2, 1, 64, 64, True, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 203, 113, 2, 2, 128, 128, True, (-1, -1), 0.0, False, torch.float16),
    (2, 17, 113, 8, 1, 32, 32, False, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 113, 113, 4, 2, 96, 96, False, (16, 4), 0.0, False, torch.bfloat16),
    (1, 64, 80, 2, 2, 192, 128, False, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 33, 47, 2, 2, 256, 256, True, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 50, 70, 2, 1, 64, 64, False, (-1, -1), 2.0, False, torch.bfloat16),
    (1, 41, 41, 2, 2, 64, 64, True, (-1, -1), 0.0, True, torch.bfloat16),
    (2, 17, 33, 4, 2, 32, 32, False, (5, 0), 5.0, True, torch.float16),
    (1, 70, 20, 2, 1, 48, 48, False, (8, -1), 0.0, False, torch.bfloat16),
    (1, 29, 29, 2, 2, 40, 24, False, (-1, 3), 0.0, True, torch.bfloat16),
]


def _id(case):
    b, sq, sk, hq, hkv, d, dv, causal, win, cap, sink, dt = case
    return (f"b{b}-q{sq}-k{sk}-h{hq}/{hkv}-d{d}/{dv}-{'causal' if causal else 'full'}"
            f"-w{win[0]}_{win[1]}-cap{cap:g}-{'sink' if sink else 'nosink'}-{str(dt)[6:]}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(backend, case):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, has_sink, dtype = case
    q, k, v = make_qkv(batch, sq, sk, hq, hkv, d, dv, dtype, DEVICE)
    sink = torch.randn(hq, device=DEVICE, requires_grad=True) if has_sink else None
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    with forced(backend):
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
    dout = torch.randn_like(out)
    with forced(backend):
        grads = torch.autograd.grad(out, [q, k, v] + ([sink] if has_sink else []), dout)
    ref32, ref_low = reference_pair(q, k, v, dout, sink=sink, **kw)

    assert out.shape == (batch, sq, hq, dv) and out.dtype == dtype
    assert_fa_close("out", out, ref32[0], ref_low[0], atol=1e-3)
    assert_lse_close(lse, ref32[1])
    for name, g, r32, rlow in zip(("dq", "dk", "dv", "dsink"), grads, ref32[2:], ref_low[2:]):
        assert g.shape == r32.shape
        # dsink sums P_sink * rowsum(dO * O) over every row, with O rounded to the input dtype
        # (as every FlashAttention backward does), so its atol grows with its magnitude.
        atol = 2e-3 if name != "dsink" else 1e-2 * max(1.0, r32.abs().max().item())
        assert_fa_close(name, g, r32, rlow, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_give_zero_and_minus_inf(backend):
    # seqlen_q > seqlen_k under a causal mask: the first rows see no key at all.
    q, k, v = make_qkv(1, 40, 8, 2, 2, 32, 32, torch.bfloat16, DEVICE)
    with forced(backend):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        out.backward(torch.randn_like(out))
    assert torch.all(out[0, :32] == 0) and torch.all(lse[0, :, :32] == float("-inf"))
    assert torch.isfinite(lse[0, :, 32:]).all()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.all(q.grad[0, :32] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_gradient(backend):
    """A loss that uses lse gets the lse's gradient too (not silently dropped)."""
    q, k, v = make_qkv(1, 23, 31, 2, 1, 32, 32, torch.float16, DEVICE)
    with forced(backend):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        grads = torch.autograd.grad((out.float() ** 2).sum() + lse.sum(), [q, k, v])
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    from asymflash.reference import attention_ref

    r_out, r_lse = attention_ref(*leaves, causal=True)
    r_grads = torch.autograd.grad((r_out ** 2).sum() + r_lse.sum(), leaves)
    for g, r in zip(grads, r_grads):
        assert (g.float() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("used", ["lse", "out"])
def test_gradient_through_one_output(backend, used):
    """Only one of out / lse reaches the loss: the other's gradient is never materialised
    (eager calls) and must count as zero, for flash_attn_func and the varlen entry point."""
    from asymflash import flash_attn_varlen_func
    from asymflash.reference import attention_ref

    q, k, v = make_qkv(2, 17, 29, 2, 1, 32, 32, torch.float16, DEVICE)
    w = torch.randn(2, 17, 2, 32, device=DEVICE)
    lse_w = torch.randn(2, 2, 17, device=DEVICE)

    def loss(out, lse):
        return (out.float() * w).sum() if used == "out" else (lse * lse_w).sum()

    with forced(backend):
        grads = torch.autograd.grad(loss(*flash_attn_func(q, k, v, causal=True,
                                                          return_lse=True)), [q, k, v])
        cu_q = torch.tensor([0, 17, 34], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 29, 58], dtype=torch.int32, device=DEVICE)
        out, lse = flash_attn_varlen_func(
            q.reshape(34, 2, 32), k.reshape(58, 1, 32), v.reshape(58, 1, 32), cu_q, cu_k,
            17, 29, causal=True, return_lse=True)
        # varlen lse is (heads, total_q): as (batch, heads, seqlen) for the same loss
        varlen_grads = torch.autograd.grad(
            loss(out.view(2, 17, 2, 32), lse.view(2, 2, 17).transpose(0, 1)), [q, k, v])
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    # lse does not depend on v: the reference's dv is then None, i.e. zero
    r_grads = torch.autograd.grad(loss(*attention_ref(*leaves, causal=True)), leaves,
                                  allow_unused=True)
    r_grads = [torch.zeros_like(t) if r is None else r for t, r in zip(leaves, r_grads)]
    for g, vg, r in zip(grads, varlen_grads, r_grads):
        tol = 2e-2 * max(1.0, r.abs().max().item())
        assert (g.float() - r).abs().max().item() < tol
        assert (vg.float() - r).abs().max().item() < tol


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's tile shape is a CPU-run knob")
@pytest.mark.parametrize("tiles", [(32, 16), (16, 32)])
def test_portable_kernels_do_not_depend_on_tile_shape(tiles, monkeypatch):
    """The GPU runs other (and non-square) tiles than the interpreter's 16x16: the mask and
    block-range logic must give the same answer for any block_m / block_n."""
    import asymflash.backends.portable as portable

    monkeypatch.setattr(portable, "_INTERPRETER_CONFIG", portable.Config(*tiles, 4, 1))
    case = (2, 37, 53, 4, 2, 32, 32, True, (9, 0), 4.0, True, torch.float16)
    test_matches_reference("portable", case)
    case = (1, 53, 29, 2, 1, 32, 32, False, (5, 3), 0.0, False, torch.bfloat16)
    test_matches_reference("portable", case)
