"""attention_backward with an external (final) out and lse: summed over key blocks, the
contributions equal the full backward's gradients (autograd through asymflash.reference)."""

import pytest
import torch

from asymflash import attention_backward, attention_ref, flash_attn_func

ATOL = 1e-4


def _ref_grads(q, k, v, dout, causal, softcap=0.0):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q, k, v, causal=causal, softcap=softcap)
    return torch.autograd.grad(out, (q, k, v), dout)


def _blockwise(q, k, v, dout, bounds, causal, softcap=0.0, deterministic=False):
    """The ring's pattern: the last block is the queries' own (causal when causal), the
    blocks before it are seen in full."""
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for i, (a, z) in enumerate(bounds):
        diag = causal and i == len(bounds) - 1
        dqb, dkb, dvb = attention_backward(dout, q, k[:, a:z], v[:, a:z], out, lse,
                                           causal=diag, softcap=softcap,
                                           deterministic=deterministic)
        assert dkb.shape == k[:, a:z].shape and dvb.shape == v[:, a:z].shape
        dq += dqb
        dks.append(dkb)
        dvs.append(dvb)
    return dq, torch.cat(dks, 1), torch.cat(dvs, 1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
def test_block_contributions_sum_to_full_gradients(causal, hq, hkv):
    b, sq, prior = 2, 23, 41  # the queries are the last sq positions of sq + prior keys
    q = torch.randn(b, sq, hq, 16)
    k, v = torch.randn(b, prior + sq, hkv, 16), torch.randn(b, prior + sq, hkv, 8)
    dout = torch.randn(b, sq, hq, 8)
    bounds = [(0, 17), (17, prior), (prior, prior + sq)]
    got = _blockwise(q, k, v, dout, bounds, causal)
    want = _ref_grads(q, k, v, dout, causal)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4)


def test_softcap_and_deterministic_repeat_bitwise():
    q, k, v = torch.randn(1, 13, 2, 8), torch.randn(1, 30, 2, 8), torch.randn(1, 30, 2, 8)
    dout = torch.randn(1, 13, 2, 8)
    bounds = [(0, 9), (9, 17), (17, 30)]
    got = _blockwise(q, k, v, dout, bounds, True, softcap=5.0, deterministic=True)
    again = _blockwise(q, k, v, dout, bounds, True, softcap=5.0, deterministic=True)
    want = _ref_grads(q, k, v, dout, True, softcap=5.0)
    for g, a, w in zip(got, again, want):
        assert torch.equal(g, a)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4)


def test_packed_rows():
    lens_q, lens_k = [5, 12], [9, 20]
    q = torch.randn(sum(lens_q), 4, 16)
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    dout = torch.randn(sum(lens_q), 4, 16)
    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 29], dtype=torch.int32)
    from asymflash import flash_attn_varlen_func
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, causal=True, return_lse=True)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=20)
    for (qa, qz), (ka, kz) in zip([(0, 5), (5, 17)], [(0, 9), (9, 29)]):
        want = _ref_grads(q[None, qa:qz], k[None, ka:kz], v[None, ka:kz], dout[None, qa:qz],
                          True)
        torch.testing.assert_close(dq[qa:qz], want[0][0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(dk[ka:kz], want[1][0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(dv[ka:kz], want[2][0], atol=ATOL, rtol=1e-4)


def test_rows_with_no_keys_get_zero_gradients():
    q, k, v = torch.randn(1, 9, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    dout = torch.randn(1, 9, 2, 8)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True)
    want = _ref_grads(q, k, v, dout, True)
    assert torch.isfinite(dq).all() and (dq[:, :5] == 0).all()
    for g, w in zip((dq, dk, dv), want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("field, value, exc, words", [
    ("lse", torch.zeros(1, 7, 2), ValueError, "lse has shape"),
    ("lse", torch.zeros(1, 2, 7, dtype=torch.float64), TypeError, "lse has dtype"),
    ("out", torch.zeros(1, 7, 2, 16), ValueError, "out has shape"),
    ("dout", torch.zeros(1, 7, 2, 8, dtype=torch.bfloat16), TypeError, "dout has dtype"),
])
def test_bad_input_is_refused(field, value, exc, words):
    args = dict(dout=torch.zeros(1, 7, 2, 8), q=torch.zeros(1, 7, 2, 8),
                k=torch.zeros(1, 5, 2, 8), v=torch.zeros(1, 5, 2, 8),
                out=torch.zeros(1, 7, 2, 8), lse=torch.zeros(1, 2, 7))
    args[field] = value
    with pytest.raises(exc, match=words):
        attention_backward(**args)


def test_portable_kernels_serve_it_too():
    # the interpreted Triton backward, forced: external lse works for every backend
    from asymflash.runtime import dispatch

    if not dispatch.interpreting():
        pytest.skip("the portable kernels run on the CPU only under TRITON_INTERPRET=1")
    q = torch.randn(1, 16, 2, 16, dtype=torch.float16)
    k, v = torch.randn(1, 48, 2, 16, dtype=torch.float16), torch.randn(1, 48, 2, 16,
                                                                        dtype=torch.float16)
    dout = torch.randn(1, 16, 2, 16, dtype=torch.float16)
    with dispatch.use_backend("portable"):
        got = _blockwise(q, k, v, dout, [(0, 32), (32, 48)], True)
    want = _ref_grads(q.float(), k.float(), v.float(), dout.float(), True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=2e-2)


def test_gradient_into_lse_splits_over_blocks():
    q, k, v = torch.randn(2, 11, 4, 8), torch.randn(2, 30, 2, 8), torch.randn(2, 30, 2, 8)
    dout, dlse = torch.randn(2, 11, 4, 8), torch.randn(2, 4, 11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, causal=True)
    want = torch.autograd.grad((ref_out, ref_lse), leaves, (dout, dlse))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for (a, z), causal in (((0, 12), False), ((12, 19), False), ((19, 30), True)):
        dqb, dkb, dvb = attention_backward(dout, q, k[:, a:z], v[:, a:z], out, lse,
                                           causal=causal, dlse=dlse)
        dq += dqb
        dks.append(dkb)
        dvs.append(dvb)
    for g, w in zip((dq, torch.cat(dks, 1), torch.cat(dvs, 1)), want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4)
