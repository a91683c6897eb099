"""The sm90 Gluon backward compiles for sm_90a without a GPU: HGMMA and fp32 reductions in
SASS, register and shared-memory budgets, (almost) no local memory.

Each compile runs in a worker interpreter without TRITON_INTERPRET (see test_sm90_compile.py:
under the interpreter a Gluon compile cannot call Triton's standard library).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sass_report import Budgets, sass_report, sm90_build, within_budget

from asymflash.backends.sm90 import common
from asymflash.backends.sm90.bwd import host as bwd
from asymflash.core import schedule

pytestmark = pytest.mark.skipif(bwd.GLUON_ERROR is not None, reason=str(bwd.GLUON_ERROR))

_BUILD = sm90_build("bwd")


def compile_report(**kw) -> dict:
    return sass_report(_BUILD, json.dumps(kw))


def _config(kw: dict) -> bwd.BwdConfig:
    """The config these compile arguments build (`compile_for_target`'s)."""
    cfg = bwd.select_config(kw["head_dim"], None, kw.get("softcap", False),
                            kw.get("deterministic", False),
                            kw.get("has_left", False) or kw.get("has_right", False),
                            window=kw.get("has_left", False))
    return replace(cfg, **kw.get("cfg", {}))


def _persistent(kw: dict) -> bool:
    """Whether these compile arguments build bwd_ws.py's persistent grid."""
    return _splits_warpgroups(kw) and bwd.persists(
        _config(kw), kw.get("uniform", True) and not kw.get("has_seqused", False),
        kw.get("softcap", False))


def _splits_warpgroups(kw: dict) -> bool:
    """Whether these compile arguments build bwd_ws.py's kernel."""
    cfg = _config(kw)
    return bwd._splits_warpgroups(kw["head_dim"], cfg, kw.get("softcap", False))


# (features, most local-memory instructions allowed). Unmasked steps never touch local
# memory. d=128 runs at the 255-register limit; deterministic mode spilled around its turn
# wait until every warp polled the turn (bwd_parts.spin_until_equal; d=128 causal 47 -> 6,
# d=256 103-134 -> 0); the bounds catch a tile-sized spill in the main loop
# (hundreds).
CONFIGS = [
    # d=64 unmasked runs bwd_ws's kernel: 128-row steps, the dQ warp
    # issuing both reduces, fragment-order dQ tiles: 6 seen (2 varlen fp16), 71 without the
    # dQ warp, 35 with row-major tiles
    ({"head_dim": 64}, 8),
    ({"head_dim": 64, "dtype": "float16", "uniform": False, "has_seqused": True}, 8),
    ({"head_dim": 64, "cfg": {"ws_dq_warp": False}}, 80),
    ({"head_dim": 64, "cfg": {"dq_fragment": False}}, 40),
    # ... and causal calls from 2k rows (what these builds, without a length, select): 66
    # seen, 27 in the step loops (the masked steps' scalars at 240 registers; 132 / 100
    # before the column indices were formed in the step, bwd_parts.allowed's STEP_COLS)
    ({"head_dim": 64, "has_right": True}, 80),
    # shorter causal calls, sliding windows and softcap keep bwd.py's kernel, 128 query rows
    # per step at the 255-register limit (4 seen causal, 41 with a window, 11 with softcap;
    # unmasked on request 3), 46 causal with fragment-order dQ tiles (all in the loop)
    ({"head_dim": 64, "cfg": {"split_warpgroups": False}}, 8),
    ({"head_dim": 64, "has_right": True,
      "cfg": {"split_warpgroups": False, "dq_fragment": False, "dq_swizzle": 32}}, 8),
    ({"head_dim": 64, "has_right": True, "cfg": {"split_warpgroups": False}}, 56),
    ({"head_dim": 64, "dtype": "float16", "has_left": True, "has_right": True}, 48),
    ({"head_dim": 64, "has_left": True, "has_right": True, "softcap": True, "uniform": False,
      "has_seqused": True}, 16),
    # d=128 runs bwd_ws.py's warp-specialised kernel (240 registers per warpgroup): 2 seen
    # (fragment-order dQ tiles, dK issued behind dQ; 17 with dK first: four loop-invariant
    # MMA descriptors reloaded around each step's dQ MMA); on masked steps each
    # warpgroup saves and restores ~10 scalars around the mask (40 seen causal, 52 with dK
    # first, 28 with a window)
    # Unmasked (and uniform) d=128 calls run it as a persistent grid (BwdConfig.ws_persistent):
    # 41 seen, none in the step loops (the tile loop's prologue and
    # epilogue hold the rest); 2 seen as a plain grid
    ({"head_dim": 128}, 48),
    ({"head_dim": 128, "cfg": {"ws_persistent": False}}, 8),
    ({"head_dim": 128, "uniform": False}, 8),
    # ... and d=64 up to 1k rows: 65 seen, 7 in the late warpgroup's step loop
    ({"head_dim": 64, "cfg": {"ws_persistent": True}}, 72),
    # causal persistent builds (not a default; the GPU tests run them)
    ({"head_dim": 128, "has_right": True, "cfg": {"ws_persistent": True}}, 112),
    ({"head_dim": 128, "has_right": True}, 56),
    ({"head_dim": 128, "dtype": "float16", "has_left": True, "has_right": True,
      "uniform": False, "has_seqused": True}, 40),
    # d=64 causal with row-major dQ tiles (162 seen, the deterministic build's)
    ({"head_dim": 64, "has_right": True, "cfg": {"dq_fragment": False, "dq_swizzle": 128}},
     176),
    ({"head_dim": 128, "cfg": {"ws_dq_warp": True}}, 64),  # 54 seen, 0 as a plain grid
    # ... or with 64-row steps (dQ split by columns), a three-slot ring: 0 seen
    ({"head_dim": 64, "has_right": True,
      "cfg": {"split_warpgroups": True, "block_m": 64, "ring_slots": 3, "ws_dq_warp": False,
              "dq_fragment": False}}, 8),
    # deterministic mode in it (a dQ warp beside the load warp; dV in flight while dSᵀ is
    # formed): 0 seen non-causal, 30 causal (the masked steps' scalars, as without the turns);
    # 40 causal with dV retired first
    ({"head_dim": 128, "deterministic": True}, 8),
    ({"head_dim": 128, "has_right": True, "deterministic": True}, 40),
    ({"head_dim": 128, "has_right": True, "deterministic": True, "cfg": {"dv_overlap": False}},
     48),
    ({"head_dim": 64, "has_right": True, "deterministic": True,
      "cfg": {"split_warpgroups": True, "block_m": 64}}, 8),
    # d=256 (bwd_wide) with row-major dQ halves (fragment order is the default)
    ({"head_dim": 256, "cfg": {"dq_fragment": False}}, 8),
    ({"head_dim": 256, "has_right": True, "deterministic": True, "cfg": {"dq_fragment": False}},
     8),
    # dK issued before dQ (ws_dk_after_dq=False, the deterministic default): 17 seen, 52
    # causal; dK behind dQ in deterministic mode 2 / 38
    ({"head_dim": 128, "cfg": {"ws_dk_after_dq": False}}, 64),
    ({"head_dim": 128, "has_right": True, "cfg": {"ws_dk_after_dq": False}}, 56),
    ({"head_dim": 128, "has_right": True, "deterministic": True,
      "cfg": {"ws_dk_after_dq": True}}, 48),
    # dV left in flight while dSᵀ is formed (dv_overlap, off by default outside deterministic
    # mode): 2 seen non-causal, 44 causal, 39 varlen with a window (two more wgmma waits of
    # depth 1); with fragment-order dQ tiles 14 / 61
    ({"head_dim": 128, "cfg": {"dv_overlap": True}}, 64),
    ({"head_dim": 128, "has_right": True, "cfg": {"dv_overlap": True}}, 68),
    # d=128 in bwd.py's kernel (softcap, deterministic mode, or asked for): the dK/dV
    # TMA-store epilogue (uniform calls) costs 4 around the loop, 1 inside
    ({"head_dim": 128, "cfg": {"split_warpgroups": False}}, 8),
    ({"head_dim": 128, "softcap": True}, 8),
    ({"head_dim": 128, "has_right": True, "cfg": {"split_warpgroups": False}}, 16),
    # (18 seen since the next step's lse/delta load under dQ, BwdConfig.stats_late; 10 before)
    ({"head_dim": 128, "dtype": "float16", "has_left": True, "has_right": True,
      "uniform": False, "has_seqused": True, "cfg": {"split_warpgroups": False}}, 24),
    ({"head_dim": 128, "has_right": True, "softcap": True}, 16),
    # d=64 deterministic mode runs bwd_ws's kernel with 128-row steps:
    # 37 seen, 24 in the loop; causal 162 / 143, a window 142 / 119, the masked steps'
    # scalars at 240 registers; still 20-35 % faster than bwd.py's kernel at 2k-16k)
    ({"head_dim": 64, "deterministic": True}, 48),
    ({"head_dim": 64, "has_right": True, "deterministic": True}, 176),
    ({"head_dim": 64, "has_left": True, "has_right": True, "deterministic": True}, 160),
    # ... and bwd.py's synchronous kernel on request (40 seen with a window)
    ({"head_dim": 64, "has_left": True, "has_right": True, "deterministic": True,
      "cfg": {"split_warpgroups": False, "dq_swizzle": 32}}, 48),
    ({"head_dim": 64, "cfg": {"split_warpgroups": False, "block_m": 64}}, 0),  # the 64-row step
    # deterministic mode in bwd.py's kernel (6 seen causal; non-causal: staggered walk,
    # turns released one step late, 14 seen, none in the loop)
    ({"head_dim": 128, "has_right": True, "deterministic": True,
      "cfg": {"split_warpgroups": False}}, 16),
    ({"head_dim": 128, "deterministic": True, "cfg": {"split_warpgroups": False}}, 16),
    # d=256 (bwd_wide.py) sits at 252-255 registers (0 seen, 2 with softcap and a window)
    ({"head_dim": 256}, 0),
    ({"head_dim": 256, "has_right": True}, 0),
    ({"head_dim": 256, "dtype": "float16", "has_left": True, "has_right": True,
      "softcap": True, "uniform": False, "has_seqused": True}, 8),
    ({"head_dim": 256, "has_right": True, "deterministic": True}, 8),  # 0 seen
    ({"head_dim": 256, "deterministic": True}, 8),  # 0 seen
    # (those two release the turns from warp 0 under the MMAs, turn_release 3; at the main
    # barrier, an earlier default: 0 seen)
    ({"head_dim": 256, "deterministic": True, "cfg": {"turn_release": 1}}, 8),
    # ... with the late high dQ half (released with the turn in the next step)
    ({"head_dim": 256, "has_right": True, "deterministic": True, "cfg": {"dq_hi_late": True}},
     8),
    ({"head_dim": 256, "deterministic": True, "cfg": {"dq_hi_late": True, "turn_release": 1}},
     8),
    # the dQ halves staged in the step's dO buffer and Q slot (BwdConfig.dq_in_operands,
    # dq_hi_late: the d=256 defaults above) and, at dv = 128, in the staging tile (0 seen)
    ({"head_dim": 256, "head_dim_v": 128, "has_right": True}, 0),
    ({"head_dim": 256, "cfg": {"dq_in_operands": False, "dq_hi_late": False}}, 0),
    # d=64 causal calls below 1k rows: 64-row steps, three ring
    # slots, fragment-order dQ, persistent: 26 seen, none in the step loops; with two K/V
    # buffers (the default there) 0, deterministic 0
    ({"head_dim": 64, "has_right": True,
      "cfg": {"split_warpgroups": True, "block_m": 64, "ring_slots": 3, "dq_fragment": True,
              "ws_persistent": True}}, 32),
    ({"head_dim": 64, "has_right": True,
      "cfg": {"split_warpgroups": True, "block_m": 64, "ring_slots": 3, "dq_fragment": True,
              "ws_persistent": True, "ws_kv_buffers": 2}}, 8),
    ({"head_dim": 64, "has_right": True, "deterministic": True,
      "cfg": {"block_m": 64, "ring_slots": 3, "dq_fragment": True, "ws_persistent": True,
              "ws_kv_buffers": 2}}, 8),
    # deterministic mode on the persistent grid; d=64 causal calls
    # below 2k rows take it, d=128 too): d=128 56 seen, 4 in the step
    # loops, causal 118 / 36; d=64 146 / 44, causal 208 / 109 (as the plain grid's
    # deterministic builds: the masked steps' scalars at 240 registers)
    ({"head_dim": 128, "deterministic": True, "cfg": {"ws_persistent": True}}, 64),
    # masked steps masking Sᵀ before the exponentials (BwdConfig.mask_scores, masked d=64
    # calls' default, off at d=128): d=128 causal 4 seen, none in
    # the step loops (40 / 36 without), persistent 54 / 0 (98 / 44), deterministic 12 / 8
    # (22 / 18); d=64 causal with its columns hoisted again 52 / 20 (66 / 27 with step_cols
    # alone)
    ({"head_dim": 128, "has_right": True, "cfg": {"mask_scores": True}}, 8),
    ({"head_dim": 128, "has_right": True, "cfg": {"mask_scores": True, "ws_persistent": True}},
     64),
    ({"head_dim": 128, "has_right": True, "deterministic": True,
      "cfg": {"mask_scores": True}}, 16),
    ({"head_dim": 64, "has_right": True, "cfg": {"mask_scores": True, "step_cols": False}}, 64),
    # (an earlier default: 66 / 27)
    ({"head_dim": 64, "has_right": True, "cfg": {"mask_scores": False}}, 80),
    ({"head_dim": 128, "has_right": True, "deterministic": True,
      "cfg": {"ws_persistent": True}}, 128),
    ({"head_dim": 64, "deterministic": True, "cfg": {"ws_persistent": True}}, 160),
    ({"head_dim": 64, "has_right": True, "deterministic": True,
      "cfg": {"ws_persistent": True}}, 224),
    # 192/128, the head dim in a 128- and a 64-wide piece: bwd_ws's 128-key tile by default
    # (dK and dV hold 160 of 240 registers: the loops' loop-invariant scalars and MMA
    # descriptors spill, 100 seen unmasked, 143 causal, 162 with a window), bwd_wide's
    # 64-key one in deterministic mode and with softcap (0 seen in each)
    ({"head_dim": 192, "head_dim_v": 128}, 128),
    ({"head_dim": 192, "head_dim_v": 128, "has_right": True}, 176),
    ({"head_dim": 192, "head_dim_v": 128, "has_left": True, "has_right": True,
      "uniform": False, "has_seqused": True}, 200),
    ({"head_dim": 192, "head_dim_v": 128, "has_right": True, "deterministic": True}, 4),
    ({"head_dim": 192, "head_dim_v": 128, "has_right": True, "softcap": True}, 8),
    ({"head_dim": 192, "head_dim_v": 128, "has_left": True, "has_right": True,
      "uniform": False, "has_seqused": True,
      "cfg": {"split_warpgroups": False, "block_n": 64, "stats_late": False}}, 8),
]


@pytest.mark.parametrize("kw,max_local", CONFIGS,
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_bwd_compiles_with_hgmma_and_budgets(kw, max_local):
    rep = compile_report(**kw)
    budgets = Budgets(rep)
    # Five MMAs per step (Sᵀ, dPᵀ, dV, dK, dQ), each several HGMMA instructions.
    assert rep["hgmma"] >= 20
    # dQ leaves through the TMA unit's reduce-add, no per-thread atomics
    assert rep["tma_reduce"] > 0 and rep["red"] == 0, rep
    if kw.get("deterministic"):
        assert rep["release_after_bulk_write"], "a dQ turn passed on before its add landed"
    budgets.check(rep["local"], max_local)
    if not (kw.get("deterministic") or kw.get("softcap") or kw.get("has_left")):
        # default mode, no softcap, no sliding window: (almost) nothing in local memory inside
        # the main loop (the spills counted above sit in the prologue / epilogue; d=128 with a
        # window spills ~10 on its masked edge blocks; with the dK/dV TMA-store epilogue
        # d=128 takes 1 unmasked, 6 causal (sm_90a); causal 10 since dK is
        # issued after dQ and stored straight from its wgmma layout)
        in_loop = 10 if kw.get("has_right") else 2
        if kw.get("has_right") and _config(kw).dq_fragment:
            in_loop = 56  # d=64 with fragment-order dQ (see CONFIGS)
        if _splits_warpgroups(kw):  # the masked steps' scalars (see CONFIGS); 10 more
            # with fragment-order dQ tiles (the dQ MMA's descriptors)
            in_loop = 56 if kw.get("has_right") else 12
            if kw.get("has_right") and kw.get("cfg", {}).get("dv_overlap"):
                in_loop = 68  # 41 seen, 60 with fragments (dv_overlap, off by default
                # outside deterministic mode)
            cfg = _config(kw)
            if kw["head_dim"] == 64 and cfg.block_m == 128:
                # 6 seen with the dQ warp and fragment-order tiles (the default), 22 with
                # row-major ones, 46 without the warp; 143 causal (why masked calls keep
                # bwd.py's kernel)
                in_loop = 160 if kw.get("has_right") else (
                    8 if cfg.ws_dq_warp and cfg.dq_fragment else 80)
            if kw["head_dim"] == 192:  # (see CONFIGS) 49 seen in the step loops unmasked
                in_loop = 176 if kw.get("has_right") else 128
        if _persistent(kw):
            # the tile loop spans prologue and epilogue: count the step loops' own (d=128 0
            # seen, 5 with the dQ warp; d=64 7 in its late warpgroup's, a step behind)
            assert rep["step_loops"] == 2, rep
            allowed = 8
            if kw.get("has_right"):
                allowed = 80  # the masked steps' scalars, as in the plain grid (36 seen)
            budgets.check(rep["local_in_step_loops"], allowed, "spills in the step loops")
        else:
            budgets.check(rep["local_in_loop"], in_loop, "spills in the main loop")
    if _splits_warpgroups(kw):
        # a load warp at 24 registers, two compute warpgroups at 240; dQ by two reduces
        # (each warpgroup's columns), dK and dV by two TMA stores each
        assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"], rep
        # (192: dK's 192-wide rows have no TMA box: stored by rows)
        assert rep["tma_store"] >= 4 or kw.get("uniform") is False or kw["head_dim"] == 192, rep
    if _persistent(kw) and kw.get("deterministic"):  # the step loops' own (see CONFIGS)
        assert rep["step_loops"] == 2, rep
        allowed = (120 if kw["head_dim"] == 64 else 48) if kw.get("has_right") else (
            48 if kw["head_dim"] == 64 else 8)
        budgets.check(rep["local_in_step_loops"], allowed, "spills in the step loops")
    if kw["head_dim"] == 256 and kw.get("deterministic") and not kw.get("softcap"):
        # the dQ turn's wait inside the loop (bwd_parts.spin_until_equal) costs no spills (it
        # cost 35-54 polling from one thread); causal takes 2 with the dK/dV TMA epilogue, 4
        # with fragment-order dQ halves
        allowed = 4 if _config(kw).dq_fragment else 2
        budgets.check(rep["local_in_loop"], allowed, "spills in the main loop")
    assert rep["regs"] <= 255
    assert rep["shared"] <= 227 * 1024
    cfg = _config(kw)
    split = _splits_warpgroups(kw)
    if bwd._fragments(cfg, split, kw["head_dim"]):
        # bwd_ws (d=128 by default): a warpgroup's 64-row dQ tile in fragment order, one
        # unswizzled box of 32-column rows (dq_fragments.py); bwd.py's 128-row tile (d=64)
        # both warpgroups' tiles in one box; bwd_wide (d=256) each 128-column half
        half = (split and cfg.block_m == 64) or kw["head_dim"] == 256
        cols = kw["head_dim"] // 2 if half else kw["head_dim"]
        rows = 64 if split else cfg.block_m
        assert rep["fp32_boxes"] == [[rows * cols // 32, 32]], rep
        assert rep["sts128"] >= 8 and rep["sts64_fp32_staging"] == 0, rep
    else:
        # row-major staging tile: d=64 with a 32-byte swizzle (8-column boxes,
        # BwdConfig.dq_swizzle), the others 128 bytes (32 columns)
        assert [box[1] for box in rep["fp32_boxes"]] == [cfg.dq_swizzle // 4], rep
    budgets.verdict()


# Head dims between the widths (96, 192/128, ...): q, k, v and dO through 3-D TMA boxes that
# zero-fill the missing columns (fwd.tma_heads); the same kernels otherwise.
@pytest.mark.parametrize("kw", [
    {"head_dim": 128, "heads_axis": True, "has_right": True},
    {"head_dim": 256, "heads_axis": True},
    {"head_dim": 256, "head_dim_v": 128, "heads_axis": True, "has_right": True},
], ids=["128-causal", "256", "256-128-causal"])
def test_heads_axis_descriptors_compile(kw):
    rep = compile_report(**kw)
    assert rep["tma_load_3d"] >= 4, rep  # K, V, Q and dO
    # d=128 causal spills a few scalars on its masked path (CONFIGS above: <= 56 in
    # bwd_ws.py's kernel)
    assert rep["hgmma"] >= 20 and rep["tma_reduce"] > 0, rep
    within_budget(rep, rep["local"], 56)


def test_defaults_where_the_h200_measured_a_gain():
    # fragment-order dQ tiles (BwdConfig.dq_fragment) and dK issued behind dQ (not
    # deterministic)
    sel = bwd.select_config
    assert sel(128, max_seqlen_q=512).dq_fragment
    assert sel(256, max_seqlen_q=512).dq_fragment and sel(256).dq_fragment
    assert sel(256, deterministic=True, masked=True, max_seqlen_q=16384).dq_fragment
    # d=64 unmasked: bwd_ws, its dQ warp issuing the reduces, fragments at every length
    for rows in (512, 16384):
        cfg = sel(64, max_seqlen_q=rows)
        assert cfg.split_warpgroups and cfg.ws_dq_warp and cfg.dq_fragment, cfg
        assert bwd._splits_warpgroups(64, cfg, False)
    for kw in ({"softcap": True}, {"deterministic": True}):
        cfg = sel(64, **{"max_seqlen_q": 16384, **kw})
        assert not (cfg.dq_fragment or cfg.ws_dq_warp), kw
    # ... and causal from 1k rows (a persistent grid below 2k); shorter causal calls as a
    # persistent grid of 64-row steps; windows and softcap on bwd.py's
    for rows, persistent in ((1024, True), (2048, False), (16384, False)):
        causal = sel(64, masked=True, max_seqlen_q=rows)
        assert causal.split_warpgroups and causal.ws_dq_warp and causal.dq_fragment, causal
        assert causal.ws_persistent == persistent, rows
    short = sel(64, masked=True, max_seqlen_q=512)
    assert (short.split_warpgroups and short.block_m == 64 and short.ring_slots == 3
            and short.dq_fragment and short.ws_persistent and not short.ws_dq_warp
            and short.ws_kv_buffers == 2), short
    # ... and unmasked ones up to 256 rows (their ragged key blocks masked after the
    # exponentials: BwdConfig.mask_scores is for masked calls)
    assert sel(64, max_seqlen_q=256) == replace(short, mask_scores=False) and short.mask_scores
    assert sel(64, max_seqlen_q=384).block_m == 128
    short_det = sel(64, masked=True, deterministic=True, max_seqlen_q=512)
    assert short_det.block_m == 64 and short_det.ws_kv_buffers == 2, short_det
    assert sel(64, masked=True, deterministic=True, max_seqlen_q=1024).ws_kv_buffers == 1
    for width, over in ((128, short), (64, replace(short, block_m=128))):  # no room for it
        with pytest.raises(ValueError, match="ws_kv_buffers"):
            sel(width, over)
    assert bwd._splits_warpgroups(64, short, False)
    for kw in ({"softcap": True}, {"masked": True, "window": True, "max_seqlen_q": 16384}):
        assert not sel(64, **kw).split_warpgroups, kw
    # persistent grids (BwdConfig.ws_persistent): unmasked d=128, unmasked d=64 up to 1k rows
    assert sel(128, max_seqlen_q=16384).ws_persistent and sel(64, max_seqlen_q=1024).ws_persistent
    for kw in ({"max_seqlen_q": 2048}, {"deterministic": True, "max_seqlen_q": 512},
               {"softcap": True}):
        assert not sel(64, **kw).ws_persistent, kw
    for kw in ({"masked": True}, {"masked": True, "max_seqlen_q": 2048},
               {"deterministic": True}, {"softcap": True}):
        assert not sel(128, **kw).ws_persistent, kw
    assert sel(128, masked=True, max_seqlen_q=1024).ws_persistent  # causal below 2k rows
    # ... and deterministic d=64 causal calls below 2k rows
    for rows, persistent in ((512, True), (1024, True), (2048, False)):
        det = sel(64, masked=True, deterministic=True, max_seqlen_q=rows)
        assert det.ws_persistent == persistent and det.split_warpgroups, rows
    assert not sel(64, masked=True, window=True, deterministic=True,
                   max_seqlen_q=512).ws_persistent
    # (off with CUDA 13's ptxas: select_config)
    assert sel(128).ws_dk_after_dq == (common.sm90_ptxas_major() < 13)
    assert not sel(128, deterministic=True).ws_dk_after_dq
    def plan(seqlen):  # d=256, non-causal, batch * seqlen = 16k
        return bwd.launch_plan(256, 256, seqlen, seqlen, True, False, -1, -1, False, False,
                               16384 // seqlen, 8, 132, None)

    # a 64-row half as 32-column fragment rows, or a warpgroup's 64 columns of it (override)
    assert plan(512).dq_fragment and plan(2048).dq_block == (256, 32)
    row_major = bwd.launch_plan(256, 256, 512, 512, True, False, -1, -1, False, False, 32, 8,
                                132, replace(bwd.select_config(256), dq_fragment=False))
    assert row_major.dq_block == (64, 128)


def test_config_outside_the_hardwired_layouts_refused():
    with pytest.raises(ValueError):
        bwd.select_config(128, bwd.BwdConfig(block_m=128))
    with pytest.raises(ValueError):
        bwd.select_config(256, bwd.BwdConfig(block_n=128))
    with pytest.raises(ValueError, match="ring_slots"):
        bwd.select_config(128, bwd.BwdConfig(split_warpgroups=True, ring_slots=1))


def test_deterministic_calls_take_the_split_kernel_without_softcap():
    cfg = bwd.select_config(128, deterministic=True)
    assert cfg.split_warpgroups and bwd._splits_warpgroups(128, cfg, False)
    # dV stays in flight there (measured +0-5 %), not in the default mode (a tie)
    assert cfg.dv_overlap and not bwd.select_config(128).dv_overlap
    assert not bwd.select_config(128, softcap=True, deterministic=True).dv_overlap
    # softcap stays on bwd.py's kernel either way
    assert not bwd._splits_warpgroups(128, cfg, True)


def test_unsupported_backward_reports_reason_on_cpu():
    import torch

    from asymflash.core.params import AttnParams, SeqInfo

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, 8, 8, "cpu")
    why = bwd.unsupported_backward(q, q, q, seq, AttnParams(0.125), None)
    assert isinstance(why, str) and why
    why = bwd.unsupported_backward(q, q, q, seq, AttnParams(0.125, deterministic=True), None)
    assert isinstance(why, str) and why


@pytest.mark.parametrize("kernel", ["bwd", "fwd"])
def test_lengths_and_counts_are_not_specialised(kernel):
    # With seqlen_q = group = 1 specialised into constants triton 3.6 crashes lowering the
    # backward (H200); runtime lengths also keep one compile per feature set.
    from asymflash.backends.sm90.fwd import kernel as fwd_kernel

    fn = {"bwd": bwd.entry.attn_bwd_kernel, "fwd": fwd_kernel.attn_fwd_kernel}[kernel]
    runtime_ints = {"seqlen_q", "seqlen_k", "total_q", "n_heads", "group", "window_left",
                    "window_right"}
    unspecialised = {p.name for p in fn.params if p.do_not_specialize}
    assert runtime_ints <= unspecialised


def test_dk_dv_tma_store_only_where_no_key_block_straddles_sequences():
    # uniform lengths, a multiple of the key block: every block is whole
    assert bwd.kv_tma_store(True, 512, 4, 128)
    assert bwd.kv_tma_store(True, 320, 2, 64)
    # 700 keys in each of 2 sequences: block 5 would hold keys of both (masked stores)
    assert not bwd.kv_tma_store(True, 700, 2, 128)
    # one sequence: the rows past its end lie past the tensor, clipped by the TMA unit
    assert bwd.kv_tma_store(True, 700, 1, 128)
    assert not bwd.kv_tma_store(False, 512, 2, 128)  # varlen / seqused_k

    def plan(max_k, batch, uniform=True):
        return bwd.launch_plan(128, 128, max_k, max_k, uniform, not uniform, -1, -1, False,
                               False, batch, 4, 132, None).constexprs["KV_TMA_STORE"]

    assert plan(512, 4) and not plan(700, 2) and not plan(512, 4, uniform=False)


def test_every_backward_kernel_skips_key_blocks_numbered_below_zero():
    """Deterministic causal calls number key blocks top-first from the sequence's own count
    (`sched.key_block`, through `parts.key_tile`), so grid columns beyond a shorter varlen
    sequence get n_blk < 0.
    Each kernel must skip them before touching memory: bwd_ws once did not, and summed rows
    of the previous sequence into dQ (H200, dQ error 282)."""
    import re
    from pathlib import Path

    sm90 = Path(bwd.__file__).parent
    for name in ("kernel.py", "kernel_ws.py"):
        src = (sm90 / name).read_text()
        calls = [m.end() for m in re.finditer(r"= key_tile\(", src)]
        assert calls, name
        for at in calls:
            body = src[at:at + 800]
            guard = re.search(r"\n\s*if \(n0 >= 0\) & \(n0 < seqlen_k\):", body)
            assert guard, f"{name}: no `n0 >= 0` guard right after key_tile"


def test_heads_first_grid_where_all_heads_fit_l2():
    # BwdConfig.heads_first: causal calls on dense lengths whose heads' Q and dO fit
    # HEADS_FIRST_L2_BYTES run the grid as (kv heads, key blocks, sequences); longer calls,
    # other masks, ragged batches and deterministic mode keep (key blocks, kv heads, ...).
    def plan(d=128, seqlen=2048, batch=8, hq=16, hkv=16, wl=-1, wr=0, uniform=True,
             det=False, cfg=None):
        return bwd.launch_plan(d, d, seqlen, seqlen, uniform, not uniform, wl, wr, False,
                               det, batch, hkv, 132, cfg, hq)

    def blocks(seqlen, d=128):
        return -(-seqlen // (64 if d == 256 else 128))

    # 16 heads x 2048 rows x (128 + 128) x 2 bytes = 16 MB: within the budget
    assert 16 * 2048 * 256 * 2 <= bwd.HEADS_FIRST_L2_BYTES < 16 * 4096 * 256 * 2
    for kw, grid in ((dict(), (16, blocks(2048), 8)),
                     (dict(d=64, hq=32, hkv=32), (32, blocks(2048), 8)),
                     (dict(d=256, hq=8, hkv=8), (8, blocks(2048, 256), 8)),
                     (dict(hq=16, hkv=4), (4, blocks(2048), 8))):  # GQA: q heads count
        p = plan(**kw)
        assert p.constexprs["HEADS_FIRST"] and p.grid == grid, kw
    for kw in (dict(seqlen=16384, batch=1), dict(wr=-1),
               dict(wl=100, wr=0), dict(uniform=False), dict(det=True)):
        p = plan(**kw)
        assert not p.constexprs["HEADS_FIRST"], kw
        grid = (blocks(kw.get("seqlen", 2048)), 16, kw.get("batch", 8))
        if p.constexprs["PERSISTENT"]:  # unmasked d=128: one CTA per SM walks that grid
            assert kw == dict(wr=-1), kw
            grid = (min(grid[0] * grid[1] * grid[2], 132),)
        assert p.grid == grid, kw
    # an explicit choice wins, within the masks it applies to
    causal = bwd.select_config(128, masked=True)
    p = plan(cfg=replace(causal, heads_first=False))
    assert not p.constexprs["HEADS_FIRST"] and p.grid == (blocks(2048), 16, 8)
    p = plan(seqlen=16384, batch=1, cfg=replace(causal, heads_first=True))
    assert p.constexprs["HEADS_FIRST"] and p.grid == (16, blocks(16384), 1)
    assert not plan(wr=-1, cfg=replace(causal, heads_first=True)).constexprs["HEADS_FIRST"]


def test_heads_first_in_chunks_where_all_heads_overflow_l2():
    # BwdConfig.heads_chunk: where all heads' Q and dO overflow HEADS_FIRST_L2_BYTES, causal
    # calls run heads first in chunks (the largest divisor of the kv heads that fits) if the
    # replayed hand-out of one head after another is more than CHUNK_GAIN less balanced.
    def plan(d=128, seqlen=4096, hq=16, hkv=16, cfg=None, wr=0):
        return bwd.launch_plan(d, d, seqlen, seqlen, True, False, -1, wr, False, False,
                               16384 // seqlen, hkv, 132, cfg, hq)

    def blocks(seqlen, d=128):
        return -(-seqlen // (64 if d == 256 else 128))

    for kw, chunk in ((dict(), 8), (dict(seqlen=8192), 4), (dict(d=64, hq=32, hkv=32), 16),
                      (dict(d=256, hq=8, hkv=8), 4), (dict(hq=16, hkv=8, seqlen=8192), 2)):
        p = plan(**kw)
        seqlen = kw.get("seqlen", 4096)
        hkv = kw.get("hkv", 16)
        assert p.constexprs["HEADS_FIRST"] == chunk, (kw, p.constexprs["HEADS_FIRST"])
        assert p.grid == (chunk, hkv // chunk * blocks(seqlen, kw.get("d", 128)),
                          16384 // seqlen), kw
    # balanced enough one head after another (16k rows: 1.005x), or no fitting chunk
    for kw in (dict(seqlen=16384), dict(d=256, hq=8, hkv=8, seqlen=8192), dict(wr=-1)):
        p = plan(**kw)
        assert not p.constexprs["HEADS_FIRST"], kw
    cfg = bwd.select_config(128, masked=True)
    steps = schedule.key_block_steps(cfg.block_m, cfg.block_n, 4096, 4096, 0, 1)
    assert steps[0] == 64 and steps[-1] == 2 and len(steps) == 32  # 64-row steps, 128 keys
    flat = schedule.dispatch_imbalance(steps, 16, 4, 1, 132)
    assert flat > 1.05 and schedule.dispatch_imbalance(steps, 16, 4, 8, 132) < 1.01
    # an explicit chunk wins (1: one head after another; all kv heads: all heads first)
    causal = replace(bwd.select_config(128, masked=True, max_seqlen_q=2048),
                     ws_persistent=False)
    for chunk, first, grid in ((2, 2, (2, 8 * blocks(2048), 8)), (1, 0, (blocks(2048), 16, 8)),
                               (16, 1, (16, blocks(2048), 8))):
        p = plan(seqlen=2048, cfg=replace(causal, heads_chunk=chunk))
        assert p.constexprs["HEADS_FIRST"] == first and p.grid == grid, chunk
    for bad in (3, 0):
        with pytest.raises(ValueError, match="heads_chunk"):
            plan(seqlen=2048, cfg=replace(causal, heads_chunk=bad))
    with pytest.raises(ValueError, match="heads_chunk"):  # persistent grids: not in chunks
        plan(seqlen=1024, cfg=replace(causal, ws_persistent=True, heads_chunk=2))


def test_persistent_grid_only_where_it_was_verified():
    # BwdConfig.ws_persistent: one CTA per SM over the plain grid's tiles, for dense lengths
    # without softcap; deterministic calls where asked for (their turns follow the tile
    # order) and by default only at d=64 causal below 2k rows
    def plan(d=128, seqlen=2048, batch=8, h=16, wr=-1, uniform=True, det=False,
             softcap=False, cfg=None):
        return bwd.launch_plan(d, d, seqlen, seqlen, uniform, False, -1, wr, softcap, det,
                               batch, h, 132, cfg, h)

    p = plan()
    assert p.persistent and p.grid == (132,), p.grid
    assert plan(batch=1, seqlen=128, h=4).grid == (4,)  # fewer tiles than SMs
    forced = replace(bwd.select_config(128), ws_persistent=True)
    for kw in (dict(uniform=False), dict(det=True), dict(softcap=True, cfg=forced)):
        p = plan(**kw)
        assert not p.persistent and len(p.grid) == 3, kw
    forced_det = replace(bwd.select_config(128, deterministic=True), ws_persistent=True)
    assert plan(det=True, cfg=forced_det).persistent
    assert not plan(wr=0).persistent  # causal d=128 from 2k rows: a tie or a loss
    assert plan(wr=0, seqlen=1024).persistent
    assert plan(d=64, seqlen=1024, h=32, wr=0).persistent  # d=64 causal at 1k rows
    assert plan(d=64, seqlen=512, h=32, wr=0).persistent  # ... and 64-row steps below
    assert plan(d=64, seqlen=512, h=32, wr=0, det=True).persistent
    assert not plan(d=64, seqlen=2048, h=32, wr=0).persistent


def test_d256_dq_staging_in_the_operand_buffers_only_where_it_fits():
    cfg = bwd.select_config(256)
    assert cfg.dq_in_operands and cfg.dq_hi_late
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
             "softcap": False}
    c = bwd._constexprs(256, 256, cfg, **feats)
    assert c["DQ_IN_OPS"] and c["HI_LATE"]
    # 192/128 runs dv = 128: its dO buffer (16 KB) cannot hold a 32 KB fp32 dQ half (the
    # first GPU run gave NaN there)
    c = bwd._constexprs(256, 128, cfg, **feats)
    assert not (c["DQ_IN_OPS"] or c["HI_LATE"])
    # deterministic mode: the late high half where the turn is released in the next step
    # (after the half's issue), never where it is released within the step (turn_release 0)
    det = bwd.select_config(256, deterministic=True)
    c = bwd._constexprs(256, 256, det, deterministic=True, **feats)
    assert c["DQ_IN_OPS"] and c["HI_LATE"] == det.dq_hi_late
    for release in (1, 2, 3):
        c = bwd._constexprs(256, 256, replace(det, dq_hi_late=True, turn_release=release),
                            deterministic=True, **feats)
        assert c["RELEASE_AT"] == release and c["HI_LATE"]
    c = bwd._constexprs(256, 256, replace(det, dq_hi_late=True, turn_release=0),
                        deterministic=True, **feats)
    assert c["RELEASE_AT"] == 0 and c["DQ_IN_OPS"] and not c["HI_LATE"]
    # head dims <= 128 run other kernels: the switches stay off
    assert not bwd._constexprs(128, 128, bwd.select_config(128), **feats)["DQ_IN_OPS"]


def test_turn_release_by_warp_zero_only_in_the_wide_kernel():
    """turn_release 3 (release from warp 0 after the main barrier) exists in bwd_wide only:
    bwd.py's kernel would never pass a turn on inside its step loop (a deadlock), so the
    config check refuses it below head dim 256; deterministic d=256 takes it by default."""
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": False,
             "softcap": False}
    det = bwd.select_config(256, deterministic=True)
    assert det.turn_release == 3
    assert bwd._constexprs(256, 256, det, deterministic=True, **feats)["RELEASE_AT"] == 3
    for d in (64, 128):
        assert bwd.select_config(d, deterministic=True).turn_release == 1
        with pytest.raises(ValueError, match="turn_release"):
            bwd.select_config(d, replace(bwd.select_config(d), turn_release=3))
    with pytest.raises(ValueError, match="turn_release"):
        bwd.select_config(256, replace(det, turn_release=4))


@pytest.mark.parametrize("d", [64, 128])
def test_short_causal_deterministic_calls_run_the_persistent_grid(d):
    """Deterministic causal calls below 2k rows take the persistent bwd_ws grid at d=64 and
    d=128 (H200); longer calls, sliding windows and softcap
    keep the plain grid."""
    def cfg(rows, window=False, softcap=False):
        return bwd.select_config(d, deterministic=True, masked=True, max_seqlen_q=rows,
                                 window=window, softcap=softcap)
    assert cfg(512).ws_persistent and cfg(2047).ws_persistent
    assert not cfg(2048).ws_persistent
    assert not cfg(512, window=True).ws_persistent
    assert not cfg(512, softcap=True).ws_persistent
    assert not bwd.select_config(d, deterministic=True, masked=False,
                                 max_seqlen_q=512).ws_persistent


def test_mask_mode_reaches_only_the_warp_specialised_kernel():
    """bwd_ws's MASK_MODE: bit 0 forms a masked step's column indices in the step
    (BwdConfig.step_cols), bit 1 masks Sᵀ before the exponentials (mask_scores); both are
    masked d=64 calls' default, neither d=128's. The other kernels get it as 0."""
    feats = {"uniform": True, "has_seqused": False, "has_left": False, "has_right": True,
             "softcap": False}

    def mode(d, **fields):
        cfg = replace(bwd.select_config(d, masked=True), **fields)
        return bwd._constexprs(d, d, cfg, split=True, **feats)["MASK_MODE"]

    assert mode(64) == 3 and mode(128) == 0
    assert mode(64, mask_scores=False) == 1 and mode(128, mask_scores=True) == 2
    assert mode(64, step_cols=False) == 2 and mode(128, step_cols=True) == 1
    assert mode(64, step_cols=False, mask_scores=False) == 0
    # unmasked d=64 calls keep it off (their build spilled more with it)
    assert not bwd.select_config(64).mask_scores and not bwd.select_config(128, masked=True) \
        .mask_scores
    assert not bwd.select_config(64, masked=True, softcap=True).mask_scores
    for d in (64, 128, 256):
        assert bwd._constexprs(d, d, bwd.select_config(d), **feats)["MASK_MODE"] == 0


# Deterministic mode's first dQ turns store (bwd.first_stores, FIRST_STORES): the dQ warp
# issues both a store and an add per tile, one aimed past the buffer (no branch: a branch
# there made ptxas spill in the compute warpgroups, 2 -> 32 local-memory instructions at
# d=128). Same local-memory budget as the build that always adds (seen: d=128 2 / 2, causal
# 22 / 22, d=64 34 / 38), and two more TMA stores than it.
@pytest.mark.parametrize("kw", [
    {"head_dim": 128, "deterministic": True},
    {"head_dim": 128, "has_right": True, "deterministic": True},
    {"head_dim": 64, "deterministic": True},
    {"head_dim": 128, "deterministic": True, "cfg": {"ws_persistent": True}},
    {"head_dim": 256, "deterministic": True},
    {"head_dim": 256, "has_right": True, "deterministic": True},
    {"head_dim": 256, "deterministic": True, "cfg": {"turn_release": 1}},
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_first_stores_build_keeps_the_spill_budget(kw):
    adds = compile_report(**kw)
    stores = compile_report(**kw, first_stores=True)
    assert stores["tma_store"] == adds["tma_store"] + adds["tma_reduce"], (adds, stores)
    assert stores["tma_reduce"] == adds["tma_reduce"] and stores["release_after_bulk_write"]
    Budgets(stores).check(stores["local"], adds["local"]).check(
        stores["local_in_step_loops"], adds["local_in_step_loops"],
        "spills in the step loops").verdict()


def test_first_stores_only_where_every_query_block_gets_a_first_turn():
    cfg = bwd.select_config(128, deterministic=True)
    rule = bwd.first_stores
    assert rule(cfg, True, True, 512, 512, -1, False)  # unmasked, whole blocks
    assert rule(cfg, True, True, 640, 640, 0, False)  # causal, sq = sk
    # where a query block meets many keys the unwanted TMA op costs more than the zeroing
    assert rule(cfg, True, True, 1024, 1024, -1, False)
    assert not rule(cfg, True, True, 2048, 2048, -1, False)
    assert rule(cfg, True, True, 2048, 2048, 0, False)
    assert not rule(cfg, True, True, 4096, 4096, 0, False)
    assert rule(cfg, True, True, 200, 700, 0, True)  # causal sq < sk, fragment tiles
    assert not rule(cfg, False, True, 512, 512, -1, False)  # default mode adds unordered
    assert not rule(cfg, True, False, 512, 512, -1, False)  # varlen / seqused: maybe empty
    assert not rule(cfg, True, True, 700, 300, 0, True)  # causal sq > sk: rows see no key
    assert not rule(cfg, True, True, 512, 0, -1, True)  # no keys
    assert not rule(cfg, True, True, 300, 300, -1, False)  # a row-major box spans sequences
    assert rule(cfg, True, True, 300, 300, -1, True)  # fragment tiles never do
    # the launch plan passes it to bwd_ws's kernel alone, and only in deterministic mode
    plan = bwd.launch_plan(128, 128, 512, 512, True, False, -1, -1, False, True, 2, 4, 132,
                           None, hq=4)
    assert plan.split and plan.constexprs.get("FIRST_STORES") is True
    plan = bwd.launch_plan(128, 128, 512, 512, True, False, -1, -1, False, False, 2, 4, 132,
                           None, hq=4)
    assert plan.constexprs["FIRST_STORES"] is False
    plan = bwd.launch_plan(256, 256, 512, 512, True, False, -1, -1, False, True, 2, 4, 132,
                           None, hq=4)
    assert not plan.split and plan.constexprs.get("FIRST_STORES") is True  # bwd_wide
    # bwd.py's kernel for d <= 128 (deterministic d=64 with softcap) always adds
    plan = bwd.launch_plan(64, 64, 512, 512, True, False, -1, -1, True, True, 2, 4, 132,
                           None, hq=4)
    assert not plan.split and plan.constexprs["FIRST_STORES"] is False


@pytest.mark.parametrize("d,causal,det,softcap,seqlen", [
    (d, causal, det, softcap, seqlen) for d in (64, 128, 256) for causal in (False, True)
    for det in (False, True) for softcap in (False, True) for seqlen in (512, 4096)])
def test_launch_plans_pass_every_constexpr(d, causal, det, softcap, seqlen):
    """DirectLaunch keeps a binary only for calls that pass every constexpr parameter (a
    defaulted one left out sends each launch down Triton's path: FIRST_STORES
    left out of non-deterministic plans cost every bwd_ws and bwd_wide launch ~85 us of
    host time on the H200's host)."""
    plan = bwd.launch_plan(d, d, seqlen, seqlen, True, False, -1, 0 if causal else -1, softcap,
                           det, 2, 4, 132, None, hq=8)
    kernel = bwd._kernel_for(d, plan.split)
    wanted = {p.name for p in kernel.params if p.is_constexpr}
    assert wanted <= set(plan.constexprs), wanted - set(plan.constexprs)


# 192/128 (DeepSeek-V3's 128 + 64 rope / 128): its own builds, the head dim in a 128- and a
# 64-wide piece, against the 256/128 build they replace.
_WIDE_192 = {"split_warpgroups": False, "block_n": 64, "stats_late": False}


def _mma_work(rep):
    """sum(N x count) over the HGMMA instructions (each M=64, K=16)."""
    return sum(int(k.split("x")[1]) * v for k, v in rep["hgmma_shapes"].items())


def test_d192_build_runs_no_mma_on_zero_columns():
    wide = compile_report(head_dim=192, head_dim_v=128, has_right=True, heads_axis=True,
                          cfg=_WIDE_192)
    ref = compile_report(head_dim=256, head_dim_v=128, has_right=True, heads_axis=True,
                         cfg={"stats_late": False})
    # bwd_wide, per step (one 64 x 64 block; N per warpgroup): Sᵀ 8 + 4 (K-steps over 128
    # + 64 columns) and dPᵀ 8 at N=32; dV 4 at N=64; dK and dQ 4 at N=64 (low piece) + 4 at
    # N=32 (high piece). MMA work 1664 vs 256/128's 2048 (= 832 / 1024 units of the issue's
    # count)
    assert wide["hgmma_shapes"] == {"64x32x16": 28, "64x64x16": 12}, wide
    assert ref["hgmma_shapes"] == {"64x32x16": 24, "64x64x16": 12, "64x128x16": 4}, ref
    assert (_mma_work(wide), _mma_work(ref)) == (1664, 2048)
    assert wide["tma_load_3d"] >= 4 and wide["tma_reduce"] > 0 and wide["red"] == 0, wide
    # dQ as row-major 64-column boxes (two 32-column TMA boxes each), no fragment order
    assert wide["fp32_boxes"] == [[64, 32]], wide
    assert wide["local"] == 0 and wide["regs"] <= 255, wide
    # the pieces take less shared memory than the zero columns did (K 24 KB, Q 2 x 24 KB,
    # beside a 16 KB staging tile of the high dQ piece)
    assert wide["shared"] < ref["shared"] <= 227 * 1024, (wide["shared"], ref["shared"])


def test_d192_ws_build():
    """bwd_ws's 192 build: each warpgroup 64 keys, no MMA on zero columns, MMAs at N >= 64."""
    rep = compile_report(head_dim=192, head_dim_v=128, has_right=True, heads_axis=True)
    # per step and warpgroup (64 keys x 64 query rows): Sᵀ 8 + 4 K-steps and dPᵀ 8 at N=64,
    # dV 4 at N=128, dK 4 at N=128 (low piece) + 4 at N=64; dQ 64-column pieces of 8
    # K-steps, two in warpgroup 0 (columns 0-127, one step late: once more after the loop),
    # one in warpgroup 1. In the two loops: 2 x (8 + 4 + 8 + 4) + 3 x 8 = 72 at N=64, 16 at
    # N=128; after them 16
    assert rep["hgmma_shapes"] == {"64x64x16": 88, "64x128x16": 16}, rep
    # a step's MMA work (64 x N x 16 per HGMMA) is its useful work, 64 query rows x 128 keys
    # x (192 + 128 + 128 + 192 + 192) multiply-adds: none on zero columns
    per_step = _mma_work(rep) - 16 * 64
    assert per_step * 64 * 16 == 64 * 128 * (192 + 128 + 128 + 192 + 192)
    assert rep["step_loops"] == 2 and 240 in rep["maxnreg"], rep
    assert rep["tma_load_3d"] >= 4 and rep["tma_reduce"] > 0 and rep["red"] == 0, rep
    assert rep["fp32_boxes"] == [[64, 32]], rep  # 64 x 64 fp32 dQ pieces, row-major
    assert rep["regs"] <= 255 and rep["shared"] <= 227 * 1024, rep
    assert rep["wgmma_serialized"] is not True, rep
    within_budget(rep, rep["local_in_step_loops"], 112, "spills in the step loops (85 seen)")


def test_d192_routing():
    """Which build a head dim pair's backward runs (`backward_widths`, `launch_plan`)."""
    widths = bwd.backward_widths
    assert widths(192, 128) == (192, 128)
    assert widths(160, 128) == (192, 128)  # zero-filled up to 192 by the TMA boxes
    assert widths(136, 64) == (192, 128)
    assert widths(192, 192) == (256, 256)  # V wider than 128: as the forward
    assert widths(200, 128) == (256, 128)
    assert widths(256, 128) == (256, 128)
    assert widths(128, 128) == (128, 128) and widths(96, 96) == (128, 128)
    assert widths(64, 64) == (64, 64) and widths(256, 256) == (256, 256)
    assert bwd.piece_cols(192) == 64 and bwd.piece_cols(128) == 128
    for det, softcap in ((False, False), (True, False), (False, True)):
        for wr in (-1, 0):
            plan = bwd.launch_plan(192, 128, 4096, 4096, True, False, -1, wr, softcap, det, 2,
                                   128, 132, None, hq=128)
            c = plan.constexprs
            ws = not (det or softcap)  # bwd_ws's 128-key tile, else bwd_wide's 64-key one
            assert c["KIND"] == (bwd.entry.KIND_WS if ws else bwd.entry.KIND_WIDE), plan
            assert plan.split == ws and not c["PERSISTENT"]
            assert (c["HEAD_DIM"], c["HEAD_DIM_V"], c["BLOCK_M"], c["BLOCK_N"]) == (
                192, 128, 64, 128 if ws else 64)
            assert not (c["KV_TMA_STORE"] or c["DQ_IN_OPS"] or c["HI_LATE"] or plan.dq_fragment)
            assert plan.dq_block == (64, 64)
            if det:
                assert c["RELEASE_AT"] == 1  # warp 0 alone does not issue its reduces (config)
    with pytest.raises(ValueError, match="row-major"):
        bwd.select_config(192, replace(bwd.select_config(192), dq_fragment=True))
    with pytest.raises(ValueError, match="turn_release"):
        bwd.select_config(192, replace(bwd.select_config(192), turn_release=3))
