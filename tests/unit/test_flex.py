"""asymflash.flex_attention on the CPU (tiled torch backend): values and gradients against
asymflash.reference.flex_attention_ref (the mods called directly) and values against torch's
own flex_attention (torch's CPU flex has no backward, so gradients are checked against the
reference, which differentiates through the mods with torch autograd)."""

from __future__ import annotations

import warnings

import pytest
import torch
from flex_mods import BLOCK, IR_MODS, MODS

import asymflash
from asymflash.core import flex_ir, flex_trace
from asymflash.reference import attention_ref, flex_attention_ref

torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

SIZES = [(1, 1), (17, 17), (113, 113), (17, 113), (113, 17)]


def _block_mask(mask_mod, batch, heads, sq, sk):
    if mask_mod is None:
        return None
    return torch_flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu",
                                        BLOCK_SIZE=BLOCK)


def _torch_flex(q, k, v, score_mod, block_mask, gqa):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                         enable_gqa=gqa, return_lse=True)


def _inputs(batch, hq, hkv, sq, sk, d, dtype=torch.float32):
    return [torch.randn(batch, h, s, d, dtype=dtype).requires_grad_(True)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


def _close(name, got, want, tol):
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{name}: -inf pattern differs"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("mod", sorted(MODS))
def test_mods_against_reference_and_torch(mod, sizes):
    sq, sk = sizes
    batch, hq, hkv, d = 2, 4, 2, 16
    score_mod, mask_mod, learned = MODS[mod](sq, sk, hq, "cpu")
    block_mask = _block_mask(mask_mod, batch, hq, sq, sk)
    q, k, v = _inputs(batch, hq, hkv, sq, sk, d)
    out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                        return_lse=True)
    ref_out, ref_lse = flex_attention_ref(q, k, v, score_mod, block_mask, enable_gqa=True)
    _close("out", out, ref_out, 1e-5)
    _close("lse", lse, ref_lse, 1e-5)

    with torch.no_grad():
        t_out, t_lse = _torch_flex(q.detach(), k.detach(), v.detach(), score_mod, block_mask,
                                   True)
    _close("out vs torch", out, t_out, 1e-5)
    _close("lse vs torch", lse, t_lse, 1e-5)

    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)

    def loss(o, l_):
        return (o * dout).sum() + (torch.where(torch.isfinite(l_), l_, 0.0) * dlse).sum()

    wrt = [q, k, v, *learned]
    got = torch.autograd.grad(loss(out, lse), wrt)
    want = torch.autograd.grad(loss(ref_out, ref_lse), wrt)
    for name, g, w in zip(["dq", "dk", "dv", "dcaptured"], got, want):
        _close(name, g, w, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    """16-bit inputs: fp32 math inside, one rounding of the output."""
    score_mod, mask_mod, _ = MODS["combined"](113, 113, 4, "cpu")
    block_mask = _block_mask(mask_mod, 2, 4, 113, 113)
    q, k, v = _inputs(2, 4, 4, 113, 113, 32, dtype)
    out, lse = asymflash.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = flex_attention_ref(q, k, v, score_mod, block_mask)
    _close("out", out, ref_out, 1e-2)
    _close("lse", lse, ref_lse, 1e-4)
    dq, = torch.autograd.grad(out.float().sum(), [q])
    rdq, = torch.autograd.grad(ref_out.sum(), [q])
    _close("dq", dq, rdq, 2e-2)


def test_fully_masked_rows_and_blocks():
    """Rows with nothing to attend to: out 0, lse -inf, zero gradients (not NaN)."""
    mask = lambda b, h, q, kv: (q >= 40) & (kv <= q)  # noqa: E731
    block_mask = _block_mask(mask, 1, 2, 70, 70)
    q, k, v = _inputs(1, 2, 2, 70, 70, 16)
    out, lse = asymflash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.all(out[:, :, :40] == 0) and torch.all(lse[:, :, :40] == float("-inf"))
    ref_out, ref_lse = flex_attention_ref(q, k, v, None, block_mask)
    _close("out", out, ref_out, 1e-5)
    _close("lse", lse, ref_lse, 1e-5)
    dq, dk = torch.autograd.grad(out.sum(), [q, k])
    assert torch.isfinite(dq).all() and torch.all(dq[:, :, :40] == 0)
    rdq, rdk = torch.autograd.grad(ref_out.sum(), [q, k])
    _close("dq", dq, rdq, 1e-4)
    _close("dk", dk, rdk, 1e-4)


def test_score_mod_minus_inf_row():
    """A score_mod that sends a whole row to -inf behaves like a masked row."""
    def score_mod(s, b, h, q, kv):
        return torch.where(q == 3, -float("inf"), s)

    q, k, v = _inputs(1, 1, 1, 9, 9, 16)
    out, lse = asymflash.flex_attention(q, k, v, score_mod, return_lse=True)
    assert torch.all(out[0, 0, 3] == 0) and lse[0, 0, 3] == float("-inf")
    ref_out, ref_lse = flex_attention_ref(q, k, v, score_mod)
    _close("out", out, ref_out, 1e-5)
    dq, = torch.autograd.grad(out.sum(), [q])
    assert torch.isfinite(dq).all()


def test_block_mask_without_full_blocks_and_scale():
    """A BlockMask listing only partial blocks, and an explicit scale."""
    mask = lambda b, h, q, kv: q >= kv  # noqa: E731
    bm = _block_mask(mask, 1, 1, 50, 50)
    bm_partial = torch_flex.BlockMask.from_kv_blocks(bm.kv_num_blocks + bm.full_kv_num_blocks,
                                                     _merge(bm), BLOCK_SIZE=BLOCK,
                                                     mask_mod=mask, seq_lengths=(50, 50))
    q, k, v = _inputs(1, 1, 1, 50, 50, 16)
    out = asymflash.flex_attention(q, k, v, block_mask=bm_partial, scale=0.3)
    ref_out, _ = flex_attention_ref(q, k, v, None, bm, scale=0.3)
    _close("out", out, ref_out, 1e-5)


def _merge(bm):
    """kv_indices listing partial and full blocks together (full ones after the partial)."""
    n_q = bm.kv_num_blocks.shape[-1]
    n_k = bm.kv_indices.shape[-1]
    rows = []
    for i in range(n_q):
        p = bm.kv_indices[0, 0, i, :bm.kv_num_blocks[0, 0, i]].tolist()
        f = bm.full_kv_indices[0, 0, i, :bm.full_kv_num_blocks[0, 0, i]].tolist()
        row = p + f
        rows.append(row + [0] * (n_k - len(row)))
    return torch.tensor(rows, dtype=torch.int32).view(1, 1, n_q, n_k)


# ---------------------------------------------------------------- flash_attn_func's mods

def _bshd(*tensors):
    return [t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in tensors]


def test_flash_attn_func_alibi_matches_definition():
    """alibi_slopes: -slope * |i + seqlen_k - seqlen_q - j|, after softcap, with causal."""
    batch, sq, sk, hq, hkv = 2, 17, 40, 4, 2
    slopes = torch.rand(batch, hq)
    q, k, v = _bshd(*_inputs(batch, hq, hkv, sq, sk, 16))
    out, lse = asymflash.flash_attn_func(q, k, v, causal=True, softcap=2.0,
                                         alibi_slopes=slopes, return_lse=True)

    def score_mod(s, b, h, i, j):
        return 2.0 * torch.tanh(s / 2.0) - slopes[b, h] * (i + sk - sq - j).abs()

    def mask(b, h, i, j):
        return j <= i + sk - sq

    bm = _block_mask(mask, batch, hq, sq, sk)
    ref_out, ref_lse = flex_attention_ref(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), score_mod, bm, enable_gqa=True)
    _close("out", out, ref_out.transpose(1, 2), 1e-5)
    _close("lse", lse, ref_lse, 1e-5)
    got = torch.autograd.grad(out.sum(), [q, k, v])
    want = torch.autograd.grad(ref_out.sum(), [q, k, v])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w, 1e-4)


