"""The sm90 Gluon backward against `reference.attention_ref` gradients, on a Hopper GPU.

Tolerance (the FA rule, `helpers.assert_fa_close`): error vs the fp32 reference <= 2 x the
error of the same reference computed in the inputs' dtype + a small atol. out and lse come
from the portable forward, so this checks the backward alone, whatever dispatch does.
`run_case` is shared with scripts/sm90-bwd-probe.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_fa_close, max_err, reference_pair

from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

pytestmark = pytest.mark.gpu


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# Each case: per-sequence lengths (varlen when they differ or seqused is given), heads, dim,
# mask (window_left, window_right; causal = (-1, 0)), softcap, sink, dtype.
CASES = [
    dict(name="d128", lens_q=[512] * 2, lens_k=[512] * 2, hq=4, hkv=4, d=128),
    dict(name="d64", lens_q=[512] * 2, lens_k=[512] * 2, hq=4, hkv=4, d=64),
    dict(name="d128-causal", lens_q=[640] * 2, lens_k=[640] * 2, hq=4, hkv=4, d=128,
         window=(-1, 0)),
    dict(name="d64-causal-fp16", lens_q=[640] * 2, lens_k=[640] * 2, hq=4, hkv=4, d=64,
         window=(-1, 0), dtype=torch.float16),
    dict(name="d128-gqa-causal-sq<sk", lens_q=[200] * 2, lens_k=[700] * 2, hq=8, hkv=2, d=128,
         window=(-1, 0)),
    dict(name="d64-causal-sq>sk", lens_q=[700], lens_k=[300], hq=2, hkv=1, d=64,
         window=(-1, 0)),
    dict(name="d128-local", lens_q=[777], lens_k=[777], hq=4, hkv=2, d=128, window=(100, 37)),
    dict(name="d64-softcap-sink", lens_q=[333] * 2, lens_k=[333] * 2, hq=4, hkv=4, d=64,
         softcap=30.0, sink=True),
    dict(name="d128-softcap-causal", lens_q=[300], lens_k=[300], hq=2, hkv=2, d=128,
         window=(-1, 0), softcap=20.0),
    dict(name="d128-varlen-causal", lens_q=[1, 130, 0, 257, 64], lens_k=[5, 129, 77, 300, 64],
         hq=4, hkv=2, d=128, window=(-1, 0)),
    dict(name="d64-varlen-seqused", lens_q=[100, 250], lens_k=[260, 400], hq=2, hkv=2, d=64,
         seqused=[200, 131]),
    # seqlen 1 with one head per group: constant-folded, this crashed triton 3.6's lowering
    dict(name="d64-q1-k1", lens_q=[1], lens_k=[1], hq=1, hkv=1, d=64),
    dict(name="d128-q1-k5-b2", lens_q=[1] * 2, lens_k=[5] * 2, hq=2, hkv=2, d=128),
    # d=256: bwd_wide.py (64-key blocks, the warpgroups split the head dim)
    dict(name="d256", lens_q=[384] * 2, lens_k=[384] * 2, hq=2, hkv=2, d=256),
    dict(name="d256-causal-fp16", lens_q=[333] * 2, lens_k=[333] * 2, hq=2, hkv=2, d=256,
         window=(-1, 0), dtype=torch.float16),
    dict(name="d256-gqa-causal-sq<sk", lens_q=[113] * 2, lens_k=[403] * 2, hq=4, hkv=1, d=256,
         window=(-1, 0)),
    dict(name="d256-local-softcap-sink", lens_q=[419], lens_k=[419], hq=2, hkv=2, d=256,
         window=(70, 17), softcap=25.0, sink=True),
    dict(name="d256-varlen-seqused", lens_q=[1, 130, 0, 203], lens_k=[17, 129, 77, 300],
         hq=2, hkv=1, d=256, seqused=[17, 100, 50, 300], window=(-1, 0)),
    dict(name="d256-q1-k1", lens_q=[1], lens_k=[1], hq=1, hkv=1, d=256),
    dict(name="d128-gqa", lens_q=[300] * 2, lens_k=[300] * 2, hq=8, hkv=2, d=128),
    # whole key blocks in every sequence: dK/dV leave by TMA stores (bwd.kv_tma_store)
    dict(name="d128-gqa-causal-tma", lens_q=[256] * 3, lens_k=[256] * 3, hq=8, hkv=2, d=128,
         window=(-1, 0)),
    dict(name="d256-causal-tma", lens_q=[320] * 2, lens_k=[320] * 2, hq=2, hkv=2, d=256,
         window=(-1, 0)),
    # other widths run zero-padded on the 128 / 256 kernels (3-D TMA boxes fill the zeros)
    dict(name="d96-causal", lens_q=[300] * 2, lens_k=[300] * 2, hq=4, hkv=2, d=96,
         window=(-1, 0)),
    # 192/128 runs its own build (bwd.backward_widths: the head dim as a 128- and a 64-wide
    # piece), 160/128 on it zero-padded
    dict(name="d192-dv128", lens_q=[257], lens_k=[257], hq=2, hkv=1, d=192, dv=128),
    dict(name="d160-dv128-causal", lens_q=[300] * 2, lens_k=[300] * 2, hq=4, hkv=2, d=160,
         dv=128, window=(-1, 0)),
    # dims TMA cannot address (not multiples of 8): zero-padded copies, 190/126 -> 192/128
    dict(name="d190-dv126-causal", lens_q=[257], lens_k=[257], hq=2, hkv=1, d=190, dv=126,
         window=(-1, 0)),
    # 256/128 runs as it is (fwd.forward_widths: V is not padded to 256)
    dict(name="d256-dv128-causal", lens_q=[300] * 2, lens_k=[300] * 2, hq=4, hkv=2, d=256,
         dv=128, window=(-1, 0)),
    dict(name="d80-dv96-varlen", lens_q=[17, 113], lens_k=[33, 203], hq=2, hkv=2, d=80, dv=96,
         window=(-1, 0)),
    # not a multiple of 8 (only reachable by calling the backend): zero-padded copies
    dict(name="d100-pad-copies", lens_q=[257], lens_k=[257], hq=2, hkv=1, d=100,
         window=(-1, 0)),
]


def make_case(c, device="cuda", seed=0):
    """Packed inputs, SeqInfo, params and sink of a case."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = c.get("dtype", torch.bfloat16)
    lens_q, lens_k = c["lens_q"], c["lens_k"]
    hq, hkv, d = c["hq"], c["hkv"], c["d"]
    dv = c.get("dv", d)
    total_q, total_k = sum(lens_q), sum(lens_k)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    q, k, v = rnd(total_q, hq, d), rnd(total_k, hkv, d), rnd(total_k, hkv, dv)
    dout = rnd(total_q, hq, dv)
    cu = [torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
          for lens in (lens_q, lens_k)]
    used = c.get("seqused")
    uniform = used is None and len(set(lens_q)) == 1 and len(set(lens_k)) == 1
    seq = SeqInfo(cu[0], cu[1], max(lens_q), max(lens_k),
                  None if used is None else torch.tensor(used, dtype=torch.int32, device=device),
                  uniform)
    wl, wr = c.get("window", (-1, -1))
    params = AttnParams(softmax_scale=d ** -0.5, mask=MaskSpec(wl, wr),
                        softcap=c.get("softcap", 0.0),
                        deterministic=c.get("deterministic", False))
    sink = (torch.randn(hq, generator=g).to(device) if c.get("sink") else None)
    return q, k, v, dout, seq, params, sink


