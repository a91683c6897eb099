"""Every portable autotuning candidate alone, launched many times (marker `gpu`).

A race in a compiled tile shows up only now and then (Triton 3.6 built one at 128x128,
3 stages, d=40/24 that faulted about once per few hundred launches on the H200), and
autotuning may pick any candidate: each one gets its own repeated run here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, forced, make_qkv, reference_pair

from asymflash import flash_attn_func

pytestmark = pytest.mark.gpu


def _portable_tiles():
    from asymflash.backends import portable

    return [(kernel, cls, cfg) for kernel, table in portable._CANDIDATES.items()
            for cls, cfgs in table.items() for cfg in cfgs]


@pytest.mark.parametrize("kernel,cls,cfg", _portable_tiles(), ids=str)
def test_every_portable_tile_survives_repeats(monkeypatch, kernel, cls, cfg):
    from asymflash.backends import portable

    monkeypatch.setitem(portable._CANDIDATES, kernel, {c: [cfg] for c in (64, 128, 256)})
    d, dv = {64: (40, 24), 128: (96, 128), 256: (256, 256)}[cls]
    q, k, v = make_qkv(1, 203, 203, 2, 1, d, dv, torch.bfloat16, "cuda")
    sink = torch.randn(2, device="cuda", requires_grad=True)
    kw = dict(window_size=(-1, 3), softcap=5.0)
    dout = torch.randn(1, 203, 2, dv, device="cuda", dtype=torch.bfloat16)
    with forced("portable"):
        for _ in range(100):
            out = flash_attn_func(q, k, v, learnable_sink=sink, **kw)
            if kernel != "fwd":
                grads = torch.autograd.grad(out, [q, k, v, sink], dout)
    torch.cuda.synchronize()
    ref32, ref_low = reference_pair(q, k, v, dout, sink=sink, **kw)
    assert_fa_close("out", out, ref32[0], ref_low[0], atol=1e-3)
    if kernel != "fwd":
        for name, g, r32, rlow in zip(("dq", "dk", "dv"), grads, ref32[2:], ref_low[2:]):
            assert_fa_close(name, g, r32, rlow, atol=2e-3)