def test_flash_attn_func_mods_and_window():
    """score_mod and mask_mod combine with window_size and softcap as the flex semantics
    say; a trivial mask_mod reproduces attention_ref exactly."""
    q, k, v = _bshd(*_inputs(1, 2, 2, 33, 33, 16))
    out = asymflash.flash_attn_func(q, k, v, window_size=(6, 2), softcap=5.0,
                                    mask_mod=lambda b, h, i, j: j >= 0)
    ref, _ = attention_ref(q, k, v, window_size=(6, 2), softcap=5.0)
    _close("out", out, ref, 1e-5)
    table = torch.randn(2, 33)
    out = asymflash.flash_attn_func(q, k, v, causal=True,
                                    score_mod=lambda s, b, h, i, j: s + table[h, j],
                                    mask_mod=lambda b, h, i, j: j % 2 == 0)
    bm = _block_mask(lambda b, h, i, j: (j % 2 == 0) & (j <= i), 1, 2, 33, 33)
    ref, _ = flex_attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                lambda s, b, h, i, j: s + table[h, j], bm)
    _close("out", out, ref.transpose(1, 2), 1e-5)


def test_flash_attn_func_mod_errors():
    q, k, v = _bshd(*_inputs(1, 2, 2, 8, 8, 16))
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        asymflash.flash_attn_func(q, k, v, alibi_slopes=torch.rand(3))
    with pytest.raises(TypeError, match="float32"):
        asymflash.flash_attn_func(q, k, v, alibi_slopes=torch.rand(2, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        asymflash.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2),
                                  alibi_slopes=torch.rand(2))
    with pytest.raises(TypeError, match="mask_mod"):
        asymflash.flash_attn_func(q, k, v, mask_mod=3)