def reference_grads(q, k, v, dout, seq, params, sink, c):
    """(fp32, same-dtype) lists of [dq, dk, dv, dsink], one sequence at a time."""
    lens_q, lens_k = c["lens_q"], c["lens_k"]
    used = c.get("seqused") or lens_k
    res = []
    for _ in range(2):
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                      for t in (q, k, v))
        dsink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        res.append([dq, dk, dv, dsink])
    qs = ks = 0
    for b in range(len(lens_q)):
        sq, sk = lens_q[b], used[b]
        if sq > 0:
            pair = reference_pair(
                q[qs:qs + sq][None], k[ks:ks + sk][None], v[ks:ks + sk][None],
                dout[qs:qs + sq][None], sink=sink, softmax_scale=params.softmax_scale,
                window_size=(params.mask.window_left, params.mask.window_right),
                softcap=params.softcap)
            for (_out, _lse, gq, gk, gv, *gs), acc in zip(pair, res):
                acc[0][qs:qs + sq] = gq[0].float()
                acc[1][ks:ks + sk] = gk[0].float()
                acc[2][ks:ks + sk] = gv[0].float()
                if gs:
                    acc[3] += gs[0].float()
        qs += lens_q[b]
        ks += lens_k[b]
    return res


def run_case(c, device="cuda", fwd_mod=None, bwd_mod=None, cfg=None):
    """Runs a forward (portable) and the sm90 backward (or the given modules; `cfg`: a
    BwdConfig override); returns {grad: (got, ref fp32, ref same dtype, atol)} for
    assert_fa_close; raises NotImplementedError when the backward refuses the case."""
    if fwd_mod is None:
        from asymflash.backends import portable as fwd_mod
    if bwd_mod is None:
        from asymflash.backends.sm90.bwd import host as bwd_mod
    bwd = bwd_mod

    q, k, v, dout, seq, params, sink = make_case(c, device)
    why = bwd.unsupported_backward(q, k, v, seq, params, sink)
    if why is not None:
        raise NotImplementedError(why)
    out, lse = fwd_mod.forward(q, k, v, seq, params, sink)
    dq, dk, dv, dsink = bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink,
                                     *([cfg] if cfg is not None else []))
    if q.is_cuda:
        torch.cuda.synchronize()
    ref32, reflow = reference_grads(q, k, v, dout, seq, params, sink, c)
    got = {"dq": dq, "dk": dk, "dv": dv}
    if sink is not None:
        got["dsink"] = dsink
    result = {}
    for i, name in enumerate(("dq", "dk", "dv", "dsink")):
        if name not in got:
            continue
        g, r32, rlow = got[name], ref32[i], reflow[i]
        atol = 2e-3 if name != "dsink" else 1e-2 * max(1.0, r32.abs().max().item())
        result[name] = (g, r32, rlow, atol)
    return result


