"""The sm90 Gluon forward compiles for sm_90a without a GPU: HGMMA in SASS, no local memory.

Each compile runs in a worker interpreter without TRITON_INTERPRET: conftest.py turns the
interpreter on for CPU machines, and under it Triton's standard library functions become
interpreted objects that a Gluon compile cannot call.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sass_report import Budgets, sass_report, sm90_build, within_budget

from asymflash.backends.sm90.fwd import host as fwd
from asymflash.core import schedule

pytestmark = pytest.mark.skipif(fwd.GLUON_ERROR is not None, reason=str(fwd.GLUON_ERROR))

_BUILD = sm90_build("fwd")


def compile_report(**kw) -> dict:
    return sass_report(_BUILD, json.dumps(kw))


CONFIGS = [
    {"head_dim": 64},
    {"head_dim": 128},
    {"head_dim": 256},
    {"head_dim": 128, "dtype": "float16", "has_right": True},
    {"head_dim": 128, "has_left": True, "has_right": True, "softcap": True, "has_sink": True,
         "uniform": False, "has_seqused": True},
    # packed documents in order: tiles found by searching cu_seqlens (`sched.packed_tile`)
    {"head_dim": 128, "has_right": True, "uniform": False, "cfg": {"lpt": False}},
    {"head_dim": 64, "uniform": False, "cfg": {"lpt": False}},
    {"head_dim": 256, "has_right": True, "uniform": False, "cfg": {"lpt": False}},
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_compiles_with_hgmma_and_no_spills(kw):
    rep = compile_report(**kw)
    assert rep["hgmma"] > 0
    # warp_specialize budgets: consumers at 240 registers, the TMA warp at 24.
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"]
    assert rep["shared"] <= 227 * 1024
    within_budget(rep, rep["local"], 0)


def _spills_allowed(kw) -> int:
    """Local-memory instructions a forward build may have: none, except the persistent d=256
    builds (O staged in the turn-shared tile, the tile coordinates read from the loader):
    2 seen (sm_90a), 1 of them between the first and last HGMMA; and persistent
    causal d=128 since P is packed by `_to_16bit`: one store before the tile
    loop, one load per tile, none in the key loops."""
    persistent = kw.get("cfg", {}).get("persistent")
    return 2 if persistent and (kw["head_dim"] == 256 or kw.get("has_right")) else 0


PERSISTENT_CONFIGS = [
    {"head_dim": 64, "cfg": {"persistent": True}},
    {"head_dim": 128, "has_right": True, "cfg": {"persistent": True, "lpt": True}},
    {"head_dim": 256, "cfg": {"persistent": True}},
    {"head_dim": 128, "dtype": "float16", "has_right": True, "uniform": False,
     "has_seqused": True, "cfg": {"persistent": True}},
]


@pytest.mark.parametrize("kw", PERSISTENT_CONFIGS,
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items() if k != "cfg"))
def test_persistent_compiles_with_hgmma_and_no_spills(kw):
    rep = compile_report(**kw)
    assert rep["hgmma"] > 0
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"]
    assert rep["shared"] <= 227 * 1024
    within_budget(rep, rep["local"], _spills_allowed(kw))


# A second Q buffer per warpgroup (persistent grid, d <= 128, the default there): the same
# kernel with the Q barriers and buffers indexed by the tile's parity; 224 KB of shared
# memory at d=128 (one buffer each: 192 KB), no spills (sm_90a).
@pytest.mark.parametrize("kw", [
    {"head_dim": 64, "has_right": True, "cfg": {"persistent": True, "lpt": True,
                                                "q_buffers": 2}},
    {"head_dim": 128, "cfg": {"persistent": True, "q_buffers": 2}},
    {"head_dim": 128, "dtype": "float16", "has_right": True, "uniform": False,
     "has_seqused": True, "cfg": {"persistent": True, "q_buffers": 2}},
], ids=["64-causal", "128", "128-varlen"])
def test_second_q_buffers_compile(kw):
    rep = compile_report(**kw)
    d = kw["head_dim"]
    k_v_rings = (4 if d == 64 else 2) * 2 * 128 * d * 2
    q_buffers = 2 * 2 * 64 * d * 2  # two sets of two warpgroups' 64-row Q tiles
    assert k_v_rings + q_buffers <= rep["shared"] <= 227 * 1024, rep
    assert rep["hgmma"] > 0, rep
    within_budget(rep, rep["local"], 0)


@pytest.mark.parametrize("cfg,d", [({"q_buffers": 2, "pingpong": True}, 128),
                                   ({"q_buffers": 2}, 256), ({"q_buffers": 2, "stages": 1}, 256),
                                   ({"q_buffers": 3}, 64)])
def test_second_q_buffers_refused_where_not_built(cfg, d):
    with pytest.raises(ValueError, match="q_buffers"):
        fwd.check_config(fwd.FwdConfig(persistent=True, **cfg), d)


def test_persistent_all_features_compiles():
    # Window + softcap + sink + varlen: a few values spill around the tile loop (seen: 33
    # LDL/STL, one pair inside the key loop), so the default keeps these calls on the plain
    # grid (`use_persistent`); forced, the kernel must still build.
    rep = compile_report(head_dim=128, has_left=True, has_right=True, softcap=True,
                         has_sink=True, uniform=False, has_seqused=True,
                         cfg={"persistent": True})
    assert rep["hgmma"] > 0 and rep["shared"] <= 227 * 1024


PINGPONG_CONFIGS = [  # (one Q buffer per warpgroup: the turns count from its parity)
    {"head_dim": 64, "cfg": {"pingpong": True}},
    {"head_dim": 128, "has_right": True, "cfg": {"pingpong": True, "lpt": True}},
    {"head_dim": 64, "cfg": {"pingpong": True, "persistent": True, "q_buffers": 1}},
    {"head_dim": 256, "has_right": True, "cfg": {"pingpong": True, "persistent": True,
                                                  "lpt": True}},
    # three warpgroups taking turns round robin (FA4's d=64 forward)
    {"head_dim": 64, "cfg": {"pingpong": True, "persistent": True, "q_buffers": 1,
                             "consumer_wgs": 3}},
]


@pytest.mark.parametrize("kw", PINGPONG_CONFIGS,
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_pingpong_compiles_with_turn_barriers(kw):
    # On by default with three warpgroups only (two measured neutral): it must build within
    # the same budgets, with the turn waits and arrives (mbarrier SYNCS instructions) on top
    # of the plain build's.
    rep = compile_report(**kw)
    plain_cfg = {k: v for k, v in kw["cfg"].items() if k != "pingpong"}
    plain = compile_report(**{k: v for k, v in kw.items() if k != "cfg"}, cfg=plain_cfg)
    assert rep["syncs"] > plain["syncs"], "no turn barriers in the ping-pong build"
    assert rep["hgmma"] > 0
    consumer_regs = 160 if kw["cfg"].get("consumer_wgs") == 3 else 240
    assert consumer_regs in rep["maxnreg"] and 24 in rep["maxnreg"], rep
    assert rep["shared"] <= 227 * 1024
    within_budget(rep, rep["local"], _spills_allowed(kw))


# ptxas serialises every wgmma of a kernel (warning C7511) when one is left in flight across
# a branch or past the kernel's end: the default causal build must keep them asynchronous.
def test_default_build_keeps_wgmmas_asynchronous():
    rep = sass_report(_BUILD, json.dumps({"head_dim": 128, "has_right": True}), ptxas=True)
    assert rep["wgmma_serialized"] is False, "ptxas serialised the wgmmas"


# Three consumer warpgroups (192-row tiles, d=64, persistent grid only): 160 registers
# each. A causal build spills 2-3 values around the peeled first block's mask (14 LDL/STL
# over three roles, none in the key loops): allowed up to 16.
@pytest.mark.parametrize("kw,max_local", [
    ({"head_dim": 64, "cfg": {"consumer_wgs": 3, "persistent": True}}, 0),
    ({"head_dim": 64, "has_right": True, "cfg": {"consumer_wgs": 3, "persistent": True,
                                                 "lpt": True}}, 16),
], ids=["noncausal", "causal"])
def test_three_consumer_warpgroups_compile(kw, max_local):
    rep = compile_report(**kw)
    assert rep["hgmma"] > 0
    assert 160 in rep["maxnreg"] and 24 in rep["maxnreg"]
    assert rep["shared"] <= 227 * 1024
    within_budget(rep, rep["local"], max_local)


# Head dims between the widths (96, 192/128, ...) read q, k, v through (rows, heads, dim)
# descriptors whose box zero-fills the missing columns: the same kernel with 3-D TMA loads.
@pytest.mark.parametrize("kw", [
    {"head_dim": 128, "heads_axis": True, "has_right": True},
    {"head_dim": 256, "heads_axis": True, "has_sink": True},
    {"head_dim": 128, "heads_axis": True, "uniform": False, "has_seqused": True},
    {"head_dim": 256, "head_dim_v": 128, "heads_axis": True, "has_right": True},
], ids=["128-causal", "256-sink", "128-varlen", "256-128-causal"])
def test_heads_axis_descriptors_compile(kw):
    rep = compile_report(**kw)
    assert rep["tma_load_3d"] >= 3, rep  # Q, K and V each through a 3-D box
    assert rep["hgmma"] > 0, rep
    assert compile_report(head_dim=kw["head_dim"])["tma_load_3d"] == 0
    within_budget(rep, rep["local"], 0)


@pytest.mark.parametrize("kw", [
    {"head_dim": 128, "has_right": True, "cfg": {"persistent": True, "lpt": True}},
    # (three warpgroups taking turns, one Q buffer each, as `launch_plan` builds them)
    {"head_dim": 64, "cfg": {"persistent": True, "consumer_wgs": 3, "q_buffers": 1,
                             "pingpong": True}},
    {"head_dim": 256},  # staged in Q's buffer
    {"head_dim": 256, "has_right": True, "cfg": {"persistent": True, "lpt": True}},
])
def test_output_leaves_through_a_tma_store(kw):
    # Sequences that fill whole 64-row tiles store O from shared memory by TMA; the others
    # (tma_store=False: `output_box_width`) keep the masked per-thread stores. Neither spills
    # (beyond the persistent d=256 allowance).
    rep = compile_report(**kw)
    assert rep["tma_store"] >= 1, rep
    masked = compile_report(**kw, tma_store=False)
    assert masked["tma_store"] == 0, masked
    Budgets(rep).check(rep["local"], _spills_allowed(kw)).check(
        masked["local"], _spills_allowed(kw), "masked stores' local-memory instructions").verdict()


def test_forward_widths_keep_a_narrow_v_narrow():
    from asymflash.backends.sm90.common import forward_widths

    # DeepSeek: V not padded to 256, q·k up to 192 on the 192 build (in pieces)
    assert forward_widths(192, 128) == (192, 128) and forward_widths(160, 96) == (192, 128)
    assert forward_widths(256, 128) == (256, 128) and forward_widths(200, 128) == (256, 128)
    assert forward_widths(96, 96) == (128, 128) and forward_widths(128, 64) == (128, 128)
    assert forward_widths(160, 160) == (256, 256) and forward_widths(200, 136) == (256, 256)
    assert forward_widths(64, 64) == (64, 64) and forward_widths(40, 40) is None


def test_kernel_head_dim_pads_to_the_next_compiled_width():
    from asymflash.backends.sm90.common import kernel_head_dim

    assert [kernel_head_dim(d, d) for d in (64, 128, 256)] == [64, 128, 256]
    assert kernel_head_dim(96, 96) == 128 and kernel_head_dim(72, 72) == 128
    assert kernel_head_dim(192, 128) == 256 and kernel_head_dim(128, 64) == 128
    assert kernel_head_dim(160, 160) == 256 and kernel_head_dim(64, 128) == 128
    # up to 64 only 64/64 itself (padding 32 to 64 would waste half the MMA); past 256 none
    assert kernel_head_dim(32, 32) is None and kernel_head_dim(40, 24) is None
    assert kernel_head_dim(64, 32) is None and kernel_head_dim(264, 264) is None


def test_three_consumer_warpgroups_default_only_where_measured_faster():
    from asymflash.backends.sm90.fwd.config import use_three_warpgroups

    assert use_three_warpgroups(64, False, 2048, True, True)
    assert use_three_warpgroups(64, False, 16384, True, True)
    assert use_three_warpgroups(64, True, 16384, True, True)  # causal: from 8k rows
    assert use_three_warpgroups(64, True, 8192, True, True)
    assert not use_three_warpgroups(64, True, 4096, True, True)  # causal, shorter: slower
    assert not use_three_warpgroups(64, False, 512, True, True)  # short: slower
    assert not use_three_warpgroups(128, False, 16384, True, True)  # not built
    assert not use_three_warpgroups(64, False, 16384, False, True)  # varlen: plain grid
    assert not use_three_warpgroups(64, False, 16384, True, False)  # softcap/sink/left


def test_short_masked_calls_stop_each_warpgroup_at_its_last_block():
    from asymflash.backends.sm90.fwd.config import _DEFAULT_CONFIGS, default_for_call

    def cfg(d, rows, masked=True, dense=True, plain=True):
        return default_for_call(d, masked, masked, rows, dense, plain)

    assert cfg(64, 512).tail_skip and cfg(64, 512).block_n == 64
    assert cfg(128, 512).tail_skip and cfg(128, 512).block_n == 64
    assert cfg(256, 1024).tail_skip and cfg(256, 1024).block_n == 64
    # measured slower or not measured: longer, unmasked, varlen, softcap/sink/left, d=64
    for d, c in ((128, cfg(128, 1024)), (256, cfg(256, 2048)), (128, cfg(128, 512, False)),
                 (256, cfg(256, 512, dense=False)), (128, cfg(128, 512, plain=False)),
                 (64, cfg(64, 1024))):
        assert not c.tail_skip and c.block_n == _DEFAULT_CONFIGS[d].block_n, (d, c)
    assert cfg(64, 16384).consumer_wgs == 3


# The skip's builds: wgmmas still asynchronous (its release loop holds no wgmma), no spills
# in the plain-grid builds; the persistent d=256 one keeps ~6 scalars of the tile loop in
# local memory (23 LDL/STL, 2 without the skip; none in the key loop's body).
@pytest.mark.parametrize("kw,max_local", [
    ({"head_dim": 256, "has_right": True, "cfg": {"tail_skip": True}}, 0),
    ({"head_dim": 256, "has_right": True, "cfg": {"tail_skip": True, "persistent": True,
                                                   "lpt": True}}, 24),
    ({"head_dim": 128, "has_right": True, "cfg": {"tail_skip": True, "block_n": 64,
                                                   "stages": 3, "persistent": True,
                                                   "lpt": True}}, 0),
    ({"head_dim": 64, "has_right": True, "cfg": {"tail_skip": True, "block_n": 64,
                                                  "persistent": True, "lpt": True}}, 0),
], ids=["256", "256-persistent", "128-64-key-blocks", "64-64-key-blocks"])
def test_tail_skip_compiles(kw, max_local):
    rep = sass_report(_BUILD, json.dumps(kw), ptxas=True)
    assert rep["hgmma"] > 0, rep
    assert rep["wgmma_serialized"] is False, "ptxas serialised the wgmmas"
    within_budget(rep, rep["local"], max_local)


def test_three_consumer_warpgroups_refused_where_not_built():
    from dataclasses import replace

    from asymflash.backends.sm90.fwd import host as fwd

    base = fwd._DEFAULT_CONFIGS[64]
    for cfg, d in ((replace(base, consumer_wgs=3, persistent=False), 64),
                   (replace(fwd._DEFAULT_CONFIGS[128], consumer_wgs=3), 128),
                   (replace(base, consumer_wgs=4), 64)):
        with pytest.raises(ValueError, match="consumer_wgs"):
            fwd.check_config(cfg, d)
    fwd.check_config(replace(base, consumer_wgs=3), 64)


@pytest.mark.parametrize("emu,thr", [(4, 0.0), (8, 8.0)])
def test_fa4_switches_compile(emu, thr):
    rep = compile_report(head_dim=64, cfg={"exp2_emu_every": emu, "rescale_threshold": thr})
    assert rep["hgmma"] > 0
    # Part of the exponentials left MUFU for the FMA pipe.
    assert rep["mufu_ex2"] < compile_report(head_dim=64)["mufu_ex2"]
    within_budget(rep, rep["local"], 0)


def test_packed_documents_take_tiles_in_order():
    """Causal packed documents (uniform=False) walk tiles head by head in order; dense
    causal calls keep the longest-first order (docs/tuning.md: varlen-probe)."""
    def plan(uniform, d=128):
        return fwd.launch_plan(d, d, 8192, 8192, uniform, False, -1, 0, False, False, 34,
                               32, 8, 132, None)

    for d in (64, 128, 256):
        assert plan(False, d).constexprs["LPT"] is False, d
        assert not plan(False, d).cfg.persistent
        assert plan(True, d).constexprs["LPT"] is True, d


def test_fa4_switches_apply_to_every_call_unless_a_config_is_given(monkeypatch):
    from dataclasses import replace

    def plan(cfg=None, d=64, seqlen=2048):
        tricks = fwd.NO_TRICKS if cfg is not None else fwd.fa4_tricks()
        return fwd.launch_plan(d, d, seqlen, seqlen, True, False, -1, 0, False, False, 2, 8,
                               8, 132, cfg, tricks)

    monkeypatch.delenv(fwd.EXP2_EMU_SWITCH, raising=False)
    monkeypatch.delenv(fwd.RESCALE_SWITCH, raising=False)
    assert fwd.fa4_tricks() == (None, None)
    off = {d: plan(d=d) for d in (64, 128, 256)}
    # unset switches leave each head dim's default: the conditional rescale only at d=256
    assert [off[d].constexprs["RESCALE_THRESHOLD"] for d in (64, 128, 256)] == [0.0, 0.0, 8.0]
    assert all(off[d].constexprs["EMU_EVERY"] == 0 for d in off)
    monkeypatch.setenv(fwd.EXP2_EMU_SWITCH, "8")
    monkeypatch.setenv(fwd.RESCALE_SWITCH, "8")
    for d in (64, 128, 256):
        p = plan(d=d)
        assert (p.cfg.exp2_emu_every, p.cfg.rescale_threshold) == (8, 8.0)
        assert p.constexprs["EMU_EVERY"] == 8 and p.constexprs["RESCALE_THRESHOLD"] == 8.0
        # the plan's other choices are those of the same call without the switches
        assert replace(p.cfg, exp2_emu_every=0,
                       rescale_threshold=off[d].cfg.rescale_threshold) == off[d].cfg
        assert p.grid == off[d].grid
    # one switch alone leaves the other trick at the config's value; "0" turns a trick off
    monkeypatch.delenv(fwd.EXP2_EMU_SWITCH)
    monkeypatch.setenv(fwd.RESCALE_SWITCH, "0")
    assert fwd.fa4_tricks() == (None, 0.0)
    assert plan(d=256).cfg == replace(off[256].cfg, rescale_threshold=0.0)
    monkeypatch.setenv(fwd.EXP2_EMU_SWITCH, "4")
    monkeypatch.delenv(fwd.RESCALE_SWITCH)
    assert plan(d=256).cfg == replace(off[256].cfg, exp2_emu_every=4)
    given = fwd._DEFAULT_CONFIGS[64]
    assert plan(cfg=given).cfg.exp2_emu_every == 0  # an explicit config wins
    for name, value in ((fwd.EXP2_EMU_SWITCH, "3"), (fwd.EXP2_EMU_SWITCH, "on"),
                        (fwd.RESCALE_SWITCH, "-1"), (fwd.RESCALE_SWITCH, "inf")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            fwd.fa4_tricks()
        monkeypatch.setenv(name, "8")
    from asymflash.runtime import env
    assert {fwd.EXP2_EMU_SWITCH, fwd.RESCALE_SWITCH} <= set(env.PER_CALL)


def test_conditional_rescale_skips_by_warp_vote():
    # d=256's default: O's multiply (130 of the key loop's 416 instructions, sm_90a) behind a
    # warp-uniform branch decided by a vote, no shared-memory reduction, wgmmas asynchronous.
    rep = sass_report(_BUILD, json.dumps({"head_dim": 256}), ptxas=True)
    assert rep["vote_any"] >= 1, rep
    assert rep["wgmma_serialized"] is False, rep
    assert compile_report(head_dim=256, cfg={"rescale_threshold": 0.0})["vote_any"] == 0
    within_budget(rep, rep["local"], 0)


def test_unsupported_reports_reason_on_cpu():
    import torch

    from asymflash.core.params import AttnParams, SeqInfo

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, 8, 8, "cpu")
    why = fwd.unsupported(q, q, q, seq, AttnParams(0.125), None)
    assert isinstance(why, str) and why


def _static_schedule_loads(costs, n_hb, grid, hb_chunk):
    """Work per CTA of the persistent grid, tile by tile as the kernel walks them (the
    loops of `_wave_tile` and `_tile_of` written out again, independently of fwd_config)."""
    nmb = len(costs)
    tiles = nmb * n_hb
    loads = [0.0] * grid
    for wave in range(-(-tiles // grid)):
        for pid in range(grid):
            tile = wave * grid + pid if wave % 2 == 0 else wave * grid + grid - 1 - pid
            if tile >= tiles:
                continue
            chunk, r = divmod(tile, hb_chunk * nmb)
            width = min(hb_chunk, n_hb - chunk * hb_chunk)
            loads[pid] += costs[nmb - 1 - r // width]
    return loads


@pytest.mark.parametrize("seqlen,block_m,block_n,n_hb,grid", [
    (16384, 192, 128, 32, 132), (1000, 128, 64, 7, 5), (4096, 128, 128, 64, 132),
    (203, 128, 64, 3, 2), (8192, 192, 128, 64, 132)])
def test_balanced_chunks_match_the_kernel_schedule(seqlen, block_m, block_n, n_hb, grid):
    # FwdConfig.balanced_chunks: the imbalance the host computes is the kernel's (loads
    # recomputed tile by tile), the tile costs are the key blocks a causal mask leaves (counted
    # from the mask itself), and the chosen chunk is the first within the tolerance.
    costs = schedule.tile_costs(seqlen, seqlen, 0, block_m, block_n)
    for m, cost in enumerate(costs):
        last_row = min((m + 1) * block_m, seqlen) - 1
        blocks = len({c // block_n for c in range(seqlen) if c <= last_row})
        assert cost == blocks + schedule.TILE_OVERHEAD_BLOCKS
    for hb in (1, 2, n_hb // 2 + 1, n_hb):
        loads = _static_schedule_loads(costs, n_hb, grid, hb)
        mean = sum(costs) * n_hb / grid
        got = schedule.schedule_imbalance(costs, n_hb, grid, hb)
        assert got == pytest.approx(max(loads) / mean)
    smallest = max(1, n_hb // 4)
    chosen = schedule.balanced_chunk(costs, n_hb, grid, smallest)
    tries = range(smallest, min(n_hb, smallest + 23) + 1)
    ratios = {hb: schedule.schedule_imbalance(costs, n_hb, grid, hb) for hb in tries}
    good = [hb for hb in tries if ratios[hb] <= schedule.BALANCE_TOLERANCE]
    assert chosen == (good[0] if good else min(tries, key=lambda hb: (ratios[hb], hb)))


def test_balanced_chunks_in_the_launch_plan():
    # d=64 causal 16k (three warpgroups): the old rule's 13 (sequence, head) pairs per chunk
    # gave the busiest CTA 1.127x the mean work; the plan now takes 10 (1.022x).
    args = dict(d=64, dv=64, max_seqlen_q=16384, max_seqlen_k=16384, uniform=True,
                has_seqused=False, window_left=-1, window_right=0, softcap=False,
                has_sink=False, batch=1, hq=32, hkv=32, sms=132)
    new = fwd.launch_plan(cfg=None, **args)
    old = fwd.launch_plan(cfg=replace(new.cfg, balanced_chunks=False, chunk_waves=8,
                                      persistent=None), **args)
    costs = schedule.tile_costs(16384, 16384, 0, 192, 128)
    assert (old.hb_chunk, new.hb_chunk) == (13, 10)
    assert schedule.schedule_imbalance(costs, 32, 132, 13) > 1.1
    assert schedule.schedule_imbalance(costs, 32, 132, 10) <= schedule.BALANCE_TOLERANCE
    # without a mask every tile does the same work: chunks by L2 alone, as before
    plain = fwd.launch_plan(cfg=None, **dict(args, window_right=-1))
    assert not plain.cfg.lpt and plain.hb_chunk == fwd.L2_KV_BUDGET // (16384 * 128 * 2)
    # degenerate shapes plan without error: no query rows (the API returns before any
    # launch), no keys, one row
    for sq, sk in ((0, 10), (17, 0), (1, 1), (203, 113)):
        p = fwd.launch_plan(cfg=None, **dict(args, max_seqlen_q=sq, max_seqlen_k=sk, batch=3))
        assert p.grid == min(p.num_tiles, 132) and 1 <= p.hb_chunk <= 96


@pytest.mark.parametrize("d,causal,seqlen,batch", [(64, False, 512, 32), (128, True, 512, 32),
                                                   (256, True, 16384, 1), (128, False, 16384, 1),
                                                   (256, False, 16384, 1), (256, False, 2048, 8),
                                                   (64, True, 1000, 3), (64, False, 2048, 8),
                                                   (64, False, 2050, 2), (64, True, 16384, 1)])
def test_persistent_launch_plan(d, causal, seqlen, batch):
    # Host side of the persistent grid (no GPU needed): one CTA per SM at most, (sequence,
    # head) chunks within [1, all pairs], and the plain grid wherever the rule says so.
    hq = 2048 // d
    wr = 0 if causal else -1

    def plan(**kw):
        args = dict(d=d, dv=d, max_seqlen_q=seqlen, max_seqlen_k=seqlen, uniform=True,
                    has_seqused=False, window_left=-1, window_right=wr, softcap=False,
                    has_sink=False, batch=batch, hq=hq, hkv=hq, sms=132, cfg=None)
        args.update(kw)
        return fwd.launch_plan(**args)

    p = plan()
    wgs = 3 if fwd.use_three_warpgroups(d, causal, seqlen, True, True) else 2
    assert p.cfg.consumer_wgs == wgs
    assert p.num_tiles == -(-seqlen // (64 * wgs)) * hq * batch
    want = wgs == 3 or fwd.use_persistent(d, causal, seqlen, True, True)
    assert p.cfg.persistent is want and p.constexprs["PERSISTENT"] is want
    if want:
        assert p.grid == min(p.num_tiles, 132) and 1 <= p.hb_chunk <= hq * batch
    else:
        assert (p.grid, p.hb_chunk) == (p.num_tiles, 1)
    # The TMA-store epilogue wherever every 64-row tile is whole (d = 256 stages O in Q's
    # buffer, 256/128 in a buffer of its own).
    assert p.o_width == (d if seqlen % 64 == 0 else 32)
    # Two Q buffers per warpgroup on the persistent grid at d <= 128, except three
    # warpgroups, which take turns (FwdConfig.pingpong: one Q buffer each).
    q_bufs = 2 if want and d <= 128 and wgs == 2 else 1
    assert p.constexprs["Q_BUFS"] == q_bufs
    assert p.constexprs["PINGPONG"] == (3 if wgs == 3 else 0)
    # Short causal calls: each warpgroup stops at its own last key block (fwd.SHORT_MASKED)
    short = causal and seqlen <= fwd.SHORT_MASKED[d][0]
    assert p.constexprs["TAIL_SKIP"] is short and (p.cfg.block_n == 64) is (short or d == 256)
    assert fwd.output_box_width(256, 128) == 128 and fwd.output_box_width(128, 256) == 32
    # Ragged batches, softcap, sinks or a left window always take the plain grid.
    for kw in ({"uniform": False}, {"softcap": True}, {"has_sink": True},
               {"window_left": 100}):
        p = plan(**kw)
        assert p.cfg.persistent is False and p.grid == p.num_tiles, kw
        assert p.cfg.consumer_wgs == 2
    assert plan(uniform=False).o_width == 32


# d_qk 192 / d_v 128 (DeepSeek-V3's MLA prefill): its own build, Q and K as a 128- and a
# 64-wide piece (FwdConsts.PIECES, 64-column TMA boxes), against the 256/128 build it
# replaces (and which zero-filled columns 192-255).
D192 = {"head_dim": 192, "head_dim_v": 128}


def test_d192_build_runs_no_mma_on_zero_columns():
    # On the same tile (64-key blocks, causal, 3-D boxes) each S = Q·Kᵀ is 12 HGMMA K-steps
    # (8 over the 128-wide piece, 4 over the 64-wide one) where 256/128 issued 16; P·V the
    # same. 7 issue sites of each (two warpgroups' code): S 84 vs 112, P·V 28 both; MMA work
    # sum(N x count) 8960 vs 10752 (5/6: 192 + 128 against 256 + 128 columns per key).
    kw = {"has_right": True, "heads_axis": True, "cfg": {"block_n": 64, "stages": 2}}
    rep = compile_report(**D192, **kw)
    ref = compile_report(head_dim=256, head_dim_v=128, **kw)
    assert rep["hgmma_shapes"] == {"64x64x16": 84, "64x128x16": 28}, rep
    assert ref["hgmma_shapes"] == {"64x64x16": 112, "64x128x16": 28}, ref

    def work(r):
        return sum(int(k.split("x")[1]) * v for k, v in r["hgmma_shapes"].items())

    assert (work(rep), work(ref)) == (8960, 10752)
    # the pieces take less shared memory than the zero columns did (Q 48 KB, K 24 KB a stage)
    assert rep["shared"] < ref["shared"] - 60 * 1024, (rep["shared"], ref["shared"])
    assert rep["tma_load_3d"] >= 3 and rep["local"] == 0, rep


def test_d192_default_build():
    # The default tile: 128-key blocks, 2 stages; every HGMMA 64x128x16 (S 12 K-steps, P·V 8,
    # at 7 issue sites: 140), i.e. MMA work 17920 for 128 keys where 256/128 did 10752 for
    # 64. wgmmas asynchronous (ptxas's verdict), no local memory, the warp_specialize
    # budgets; Q 48 KB + K 96 KB + V 64 KB with O staged in Q's 128-wide piece.
    rep = sass_report(_BUILD, json.dumps({**D192, "has_right": True}), ptxas=True)
    assert rep["hgmma_shapes"] == {"64x128x16": 140}, rep
    assert rep["wgmma_serialized"] is False, "ptxas serialised the wgmmas"
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"], rep
    assert 208 * 1024 <= rep["shared"] <= 209 * 1024, rep
    assert rep["tma_store"] >= 1, rep  # O staged in Q's buffer, stored by TMA
    within_budget(rep, rep["local"], 0)


# The 192 build across the kernel's features, and the budgets seen (sm_90a): none but on
# the persistent grid, which keeps a few values of the tile loop in local memory (4 / 2
# LDL+STL, none in the key loops; 12 with the tail skip, as d=256's 24), and in the 224 KB
# of its turn-shared O tile.
D192_VARIANTS = [
    ({"has_right": True, "heads_axis": True}, 0),
    ({"uniform": False, "has_seqused": True, "has_sink": True, "dtype": "float16"}, 0),
    ({"has_left": True, "has_right": True}, 0),
    ({"tma_store": False, "uniform": False}, 0),
    # softcap takes 64-key blocks (fwd.SOFTCAP_FIELDS: 128-key ones spill 4, 10 with a
    # window, sink and varlen)
    ({"softcap": True, "has_left": True, "has_right": True, "has_sink": True,
      "uniform": False, "has_seqused": True, "cfg": {"block_n": 64, "stages": 3}}, 0),
    ({"has_right": True, "cfg": {"pingpong": True, "lpt": True}}, 0),
    ({"has_right": True, "cfg": {"block_n": 64, "stages": 3, "tail_skip": True}}, 0),
    ({"cfg": {"persistent": True}}, 4),
    ({"has_right": True, "cfg": {"persistent": True, "lpt": True}}, 2),
    ({"has_right": True, "cfg": {"persistent": True, "lpt": True, "pingpong": True}}, 2),
    ({"has_right": True, "uniform": False, "has_seqused": True, "cfg": {"persistent": True}},
     0),
    ({"has_right": True, "cfg": {"block_n": 64, "stages": 3, "tail_skip": True,
                                 "persistent": True, "lpt": True}}, 12),
]


@pytest.mark.parametrize("kw,max_local", D192_VARIANTS,
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_d192_variants_compile(kw, max_local):
    rep = compile_report(**D192, **kw)
    cfg = kw.get("cfg", {})
    n = cfg.get("block_n", 128)
    # S at N = block_n, P·V at N = 128
    assert set(rep["hgmma_shapes"]) == {f"64x{n}x16", "64x128x16"}, rep
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"], rep
    persistent = cfg.get("persistent", False)
    assert rep["shared"] <= (224 if persistent else 208) * 1024 + 1024, rep
    assert rep["tma_store"] >= (0 if kw.get("tma_store") is False else 1), rep
    assert rep["local_in_step_loops"] == 0, rep
    within_budget(rep, rep["local"], max_local)


def test_d192_routing():
    """Which build and config a 192/128 call's forward takes (`forward_widths`,
    `launch_plan`), and the configs the build refuses."""
    from asymflash.backends.sm90.common import piece_cols

    assert piece_cols(192) == 64 and piece_cols(128) == 128 and piece_cols(256) == 256
    assert fwd.forward_widths(136, 64) == (192, 128) and fwd.forward_widths(190, 126) == (
        192, 128)
    assert fwd.forward_widths(192, 192) == (256, 256)  # V wider than 128: 256/256

    def plan(seqlen=4096, wr=-1, softcap=False, uniform=True, sink=False):
        return fwd.launch_plan(192, 128, seqlen, seqlen, uniform, False, -1, wr, softcap,
                               sink, 2, 128, 128, 132, None)

    for kw, block_n, persistent, tail_skip in (
            (dict(), 128, False, False),
            (dict(seqlen=16384), 128, True, False),  # unmasked from 16k: as d=256
            (dict(wr=0), 128, True, False),  # MLA prefill (causal 4k): persistent, LPT
            (dict(wr=0, seqlen=1024), 64, True, True),  # short causal: as d=256
            (dict(wr=0, softcap=True), 64, False, False),
            (dict(softcap=True, uniform=False), 64, False, False),
            (dict(sink=True), 128, False, False)):
        p = plan(**kw)
        c = p.constexprs
        assert (c["HEAD_DIM"], c["HEAD_DIM_V"], c["BLOCK_N"]) == (192, 128, block_n), kw
        assert c["STAGES"] == (2 if block_n == 128 else 3), kw
        assert bool(c["PERSISTENT"]) is persistent and c["TAIL_SKIP"] is tail_skip, kw
        assert c["Q_BUFS"] == 1 and c["NUM_WG"] == 2, kw  # no room for a second Q buffer
    assert plan().o_width == 128 and plan(seqlen=4000).o_width == 32
    base = fwd._DEFAULT_CONFIGS[192]
    with pytest.raises(ValueError, match="q_buffers"):
        fwd.check_config(replace(base, persistent=True, q_buffers=2), 192)
    with pytest.raises(ValueError, match="256 keys"):
        fwd.check_config(replace(base, stages=3), 192)
    with pytest.raises(ValueError, match="consumer_wgs"):
        fwd.check_config(replace(base, consumer_wgs=3, persistent=True), 192)
    fwd.check_config(replace(base, block_n=64, stages=4, persistent=True), 192)


# The fp8 forward (e4m3 q, k and Vᵀ, `host.forward_fp8`): every wgmma an e4m3 one (SASS
# QGMMA...E4M3.E4M3), within the same register budgets, no local memory; P becomes the
# e4m3 A operand in registers: its key loops hold no byte permutes (PRMT), no shuffles
# across lanes other than the row max / sum butterflies, no shared-memory loads or stores,
# and one fp16 -> e4m3 conversion per two elements of P (`epilogue.p_operand_fp8`).
FP8_CONFIGS = [
    {"head_dim": 128},
    {"head_dim": 128, "has_right": True},
    {"head_dim": 128, "has_left": True, "has_right": True},
    {"head_dim": 128, "cfg": {"persistent": True, "q_buffers": 2}},
    {"head_dim": 128, "has_right": True, "cfg": {"persistent": True, "lpt": True}},
    {"head_dim": 128, "has_right": True, "cfg": {"block_n": 64, "stages": 3, "tail_skip": True,
                                                 "persistent": True, "lpt": True}},
    {"head_dim": 64},
    {"head_dim": 64, "has_right": True, "cfg": {"persistent": True, "lpt": True}},
    # d=256: 64-key blocks, O staged in a tile of its own (`epilogue.o_staging`)
    {"head_dim": 256, "cfg": {"block_n": 64}},
    {"head_dim": 256, "has_right": True, "cfg": {"block_n": 64}},
]


@pytest.mark.parametrize("kw", FP8_CONFIGS,
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_fp8_compiles_to_e4m3_wgmma_without_data_movement(kw):
    rep = compile_report(dtype="float8_e4m3fn", **kw)
    assert rep["qgmma_e4m3"] > 0 and rep["hgmma"] == 0, rep
    assert 240 in rep["maxnreg"] and 24 in rep["maxnreg"], rep
    assert rep["shared"] <= 227 * 1024
    ops = rep["step_ops"]
    assert rep["step_loops"] > 0 and all(op.startswith("QGMMA") or "GMMA" not in op
                                         for op in ops), ops
    moved = {op: n for op, n in ops.items()
             if op.split(".")[0] in ("PRMT", "LDS", "STS", "LDSM", "STSM")
             or op.startswith("SHFL.IDX")}
    assert not moved, moved
    # per key block: the P operand's conversions, 1 per 2 elements of a 64 x BLOCK_N tile
    # per 128 threads, and as many fp32 -> fp16x2 packs
    block_n = kw.get("cfg", {}).get("block_n", 128)
    per_step = 64 * block_n // 128 // 2
    cvt = ops.get("F2FP.SATFINITE.E4M3.F16.UNPACK_B_MERGE_C", 0)
    assert cvt > 0 and cvt % per_step == 0, ops
    assert ops.get("F2FP.F16.F32.PACK_AB", 0) == cvt, ops
    within_budget(rep, rep["local"], 0)


def test_fp8_three_warpgroups_compile_but_are_not_planned():
    # Three warpgroups taking turns (d=64's long-sequence plan at 16 bits, 160 registers
    # each) build for fp8 too, but keep values in local memory inside the key loops (6
    # local-memory instructions, 4 of them in the key loops, sm_90a): fp8 plans two.
    rep = compile_report(dtype="float8_e4m3fn", head_dim=64,
                         cfg={"persistent": True, "consumer_wgs": 3, "q_buffers": 1,
                              "pingpong": True})
    assert rep["qgmma_e4m3"] > 0 and 160 in rep["maxnreg"], rep
    Budgets(rep).check(rep["local"], 6).check(
        rep["local_in_step_loops"], 4, "local-memory instructions in the key loops").verdict()
    plan = fwd.launch_plan(64, 64, 16384, 16384, True, False, -1, -1, False, False, 2, 16, 16,
                           132, None, fwd.NO_TRICKS, True)
    assert plan.cfg.consumer_wgs == 2, plan.cfg


def test_fp8_build_keeps_wgmmas_asynchronous():
    # The e4m3 P operand is no dependency of the P·V wait (`kernel._wait_pv`): ptxas must
    # keep its registers itself, without serialising the wgmmas.
    rep = sass_report(_BUILD, json.dumps({"head_dim": 128, "dtype": "float8_e4m3fn",
                                          "has_right": True}), ptxas=True)
    assert rep["wgmma_serialized"] is False, "ptxas serialised the fp8 wgmmas"


def test_fp8_configs_refused_where_not_built():
    with pytest.raises(ValueError, match="head dims"):
        fwd.check_config(fwd.FwdConfig(), 96, fp8=True)
    with pytest.raises(ValueError, match="rescale_threshold"):
        fwd.check_config(fwd.FwdConfig(rescale_threshold=8.0), 128, fp8=True)
    plan = fwd.launch_plan(128, 128, 16384, 16384, True, False, -1, -1, False, False, 2, 16,
                           16, 132, None, fwd.NO_TRICKS, True)
    assert plan.constexprs["FP8"] and plan.constexprs["RESCALE_THRESHOLD"] == 0.0