# ---------------------------------------------------------------- errors

def test_bad_inputs_are_refused_by_name():
    q, k, v = _inputs(1, 4, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        asymflash.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="4 dims"):
        asymflash.flex_attention(q[0], k, v)
    with pytest.raises(ValueError, match="head dim"):
        asymflash.flex_attention(q, k[..., :8], v, enable_gqa=True)
    with pytest.raises(TypeError, match="dtype"):
        asymflash.flex_attention(q, k.double(), v, enable_gqa=True)
    with pytest.raises(TypeError, match="score_mod"):
        asymflash.flex_attention(q, k, v, score_mod=1.0, enable_gqa=True)
    with pytest.raises(TypeError, match="scale"):
        asymflash.flex_attention(q, k, v, scale="x", enable_gqa=True)
    bm = _block_mask(lambda b, h, i, j: i >= j, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="create it for these lengths"):
        asymflash.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    with pytest.raises(TypeError, match="BlockMask"):
        asymflash.flex_attention(q, k, v, block_mask=torch.ones(8, 8), enable_gqa=True)


def test_unsupported_op_is_named():
    q, k, v = _inputs(1, 2, 2, 8, 8, 16)
    with pytest.raises(flex_trace.ModTraceError, match="sin"):
        asymflash.flex_attention(q, k, v, lambda s, b, h, i, j: torch.sin(s))
    with pytest.raises(flex_trace.ModTraceError, match="could not be traced"):
        asymflash.flex_attention(q, k, v, lambda s, b, h, i, j: s if i.item() > 2 else -s)


# ---------------------------------------------------------------- the expression form

def _bhqk(score_shape):
    b, h, m, n = score_shape
    i32 = torch.int32
    return {"b": torch.arange(b, dtype=i32).view(-1, 1, 1, 1),
            "h": torch.arange(h, dtype=i32).view(1, -1, 1, 1),
            "q_idx": torch.arange(m, dtype=i32).view(1, 1, -1, 1),
            "kv_idx": torch.arange(n, dtype=i32).view(1, 1, 1, -1)}


def _direct(mod, score):
    """The mod called on one-element tensors, element by element (the definition)."""
    from asymflash.core.flex import apply_score_mod

    return apply_score_mod(mod, score)




@pytest.mark.parametrize("name", sorted(IR_MODS))
def test_ir_evaluation_and_derivative(name):
    fn = IR_MODS[name]
    mod = flex_trace.trace(fn, "score")
    score = torch.randn(2, 3, 9, 11, requires_grad=True)
    want = _direct(fn, score)
    got = flex_ir.evaluate(mod.root, {"score": score, **_bhqk(score.shape)}, mod.captured)
    _close("value", got.expand_as(want), want, 1e-6)
    slope = flex_ir.evaluate(flex_ir.derivative(mod.root), {"score": score,
                                                            **_bhqk(score.shape)}, ())
    auto, = torch.autograd.grad(want.sum(), [score])
    _close("d/dscore", slope.expand_as(auto), auto, 1e-5)