def bwd_width(case) -> int:
    """The compiled head dim the sm90 backward runs `case` at (96 -> 128, 160/128 -> 192)."""
    from asymflash.backends.sm90.bwd import host as bwd

    return bwd.backward_widths(case["d"], case.get("dv", case["d"]))[0]


def assert_repeats_bitwise(case, repeats, cfg=None):
    """The sm90 backward of `case` (config `cfg`, or the default) gives bitwise the same
    dQ, dK and dV `repeats` more times (deterministic mode)."""
    from asymflash.backends import portable
    from asymflash.backends.sm90.bwd import host as bwd

    q, k, v, dout, seq, params, sink = make_case(case)
    assert params.deterministic and bwd.unsupported_backward(q, k, v, seq, params, sink) is None
    out, lse = portable.forward(q, k, v, seq, params, sink)
    extra = [cfg] if cfg is not None else []
    first = bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink, *extra)
    for _ in range(repeats):
        again = bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink, *extra)
        for a, b in zip(first[:3], again[:3]):
            assert torch.equal(a, b)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_sm90_backward_matches_reference(case):
    for name, (g, r32, rlow, atol) in run_case(case).items():
        assert g.shape == r32.shape, name
        assert_fa_close(name, g, r32, rlow, atol=atol)


# d=128 runs bwd_ws.py's warp-specialised kernel by default (dQ of warpgroup 0 one step
# late). Its other schedules (dV left in flight while dSᵀ is formed: dv_overlap), and bwd.py's
# kernel (which keeps softcap calls), on every d=128 case they can take.
SPLIT_CASES = [c for c in CASES if c["d"] in (96, 128) and not c.get("softcap")]
# d=64 runs it by default on unmasked calls without softcap (128-row steps, dQ split by
# rows, the dQ warp issuing both reduces, fragment-order dQ tiles). Here that build on every
# d=64 case (masked ones too), and its variants: without the dQ warp, row-major tiles (32-
# or 128-byte swizzle), 64-row steps (dQ split by columns) with two or three ring slots.
SPLIT_CASES_D64 = [c for c in CASES if c["d"] == 64 and not c.get("softcap")]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", [dict(split_warpgroups=False), dict(dv_overlap=True),
                                     dict(dq_fragment=False), dict(ws_dk_after_dq=False),
                                     dict(ws_dq_warp=True),
                                     dict(ws_dq_warp=True, dq_fragment=False)],
                         ids=["synchronous", "dv-overlap", "dq-row-major", "dk-before-dq",
                              "dq-warp", "dq-warp-row-major"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c["name"])
