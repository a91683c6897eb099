"""The sm90 flex forward (`backends/sm90/fwd/flex_kernel.py`) builds for sm_90a without a
GPU, with the user's mods inlined: HGMMA, asynchronous wgmmas, no local memory in the key
loop, shared memory within the H200's 227 KB."""

from __future__ import annotations

import json

import pytest
from sass_report import sass_report

_BUILD = r"""
import json, sys
import torch, triton
from asymflash.backends.sm90 import flex
from asymflash.core import flex_trace

kw = json.loads(sys.argv[1])
table = torch.randn(4, 300)  # fp32 bias table (ptr, 2 sizes, 2 strides)
doc = torch.zeros(300, dtype=torch.int64)  # document ids
MODS = {
    "none": (None, None, ()),
    "causal": (None, lambda b, h, q, kv: q >= kv, ()),
    "softcap": (lambda s, b, h, q, kv: 30 * torch.tanh(s / 30), None, ()),
    "alibi": (lambda s, b, h, q, kv: s - (h + 1) * 0.125 * (q - kv).abs(), None, ()),
    # a captured bias table (with negative indices wrapped) and a document mask
    "bias_doc": (lambda s, b, h, q, kv: s + table[h, q - kv + 150],
                 lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
                 ("*fp32", ("i32", "i32"), ("i32", "i32"), "*i64", ("i32",), ("i32",))),
}
score_fn, mask_fn, sig = MODS[kw.pop("mods")]
score = flex_trace.trace(score_fn, "score") if score_fn else None
mask = flex_trace.trace(mask_fn, "mask") if mask_fn else None
kernel = flex.compile_for_target(kw.pop("d"), score, mask, sig, **kw)
"""

CASES = [
    {"d": 128, "mods": "none"},
    {"d": 128, "mods": "causal"},
    {"d": 128, "mods": "softcap", "even_k": False},
    {"d": 64, "mods": "alibi"},
    {"d": 128, "mods": "bias_doc", "even_k": False},
    {"d": 64, "mods": "bias_doc"},
    {"d": 256, "mods": "causal", "sub": 2},
    # (d=256 with a 2-D gather is refused: it spilled 104 local-memory instructions in the
    # key loop at 64-key blocks; tests/unit/test_sm90_flex_host.py)
    {"d": 256, "mods": "alibi", "sub": 2, "even_k": False},
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_flex_forward_builds_for_sm90(kw):
    rep = sass_report(_BUILD, json.dumps(kw), ptxas=True)
    assert rep["hgmma"] > 0, "no HGMMA"
    assert rep["wgmma_serialized"] is False, "ptxas serialised the wgmmas"
    assert rep["local_in_step_loops"] == 0, rep
    assert rep["shared"] <= 227 * 1024, rep["shared"]
    # the two consumer warpgroups' register budget, as the dense forward's
    assert 240 in rep["maxnreg"], rep["maxnreg"]
