"""FlexAttention on the GPU at realistic sizes (marker `gpu`): the portable flex kernels
(forward, dQ, dK/dV) against asymflash.reference.flex_attention_ref by the FA tolerance
rule, and against torch's compiled flex_attention (values and gradients), for every mod of
the suite. Written on a CPU machine: this file is what the GPU must confirm."""

from __future__ import annotations

import warnings

import pytest
import torch
from flex_mods import GRAD_MODS, MODS
from helpers import assert_fa_close, assert_lse_close

import asymflash
from asymflash.reference import flex_attention_ref
from asymflash.runtime.dispatch import use_backend

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dtype)
CASES = [(2, 2048, 2048, 16, 4, 128, torch.bfloat16), (1, 4096, 4096, 8, 8, 64, torch.float16),
         (2, 1000, 1113, 8, 2, 128, torch.bfloat16)]
_compiled = {}


def _torch_flex(*args, **kw):
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(torch_flex.flex_attention)
    return _compiled["fn"](*args, **kw)



def _check_against_reference(out, lse, grads, wrt, dout, score_mod, block_mask, dtype):
    """out, lse and the gradients of wrt (q, k, v, then captured tensors) against the fp32
    reference by the FA rule (the baseline: the reference in the inputs' dtype); returns
    the reference's (out, lse) and its fp32 gradients."""
    q, k, v = wrt[:3]
    ref = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True)
    low = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True,
                             compute_dtype=dtype)
    assert_fa_close("out", out, ref[0], low[0], atol=1e-3)
    assert_lse_close(lse, ref[1])
    ref_grads = torch.autograd.grad(ref[0], wrt, dout.float())
    low_grads = torch.autograd.grad(low[0], wrt, dout)
    for name, g, r, lo in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, low_grads):
        assert_fa_close(name, g, r, lo, atol=1e-2 * max(1.0, r.abs().max().item()))
    return ref, ref_grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:6]))
@pytest.mark.parametrize("mod", sorted(MODS))
def test_flex_realistic(mod, case):
    batch, sq, sk, hq, hkv, d, dtype = case
    score_mod, mask_mod, learned = MODS[mod](sq, sk, hq, "cuda")
    block_mask = None if mask_mod is None else torch_flex.create_block_mask(
        mask_mod, batch, hq, sq, sk, device="cuda")
    q, k, v = (torch.randn(batch, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    wrt = [q, k, v, *learned]
    with use_backend("portable"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                            return_lse=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, wrt, dout)
    ref, ref_grads = _check_against_reference(out, lse, grads, wrt, dout, score_mod,
                                              block_mask, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out = _torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=True)
    t_grads = torch.autograd.grad(t_out, wrt, dout)
    assert_fa_close("out vs torch", out, ref[0], t_out, atol=1e-3)
    for name, g, r, t in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, t_grads):
        assert_fa_close(f"{name} vs torch", g, r, t, atol=1e-2 * max(1.0, r.abs().max().item()))


@pytest.mark.parametrize("mod", sorted(GRAD_MODS))
def test_flex_captured_gradients_realistic(mod):
    """Gradients of learned captured tensors from the portable dQ kernel's fp32 atomics at
    a realistic size, against the fp32 reference; a second backward gives bitwise the same
    dq, dk, dv (only the atomically summed gradients may differ, in the last bits)."""
    batch, sq, sk, hq, hkv, d, dtype = CASES[2]
    score_mod, learned = GRAD_MODS[mod](sq, sk, hq, "cuda")
    q, k, v = (torch.randn(batch, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    wrt = [q, k, v, *learned]
    with use_backend("portable"):
        out = asymflash.flex_attention(q, k, v, score_mod, enable_gqa=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, wrt, dout, retain_graph=True)
        again = torch.autograd.grad(out, wrt, dout)
    ref = flex_attention_ref(q, k, v, score_mod, enable_gqa=True)[0]
    low = flex_attention_ref(q, k, v, score_mod, enable_gqa=True, compute_dtype=dtype)[0]
    ref_grads = torch.autograd.grad(ref, wrt, dout.float())
    low_grads = torch.autograd.grad(low, wrt, dout)
    names = ["dq", "dk", "dv"] + [f"d{mod}[{i}]" for i in range(len(learned))]
    for name, g, r, lo in zip(names, grads, ref_grads, low_grads):
        assert_fa_close(name, g, r, lo, atol=1e-2 * max(1.0, r.abs().max().item()))
    for name, g, h in zip(names[:3], grads, again):
        assert torch.equal(g, h), f"{name} differs between two backwards"


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dtype, layout): layout "bshd" passes
# q, k, v as transposed views of (batch, seqlen, heads, dim) tensors (read in place)
SM90_CASES = [c + ("bhsd",) for c in CASES] + [
    (2, 2048, 2048, 16, 4, 128, torch.bfloat16, "bshd"),
    (1, 1000, 3001, 8, 8, 64, torch.bfloat16, "bshd"),
    (2, 2048, 2048, 8, 8, 256, torch.bfloat16, "bhsd"),
]


def _inputs(batch, sq, sk, hq, hkv, d, dtype, layout, requires_grad=False):
    def one(h, s):
        if layout == "bshd":
            t = torch.randn(batch, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, h, s, d, device="cuda", dtype=dtype)
        return t.requires_grad_(requires_grad)
    return one(hq, sq), one(hkv, sk), one(hkv, sk)


@pytest.mark.skipif(not _sm90(), reason="the sm90 flex forward is Hopper's")
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("mod", sorted(MODS))
def test_sm90_flex_forward_realistic(mod, case):
    """The sm90 flex forward (backends/sm90/flex.py) for every mod of the suite, against
    the fp32 reference and torch's compiled flex_attention; d=256 with a mod gathering
    along rows and keys is refused by name (the portable kernel runs it by default)."""
    batch, sq, sk, hq, hkv, d, dtype, layout = case
    score_mod, mask_mod, _ = MODS[mod](sq, sk, hq, "cuda")
    block_mask = None if mask_mod is None else torch_flex.create_block_mask(
        mask_mod, batch, hq, sq, sk, device="cuda")
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dtype, layout)
    try:
        with use_backend("sm90"):
            out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask,
                                                enable_gqa=True, return_lse=True)
    except NotImplementedError as e:
        assert d == 256 and "rows and keys" in str(e), e
        pytest.skip(f"refused: {e}")
    assert out.shape == (batch, hq, sq, d) and out.is_contiguous() and lse.is_contiguous()
    ref = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True)
    low = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True,
                             compute_dtype=dtype)
    assert_fa_close("out", out, ref[0], low[0], atol=1e-3)
    assert_lse_close(lse, ref[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out = _torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=True)
    assert_fa_close("out vs torch", out, ref[0], t_out, atol=1e-3)


@pytest.mark.skipif(not _sm90(), reason="the sm90 flex forward is Hopper's")
def test_sm90_flex_empty_query_blocks_and_training_step():
    """Query blocks the BlockMask leaves without any key block get out = 0 and lse = -inf
    (the kernel's no-pipeline path); the sm90 forward's out and lse feed the portable
    backward (its gradients against the reference's)."""
    batch, sq, sk, hq, hkv, d = 2, 1100, 1300, 8, 2, 128
    # rows of query blocks 2 and 5 see no key at all; the rest a banded causal window
    mask_mod = (lambda b, h, q, kv: (q // 128 != 2) & (q // 128 != 5)  # noqa: E731
                & (kv <= q + 200) & (kv >= q - 700))
    block_mask = torch_flex.create_block_mask(mask_mod, batch, hq, sq, sk, device="cuda")
    table = torch.randn(hq, 64, device="cuda", requires_grad=True)
    score_mod = lambda s, b, h, q, kv: s + table[h, (q - kv) % 64]  # noqa: E731
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, torch.bfloat16, "bshd", requires_grad=True)
    wrt = [q, k, v, table]
    with use_backend("sm90"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                            return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, wrt, dout)
    empty = torch.zeros(sq, dtype=torch.bool, device="cuda")
    empty[256:384] = empty[640:768] = True
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    _check_against_reference(out, lse, grads, wrt, dout, score_mod, block_mask, torch.bfloat16)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dtype, layout) for the sm90 backward
SM90_BWD_CASES = [(2, 2048, 2048, 16, 4, 128, torch.bfloat16, "bshd"),
                  (1, 1000, 1113, 8, 2, 64, torch.float16, "bhsd"),
                  (2, 777, 1500, 8, 8, 128, torch.bfloat16, "bhsd")]