def test_sm90_backward_d128_schedules_match_reference(case, variant):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    cfg = replace(bwd.select_config(128), **variant)
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", [dict(),
                                     dict(ws_dq_warp=False),
                                     dict(dq_fragment=False),
                                     dict(ws_dq_warp=False, dq_fragment=False, dq_swizzle=32),
                                     dict(block_m=64, ws_dq_warp=False, dq_fragment=False,
                                          dq_swizzle=32),
                                     dict(block_m=64, ws_dq_warp=False, dq_fragment=False,
                                          dq_swizzle=32, ring_slots=3),
                                     dict(block_m=64, ws_dq_warp=False)],
                         ids=["rows128-dq-warp", "rows128", "rows128-dq-warp-row-major",
                              "rows128-row-major32", "rows64", "rows64-ring3",
                              "rows64-dq-fragment"])
@pytest.mark.parametrize("case", SPLIT_CASES_D64, ids=lambda c: c["name"])
def test_sm90_backward_d64_split_warpgroups_match_reference(case, variant):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    # the unmasked default's switches, on every case (masked ones too)
    base = bwd.select_config(64, max_seqlen_q=max(case["lens_q"]))
    unmasked_default = dict(split_warpgroups=True, ws_dq_warp=True, dq_fragment=True,
                            dq_swizzle=128)
    cfg = replace(base, **{**unmasked_default, **variant})
    assert bwd._splits_warpgroups(64, cfg, False)
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


# How bwd_ws's masked steps mask (BwdConfig.step_cols, mask_scores: bwd_parts.probabilities'
# MASK_MODE; both on at d=64, off at d=128, by default): every case bwd_ws can take at
# d=64 / 96 / 128 (causal, windows, ragged keys past a block's end), as a plain grid and, where
# the lengths are dense, as a persistent one.
MASK_CASES = SPLIT_CASES + SPLIT_CASES_D64


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", [dict(mask_scores=True),
                                     dict(mask_scores=True, step_cols=False),
                                     dict(step_cols=True),
                                     dict(mask_scores=True, ws_persistent=True),
                                     dict(mask_scores=False)],
                         ids=["mask-scores", "mask-scores-hoisted-cols", "step-cols",
                              "mask-scores-persistent", "no-mask-scores"])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c["name"])
def test_sm90_backward_mask_modes_match_reference(case, variant):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    width = bwd_width(case)
    window = case.get("window", (-1, -1))
    cfg = replace(bwd.select_config(width, masked=window != (-1, -1), window=window[0] >= 0,
                                    max_seqlen_q=max(case["lens_q"])),
                  split_warpgroups=True, **variant)
    if width == 64 and cfg.block_m == 128:
        cfg = replace(cfg, ws_dq_warp=True, dq_fragment=True, dq_swizzle=128)
    assert bwd._splits_warpgroups(width, cfg, False)
    if cfg.ws_persistent:
        seq = make_case(case, "cuda")[4]
        if not bwd.persists(cfg, seq.uniform and seq.seqused_k is None):
            pytest.skip("ragged lengths run the plain grid (the variant above)")
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


# The persistent bwd_ws (BwdConfig.ws_persistent): every dense case of bwd_ws's widths (d=64 with
# its bwd_ws build, masked cases too), and cases with more tiles than the H200 has SMs, where a
# CTA walks several tiles (the small cases give each CTA one at most): uneven causal tiles, GQA,
# a last key block past the keys.
PERSISTENT_CASES = [c for c in CASES if bwd_width(c) in (64, 128) and not c.get("softcap")
                    and not c.get("seqused") and len(set(c["lens_q"])) == 1
                    and len(set(c["lens_k"])) == 1] + [
    dict(name="d64-many-tiles", lens_q=[1024] * 4, lens_k=[1024] * 4, hq=16, hkv=8, d=64),
    dict(name="d128-causal-many-tiles", lens_q=[1536] * 3, lens_k=[1536] * 3, hq=12, hkv=12,
         d=128, window=(-1, 0)),
    dict(name="d64-gqa-causal-many-tiles", lens_q=[777] * 8, lens_k=[777] * 8, hq=8, hkv=4,
         d=64, window=(-1, 0), dtype=torch.float16),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: c["name"])
