"""arrive_all.py: the PTX pass that turns a warpgroup's marked arrive (thread 0, count 128,
after a warpgroup barrier) into an arrive by every thread, and drops the warpgroup barriers
of those partitions that order nothing. Synthetic PTX for each rule, then our kernels built
for sm_90a."""

from __future__ import annotations

import json

import pytest
from sass_report import sass_report, sm90_build

from asymflash.backends.sm90 import arrive_all, fwd

MARKED = "\t@%p7 mbarrier.arrive.shared::cta.b64 _, [%r9], 128;"
PER_THREAD = "\tmbarrier.arrive.shared::cta.b64 _, [%r9];"
WAIT_LOOP = """\t// begin inline asm
\t{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r4], %r5;
\t@!complete bra.uni waitLoop;
\t}
\t// end inline asm"""


def ptx(*body: str) -> str:
    return "\n".join([".visible .entry k()", "{", *body, "\tret;", "}"])


def arrive_after(*region: str) -> str:
    """A previous barrier, the region, the warpgroup barrier, the marked arrive."""
    return ptx("\tbar.sync \t1, 128;", *region, "\t.loc\t1 611 20", "\tbar.sync \t1, 128;",
               "\t// begin inline asm", MARKED, "\t// end inline asm")


def test_a_barrier_that_orders_nothing_goes():
    src = arrive_after("\twgmma.wait_group.sync.aligned 1;", "\tadd.s32 \t%r9, %r8, 16;",
                       WAIT_LOOP, "\tcp.async.bulk.commit_group;")
    out, n, dropped = arrive_all.rewrite_ptx(src)
    assert n == 1 and dropped == 1
    assert PER_THREAD in out and MARKED not in out
    assert out.count("bar.sync") == 1  # the previous one stays


@pytest.mark.parametrize("access", [
    "\tst.shared.v2.b32 \t[%r56+163840], {%r1, %r2};",
    "\tld.shared.f32 \t%r3, [%r56];",
    "\tstmatrix.sync.aligned.m8n8.x4.shared.b16 [%r4], {%r1, %r2, %r3, %r5};",
    "\tfence.proxy.async.shared::cta;",
    "\tcp.async.bulk.wait_group.read 0;",  # others may overwrite what the copy still reads
])
def test_a_barrier_after_data_stays(access):
    src = arrive_after("\tadd.s32 \t%r9, %r8, 16;", access)
    assert arrive_all.rewrite_ptx(src) == (src, 0, 0)


def test_unmarked_arrives_and_barriers_of_other_sizes_stay():
    single = MARKED.replace(", 128;", ";")
    src = ptx("\tbar.sync \t1, 128;", "\tbar.sync \t1, 128;", single)
    assert arrive_all.rewrite_ptx(src) == (src, 0, 0)
    cta_wide = ptx("\tbar.sync \t1, 128;", "\tbar.sync \t0;", MARKED)
    assert arrive_all.rewrite_ptx(cta_wide) == (cta_wide, 0, 0)


def _branchy(dirty_branch: bool) -> str:
    """The region reaches a label: by fall-through (clean) and by a jump from a block that
    may or may not touch shared memory."""
    side = "\tst.shared.u32 \t[%r1], %r2;" if dirty_branch else "\tadd.s32 \t%r2, %r2, 1;"
    return ptx("\tbar.sync \t1, 128;", "\t@%p1 bra \t$L__BB0_2;", "\tbar.sync \t1, 128;", side,
               "\t@%p2 bra \t$L__BB0_3;", "\tadd.s32 \t%r3, %r3, 1;",
               "$L__BB0_3:                             // in Loop",
               "\tmul.lo.s32 \t%r4, %r3, 3;", "\tbar.sync \t1, 128;", MARKED,
               "$L__BB0_2:", "\tadd.s32 \t%r5, %r5, 1;")


def test_labels_are_followed_to_every_jump():
    out, n, _ = arrive_all.rewrite_ptx(_branchy(dirty_branch=False))
    assert n == 1 and PER_THREAD in out
    assert arrive_all.rewrite_ptx(_branchy(dirty_branch=True))[1] == 0


def test_the_functions_start_is_not_a_barrier():
    src = ptx("\tadd.s32 \t%r9, %r8, 16;", "\tbar.sync \t1, 128;", MARKED)
    assert arrive_all.rewrite_ptx(src)[1:] == (0, 0)


def _loop(body: list[str]) -> str:
    """A key loop as Triton leaves it: a barrier before the K wait at the top (put there
    because the last iteration's arrive counts as touching all shared memory), the marked
    arrive with its barrier, a thread-0 arrive of another barrier with its own, and the
    back edge; partition 2 has a barrier of its own after the loop."""
    return ptx("\tbar.sync \t1, 128;", "$L__BB0_4:", "\tbar.sync \t1, 128;", WAIT_LOOP,
               *body, "\tbar.sync \t1, 128;", MARKED,
               "\tbar.sync \t1, 128;", "\t@%p7 mbarrier.arrive.shared::cta.b64 _, [%r6];",
               "\t@%p3 bra \t$L__BB0_4;", "\tbar.sync \t2, 128;", "\tadd.s32 \t%r1, %r1, 1;")