@pytest.mark.skipif(not _sm90(), reason="the sm90 flex kernels are Hopper's")
@pytest.mark.parametrize("case", SM90_BWD_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("mod", sorted(MODS))
def test_sm90_flex_backward_realistic(mod, case):
    """The sm90 flex backward (`bwd/flex_parts.py` on the synchronous body) behind the sm90
    forward, every mod of the suite whose captured tensors need no gradient (those take the
    portable backward): dq, dk, dv against the fp32 reference by the FA rule."""
    from asymflash.backends.sm90 import flex as sm90_flex

    batch, sq, sk, hq, hkv, d, dtype, layout = case
    score_mod, mask_mod, learned = MODS[mod](sq, sk, hq, "cuda")
    if learned:
        pytest.skip("learned captured tensors: the portable backward")
    block_mask = None if mask_mod is None else torch_flex.create_block_mask(
        mask_mod, batch, hq, sq, sk, device="cuda")
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dtype, layout, requires_grad=True)
    with use_backend("sm90"):
        out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                            return_lse=True)
    dout = torch.randn_like(out)
    calls = []
    run = sm90_flex.flex_backward
    sm90_flex.flex_backward = lambda *a: calls.append(1) or run(*a)
    try:
        grads = torch.autograd.grad(out, [q, k, v], dout)
    finally:
        sm90_flex.flex_backward = run
    assert calls, "the sm90 flex backward did not run"
    _check_against_reference(out, lse, grads, [q, k, v], dout, score_mod, block_mask, dtype)


@pytest.mark.skipif(not _sm90(), reason="the sm90 flex kernels are Hopper's")
def test_sm90_flex_backward_key_blocks_without_queries():
    """Key blocks no query block lists get dK = dV = 0 (their CTAs walk no step); a
    document-style mask with GQA and ragged lengths, through both sm90 kernels."""
    batch, sq, sk, hq, hkv, d = 2, 1100, 1300, 8, 2, 128
    mask_mod = (lambda b, h, q, kv: (kv // 128 != 3) & (kv // 128 != 7)  # noqa: E731
                & (kv <= q + 200) & (kv >= q - 700))
    block_mask = torch_flex.create_block_mask(mask_mod, batch, hq, sq, sk, device="cuda")
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, torch.bfloat16, "bhsd", requires_grad=True)
    with use_backend("sm90"):
        out, lse = asymflash.flex_attention(q, k, v, None, block_mask, enable_gqa=True,
                                            return_lse=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, k, v], dout)
    unseen = torch.zeros(sk, dtype=torch.bool, device="cuda")
    unseen[384:512] = unseen[896:1024] = True
    for g in grads[1:]:
        assert torch.equal(g[:, :, unseen], torch.zeros_like(g[:, :, unseen]))
    _check_against_reference(out, lse, grads, [q, k, v], dout, None, block_mask,
                             torch.bfloat16)