def test_sm90_backward_persistent_matches_reference(case):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    width = bwd_width(case)
    window = case.get("window", (-1, -1))
    cfg = bwd.select_config(width, masked=window != (-1, -1), window=window[0] >= 0,
                            max_seqlen_q=max(case["lens_q"]))
    if width == 64:  # the unmasked default's bwd_ws build, on masked cases too
        cfg = replace(cfg, split_warpgroups=True, ws_dq_warp=True, dq_fragment=True,
                      dq_swizzle=128)
    cfg = replace(cfg, ws_persistent=True)
    seq = make_case(case, "cuda")[4]
    assert bwd.persists(cfg, seq.uniform and seq.seqused_k is None), case["name"]
    for _ in range(2):  # the second call must find its tile counter zeroed again
        for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
            assert_fa_close(name, g, r32, rlow, atol=atol)


# Two K/V buffers on the persistent grid (BwdConfig.ws_kv_buffers: the next tile's K/V load
# during this one, dK/dV staged in the tile's own buffer), d=64 with 64-row steps (the only
# build with the shared memory for it), default and deterministic mode.
KV2_CASES = [c for c in PERSISTENT_CASES if bwd_width(c) == 64]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("det", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("case", KV2_CASES, ids=lambda c: c["name"])
def test_sm90_backward_two_kv_buffers_match_reference(case, det):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    window = case.get("window", (-1, -1))
    cfg = replace(bwd.select_config(64, masked=window != (-1, -1), deterministic=det,
                                    window=window[0] >= 0, max_seqlen_q=max(case["lens_q"])),
                  split_warpgroups=True, block_m=64, ring_slots=3, dq_fragment=True,
                  ws_dq_warp=False, ws_persistent=True, ws_kv_buffers=2)
    case = dict(case, deterministic=det)
    for _ in range(2):  # the second call must find its tile counter zeroed again
        for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
            assert_fa_close(name, g, r32, rlow, atol=atol)
    if det:
        assert_repeats_bitwise(case, 10, cfg)


# Deterministic mode on the persistent grid (its turns follow the order tiles are taken in:
# ascending, causal tiles top-first; `bwd_ws._ws_tiles`): the persistent cases (several tiles
# per CTA, GQA, causal, sq < sk) against the reference, then bitwise repeats. A turn order
# against the tile order would hang here, not fail.
PERSISTENT_DET_CASES = [dict(c, deterministic=True) for c in PERSISTENT_CASES]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", PERSISTENT_DET_CASES, ids=lambda c: c["name"])
def test_sm90_deterministic_persistent_backward_is_bitwise_reproducible(case):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    window = case.get("window", (-1, -1))
    cfg = replace(bwd.select_config(bwd_width(case), deterministic=True,
                                    masked=window != (-1, -1), window=window[0] >= 0,
                                    max_seqlen_q=max(case["lens_q"])), ws_persistent=True)
    seq = make_case(case, "cuda")[4]
    assert bwd.persists(cfg, seq.uniform and seq.seqused_k is None), case["name"]
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)
    assert_repeats_bitwise(case, 20, cfg)


# The grid's two orders (BwdConfig.heads_first): heads first, the default of causal calls
# whose heads' Q and dO fit the L2 budget (every case here), and key blocks first, the order
# of longer calls, on the causal cases with dense lengths (GQA, sq < sk, fp16, d=64/128/256).
ORDER_CASES = [c for c in CASES if c.get("window") == (-1, 0) and not c.get("seqused")
               and len(set(c["lens_q"])) == 1 and len(set(c["lens_k"])) == 1]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("first", [True, False], ids=["heads-first", "blocks-first"])
@pytest.mark.parametrize("case", ORDER_CASES, ids=lambda c: c["name"])
def test_sm90_backward_grid_orders_match_reference(case, first):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    cfg = replace(bwd.select_config(bwd_width(case), softcap=bool(case.get("softcap")),
                                    masked=True), heads_first=first)
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


# Heads first in chunks of kv heads (BwdConfig.heads_chunk: the grid (chunk's heads,
# chunks x key blocks, sequences), where all heads' Q and dO overflow L2): the same causal
# cases with four kv heads, in chunks of two, on the plain grid.
CHUNK_CASES = [dict(c, name=c["name"] + "-4kv", hq=c["hq"] * 4 // c["hkv"], hkv=4)
               for c in ORDER_CASES]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c["name"])
