"""Online softmax with conditional rescaling against exact softmax in fp64."""

import math

import pytest
import torch

from asymflash.core.exp2 import MAX_REL_ERR
from asymflash.core.softmax import LN2, online_softmax, online_softmax_attention

FP32_TOL = 2e-6  # relative to max|v|: fp32 accumulation over a few hundred keys


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _exact_log2(s, v, sink=None):
    """softmax over log2-unit scores (fp64): out, natural-log lse."""
    s = s.double() * LN2
    if sink is not None:
        sink = torch.broadcast_to(sink.double() * LN2, s.shape[:-1])
        s = torch.cat([s, sink[..., None]], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse > -math.inf, lse, 0.0)[..., None])
    out = p[..., : v.shape[-2]] @ v.double()
    return out, lse


def _exact_attention(q, k, v, scale, softcap=0.0, sink=None, mask=None):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return _exact_log2(s / LN2, v, None if sink is None else sink.double() / LN2)


def _check(out, lse, ref_out, ref_lse, v, tol=FP32_TOL, lse_tol=1e-5):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    vmax = v.abs().max().item()
    assert (out.double() - ref_out).abs().max().item() <= tol * vmax
    finite = ref_lse > -math.inf
    assert torch.equal(lse > -math.inf, finite)
    err = (lse.double() - ref_lse)[finite].abs() / ref_lse[finite].abs().clamp(min=1.0)
    assert err.max().item() <= lse_tol if err.numel() else True


def test_random_attention_rescales_rarely():
    g = _gen(0)
    q, k = torch.randn(2, 3, 64, 32, generator=g), torch.randn(2, 3, 1024, 32, generator=g)
    v = torch.randn(2, 3, 1024, 48, generator=g)
    ref = _exact_attention(q, k, v, 32**-0.5)
    out, lse, st = online_softmax_attention(q, k, v, block_n=64, return_stats=True)
    _check(out, lse, *ref, v)
    assert st.steps == 2 * 3 * 64 * 16
    assert st.rescales == 0  # after the first block the max never grows by 2^8
    _, _, st0 = online_softmax_attention(q, k, v, block_n=64, threshold=0.0, return_stats=True)
    assert st0.rescales > 600  # classic FA2 rescales whenever the max grows: ~H(16)-1 per row
    assert 1.0 <= st.p_max <= 2.0**8


def test_rising_scores_rescale_every_block():
    g = _gen(1)
    nb, bn = 12, 32
    rise = torch.arange(nb).repeat_interleave(bn) * 20.0  # +20 per block: always > 8 past noise
    s = torch.randn(4, 16, nb * bn, generator=g) + rise
    v = torch.randn(4, nb * bn, 8, generator=g)
    out, lse, st = online_softmax(s, v, block_n=bn)
    _check(out, lse, *_exact_log2(s, v), v)
    assert st.rescales == 4 * 16 * (nb - 1)


def test_slow_rise_keeps_stale_max_and_bounds_p():
    g = _gen(2)
    nb, bn = 20, 16
    rise = torch.arange(nb).repeat_interleave(bn) * 3.0  # crosses 8 every third block
    s = torch.rand(2, 8, nb * bn, generator=g) + rise
    v = torch.randn(2, nb * bn, 8, generator=g)
    out, lse, st = online_softmax(s, v, block_n=bn)
    _check(out, lse, *_exact_log2(s, v), v)
    assert 0 < st.rescales < 2 * 8 * (nb - 1) // 2
    assert 2.0**6 < st.p_max <= 2.0**8  # p really exceeds 1 with a stale max, never 2^8


def test_huge_ranges():
    g = _gen(3)
    s = (torch.rand(3, 32, 500, generator=g) * 2 - 1) * 1e4  # log2 units, spread 2e4
    s[:, :, 250:260] += 5e3  # a late cluster of large scores
    v = torch.randn(3, 500, 16, generator=g)
    for th in (0.0, 8.0):
        out, lse, _ = online_softmax(s, v, block_n=64, threshold=th)
        _check(out, lse, *_exact_log2(s, v), v, lse_tol=1e-6)


def test_masked_rows_and_partially_masked_blocks():
    g = _gen(4)
    sq, sk, bn = 40, 200, 32
    q, k = torch.randn(2, sq, 16, generator=g), torch.randn(2, sk, 16, generator=g)
    v = torch.randn(2, sk, 24, generator=g)
    mask = torch.rand(2, sq, sk, generator=g) < 0.3  # scattered -inf everywhere
    mask[:, :10, : 3 * bn] = False  # whole blocks masked, including the first ones
    mask[:, 10:20, 2 * bn :] = False  # whole trailing blocks masked
    mask[0, 5] = False  # fully masked rows
    mask[1, 30:] = False
    out, lse = online_softmax_attention(q, k, v, mask=mask, block_n=bn)
    _check(out, lse, *_exact_attention(q, k, v, 16**-0.5, mask=mask), v)
    assert torch.all(out[0, 5] == 0) and torch.all(out[1, 30:] == 0)
    assert lse[0, 5] == -math.inf and torch.all(lse[1, 30:] == -math.inf)
    # causal with a ragged tail block (seqlen_k not a multiple of block_n)
    causal = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    out, lse = online_softmax_attention(q, k, v, mask=causal, block_n=48)
    _check(out, lse, *_exact_attention(q, k, v, 16**-0.5, mask=causal), v)


