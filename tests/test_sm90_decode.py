"""The Hopper decode kernel (backends/sm90/decode.py): against the reference on an sm_90 GPU,
its sm_90a build and its routing on any machine.

Caches long enough that blocks come by TMA (whole 64/128-key blocks below the cache length)
and by the threads (the cache's last partial block, the new keys), ragged lengths (0, 1, a
block boundary, mid-block), every cache layout the kernel takes, both head dims, splits
forced and heuristic. The backend is forced without the skip of `helpers.forced`: a case
listed here that the kernel refuses is a failure.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, assert_lse_close
from test_kvcache import Cache, reference

from asymflash import flash_attn_with_kvcache
from asymflash.backends.sm90 import decode
from asymflash.runtime import dispatch

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU")


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    """The kernel is off by default (it ties the portable one): these tests switch it on."""
    monkeypatch.setenv(decode.SWITCH, "1")

CASES = {
    # name: (seqlen_q, nheads_q, nheads_kv, seqlen_new, cache_seqlens, kwargs)
    "decode-gqa8": (1, 32, 4, 1, [0, 300, 767, 128], dict(causal=True)),
    "decode-no-append": (1, 8, 1, 0, [1, 0, 640, 513], dict()),
    "decode-softcap-sink": (1, 16, 2, 1, [17, 0, 700, 256], dict(causal=True, softcap=5.0,
                                                                 sink=True)),
    "spec-7-window": (7, 8, 1, 7, [15, 0, 600, 383], dict(causal=True, window_size=(203, 0),
                                                          softcap=3.0, sink=True)),
    "append-5-local": (5, 4, 4, 5, [12, 0, 513, 700], dict(window_size=(113, 2))),
    "mha-1": (1, 4, 4, 1, [1, 129, 255, 768], dict(causal=True)),
}
LAYOUTS = [("paged", 64), ("paged", 256), ("contiguous", None), ("indexed", None)]


def run(layout, page, name, d, splits, dtype=torch.bfloat16, leftpad=False):
    sq, hq, hkv, new, lens, kw = CASES[name]
    kw = dict(kw)
    batch = len(lens)
    cache = Cache(layout, batch, hkv, d, d, capacity=1024, dtype=dtype, page=page or 16)
    q = torch.randn(batch, sq, hq, d, dtype=dtype, device=DEVICE)
    k_new = torch.randn(batch, new, hkv, d, dtype=dtype, device=DEVICE) if new else None
    v_new = torch.randn(batch, new, hkv, d, dtype=dtype, device=DEVICE) if new else None
    sink = torch.randn(hq, device=DEVICE) if kw.pop("sink", False) else None
    want_k, want_v = (cache.expected_after_append(lens, k_new, v_new) if new
                      else (cache.k.clone(), cache.v.clone()))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    extra = {}
    left = [0] * batch
    if leftpad:
        left = [min(n, 3 * b + 1) for b, n in enumerate(lens)]
        extra["cache_leftpad"] = torch.tensor(left, dtype=torch.int32, device=DEVICE)
    q_before = q.clone()
    with dispatch.use_backend("sm90"):
        out, lse = flash_attn_with_kvcache(
            q, cache.k, cache.v, k_new, v_new, cache_seqlens=seqlens, learnable_sink=sink,
            num_splits=splits, return_lse=True, **cache.kwargs(), **extra, **kw)
    assert torch.equal(q, q_before)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), "append"
    if leftpad:  # the reference sees each sequence's keys from its first own position on
        outs32, outs_low, lses = [], [], []
        for b, n in enumerate(lens):
            kb, vb = cache.keys(b, n + new, want_k, want_v)
            r32, rlow, rlse = _ref_one(q[b:b + 1], kb[left[b]:], vb[left[b]:], sink, kw)
            outs32.append(r32)
            outs_low.append(rlow)
            lses.append(rlse)
        r32, rlow, rlse = torch.cat(outs32), torch.cat(outs_low), torch.cat(lses)
    else:
        r32, rlow, rlse = reference(q, cache, want_k, want_v, [n + new for n in lens], sink,
                                    **kw)
    assert_fa_close("out", out, r32, rlow, atol=1e-3)
    assert_lse_close(lse, rlse)


def _ref_one(q, kb, vb, sink, kw):
    from asymflash.reference import attention_ref

    r32, rlse = attention_ref(q, kb[None], vb[None], learnable_sink=sink, **kw)
    rlow, _ = attention_ref(q, kb[None], vb[None], learnable_sink=sink, upcast=False, **kw)
    return r32, rlow, rlse


@needs_sm90
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("layout,page", LAYOUTS, ids=lambda x: str(x))
@pytest.mark.parametrize("name", list(CASES))
def test_sm90_decode_matches_reference(name, layout, page, d):
    run(layout, page, name, d, splits=0)


@needs_sm90
@pytest.mark.parametrize("splits", [1, 3, 5])
@pytest.mark.parametrize("layout,page", [("paged", 64), ("contiguous", None)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("name", ["decode-gqa8", "decode-softcap-sink", "spec-7-window"])
def test_sm90_decode_splits(name, layout, page, splits):
    run(layout, page, name, 128, splits)


@needs_sm90
@pytest.mark.parametrize("name", ["decode-gqa8", "decode-no-append", "append-5-local"])
def test_sm90_decode_leftpad(name):
    run("contiguous", None, name, 128, splits=0, leftpad=True)


@needs_sm90
def test_sm90_decode_fp16():
    run("paged", 64, "decode-gqa8", 128, 0, dtype=torch.float16)
    run("contiguous", None, "spec-7-window", 64, 3, dtype=torch.float16)


@needs_sm90
def test_sm90_decode_is_what_dispatch_picks_and_others_go_elsewhere():
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device=DEVICE)
    kc = torch.randn(2, 512, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    spec = _spec(q, kc)
    assert dispatch.pick_decode(q, spec, _params(), None) is decode
    # page 16, head dim 32, 72 packed rows: the portable kernel's
    paged16 = _spec(q, torch.randn(64, 16, 4, 128, dtype=torch.bfloat16, device=DEVICE),
                    table=torch.zeros(2, 32, dtype=torch.int32, device=DEVICE))
    assert "page size" in decode.unsupported_decode(q, paged16, _params(), None)
    q9 = torch.randn(2, 9, 32, 128, dtype=torch.bfloat16, device=DEVICE)
    assert "rows" in decode.unsupported_decode(q9, _spec(q9, kc), _params(), None)
    for spec_q, spec_ in ((q, paged16), (q9, _spec(q9, kc))):
        assert dispatch.pick_decode(spec_q, spec_, _params(), None).__name__.endswith(
            "portable.decode")


def _params():
    from asymflash.core.params import AttnParams, MaskSpec

    return AttnParams(softmax_scale=0.1, mask=MaskSpec(-1, -1), softcap=0.0)


def _spec(q, kc, table=None):
    from asymflash.api.kvcache import CacheSpec

    batch, sq = q.shape[:2]
    lens = torch.full((batch,), 100, dtype=torch.int32, device=q.device)
    return CacheSpec(kc, kc, lens, 0, table, None, None, sq, 512, batch)


def test_decode_kernel_is_off_by_default(monkeypatch):
    monkeypatch.delenv(decode.SWITCH)
    assert not decode.decode_enabled()
    monkeypatch.setenv(decode.SWITCH, "0")
    assert not decode.decode_enabled()
    monkeypatch.setenv(decode.SWITCH, "1")
    assert decode.decode_enabled()


def test_cache_layouts_the_kernel_reads_in_place():
    """Host-side checks, CPU: TMA reads a cache as a (slots, heads·dim) matrix."""
    kc = torch.zeros(3, 64, 4, 128, dtype=torch.bfloat16)
    assert decode._cache_reason(kc, "k") is None
    assert decode._cache_reason(kc[:, :32], "k") is not None  # slots not evenly strided
    assert decode._cache_reason(kc[:, :, :, :64], "k") is not None  # heads not dense
    assert decode._cache_reason(kc[:, :, :2], "k") is None  # some heads: a longer row stride
    assert decode._cache_reason(kc.transpose(1, 2).contiguous().transpose(1, 2), "k") \
        is not None
    assert decode._cache_reason(kc[1:2, :32], "k") is None  # one slot row: any stride
    assert decode.block_n(64) == 64 and decode.block_n(256) == 128 and decode.block_n(None) == 128
    assert decode.stages(128, 128) == 3 and decode.stages(64, 128) == 6
    assert decode.stages(128, 64) == 6 and decode.stages(64, 64) == 8


# (features, most local-memory instructions allowed) of the sm_90a build. The TMA key loop
# itself stays in registers; what spills is the tail (a block loaded by the threads while O
# is live), once per program: 6 seen with the split merge, 56-116 with the append's tail.
BUILDS = [
    ({}, 12),
    ({"head_dim": 64}, 4),
    ({"paged": True, "page_size": 64}, 4),
    ({"paged": True, "page_size": 256, "HAS_NEW": True}, 140),
    ({"HAS_NEW": True, "HAS_LEFTPAD": True, "HAS_BATCH_IDX": True, "RIGHT": True,
      "LEFT": True, "SOFTCAP": True, "HAS_SINK": True}, 220),
]


@pytest.mark.parametrize("kw,max_local", BUILDS, ids=lambda x: str(x))
def test_decode_kernel_builds_for_sm90a_with_hgmma_and_tma(kw, max_local):
    import json

    from sass_report import sass_report, sm90_build

    rep = sass_report(sm90_build("decode"), json.dumps(kw))
    assert rep["hgmma"] > 0, rep
    assert rep["local"] <= max_local, f"register spills: {rep}"
    assert rep["shared"] <= 227 * 1024, rep
