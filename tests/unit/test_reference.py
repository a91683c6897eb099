"""The reference itself, on cases small enough to compute by hand or by another route."""

from __future__ import annotations

import math

import torch

from asymflash.core.masks import allowed, key_range, query_range
from asymflash.core.params import MaskSpec
from asymflash.reference import attention_ref


def test_two_keys_by_hand():
    # one query, two keys: scores 0 and 1 (scale 1) -> weights 1/(1+e), e/(1+e)
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[0.0, 0.0]], [[1.0, 0.0]]]])
    v = torch.tensor([[[[2.0, 0.0]], [[0.0, 4.0]]]])
    out, lse = attention_ref(q, k, v, softmax_scale=1.0)
    w1 = math.e / (1 + math.e)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([2 * (1 - w1), 4 * w1]))
    torch.testing.assert_close(lse[0, 0, 0], torch.tensor(math.log(1 + math.e)))


def test_sink_by_hand():
    # a single key with score 0 and a sink logit log(3): weight 1/4 on the key
    q, k = torch.ones(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)
    v = torch.full((1, 1, 1, 8), 2.0)
    out, lse = attention_ref(q, k, v, learnable_sink=torch.tensor([math.log(3.0)]))
    torch.testing.assert_close(out, torch.full_like(out, 0.5))
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(4.0)))


def test_softcap_by_hand():
    q = torch.tensor([[[[10.0]]]]).expand(1, 1, 1, 8).contiguous()
    k = torch.tensor([[[[1.0]]], [[[0.0]]]]).view(1, 2, 1, 1).expand(1, 2, 1, 8).contiguous()
    v = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1).expand(1, 2, 1, 8).contiguous()
    out, _ = attention_ref(q, k, v, softmax_scale=1.0, softcap=2.0)
    s0 = 2.0 * math.tanh(80.0 / 2.0)  # q.k = 80 capped to ~2
    w = math.exp(s0) / (math.exp(s0) + 1.0)
    torch.testing.assert_close(out[0, 0, 0, 0], torch.tensor(w))


def test_matches_torch_sdpa_and_gqa_equals_repeated_heads():
    q = torch.randn(2, 19, 8, 32, dtype=torch.float64)
    k = torch.randn(2, 23, 2, 32, dtype=torch.float64)
    v = torch.randn(2, 23, 2, 16, dtype=torch.float64)
    out, _ = attention_ref(q, k, v, compute_dtype=torch.float64)
    kr, vr = k.repeat_interleave(4, 2), v.repeat_interleave(4, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, sdpa)
    out_rep, _ = attention_ref(q, kr, vr, compute_dtype=torch.float64)
    torch.testing.assert_close(out, out_rep)


def test_causal_is_bottom_right_aligned():
    ok = allowed(2, 4, MaskSpec(-1, 0))
    assert ok.tolist() == [[True, True, True, False], [True, True, True, True]]
    ok = allowed(4, 2, MaskSpec(-1, 0))  # first two queries see nothing
    assert ok.tolist() == [[False, False], [False, False], [True, False], [True, True]]


def test_local_window():
    ok = allowed(5, 5, MaskSpec(1, 1))
    for i in range(5):
        assert ok[i].nonzero().flatten().tolist() == [j for j in range(5) if abs(i - j) <= 1]


def test_block_ranges_cover_exactly_the_allowed_pairs():
    for sq, sk, mask in [(37, 53, MaskSpec(-1, 0)), (53, 37, MaskSpec(5, 2)),
                         (40, 40, MaskSpec(3, -1)), (17, 90, MaskSpec(-1, -1))]:
        ok = allowed(sq, sk, mask)
        for q_lo in range(0, sq, 8):
            q_hi = min(sq, q_lo + 8)
            k_lo, k_hi = key_range(q_lo, q_hi, sq, sk, mask)
            cols = ok[q_lo:q_hi].any(0).nonzero().flatten()
            if len(cols):
                assert k_lo <= cols.min() and cols.max() < k_hi
        for k_lo in range(0, sk, 8):
            k_hi = min(sk, k_lo + 8)
            q_lo, q_hi = query_range(k_lo, k_hi, sq, sk, mask)
            rows = ok[:, k_lo:k_hi].any(1).nonzero().flatten()
            if len(rows):
                assert q_lo <= rows.min() and rows.max() < q_hi


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(out[0, :3] == 0) and torch.all(lse[0, :, :3] == float("-inf"))
    assert torch.isfinite(out).all()


def test_p_dtype_rounds_the_scaled_weights_to_e4m3():
    """attention_ref(p_dtype=e4m3) against the same steps written out: the weights of each row
    scaled so its largest is 256, rounded through fp16 to e4m3, P·V over the unrounded sum;
    and it is off the exact result by more than the bf16 baseline (what it is for)."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, s, h, 40) for s, h in ((17, 6), (113, 2), (113, 2)))
    got, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                           upcast=False, p_dtype=torch.float8_e4m3fn)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    kb, vb = kb.repeat_interleave(3, dim=2), vb.repeat_interleave(3, dim=2).float()
    # the scores as the bf16 baseline forms them (a bf16 product), then fp32
    s = torch.einsum("bqhd,bkhd->bhqk", qb, kb).float() * 40 ** -0.5
    rows, cols = torch.arange(17)[:, None], torch.arange(113)[None, :]
    s = s.masked_fill(cols > rows + 113 - 17, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * 256).half().to(torch.float8_e4m3fn).float() / 256
    want = torch.einsum("bhqk,bkhd->bqhd", (p8 / p.sum(-1, keepdim=True)).bfloat16().float(),
                        vb)
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()
    exact, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                             compute_dtype=torch.float64)
    plain, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                             upcast=False)
    assert (got.double() - exact).abs().max() > 2 * (plain.double() - exact).abs().max()