def test_softcap():
    g = _gen(5)
    q, k = torch.randn(2, 32, 64, generator=g) * 3, torch.randn(2, 300, 64, generator=g) * 3
    v = torch.randn(2, 300, 32, generator=g)
    ref = _exact_attention(q, k, v, 0.125, softcap=5.0)
    out, lse = online_softmax_attention(q, k, v, softmax_scale=0.125, softcap=5.0, block_n=64)
    _check(out, lse, *ref, v)
    plain = _exact_attention(q, k, v, 0.125)
    assert (plain[0] - ref[0]).abs().max() > 0.1  # the cap actually changed the result


@pytest.mark.parametrize("sink_value", [-3.0, 2.0, 60.0])
def test_sink(sink_value):
    g = _gen(6)
    q, k = torch.randn(2, 3, 20, 16, generator=g), torch.randn(2, 3, 150, 16, generator=g)
    v = torch.randn(2, 3, 150, 8, generator=g)
    sink = torch.tensor([sink_value, -1.0, 0.5])[:, None]  # one per head
    mask = torch.ones(20, 150, dtype=torch.bool)
    mask[7] = False  # a masked row with a sink: out 0, lse = sink
    ref = _exact_attention(q, k, v, 0.25, sink=sink, mask=mask)
    out, lse = online_softmax_attention(
        q, k, v, softmax_scale=0.25, sink=sink, mask=mask, block_n=32
    )
    _check(out, lse, *ref, v)
    assert torch.all(out[:, :, 7] == 0)
    torch.testing.assert_close(lse[:, :, 7], torch.broadcast_to(sink[:, 0], (2, 3)))


def test_threshold_zero_and_eight_agree():
    g = _gen(7)
    s = torch.randn(4, 64, 512, generator=g) * 4 + torch.linspace(0, 30, 512)
    v = torch.randn(4, 512, 32, generator=g)
    o0, l0, st0 = online_softmax(s, v, block_n=64, threshold=0.0)
    o8, l8, st8 = online_softmax(s, v, block_n=64, threshold=8.0)
    assert st8.rescales < st0.rescales / 2
    assert (o0 - o8).abs().max() <= FP32_TOL * v.abs().max()
    torch.testing.assert_close(l0, l8, rtol=1e-6, atol=1e-6)
    ref = _exact_log2(s, v)
    _check(o0, l0, *ref, v)
    _check(o8, l8, *ref, v)


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_poly_share_error_bound(share):
    g = _gen(8)
    q, k = torch.randn(2, 64, 64, generator=g), torch.randn(2, 700, 64, generator=g)
    v = torch.randn(2, 700, 64, generator=g)
    mask = torch.rand(2, 64, 700, generator=g) < 0.9
    ref_out, ref_lse = _exact_attention(q, k, v, 0.125, softcap=20.0, mask=mask)
    out, lse = online_softmax_attention(
        q, k, v, softmax_scale=0.125, softcap=20.0, mask=mask, block_n=128, use_poly_share=share
    )
    # each p carries relative error <= e, so out = sum p v / sum p moves by <= 2e/(1-e) max|v|
    # and lse by <= e (plus fp32 rounding)
    e = MAX_REL_ERR
    assert (out.double() - ref_out).abs().max() <= (2 * e / (1 - e) + FP32_TOL) * v.abs().max()
    assert (lse.double() - ref_lse).abs().max() <= e + 1e-5
    # in practice the errors of many p average out (measured 3.8e-6 and 1.9e-5 at share 1)
    assert (out.double() - ref_out).abs().max() <= 2e-5 * v.abs().max()
    assert (lse.double() - ref_lse).abs().max() <= 4e-5
    exact, _ = online_softmax_attention(
        q, k, v, softmax_scale=0.125, softcap=20.0, mask=mask, block_n=128
    )
    assert not torch.equal(out, exact)  # the polynomial was really used


@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_bf16_p_with_stale_max(threshold):
    """P up to 2^8 rounded to bf16 is as accurate as P <= 1: same relative rounding."""
    g = _gen(9)
    nb, bn = 16, 32
    s = torch.rand(2, 32, nb * bn, generator=g) * 6 + torch.arange(nb).repeat_interleave(bn) * 2
    v = torch.randn(2, nb * bn, 16, generator=g)
    out, _, st = online_softmax(s, v, block_n=bn, threshold=threshold, p_dtype=torch.bfloat16)
    ref_out, _ = _exact_log2(s, v)
    # bf16 keeps 8 significant bits: each p is off by <= 2^-9 relative, so out by <= 2^-8 max|v|
    assert (out.double() - ref_out).abs().max() <= 2.0**-8 * v.abs().max()
    if threshold > 0:
        assert st.p_max > 16.0


def test_argument_checks():
    s, v = torch.zeros(2, 4), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="threshold"):
        online_softmax(s, v, threshold=-1.0)
    with pytest.raises(ValueError, match="block_n"):
        online_softmax(s, v, block_n=0)