def test_sm90_backward_heads_in_chunks_match_reference(case):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    cfg = replace(bwd.select_config(bwd_width(case), softcap=bool(case.get("softcap")),
                                    masked=True, max_seqlen_q=max(case["lens_q"])),
                  heads_chunk=2, ws_persistent=False)
    seq = make_case(case, "cuda")[4]
    width, width_v = bwd.backward_widths(case["d"], case.get("dv", case["d"]))
    plan = bwd.launch_plan(width, width_v, seq.max_seqlen_q, seq.max_seqlen_k, seq.uniform,
                           False, -1, 0, bool(case.get("softcap")), False, seq.batch, 4, 132,
                           cfg, case["hq"])
    assert plan.constexprs["HEADS_FIRST"] == 2 and plan.grid[0] == 2, plan.grid
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


# The dQ staging tile with a 32-byte swizzle (BwdConfig.dq_swizzle: conflict-free stores from
# the wgmma accumulator; the TMA reduce moves 8-column boxes; d=64's default), on every case
# of each kernel: bwd.py's (d=64, softcap), bwd_ws.py's (d=128, deterministic with its dQ
# warp), bwd_wide's (d=256).
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_sm90_backward_dq_swizzle32_matches_reference(case):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    width = bwd_width(case)
    default = bwd.select_config(width, softcap=bool(case.get("softcap")),
                                deterministic=bool(case.get("deterministic")))
    cfg = replace(default, dq_swizzle=32, dq_fragment=False)  # row-major tiles at d=128 too
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)


# Deterministic mode: the ordered dQ turns over every mask shape the turn formula handles
# (non-causal ones walk staggered: d128, d128-gqa across the group's heads, d256,
# d64-varlen-seqused with a different key-block count per sequence).
DET_CASES = [dict(c, deterministic=True) for c in CASES
             if c["name"] in ("d128", "d128-gqa", "d256", "d64-causal-fp16",
                              "d128-gqa-causal-sq<sk", "d128-local", "d64-softcap-sink",
                              "d128-varlen-causal", "d64-varlen-seqused", "d256-causal-fp16",
                              "d256-local-softcap-sink", "d256-varlen-seqused",
                              "d256-dv128-causal", "d128-gqa-causal-tma", "d192-dv128",
                              "d160-dv128-causal")]


# dQ tiles in the order the default does not take (BwdConfig.dq_fragment, `select_config`):
# at d=64 row-major tiles on unmasked calls (bwd_ws, its dQ warp), fragments on masked and
# softcap ones (bwd.py's 128-row tiles: two warpgroups' 64-row tiles in one box), at d=256
# (bwd_wide's 128-column halves, fragments by default) row-major tiles. Every case of those widths,
# deterministic ones with 20 bitwise repeats.
FRAGMENT_CASES = [c for c in CASES + DET_CASES
                  if bwd_width(c) in (64, 256)]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", FRAGMENT_CASES, ids=lambda c: c["name"] + (
    "-det" if c.get("deterministic") else ""))
def test_sm90_backward_dq_fragment_variants_match_reference(case):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    default = bwd.select_config(bwd_width(case), softcap=bool(case.get("softcap")),
                                deterministic=bool(case.get("deterministic")),
                                masked=case.get("window", (-1, -1)) != (-1, -1),
                                window=case.get("window", (-1, -1))[0] >= 0,
                                max_seqlen_q=max(case["lens_q"]))
    cfg = replace(default, dq_fragment=not default.dq_fragment)
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)
    if case.get("deterministic"):
        assert_repeats_bitwise(case, 20, cfg)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", DET_CASES, ids=lambda c: c["name"])
def test_sm90_deterministic_backward_is_bitwise_reproducible(case):

    for name, (g, r32, rlow, atol) in run_case(case).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)
    assert_repeats_bitwise(case, 50)


