"""The sm90 kernels run head dims other than 64/128/256 on zero-padded copies (fwd.kernel_head_dim):
q, k, v (and dO, O for the backward) get zero columns up to the compiled width, and the
results' extra columns are dropped. That the padding changes nothing is checked here on the
CPU: the compiled kernel is replaced by the CPU backend at the padded width, and the sliced
results must equal the CPU backend's at the real width. (The kernels themselves at the
padded widths are checked on the GPU: tests/test_sm90_gpu.py, tests/test_sm90_bwd_gpu.py.)
"""

from __future__ import annotations

import pytest
import torch
from test_sm90_bwd_gpu import make_case

from asymflash.backends import cpu
from asymflash.backends.sm90 import bwd, fwd

CASES = [
    dict(name="d96-causal-gqa", lens_q=[17, 113], lens_k=[33, 203], hq=4, hkv=2, d=96,
         window=(-1, 0)),
    dict(name="d192-dv128", lens_q=[113], lens_k=[113], hq=2, hkv=1, d=192, dv=128),
    dict(name="d72-dv136-local-softcap-sink", lens_q=[1, 203], lens_k=[17, 203], hq=2, hkv=2,
         d=72, dv=136, window=(40, 9), softcap=15.0, sink=True),
]


def _case(c):
    q, k, v, dout, seq, params, sink = make_case(dict(c, dtype=torch.float32), device="cpu")
    # scores of O(10): a padding bug would show far above fp32 rounding
    return q * 2, k * 2, v, dout, seq, params, sink


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_padded_forward_equals_unpadded(case, monkeypatch):
    q, k, v, _, seq, params, sink = _case(case)
    width = fwd.kernel_head_dim(q.shape[-1], v.shape[-1])
    assert width in (128, 256)
    inputs = [t.clone() for t in (q, k, v)]
    padded_forward = fwd.forward

    def kernel_stand_in(qp, kp, vp, seq_, params_, sink_, cfg=None):
        assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == width
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
    width = fwd.kernel_head_dim(q.shape[-1], v.shape[-1])
    out, lse = cpu.forward(q, k, v, seq, params, sink)
    padded_backward = bwd.backward

    def kernel_stand_in(dout_, qp, kp, vp, outp, lse_, dlse_, seq_, params_, sink_, cfg=None):
        assert {t.shape[-1] for t in (dout_, qp, kp, vp, outp)} == {width}
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
