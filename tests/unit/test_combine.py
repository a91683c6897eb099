"""flash_attn_combine and core.merge: merging attention over disjoint key chunks equals
attention over all the keys (asymflash.reference), with empty chunks and empty rows."""

import math

import pytest
import torch

from asymflash import attention_ref, flash_attn_combine, flash_attn_func
from asymflash.core.merge import merge_into, merge_partials

ATOL = 2e-5


def _qkv(b, sq, sk, hq, hkv, d, dv):
    return (torch.randn(b, sq, hq, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, dv))


def _partials(q, k, v, bounds, causal_last=False):
    outs, lses = [], []
    for i, (a, z) in enumerate(bounds):
        causal = causal_last and i == len(bounds) - 1
        o, lse = flash_attn_func(q, k[:, a:z], v[:, a:z], causal=causal, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses).transpose(-1, -2)


@pytest.mark.parametrize("bounds", [[(0, 20), (20, 20), (20, 61), (61, 83)],
                                    [(0, 83)], [(0, 1), (1, 82), (82, 83)]])
def test_combine_equals_full_attention(bounds):
    q, k, v = _qkv(2, 37, 83, 6, 2, 16, 24)
    out_p, lse_p = _partials(q, k, v, bounds)
    out, lse = flash_attn_combine(out_p, lse_p)
    ref_out, ref_lse = attention_ref(q, k, v)
    assert out.dtype == q.dtype and lse.shape == (2, 37, 6)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.transpose(1, 2), atol=ATOL, rtol=1e-5)


def test_combine_causal_blocks_of_a_ring():
    # queries are the last 29 positions: the keys before them fully, their own block causally
    q, k, v = _qkv(1, 29, 29 + 45, 4, 4, 8, 8)
    out_p, lse_p = _partials(q, k, v, [(0, 13), (13, 45), (45, 74)], causal_last=True)
    out, lse = flash_attn_combine(out_p, lse_p)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.transpose(1, 2), atol=ATOL, rtol=1e-5)


def test_rows_no_chunk_saw_give_zero_and_minus_inf():
    # causal with seqlen_q > seqlen_k: the first rows see no key in any chunk
    q, k, v = _qkv(2, 11, 5, 2, 1, 8, 8)
    out_p, lse_p = _partials(q, k, v, [(0, 5), (5, 5)], causal_last=False)
    o1, l1 = flash_attn_func(q, k, v, causal=True, return_lse=True)
    out, lse = flash_attn_combine(torch.stack([o1, out_p[1]]),
                                  torch.stack([l1, lse_p[1].transpose(-1, -2)]).transpose(-1, -2))
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert torch.isinf(ref_lse[:, :, :6]).all()
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.transpose(1, 2), atol=ATOL, rtol=1e-5)


def test_weightless_parts_never_leak_nan_or_inf():
    out_p = torch.randn(3, 5, 2, 8)
    lse_p = torch.randn(3, 5, 2)
    out_p[1] = float("nan")
    out_p[2, :2] = float("inf")
    lse_p[1] = -math.inf
    lse_p[2, :2] = -math.inf
    lse_p[:, 4] = -math.inf  # row 4: nobody saw anything
    out, lse = flash_attn_combine(out_p, lse_p)
    assert torch.isfinite(out).all()
    assert (out[4] == 0).all() and torch.isinf(lse[4]).all()
    w = torch.softmax(torch.stack([lse_p[0, :4], lse_p[2, :4]]), 0)
    want = w[0, ..., None] * out_p[0, :4] + w[1, ..., None] * torch.where(
        torch.isinf(out_p[2, :4]), 0.0, out_p[2, :4])
    torch.testing.assert_close(out[:4], want)
    torch.testing.assert_close(lse[:4], torch.logsumexp(lse_p[:, :4], 0))


def test_packed_rows_out_dtype_and_out_argument():
    q, k, v = _qkv(1, 19, 40, 4, 2, 16, 16)
    out_p, lse_p = _partials(q, k, v, [(0, 17), (17, 40)])
    packed_out, packed_lse = out_p.flatten(1, 2), lse_p.flatten(1, 2)
    dest = torch.empty(19, 4, 16, dtype=torch.bfloat16)
    out, lse = flash_attn_combine(packed_out, packed_lse, out=dest, out_dtype=torch.bfloat16)
    assert out is dest
    ref_out, ref_lse = attention_ref(q, k, v)
    torch.testing.assert_close(out.float(), ref_out[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse[0].transpose(0, 1), atol=ATOL, rtol=1e-5)


def test_merge_into_folds_like_merge_partials():
    out_p, lse_p = torch.randn(4, 7, 3, 8), torch.randn(4, 7, 3) * 30
    lse_p[2, :3] = -math.inf
    lse_p[:, 6] = -math.inf
    acc, acc_lse = torch.zeros(7, 3, 8), torch.full((7, 3), -math.inf)
    for i in range(4):
        merge_into(acc, acc_lse, out_p[i], lse_p[i])
    out, lse = merge_partials(out_p, lse_p)
    torch.testing.assert_close(acc, out)
    torch.testing.assert_close(acc_lse, lse)
    assert (acc[6] == 0).all() and torch.isinf(acc_lse[6]).all()


def test_no_splits_and_gradients():
    out, lse = flash_attn_combine(torch.zeros(0, 2, 3, 4, 8), torch.zeros(0, 2, 3, 4))
    assert (out == 0).all() and torch.isinf(lse).all()
    out_p = torch.randn(3, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    lse_p = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda o, s: merge_partials(o, s)[0].double(),
                                    (out_p, lse_p))


@pytest.mark.parametrize("bad, exc, words", [
    (dict(lse_partial=torch.zeros(2, 3, 4)), ValueError, "lse_partial has shape"),
    (dict(out_partial=torch.zeros(2, 3, 8)), ValueError, "out_partial has shape"),
    (dict(lse_partial=[0.0]), TypeError, "lse_partial is a list"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    (dict(out=torch.zeros(3, 4, 5, 16)), ValueError, "out is"),
])
def test_bad_input_is_refused(bad, exc, words):
    args = dict(out_partial=torch.zeros(2, 3, 4, 5, 8), lse_partial=torch.zeros(2, 3, 4, 5))
    args.update(bad)
    with pytest.raises(exc, match=words):
        flash_attn_combine(**args)


def test_lse_has_fa3s_memory_layout():
    out_p, lse_p = torch.randn(2, 3, 5, 4, 8), torch.randn(2, 3, 5, 4)
    _, lse = flash_attn_combine(out_p, lse_p)
    assert lse.shape == (3, 5, 4) and lse.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(lse, torch.logsumexp(lse_p, 0))