# Deterministic mode without zeroing dQ_acc (bwd.first_stores): each query block's first
# turn stores its tile. The caching allocator is first handed NaN-filled blocks of the sizes
# dQ_acc takes, so a tile no turn stored would show as NaN, not as the zeros a fresh
# allocation happens to hold. (name, whether the preprocess skips the zeroing): the shapes
# the rule refuses (causal rows that see no key, varlen) must still zero.
FIRST_STORE_CASES = [(dict(c, deterministic=True), skips) for c in CASES for name, skips in (
    ("d128", True), ("d64", True), ("d128-causal", True), ("d64-causal-fp16", True),
    ("d128-gqa-causal-tma", True), ("d128-gqa-causal-sq<sk", None), ("d128-gqa", None),
    ("d64-causal-sq>sk", False), ("d128-varlen-causal", False), ("d256", True),
    ("d256-causal-fp16", True), ("d256-causal-tma", True), ("d256-gqa-causal-sq<sk", True),
    ("d256-varlen-seqused", False), ("d256-dv128-causal", True)) if c["name"] == name]


def _poison_allocator(total_q, batch, hq, width):
    from asymflash.backends.sm90.bwd import dq_fragments

    for rows in (total_q, dq_fragments.num_blocks(total_q, batch) * 64):
        for _ in range(2):
            torch.full((rows, hq, width), float("nan"), device="cuda")  # freed at once


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case,skips", FIRST_STORE_CASES, ids=lambda x: x["name"]
                         if isinstance(x, dict) else str(x))
def test_sm90_deterministic_first_stores_leave_no_stale_dq(case, skips, monkeypatch):
    from asymflash.backends import portable
    from asymflash.backends.sm90.bwd import host as bwd

    zeroed = []
    delta = portable.row_delta

    def recording_delta(out, dout, dlse, zero=None, **kw):
        zeroed.append(zero is not None)
        return delta(out, dout, dlse, zero=zero, **kw)

    monkeypatch.setattr(portable, "row_delta", recording_delta)
    q, k, v, dout, seq, params, sink = make_case(case)
    out, lse = portable.forward(q, k, v, seq, params, sink)
    width = bwd_width(case)
    grads = []
    for _ in range(3):
        _poison_allocator(q.shape[0], seq.batch, q.shape[1], width)
        grads.append(bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink)[:3])
    torch.cuda.synchronize()
    if skips is not None:
        assert zeroed == [not skips] * 3
    ref32, reflow = reference_grads(q, k, v, dout, seq, params, sink, case)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_fa_close(name, grads[0][i], ref32[i], reflow[i], atol=2e-3)
        for again in grads[1:]:
            assert torch.equal(grads[0][i], again[i])


# Deterministic mode on kernels and schedules the default config does not pick: at d=128
# bwd.py's synchronous kernel (split_warpgroups=False; softcap calls take it anyway) and
# bwd_ws.py's with dV retired before dSᵀ is formed (dv_overlap=False), with row-major dQ
# tiles (dq_fragment=False, or with a 32-byte swizzle), with dK issued behind dQ
# (ws_dk_after_dq), at d=64 bwd.py's synchronous kernel
# (an earlier default) and bwd_ws.py's with 64-row steps; at d=256
# without the late high dQ half (BwdConfig.dq_hi_late, the default) and with it where the
# turn is released at the main barrier or before the next take.
DET_VARIANTS = [(c, variant) for c in DET_CASES if c["d"] in (96, 128) and not c.get("softcap")
                for variant in (dict(split_warpgroups=False), dict(dv_overlap=False),
                                dict(dq_fragment=False, dq_swizzle=32),
                                dict(dq_fragment=False), dict(ws_dk_after_dq=True))] + \
    [(c, variant) for c in DET_CASES if c["d"] == 64 and not c.get("softcap")
     for variant in (dict(split_warpgroups=False, dq_swizzle=32), dict(block_m=64))] + \
    [(c, variant) for c in DET_CASES if c["d"] == 256
     for variant in (dict(dq_hi_late=False), dict(turn_release=1), dict(turn_release=2))]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case,variant", DET_VARIANTS, ids=lambda x: x.get("name", "") or
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_sm90_other_deterministic_kernel_is_bitwise_reproducible(case, variant):
    from dataclasses import replace

    from asymflash.backends.sm90.bwd import host as bwd

    width = bwd.common.forward_widths(case["d"], case.get("dv", case["d"]))[0]
    default = bwd.select_config(width, deterministic=True)
    cfg = replace(default, **variant)
    assert cfg != default, "the default kernel"
    for name, (g, r32, rlow, atol) in run_case(case, cfg=cfg).items():
        assert_fa_close(name, g, r32, rlow, atol=atol)
    assert_repeats_bitwise(case, 50, cfg)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