def test_register_arithmetic_between_a_barrier_and_its_arrive():
    """The arrive's predicate is often computed between the barrier and the arrive: a marked
    arrive is still found, and a thread-0 arrive still keeps its barrier."""
    setp = "\tsetp.eq.b32 \t%p7, %r12, 0;"
    src = ptx("\tbar.sync \t1, 128;", "\tadd.s32 \t%r9, %r8, 16;", "\tbar.sync \t1, 128;",
              setp, MARKED, "\tadd.s32 \t%r2, %r2, 1;", "\tbar.sync \t1, 128;", setp,
              "\t@%p7 mbarrier.arrive.shared::cta.b64 _, [%r6];")
    out, n, dropped = arrive_all.rewrite_ptx(src)
    assert n == 1 and dropped == 1 and PER_THREAD in out
    assert out.count("bar.sync") == 2  # the first and the thread-0 arrive's


def test_the_loop_top_barrier_goes_with_the_arrives_when_the_loop_touches_no_data():
    out, n, dropped = arrive_all.rewrite_ptx(_loop(["\twgmma.wait_group.sync.aligned 1;"]))
    assert n == 1 and dropped == 2  # the arrive's and the loop top's
    # kept: the one before the loop, the thread-0 arrive's, partition 2's
    assert out.count("bar.sync \t1, 128;") == 2 and out.count("bar.sync \t2, 128;") == 1
    dirty = arrive_all.rewrite_ptx(_loop(["\tld.shared.f32 \t%r3, [%r56];"]))
    assert dirty[1:] == (0, 0)


gluon = pytest.mark.skipif(fwd._GLUON_ERROR is not None, reason=str(fwd._GLUON_ERROR))


@gluon
@pytest.mark.parametrize("module,kw", [
    ("fwd", {"head_dim": 64}),
    ("bwd", {"head_dim": 128}),
], ids=["fwd-d64", "bwd-d128"])
def test_kernels_arrive_per_thread_with_fewer_barriers(module, kw):
    """Built for sm_90a with arrive_all: the pass rewrote the K/V (forward) or Q/dO and dSᵀ
    (backward) releases and dropped their barriers and those that ordered nothing, and the
    build is otherwise the default one's (tensor-core instructions, no new local memory)."""
    base = sass_report(sm90_build(module), json.dumps(kw))
    per_thread = sass_report(sm90_build(module), json.dumps({**kw, "cfg": {"arrive_all": True}}))
    assert base["arrives_per_thread"] == 0 and base["barriers_dropped"] == 0
    assert per_thread["arrives_per_thread"] >= (8 if module == "fwd" else 4)
    assert per_thread["barriers_dropped"] > per_thread["arrives_per_thread"]
    assert per_thread["bars"] == base["bars"] - per_thread["barriers_dropped"]
    assert per_thread["hgmma"] == base["hgmma"] and per_thread["local"] <= base["local"]


def test_the_switch_applies_to_every_call_unless_a_config_is_given(monkeypatch):
    """ASYMFLASH_SM90_ARRIVE_ALL=1 turns arrive_all on in the plans of calls without a
    config (forward and backward), changes nothing else in them, and keys call plans."""
    from dataclasses import replace

    from asymflash.backends.sm90 import bwd
    from asymflash.runtime import dispatch

    def fwd_plan(cfg=None):
        return fwd.launch_plan(128, 128, 2048, 2048, True, False, -1, 0, False, False, 2, 8,
                               8, 132, cfg, fwd.NO_TRICKS, cfg is None and fwd.arrive_all_switch())

    def bwd_plan(cfg=None):
        return bwd.launch_plan(128, 128, 2048, 2048, True, False, -1, 0, False, False, 2, 8,
                               132, cfg, cfg is None and fwd.arrive_all_switch())

    monkeypatch.delenv(fwd.ARRIVE_ALL_SWITCH, raising=False)
    off_f, off_b = fwd_plan(), bwd_plan()
    assert off_f.constexprs["ARRIVE"] == 1 and off_b.constexprs["ARRIVE"] == 1
    monkeypatch.setenv(fwd.ARRIVE_ALL_SWITCH, "1")
    on_f, on_b = fwd_plan(), bwd_plan()
    assert on_f.constexprs["ARRIVE"] == arrive_all.WARPGROUP == on_b.constexprs["ARRIVE"]
    assert on_f.constexprs["ARRIVE_PASS"] == arrive_all.VERSION
    assert replace(on_f.cfg, arrive_all=False) == off_f.cfg and on_f.grid == off_f.grid
    assert replace(on_b.cfg, arrive_all=False) == off_b.cfg and on_b.grid == off_b.grid
    given = fwd._DEFAULT_CONFIGS[128]
    assert not fwd_plan(cfg=given).cfg.arrive_all  # an explicit config wins
    monkeypatch.setenv(fwd.ARRIVE_ALL_SWITCH, "yes")
    with pytest.raises(ValueError, match=fwd.ARRIVE_ALL_SWITCH):
        fwd.arrive_all_switch()
    assert fwd.ARRIVE_ALL_SWITCH in dispatch.SWITCHES
