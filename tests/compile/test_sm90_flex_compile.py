"""The sm90 flex kernels build for sm_90a without a GPU, with the user's mods inlined: the
forward (`backends/sm90/fwd/flex_kernel.py`: HGMMA, asynchronous wgmmas, no local memory in
the key loop, shared memory within the H200's 227 KB) and the backward
(`bwd/entry.attn_bwd_flex_kernel` on the synchronous body: HGMMA, local memory within
today's counts)."""

from __future__ import annotations

import json

import pytest
from sass_report import sass_report, within_budget

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
build = flex.compile_backward_for_target if kw.pop("backward", False) else \
    flex.compile_for_target
kernel = build(kw.pop("d"), score, mask, sig, **kw)
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
    assert rep["shared"] <= 227 * 1024, rep["shared"]
    # the two consumer warpgroups' register budget, as the dense forward's
    assert 240 in rep["maxnreg"], rep["maxnreg"]
    within_budget(rep, rep["local_in_step_loops"], 0, "local-memory instructions in the key loop")


# (d, mods): local-memory instructions in the backward's step loop (sm_90a, triton 3.6,
# 2026-12-05): none at d=64; at d=128 the synchronous body sits at the register limit
# without mods (the dense d=128 default runs the warp-specialised body), and a gathering
# mod (bias table + document mask) costs 70 (60 while the captured table's unit stride was
# a compile-time 1: runtime strides, flex_emit.TUPLE_BIAS, hold a few more registers).
BACKWARD_LOOP_LOCAL = {(64, "bias_doc"): 0, (64, "softcap"): 0, (64, "causal"): 0,
                       (128, "none"): 0, (128, "causal"): 0, (128, "softcap"): 4,
                       (128, "bias_doc"): 70}


@pytest.mark.parametrize("case", sorted(BACKWARD_LOOP_LOCAL), ids=lambda c: f"{c[0]}-{c[1]}")
def test_flex_backward_builds_for_sm90(case):
    d, mods = case
    rep = sass_report(_BUILD, json.dumps({"d": d, "mods": mods, "backward": True}))
    assert rep["hgmma"] > 0, "no HGMMA"
    assert rep["step_loops"] == 1, rep["step_loops"]
    within_budget(rep, rep["local_in_step_loops"], BACKWARD_LOOP_LOCAL[case],
                  "local-memory instructions in the step loop")