def test_sm90_backward_dq_atomics_repeatable_within_tolerance():
    """Two runs differ only by the dQ summation order: far below the FA tolerance."""
    from asymflash.backends import portable
    from asymflash.backends.sm90.bwd import host as bwd

    q, k, v, dout, seq, params, sink = make_case(CASES[4])
    out, lse = portable.forward(q, k, v, seq, params, sink)
    a = bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink)
    b = bwd.backward(dout, q, k, v, out, lse, None, seq, params, sink)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # dK, dV: no atomics
    assert max_err(a[0], b[0]) <= 2e-2 * max(1.0, a[0].float().abs().max().item())


# DeepSeek-V3-style 192/128 (128 + 64 rope / 128) at training sizes: the 192 builds (the
# head dim in a 128- and a 64-wide piece; bwd_ws's 128-key tile, bwd_wide's 64-key one in
# deterministic mode and with softcap) over many key blocks and steps, GQA, causal and not,
# lengths that do and do not fill whole 64-row and 128-key blocks, varlen, and
# deterministic mode (bitwise repeats as well as the reference).
D192_CASES = [
    dict(name="d192-b2-4096-causal", lens_q=[4096] * 2, lens_k=[4096] * 2, hq=16, hkv=16,
         d=192, dv=128, window=(-1, 0)),
    dict(name="d192-b2-4096", lens_q=[4096] * 2, lens_k=[4096] * 2, hq=16, hkv=16, d=192,
         dv=128),
    dict(name="d192-b2-1000-causal-gqa", lens_q=[1000] * 2, lens_k=[1000] * 2, hq=16, hkv=4,
         d=192, dv=128, window=(-1, 0)),
    dict(name="d192-b2-1000-gqa", lens_q=[1000] * 2, lens_k=[1000] * 2, hq=16, hkv=4, d=192,
         dv=128),
    dict(name="d192-b2-1000-causal-det", lens_q=[1000] * 2, lens_k=[1000] * 2, hq=16, hkv=16,
         d=192, dv=128, window=(-1, 0), deterministic=True),
    # (deterministic, whole 64-row blocks, <= 1k keys: first turns store, bwd.first_stores)
    dict(name="d192-b2-512-causal-det-first-stores", lens_q=[512] * 2, lens_k=[512] * 2, hq=8,
         hkv=2, d=192, dv=128, window=(-1, 0), deterministic=True),
    dict(name="d192-b2-4096-gqa-det", lens_q=[4096] * 2, lens_k=[4096] * 2, hq=16, hkv=4,
         d=192, dv=128, deterministic=True),
    dict(name="d192-varlen-causal", lens_q=[1, 130, 0, 777, 64], lens_k=[5, 129, 77, 800, 64],
         hq=4, hkv=2, d=192, dv=128, window=(-1, 0)),
    dict(name="d192-dv64-causal-fp16", lens_q=[333] * 2, lens_k=[333] * 2, hq=4, hkv=4, d=192,
         dv=64, window=(-1, 0), dtype=torch.float16),
    dict(name="d192-local", lens_q=[900], lens_k=[900], hq=4, hkv=2, d=192, dv=128,
         window=(200, 50)),
    dict(name="d192-softcap-causal-gqa", lens_q=[203] * 2, lens_k=[203] * 2, hq=4, hkv=2,
         d=192, dv=128, window=(-1, 0), softcap=30.0),
]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", D192_CASES, ids=lambda c: c["name"])
def test_sm90_backward_d192_matches_reference(case):
    from asymflash.backends.sm90.bwd import host as bwd

    det, softcap = case.get("deterministic", False), case.get("softcap", 0.0) > 0
    kind = bwd.launch_plan(192, 128, max(case["lens_q"]), max(case["lens_k"]), True, False, -1,
                           -1, softcap, det, 1, case["hkv"], 132, None).constexprs["KIND"]
    assert bwd_width(case) == 192
    assert kind == (bwd.entry.KIND_WIDE if det or softcap else bwd.entry.KIND_WS)
    for name, (g, r32, rlow, atol) in run_case(case).items():
        assert g.shape == r32.shape, name
        assert_fa_close(name, g, r32, rlow, atol=atol)
    if case.get("deterministic"):
        assert_repeats_bitwise(case, 3)
