"""Host-side transforms of the sm90 backend, checked on the CPU with the CPU backend standing
in for the compiled kernel:

- head dims other than the kernels' widths (64/128/256, 192/128: fwd.forward_widths) run
  on zero-padded copies: q, k, v
  (and dO, O for the backward) get zero columns up to the compiled width and the results'
  extra columns are dropped; the sliced results must equal the unpadded ones. (Only dims
  that are not multiples of 8 are padded this way, reachable by calling the backend
  directly; the others read through zero-filling 3-D TMA boxes, checked on the GPU.)
- GQA packing (fwd.packs_gqa): the q heads of a kv head become extra query rows; the
  unpacked results must equal the unpacked computation, and calls it would change are not
  packed.

The kernels themselves are checked on the GPU (tests/test_sm90_gpu.py, test_sm90_bwd_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from test_sm90_bwd_gpu import make_case

from asymflash.backends import cpu
from asymflash.backends.sm90.bwd import host as bwd
from asymflash.backends.sm90.fwd import host as fwd
from asymflash.core.params import AttnParams, MaskSpec

# Dims TMA cannot address per head (not multiples of 8), so the padded-copy path.
CASES = [
    dict(name="d100-causal-gqa", lens_q=[17, 113], lens_k=[33, 203], hq=4, hkv=2, d=100,
         window=(-1, 0)),
    dict(name="d190-dv126", lens_q=[113], lens_k=[113], hq=2, hkv=1, d=190, dv=126),
    dict(name="d68-dv132-local-softcap-sink", lens_q=[1, 203], lens_k=[17, 203], hq=2, hkv=2,
         d=68, dv=132, window=(40, 9), softcap=15.0, sink=True),
]


def _case(c):
    q, k, v, dout, seq, params, sink = make_case(dict(c, dtype=torch.float32), device="cpu")
    # scores of O(10): a padding bug would show far above fp32 rounding
    return q * 2, k * 2, v, dout, seq, params, sink


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_padded_forward_equals_unpadded(case, monkeypatch):
    q, k, v, _, seq, params, sink = _case(case)
    widths = fwd.forward_widths(q.shape[-1], v.shape[-1])  # 190/126 -> 192/128
    assert widths in ((128, 128), (192, 128), (256, 256))
    inputs = [t.clone() for t in (q, k, v)]
    padded_forward = fwd.forward

    def kernel_stand_in(qp, kp, vp, seq_, params_, sink_, cfg=None):
        assert (qp.shape[-1], vp.shape[-1]) == widths and kp.shape[-1] == widths[0]
        assert qp.is_contiguous() and vp.is_contiguous()
        return cpu.forward(qp, kp, vp, seq_, params_, sink_)

    monkeypatch.setattr(fwd, "forward", kernel_stand_in)
    out, lse = padded_forward(q, k, v, seq, params, sink)
    ref_out, ref_lse = cpu.forward(q, k, v, seq, params, sink)
    assert out.shape == ref_out.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    for t, before in zip((q, k, v), inputs):
        assert torch.equal(t, before), "inputs must not be modified"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_padded_backward_equals_unpadded(case, monkeypatch):
    q, k, v, dout, seq, params, sink = _case(case)
    width, width_v = bwd.backward_widths(q.shape[-1], v.shape[-1])  # 190/126 -> 192/128
    out, lse = cpu.forward(q, k, v, seq, params, sink)
    padded_backward = bwd.backward

    def kernel_stand_in(dout_, qp, kp, vp, outp, lse_, dlse_, seq_, params_, sink_, cfg=None):
        assert qp.shape[-1] == kp.shape[-1] == width
        assert vp.shape[-1] == dout_.shape[-1] == outp.shape[-1] == width_v
        return cpu.backward(dout_, qp, kp, vp, outp, lse_, dlse_, seq_, params_, sink_)

    monkeypatch.setattr(bwd, "backward", kernel_stand_in)
    got = padded_backward(dout, q, k, v, out, lse, None, seq, params, sink)
    ref = cpu.backward(dout, q, k, v, out, lse, None, seq, params, sink)
    for name, g, r in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        assert g.shape == r.shape and g.is_contiguous(), name
        assert r.abs().max() > 0, name  # a vacuous comparison would pass anything
        # fp32 sums over a different width round differently: ~3e-6 of the largest gradient
        torch.testing.assert_close(g, r, atol=1e-5 * r.abs().max().item(), rtol=1e-5, msg=name)
    if sink is not None:
        torch.testing.assert_close(got[3], ref[3], atol=1e-5, rtol=1e-5)


PACK_CASES = [
    dict(name="gqa4-sq17-softcap", lens_q=[17] * 2, lens_k=[203] * 2, hq=8, hkv=2, d=128,
         softcap=20.0),
    dict(name="gqa4-decode-causal-varlen", lens_q=[1, 1, 1], lens_k=[113, 1, 203], hq=4,
         hkv=1, d=64, window=(-1, 0)),
    dict(name="gqa2-sq64-seqused", lens_q=[64, 33], lens_k=[100, 300], hq=4, hkv=2, d=128,
         seqused=[50, 300]),
]


def _stand_in_forward(expect_heads):
    def kernel_stand_in(q, k, v, seq, params, sink, cfg=None):
        assert q.shape[1] == k.shape[1] == expect_heads, "q heads not packed into rows"
        assert sink is None and not params.mask.is_local
        return cpu.forward(q, k, v, seq, params, sink)
    return kernel_stand_in


@pytest.mark.parametrize("case", PACK_CASES, ids=lambda c: c["name"])
def test_packed_gqa_forward_equals_unpacked(case, monkeypatch):
    q, k, v, _, seq, params, sink = _case(case)
    assert fwd.packs_gqa(q.shape[0], q.shape[1], k.shape[1], seq, params, sink)
    real_forward = fwd.forward
    monkeypatch.setattr(fwd, "forward", _stand_in_forward(k.shape[1]))
    q_before = q.clone()
    out, lse = real_forward(q, k, v, seq, params, sink)
    ref_out, ref_lse = cpu.forward(q, k, v, seq, params, sink)
    assert out.shape == ref_out.shape and out.is_contiguous() and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(q, q_before)


def test_gqa_packing_only_where_every_row_sees_the_same_keys(monkeypatch):
    _, _, _, _, seq1, _, _ = _case(PACK_CASES[1])  # one query row per sequence
    _, _, _, _, seq17, _, _ = _case(PACK_CASES[0])  # 17
    plain, causal = AttnParams(0.1), AttnParams(0.1, MaskSpec(-1, 0))
    left = AttnParams(0.1, MaskSpec(30, 0))
    sink = torch.zeros(8)
    assert fwd.packs_gqa(100, 8, 2, seq17, plain, None)
    assert fwd.packs_gqa(100, 8, 2, seq1, causal, None)
    assert not fwd.packs_gqa(100, 8, 2, seq17, causal, None)  # rows see different keys
    assert not fwd.packs_gqa(100, 8, 2, seq1, left, None)  # the left window cuts keys
    assert not fwd.packs_gqa(100, 8, 2, seq17, plain, sink)  # a per-q-head logit
    assert not fwd.packs_gqa(100, 8, 8, seq17, plain, None)  # no group
    assert not fwd.packs_gqa(2**29, 8, 2, seq17, plain, None)  # rows past int32 coordinates


@pytest.mark.skipif(fwd.GLUON_ERROR is not None, reason="no Gluon")
@pytest.mark.parametrize("d,width", [(96, 128), (192, 256), (80, 128)])
def test_heads_axis_descriptor_reads_one_head_at_full_width(d, width):
    # fwd.tma_heads: the (rows, heads, dim) tensor as it is, a box of one head that is
    # `width` wide (the TMA unit zero-fills columns d..width), rows strided by heads * dim.
    t = torch.zeros(300, 6, d, dtype=torch.bfloat16)
    desc = fwd.tma_heads(t, 64, width)
    assert desc.base is t and desc.shape == [300, 6, d] and desc.strides == [6 * d, d, 1]
    assert desc.block_shape == [64, 1, width] and desc.padding == "zero"
    assert desc.layout.rank == 3 and desc.layout.swizzle_byte_width == 128
    assert (d * t.element_size()) % 16 == 0  # TMA row strides: the forward's precondition
