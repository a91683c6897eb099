"""The portable FlexAttention forward (mods emitted as triton functions, BlockMask lists
visited) against asymflash.reference.flex_attention_ref and torch's flex_attention, and the
emitted mods themselves against the expression trees. Under the interpreter on a CPU
machine: tiny odd shapes."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl
from flex_mods import BLOCK, IR_MODS, MODS
from helpers import assert_fa_close, assert_lse_close

import asymflash
from asymflash.core import flex_ir, flex_trace
from asymflash.reference import flex_attention_ref
from asymflash.runtime.dispatch import backend_names, use_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("portable" not in backend_names(DEVICE),
                                reason="no portable backend on this machine")
torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

SIZES = [(1, 1), (17, 17), (33, 70), (113, 17)]


def _block_mask(mask_mod, batch, heads, sq, sk):
    if mask_mod is None:
        return None
    return torch_flex.create_block_mask(mask_mod, batch, heads, sq, sk, device=DEVICE,
                                        BLOCK_SIZE=BLOCK)


def _inputs(batch, hq, hkv, sq, sk, d, dtype):
    return [torch.randn(batch, h, s, d, dtype=dtype, device=DEVICE).requires_grad_(True)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("mod", sorted(MODS))
def test_portable_forward_against_reference(mod, sizes):
    sq, sk = sizes
    dtype = torch.float16 if mod in ("alibi", "document", "combined") else torch.bfloat16
    batch, hq, hkv, d = 2, 4, 2, 32
    score_mod, mask_mod, learned = MODS[mod](sq, sk, hq, DEVICE)
    block_mask = _block_mask(mask_mod, batch, hq, sq, sk)
    q, k, v = _inputs(batch, hq, hkv, sq, sk, d, dtype)
    with use_backend("portable"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                            return_lse=True)
        dout = torch.randn_like(out)
        wrt = [q, k, v, *learned]
        grads = torch.autograd.grad(out, wrt, dout)  # the backward pairs with the torch one
    ref = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True)
    low = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True,
                             compute_dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_fa_close("out", out, ref[0], low[0], atol=1e-3)
    assert_lse_close(lse, ref[1])
    ref_grads = torch.autograd.grad(ref[0], wrt, dout.float())
    low_grads = torch.autograd.grad(low[0], wrt, dout)
    # P is rounded to the input dtype before the dV / dK products (as in every FA kernel),
    # which the plain same-dtype computation does not do: one ulp of bf16 on top
    eps = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name, g, r, lo in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, low_grads):
        assert_fa_close(name, g, r, lo, atol=eps * max(1.0, r.abs().max().item()))


@pytest.mark.parametrize("mod", ["document", "relative_bias", "combined"])
def test_portable_forward_against_torch_flex(mod):
    sq, sk = 33, 70
    score_mod, mask_mod, _ = MODS[mod](sq, sk, 2, DEVICE)
    block_mask = _block_mask(mask_mod, 2, 2, sq, sk)
    q, k, v = (t.detach() for t in _inputs(2, 2, 2, sq, sk, 16, torch.float16))
    with use_backend("portable"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out, t_lse = torch_flex.flex_attention(q.float(), k.float(), v.float(), score_mod,
                                                 block_mask, return_lse=True)
    assert (out.float() - t_out).abs().max() < 4e-3
    assert_lse_close(lse, t_lse)


def test_portable_flash_attn_func_alibi_and_mask_mod():
    """flash_attn_func's alibi_slopes, softcap, causal and a mask_mod on the portable kernel
    give what the tiled torch backend gives."""
    q, k, v = (torch.randn(2, s, 4, 32, dtype=torch.bfloat16, device=DEVICE)
               for s in (17, 40, 40))
    k, v = k[:, :, :2], v[:, :, :2]
    slopes = torch.rand(4, device=DEVICE)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes,
              mask_mod=lambda b, h, i, j: j % 3 != 1, return_lse=True)
    with use_backend("portable"):
        out, lse = asymflash.flash_attn_func(q, k, v, **kw)
    with use_backend("cpu"):
        ref, ref_lse = asymflash.flash_attn_func(q.float(), k.float(), v.float(), **kw)
    assert (out.float() - ref).abs().max() < 2e-2
    assert_lse_close(lse, ref_lse)


# ---------------------------------------------------------------- emitted mods

@triton.jit
def _eval_kernel(S, OUT, C, FN: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                 B: tl.constexpr, H: tl.constexpr):
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    offs = tl.program_id(0) * M * N + rows[:, None] * N + cols[None, :]
    inb = (rows[:, None] < M) & (cols[None, :] < N)
    s = tl.load(S + offs)
    tl.store(OUT + offs, FN(s, b, h, rows[:, None], cols[None, :], inb, C))


def _run_emitted(root, captured, score):
    from asymflash.backends.portable.flex_emit import captured_args, jit_function

    b, h, m, n = score.shape
    out = torch.empty_like(score)
    _eval_kernel[(b * h,)](score, out, captured_args(captured), jit_function(root), m, n, b, h)
    return out


def _bhqk(shape):
    b, h, m, n = shape
    i32 = torch.int32
    return {"b": torch.arange(b, dtype=i32, device=DEVICE).view(-1, 1, 1, 1),
            "h": torch.arange(h, dtype=i32, device=DEVICE).view(1, -1, 1, 1),
            "q_idx": torch.arange(m, dtype=i32, device=DEVICE).view(1, 1, -1, 1),
            "kv_idx": torch.arange(n, dtype=i32, device=DEVICE).view(1, 1, 1, -1)}


@pytest.mark.parametrize("name", sorted(IR_MODS))
def test_emitted_mod_and_derivative_match_the_tree(name):
    mod = flex_trace.trace(IR_MODS[name], "score")
    score = torch.randn(2, 3, 16, 16, device=DEVICE)
    inputs = {"score": score, **_bhqk(score.shape)}
    for root in (mod.root, flex_ir.derivative(mod.root)):
        want = flex_ir.evaluate(root, inputs, mod.captured).expand_as(score)
        got = _run_emitted(root, mod.captured, score)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_emitted_captured_reads_wrap_negatives_and_zero_out_of_range():
    table = torch.arange(1.0, 9.0, device=DEVICE)

    def score_mod(s, b, h, q, kv):
        return s * 0 + table[q - kv]  # indices from -15 to 15 into 8 entries

    mod = flex_trace.trace(score_mod, "score", DEVICE)
    score = torch.zeros(1, 1, 16, 16, device=DEVICE)
    got = _run_emitted(mod.root, mod.captured, score)
    d = torch.arange(16, device=DEVICE)[:, None] - torch.arange(16, device=DEVICE)[None, :]
    inside = (d >= -8) & (d < 8)  # where torch's indexing is defined: the same values
    want = table[torch.where(inside, d, 0)]
    assert torch.equal(got[0, 0][inside], want[inside])
    assert torch.all(got[0, 0][~inside] == 0)


def test_backward_dispatch():
    """The portable backward takes calls without captured-tensor gradients; those with go to
    the tiled torch backend (which computes them)."""
    from asymflash.api.flex import prepare
    from asymflash.runtime.dispatch import pick_flex

    q, k, v = _inputs(1, 2, 2, 17, 17, 16, torch.float16)
    plain, _, _ = MODS["alibi"](17, 17, 2, DEVICE)
    learned, _, _ = MODS["relative_bias"](17, 17, 2, DEVICE)
    with use_backend("portable"):
        for mod, want in ((plain, "portable"), (learned, "cpu")):
            problem = prepare(q, k, v, mod, None, None, False)
            assert pick_flex(q, k, v, problem, "backward").NAME == want