def test_ir_derivative_with_respect_to_loads():
    """d mod / d (each read of a learned tensor), scattered at the read's position, sums to
    autograd's gradient of the tensor: reads used twice, two positions of one tensor, a
    read inside min/where/exp, and a read whose index comes from another captured tensor."""
    bias = torch.randn(3, 25, requires_grad=True)
    temp = torch.rand(3, requires_grad=True)
    pos = torch.randint(0, 5, (11,))

    def fn(s, b, h, q, kv):
        near = bias[h, q - kv + 12]
        far = bias[h, pos[kv] - pos[q] + 4]
        return torch.where(q > kv, torch.minimum(s * temp[h], near * near), s) \
            + torch.exp(far) * temp[h]

    mod = flex_trace.trace(fn, "score")
    score = torch.randn(2, 3, 9, 11)
    inputs = {"score": score, **_bhqk(score.shape)}
    ds = torch.randn(2, 3, 9, 11)
    want = torch.autograd.grad((_direct(fn, score) * ds).sum(), [bias, temp])
    for slot, tensor, auto in zip((0, 1), (bias, temp), want):
        got = torch.zeros_like(tensor)
        index = next(i for i, t in enumerate(mod.captured) if t is tensor)
        loads = flex_ir.loads_of(mod.root, {index})
        assert len(loads) == (2 if tensor is bias else 1)
        for load in loads:
            slope = flex_ir.evaluate(flex_ir.derivative(mod.root, load), inputs, mod.captured)
            where = [flex_ir.evaluate(i, inputs, mod.captured).long().expand_as(score)
                     for i in load.index]
            got.index_put_(tuple(where), (ds * slope).expand_as(score), accumulate=True)
        _close(f"d/dslot{slot}", got, auto, 1e-4)


def test_trace_cache_follows_captured_tensors():
    table = torch.randn(10)

    def score_mod(s, b, h, q, kv):
        return s + table[kv]

    first = flex_trace.traced(score_mod, "score")
    assert flex_trace.traced(score_mod, "score") is first
    assert first.captured[0] is table
    table = torch.randn(10)  # rebinding the closure's tensor re-traces with the new one
    second = flex_trace.traced(score_mod, "score")
    assert second is not first and second.captured[0] is table


def test_mask_with_captured_requires_grad_gets_no_grad():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2.0], requires_grad=True)

    def mask(b, h, q, kv):
        return doc[q] == doc[kv]

    q, k, v = _inputs(1, 1, 1, 8, 8, 16)
    bm = _block_mask(mask, 1, 1, 8, 8)
    out = asymflash.flex_attention(q, k, v, block_mask=bm)
    out.sum().backward()
    assert doc.grad is None and q.grad is not None


def test_repeated_calls_reuse_host_work():
    """A repeated call finds its traced mods, block layout and composed built-ins cached
    (identity, not a re-trace), and rebuilding the BlockMask is noticed."""
    from asymflash.api.flex import builtin_mask, builtin_score, prepare
    from asymflash.core.masks import normalize_window

    q, k, v = _inputs(1, 2, 2, 40, 40, 16)
    doc = torch.randint(0, 3, (40,)).sort().values

    def mask(b, h, i, j):
        return doc[i] == doc[j]

    bm = _block_mask(mask, 1, 2, 40, 40)
    first = prepare(q, k, v, None, bm, None, False)
    again = prepare(q, k, v, None, bm, None, False)
    assert again.layout is first.layout and again.mask is first.mask
    rebuilt = prepare(q, k, v, None, _block_mask(mask, 1, 2, 40, 40), None, False)
    assert rebuilt.layout is not first.layout
    assert torch.equal(rebuilt.layout.kinds, first.layout.kinds)
    slopes = torch.rand(2)
    assert builtin_score(0.0, slopes, 40, 40) is builtin_score(0.0, slopes, 40, 40)
    assert builtin_score(0.0, torch.rand(2), 40, 40) is not builtin_score(0.0, slopes, 40, 40)
    window = normalize_window(True, (-1, -1))
    assert builtin_mask(window, 40, 40) is builtin_mask(normalize_window(True, (-1, -1)), 40, 40)
    assert builtin_mask(window, 40, 41) is not builtin_mask(window, 40, 40)


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0)])
def test_empty_sequences(sq, sk):
    q, k, v = _inputs(1, 2, 2, sq, sk, 16)
    out, lse = asymflash.flex_attention(q, k, v, lambda s, b, h, i, j: s * 2, return_lse=True)
    assert out.shape == (1, 2, sq, 16) and torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out.sum(), [q, k, v])
    assert torch.all(dq == 0) and dk.shape == k.shape and torch.all(dv == 0)


def test_captured_tensor_on_another_device_is_refused():
    q, k, v = _inputs(1, 2, 2, 8, 8, 16)
    table = torch.randn(8, device="meta")
    with pytest.raises(ValueError, match="capture"):
        asymflash.flex_attention(q, k, v, lambda s, b, h, i, j: s + table[j])
