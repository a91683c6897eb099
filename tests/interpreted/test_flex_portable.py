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
from flex_mods import BLOCK, GRAD_MODS, IR_MODS, MODS
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


def test_emitted_index_subexpression_reused_outside_the_index():
    """q - kv feeds a captured read's index and the score too: the wrapped index gets a
    name of its own (it once took the name of q - kv's, changing the score's term)."""
    table = torch.randn(3, 40, device=DEVICE)

    def score_mod(s, b, h, q, kv):
        d = q - kv  # one node, used twice
        return s + table[h, d + 20] + d * 0.25

    mod = flex_trace.trace(score_mod, "score", DEVICE)
    score = torch.randn(2, 3, 16, 16, device=DEVICE)
    want = flex_ir.evaluate(mod.root, {"score": score, **_bhqk(score.shape)}, mod.captured)
    got = _run_emitted(mod.root, mod.captured, score)
    assert torch.allclose(got, want.expand_as(score), atol=1e-5)


def test_backward_dispatch():
    """The portable backward takes calls with and without captured-tensor gradients; with
    deterministic=True, those with go to the tiled torch backend (no atomics there)."""
    import dataclasses

    from asymflash.api.flex import prepare
    from asymflash.runtime.dispatch import pick_flex

    q, k, v = _inputs(1, 2, 2, 17, 17, 16, torch.float16)
    plain, _, _ = MODS["alibi"](17, 17, 2, DEVICE)
    learned, _, _ = MODS["relative_bias"](17, 17, 2, DEVICE)
    with use_backend("portable"):
        for mod, deterministic, want in ((plain, True, "portable"), (learned, False, "portable"),
                                         (learned, True, "cpu")):
            problem = prepare(q, k, v, mod, None, None, False)
            problem = dataclasses.replace(problem, deterministic=deterministic)
            assert pick_flex(q, k, v, problem, "backward").NAME == want
        problem = prepare(q, k, v, learned, None, None, False)
        torch.use_deterministic_algorithms(True)
        try:  # torch's own switch rules out the atomics too
            assert pick_flex(q, k, v, problem, "backward").NAME == "cpu"
        finally:
            torch.use_deterministic_algorithms(False)



def test_backward_without_a_derivative_keeps_the_tiled_torch_path(monkeypatch):
    """A mod whose gradient cannot be formed for the kernel (NotImplementedError from the
    derivative or the emitter) is sent to the tiled torch backward, with the reason."""
    from asymflash.api.flex import prepare
    from asymflash.backends.portable import flex_bwd
    from asymflash.runtime.dispatch import pick_flex

    def refuse(score, slots):
        raise NotImplementedError("asymflash: no derivative rule for op 'mystery'")

    monkeypatch.setattr(flex_bwd, "grad_function", refuse)
    q, k, v = _inputs(1, 2, 2, 17, 17, 16, torch.float16)
    learned, _, _ = MODS["relative_bias"](17, 17, 2, DEVICE)
    problem = prepare(q, k, v, learned, None, None, False)
    with use_backend("portable"):
        assert pick_flex(q, k, v, problem, "backward").NAME == "cpu"
    from asymflash.backends.portable import flex as portable_flex

    why = portable_flex.unsupported_flex_backward(q, k, v, problem)
    assert "gradients of captured tensors" in why and "'mystery'" in why


# ---------------------------------------------------------------- captured-tensor gradients

def _document_block_mask(batch, hq, sq, sk):
    doc = torch.randint(0, 3, (max(sq, sk),), device=DEVICE).sort().values
    return _block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), batch, hq, sq, sk)


def _check_grads(names, got, ref, low, dtype):
    eps = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name, g, r, lo in zip(names, got, ref, low):
        assert g is not None and g.dtype == r.dtype and g.shape == r.shape, name
        assert_fa_close(name, g, r, lo, atol=eps * max(1.0, r.abs().max().item()))


# every size for the bias table; one per other mod keeps the interpreter quick
GRAD_CASES = [("relative_table", s) for s in ((17, 17), (17, 113))] + \
    [(name, (113, 17)) for name in sorted(GRAD_MODS)]


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "document-blockmask"])
@pytest.mark.parametrize("mod,sizes", GRAD_CASES,
                         ids=[f"{m}-q{s[0]}-k{s[1]}" for m, s in GRAD_CASES])
