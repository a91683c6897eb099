"""Strided q, k, v on the sm90 path: read in place through TMA descriptors with the tensors'
own strides, or as contiguous copies where TMA cannot read them, instead of going to the
portable kernels.

The layouts users hand us: views of a fused QKV projection ((batch, seqlen, 3, heads, dim) or
(batch, seqlen, heads, 3, dim)), and Hugging Face's (batch, heads, seqlen, dim) tensors
transposed to (batch, seqlen, heads, dim). The CPU tests check the stride rules and the
descriptors built from them; the GPU tests check values against the reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, reference_pair

from asymflash import flash_attn_func, flash_attn_varlen_func
from asymflash.backends.sm90.fwd import host as fwd
from asymflash.runtime.dispatch import use_backend

needs_gluon = pytest.mark.skipif(fwd.GLUON_ERROR is not None, reason=str(fwd.GLUON_ERROR))


def fused_qkv(rows, heads, dim, dtype=torch.bfloat16, device="cpu", heads_inner=False):
    """q, k, v as views of one (rows, 3, heads, dim) buffer, or (rows, heads, 3, dim) with
    heads_inner (the projection's output reshaped per head)."""
    if heads_inner:
        buf = torch.randn(rows, heads, 3, dim, dtype=dtype, device=device)
        return buf.unbind(2)
    buf = torch.randn(rows, 3, heads, dim, dtype=dtype, device=device)
    return buf.unbind(1)


def transposed(rows, heads, dim, dtype=torch.bfloat16, device="cpu"):
    """A (rows, heads, dim) view of a contiguous (heads, rows, dim) tensor."""
    return torch.randn(heads, rows, dim, dtype=dtype, device=device).transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# CPU: stride rules and descriptors


def test_row_head_strides_of_common_layouts():
    q, _, _ = fused_qkv(17, 4, 64)
    assert fwd.row_head_strides(q) == (3 * 4 * 64, 64) and fwd.rows_dense(q)
    q, _, _ = fused_qkv(17, 4, 64, heads_inner=True)
    assert fwd.row_head_strides(q) == (4 * 3 * 64, 3 * 64) and not fwd.rows_dense(q)
    t = transposed(113, 2, 128)
    assert fwd.row_head_strides(t) == (128, 113 * 128) and not fwd.rows_dense(t)
    dense = torch.randn(5, 3, 64)
    assert fwd.row_head_strides(dense) == (3 * 64, 64) and fwd.rows_dense(dense)


def test_size_one_dims_take_dense_strides():
    # torch may report any stride for a dimension of size 1: the descriptor must not use it
    one_row = torch.randn(4, 8, 64)[:1].as_strided((1, 8, 64), (12345, 64, 1))
    assert fwd.row_head_strides(one_row) == (8 * 64, 64)
    one_head = torch.randn(7, 64).view(7, 1, 64).as_strided((7, 1, 64), (64, 999, 1))
    assert fwd.row_head_strides(one_head) == (64, 64) and fwd.rows_dense(one_head)


def test_layouts_tma_cannot_read_are_reported():
    assert fwd.tma_layout_reason(torch.randn(9, 2, 64, dtype=torch.bfloat16), "q") is None
    q, _, _ = fused_qkv(9, 2, 64)
    assert fwd.tma_layout_reason(q, "q") is None
    assert fwd.tma_layout_reason(transposed(9, 2, 64), "k") is None
    # rows 68 elements apart: 136 bytes, not a multiple of 16
    odd = torch.randn(9, 68, dtype=torch.bfloat16)[:, :64].unsqueeze(1)
    assert "strides" in fwd.tma_layout_reason(odd, "v")
    # heads broadcast by expand: stride 0
    shared = torch.randn(9, 1, 64, dtype=torch.bfloat16).expand(9, 4, 64)
    assert "strides" in fwd.tma_layout_reason(shared, "k")
    # an 8-byte offset into a buffer
    base = torch.randn(9 * 64 + 4, dtype=torch.bfloat16)[4:].view(9, 1, 64)
    assert "aligned" in fwd.tma_layout_reason(base, "q")


def test_tma_ready_copies_only_what_cannot_be_read_in_place():
    dense = torch.randn(9, 2, 64, dtype=torch.bfloat16)
    q, _, _ = fused_qkv(9, 2, 64)
    odd = torch.randn(9, 68, dtype=torch.bfloat16)[:, :64].unsqueeze(1)
    assert fwd.tma_ready(dense) is dense
    assert fwd.tma_ready(q) is q  # read in place
    copy = fwd.tma_ready(odd)  # rows 136 bytes apart: copied
    assert copy is not odd and copy.is_contiguous() and torch.equal(copy, odd)


@needs_gluon
def test_descriptors_carry_the_tensors_strides():
    q, k, _ = fused_qkv(33, 4, 64)
    desc = fwd.tma_rows(q, (64, 64))
    assert desc.shape == [33, 4 * 64] and desc.strides == [3 * 4 * 64, 1]
    t = transposed(33, 4, 128)
    desc = fwd.tma_heads(t, 64, 128)
    assert desc.shape == [33, 4, 128] and desc.strides == [128, 33 * 128, 1]
    dense = torch.randn(33, 4, 64, dtype=torch.bfloat16)
    assert fwd.tma_rows(dense, (64, 64)).strides == [4 * 64, 1]
    assert fwd.tma_heads(dense, 64, 64).strides == [4 * 64, 64, 1]


# ----------------------------------------------------------------------------------------------
# GPU: values


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _check(got, grads, ref32, reflow):
    out32, _, *g32 = ref32
    outlow, _, *glow = reflow
    assert_fa_close("out", got, out32, outlow, atol=2e-3)
    for name, g, r32, rlow in zip(("dq", "dk", "dv"), grads, g32, glow):
        assert_fa_close(name, g, r32, rlow, atol=2e-3)


@pytest.mark.parametrize("layout", ["fused", "fused-heads-inner", "transposed"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_strided_dense_inputs_on_sm90_match_reference(layout, d, causal):
    batch, seqlen, heads = 1, 203, 4  # batch 1: (b, s, h, d) -> rows stays a view
    if layout == "transposed":
        q, k, v = (transposed(seqlen, heads, d, device="cuda").unsqueeze(0) for _ in range(3))
    else:
        q, k, v = (t.view(batch, seqlen, heads, d) for t in fused_qkv(
            seqlen, heads, d, device="cuda", heads_inner=layout == "fused-heads-inner"))
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    assert not q.is_contiguous()
    dout = torch.randn(batch, seqlen, heads, d, dtype=q.dtype, device="cuda")
    with use_backend("sm90"):  # forced: a refusal raises instead of falling back
        out = flash_attn_func(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(out, grads, *reference_pair(q, k, v, dout, causal=causal))


@pytest.mark.parametrize("kv_layout", ["transposed", "fused"])
@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_strided_varlen_gqa_on_sm90_matches_reference(kv_layout):
    """Packed sequences (17, 113 rows) with a contiguous q and strided k, v (GQA 4:2)."""
    lens, d, hq, hkv = [17, 113], 128, 4, 2
    total = sum(lens)
    cu = torch.tensor([0, lens[0], total], dtype=torch.int32, device="cuda")
    q = torch.randn(total, hq, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    if kv_layout == "transposed":
        k, v = (transposed(total, hkv, d, device="cuda") for _ in range(2))
    else:
        _, k, v = fused_qkv(total, hkv, d, device="cuda")
    k, v = (t.detach().requires_grad_(True) for t in (k, v))
    dout = torch.randn(total, hq, d, dtype=q.dtype, device="cuda")
    with use_backend("sm90"):
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        qb, kb, vb = (t[rows].unsqueeze(0) for t in (q, k, v))
        ref32, reflow = reference_pair(qb, kb, vb, dout[rows].unsqueeze(0), causal=True)
        _check(out[rows].unsqueeze(0), [g[rows].unsqueeze(0) for g in grads], ref32, reflow)