def test_portable_captured_gradients_against_reference(mod, sizes, masked):
    """Gradients of q, k, v and of every learned captured tensor from the portable
    backward (captured ones by the dQ kernel's scatter), GQA, against the fp32 reference."""
    sq, sk = sizes
    dtype, batch, hq, hkv = torch.bfloat16, 2, 4, 2
    score_mod, learned = GRAD_MODS[mod](sq, sk, hq, DEVICE)
    block_mask = _document_block_mask(batch, hq, sq, sk) if masked else None
    q, k, v = _inputs(batch, hq, hkv, sq, sk, 16, dtype)
    wrt = [q, k, v, *learned]
    with use_backend("portable"):
        out = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, wrt, dout)
    ref = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True)[0]
    low = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True,
                             compute_dtype=dtype)[0]
    names = ["dq", "dk", "dv"] + [f"d{mod}[{i}]" for i in range(len(learned))]
    _check_grads(names, got, torch.autograd.grad(ref, wrt, dout.float()),
                 torch.autograd.grad(low, wrt, dout), dtype)


def test_portable_captured_gradients_run_on_portable():
    """The backward with captured-tensor gradients is the portable one (not a fallback),
    and takes out.sum()'s gradient, an expanded tensor with every stride 0."""
    from asymflash.backends.portable import flex_bwd

    score_mod, (table,) = GRAD_MODS["relative_table"](17, 17, 2, DEVICE)
    q, k, v = _inputs(1, 2, 2, 17, 17, 16, torch.float16)
    calls = []
    original = flex_bwd.flex_backward

    def spy(*args):
        calls.append(args[-1])
        return original(*args)

    flex_bwd.flex_backward = spy
    try:
        with use_backend("portable"):
            out = asymflash.flex_attention(q, k, v, score_mod)
            (dtable,) = torch.autograd.grad(out.sum(), [table])
    finally:
        flex_bwd.flex_backward = original
    assert calls == [[True]]
    with use_backend("cpu"):
        out = asymflash.flex_attention(q, k, v, score_mod)
        (want,) = torch.autograd.grad(out.sum(), [table])
    assert (dtable - want).abs().max() <= 1e-2 * want.abs().max()


def test_portable_captured_gradients_through_lse_and_a_condition():
    """A loss on lse as well as out (dlse enters dS), and a learned tensor read only for a
    condition (gradient 0, as autograd gives), beside a bias table."""
    sq, sk, hq = 17, 33, 2
    table = (0.5 * torch.randn(hq, sq + sk - 1, device=DEVICE)).requires_grad_(True)
    gate = torch.randn(hq, device=DEVICE).requires_grad_(True)

    def score_mod(s, b, h, i, j):
        return torch.where(gate[h] > 0, s + table[h, i - j + sk - 1], s)

    q, k, v = _inputs(1, hq, hq, sq, sk, 16, torch.bfloat16)
    wrt = [q, k, v, table, gate]
    with use_backend("portable"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, return_lse=True)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.autograd.grad((out, lse), wrt, (dout, dlse))
    ref = flex_attention_ref(q, k, v, score_mod)
    low = flex_attention_ref(q, k, v, score_mod, compute_dtype=torch.bfloat16)
    ref_grads = torch.autograd.grad(ref, wrt[:4], (dout.float(), dlse))
    low_grads = torch.autograd.grad(low, wrt[:4], (dout, dlse))
    _check_grads(["dq", "dk", "dv", "dtable"], got[:4], ref_grads, low_grads, torch.bfloat16)
    assert torch.equal(got[4], torch.zeros_like(gate))  # autograd: unused (no path to it)


@pytest.mark.parametrize("deterministic", [False, True])
def test_portable_learned_alibi_slopes_and_document_mask_mod(deterministic):
    """flash_attn_func's alibi_slopes (a captured tensor of the built-in score mod) with
    requires_grad, causal and a document mask_mod, GQA: gradients of q, k, v and the slopes
    against the tiled torch path in fp32. deterministic=True keeps the atomics out (the
    tiled torch backward computes the slopes' gradient then)."""
    sq, sk, hq, hkv = 113, 17, 4, 2
    q = torch.randn(2, sq, hq, 16, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, sk, hkv, 16, dtype=torch.bfloat16, device=DEVICE,
                        requires_grad=True) for _ in "kv")
    slopes = (torch.rand(2, hq, device=DEVICE) + 0.1).requires_grad_(True)
    doc = torch.randint(0, 3, (sq,), device=DEVICE).sort().values
    kw = dict(causal=True, alibi_slopes=slopes, deterministic=deterministic,
              mask_mod=lambda b, h, i, j: doc[i] == doc[j % sq])
    wrt = [q, k, v, slopes]
    with use_backend("portable"):
        out = asymflash.flash_attn_func(q, k, v, **kw)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, wrt, dout)
    with use_backend("cpu"):
        ref = asymflash.flash_attn_func(*(t.float() for t in (q, k, v)), **kw)
        low = asymflash.flash_attn_func(q, k, v, **kw)
        ref_grads = torch.autograd.grad(ref, wrt, dout.float())
        low_grads = torch.autograd.grad(low, wrt, dout)
    _check_grads(["dq", "dk", "dv", "dslopes"], got, ref_grads, low_grads, torch.bfloat16)
