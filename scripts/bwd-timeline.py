"""Where a backward step's time goes: SM clock stamps inside the sm90 Gluon backward (d=64/128).

A copy of `backends/sm90/bwd.py` is patched at run time (the kernel in the package is never
changed), and its kernel runs every cell (BwdConfig.split_warpgroups off: d=128 calls would
otherwise run bwd_ws.py's warp-specialised kernel, which this script does not stamp): CTAs 0-7 (linear id x + X·(y + Y·z) of the (key block, kv head, batch) grid, i.e. the
first eight launched) stamp `%clock` (the low 32 bits of the `%clock64` counter: one register,
CS2R.32) at nine points of each of their first 16 steps of the `for it in range(n_steps)` loop
(one step = one query block of one q head):

    0 step start      1 Q/dO arrived (ready wait)   2 Sᵀ retired (S wait)
    3 Pᵀ formed (probabilities)   4 dPᵀ retired (dP / dV wait)
    5 dSᵀ stored (dK issued unless dk_late), fence: just before the step's tma.store_wait and first
      thread_barrier (not between the two: triton lowers tma.store_wait with a bar.sync of
      its own, which merges with the barrier right behind it unless a stamp sits there)
    6 after that barrier          7 dQ retired (and dK, unless BwdConfig.dk_late)
    8 step end (dQ staged, second barrier, TMA reduce-add issued; or the atomics)

at int32 index (cta·16 + it)·9 + k, and once per CTA, at 8·16·9 + cta·9 + k:

    0 body start (after key_block)   1 loop start (K/V arrived)   2 loop end
    3 after store_key_grads (dK/dV written)   4 n_steps + 1 (0: the CTA stamped nothing)

The buffer is passed as `sem_ptr`, which non-deterministic calls never read (the host passes
`_unused_semaphore` there); deterministic builds are left unstamped. Every thread reads the
clock, but triton issues a scalar store from thread 0 only: the stamps are warp 0's
(warpgroup 0). Each store is predicated (no branch between an MMA's issue and its wait), and
the CTA id is re-read by volatile asm at each stamp, so nothing extra stays live in the loop.
ptxas may still move arithmetic across a clock read: a phase is where warp 0 saw it, not a
hard boundary. The stamps cost registers at the 255 limit: `--compile` prints the plain and
stamped builds side by side (at this writing, local-memory instructions in the main loop's
body d=128 1 -> 2, d=64 0 -> 1; in all 4 -> 12 and 0 -> 8; barriers unchanged, no wgmma
serialisation).

It prints, per phase, the median cycles over the stamped steps, the step total (one step's
start to the next's), the prologue (body start -> loop start), the loop's mean cycles per
step (all steps, stamped or not), the epilogue (loop end -> after store_key_grads), and the
backward's time with and without the stamps (the whole call by do_bench, and the kernel alone
by the profiler).

    PYTHONPATH=. python scripts/bwd-timeline.py            # H200: five cells
    PYTHONPATH=. python scripts/bwd-timeline.py --first-cta 1000   # a later wave's CTAs
                                                           # (CTAs 0-7 all start at once)
    PYTHONPATH=. python scripts/bwd-timeline.py --compile  # CPU: the patched kernel builds (sm_90a)
    PYTHONPATH=. python scripts/bwd-timeline.py --ws       # bwd_ws.py's kernel, per warpgroup
                                                           # (--ws --compile: its builds)
"""

# ruff: noqa: E501, B023
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_common  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "asymflash" / "backends" / "sm90" / "bwd" / "kernel.py"
NSLOTS = 9  # stamps per step (and per CTA row)
NCTA, NSTEP = 8, 16
CTA_AREA = NCTA * NSTEP * NSLOTS  # per-CTA stamps start here
TIMELINE_WORDS = CTA_AREA + NCTA * NSLOTS

# Linear CTA id, read anew at each stamp (volatile asm: not merged with key_block's reads,
# nothing derived from it kept live through the loop).
# Minus FIRST_CTA (--first-cta, a later wave's CTAs): negative ids stamp nothing.
_CTA_ASM = ("{{ .reg .u32 x, y, z, nx, ny; mov.u32 x, %ctaid.x; mov.u32 y, %ctaid.y; "
            "mov.u32 z, %ctaid.z; mov.u32 nx, %nctaid.x; mov.u32 ny, %nctaid.y; "
            "mad.lo.u32 y, z, ny, y; mad.lo.u32 x, y, nx, x; sub.u32 $0, x, {first}; }}")

# The CTA id and clock readers, inserted into either kernel copy (`cta_asm`: _CTA_ASM).
READERS = '''
    @gluon.jit
    def _tl_cta(x):
        return gl.inline_asm_elementwise("{cta_asm}", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _tl_clock(x):
        # %clock: the low 32 bits of %clock64's counter, one register (CS2R.32 SR_CLOCKLO)
        return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)
'''

STAMP = READERS + '''
    @gluon.jit
    def _tl_step(base, it, k: gl.constexpr, DETERMINISTIC: gl.constexpr):
        # stamp k of step `it` ({NCTA} CTAs from --first-cta, steps below {NSTEP})
        if not DETERMINISTIC:
            cta = _tl_cta(it)
            t = _tl_clock(it)
            gl.store(base + (cta * {NSTEP} + it) * {NSLOTS} + k, t,
                     mask=(cta >= 0) & (cta < {NCTA}) & (it < {NSTEP}))

    @gluon.jit
    def _tl_cta_value(base, value, k: gl.constexpr, DETERMINISTIC: gl.constexpr):
        if not DETERMINISTIC:
            cta = _tl_cta(value)
            gl.store(base + {CTA_AREA} + cta * {NSLOTS} + k, value,
                     mask=(cta >= 0) & (cta < {NCTA}))

    @gluon.jit
    def _tl_cta_stamp(base, x, k: gl.constexpr, DETERMINISTIC: gl.constexpr):
        # per-CTA stamp k (x: any int32 operand, orders the clock read after it)
        if not DETERMINISTIC:
            _tl_cta_value(base, _tl_clock(x), k, DETERMINISTIC)
'''


def _step(k: int, indent: int = 16) -> str:
    return " " * indent + f"_tl_step(sem_ptr, it, {k}, DETERMINISTIC)\n"


def _cta(x: str, k: int, indent: int = 12) -> str:
    return " " * indent + f"_tl_cta_stamp(sem_ptr, {x}, {k}, DETERMINISTIC)\n"


def stamp_source(first_cta: int) -> str:
    return STAMP.format(cta_asm=_CTA_ASM.format(first=first_cta), NCTA=NCTA, NSTEP=NSTEP,
                        NSLOTS=NSLOTS, CTA_AREA=CTA_AREA)


# (old, new, count): exact edits of bwd.py's text; the stamp helpers go in first (`edits`)
EDITS = [
    # per CTA: body start, loop start (+ n_steps), loop end, after the dK/dV epilogue
    ("        if (n0 >= 0) & (n0 < seqlen_k):\n",
     "        if (n0 >= 0) & (n0 < seqlen_k):\n" + _cta("n0", 0), 1),
    ("            mbarrier.wait(kv_bar.index(0), 0)\n\n            for it in range(n_steps):\n"
     "                slot = it % 2\n",
     "            mbarrier.wait(kv_bar.index(0), 0)\n" + _cta("n_steps", 1)
     + "            _tl_cta_value(sem_ptr, n_steps + 1, 4, DETERMINISTIC)\n"
     "\n            for it in range(n_steps):\n" + _step(0) + "                slot = it % 2\n", 1),
    ("            if DQ_TMA:\n                if DETERMINISTIC:\n                    if RELEASE_AT != 0:\n",
     _cta("seqlen_k", 2) + "            if DQ_TMA:\n                if DETERMINISTIC:\n"
     "                    if RELEASE_AT != 0:\n", 1),
    ("                            dk_layout, dv_layout)\n",
     "                            dk_layout, dv_layout)\n" + _cta("seqlen_k", 3), 1),
    # per step
    ("                mbarrier.wait(ready.index(slot), (it // 2) & 1)\n",
     "                mbarrier.wait(ready.index(slot), (it // 2) & 1)\n" + _step(1), 1),
    ("                lse2 = lse_smem.index(slot).load(col_layout)\n",
     _step(2) + "                lse2 = lse_smem.index(slot).load(col_layout)\n", 1),
    ("SOFTCAP, HAS_LEFT, HAS_RIGHT)\n                if not DP_EARLY:\n",
     "SOFTCAP, HAS_LEFT, HAS_RIGHT)\n" + _step(3) + "                if not DP_EARLY:\n", 1),
    ("                delta = delta_smem.index(slot).load(col_layout)\n",
     _step(4) + "                delta = delta_smem.index(slot).load(col_layout)\n", 1),
    ("                fence_async_shared()\n                if DQ_TMA:\n                    if DETERMINISTIC:\n"
     "                        if RELEASE_AT == 1:\n",
     "                fence_async_shared()\n" + _step(5) + "                if DQ_TMA:\n"
     "                    if DETERMINISTIC:\n                        if RELEASE_AT == 1:\n", 1),
    ("                gl.thread_barrier()\n                load_qdo(",
     "                gl.thread_barrier()\n" + _step(6) + "                load_qdo(", 1),
    # after the dQ wait (with dk_late, dK is still in flight there)
    ("\n                if DQ_TMA:\n                    # Rows past this sequence get exact zeros",
     "\n" + _step(7) + "                if DQ_TMA:\n"
     "                    # Rows past this sequence get exact zeros", 1),
    ("                h = h_next\n                m0 = m0_next\n\n",
     _step(8) + "                h = h_next\n                m0 = m0_next\n\n", 1),
    # the host passes the stamp buffer where the (unread) semaphore goes
    ("        sem = _unused_semaphore(q.device)\n", "        sem = TIMELINE\n", 1),
]


def patched_module(first_cta: int = 0):
    helpers = ("    @gluon.constexpr_function\n    def _dq_mma_layout(",
               stamp_source(first_cta) + "\n    @gluon.constexpr_function\n"
               "    def _dq_mma_layout(", 1)
    return probe_common.patched_module(SRC, [helpers, *EDITS], "bwd-timeline")


# --ws: bwd_ws.py's warp-specialised kernel (d=128's default). Each compute warpgroup stamps
# its own steps (thread 0 of its partition stores), warpgroup w at w·WS_AREA:
#   0 step start   1 Q/dO ready   2 Sᵀ retired   3 Pᵀ formed   4 dPᵀ and dV retired
#   5 dSᵀ half stored and published   6 dK issued and this warpgroup's dQ done (waited for
#   the other dSᵀ half, MMA, staged, reduce issued; warpgroup 0: the previous step's)
#   7 dK retired   8 step end (slot released)
SRC_WS = SRC.with_name("kernel_ws.py")
WS_AREA = NCTA * NSTEP * NSLOTS
WS_WORDS = 2 * WS_AREA

STAMP_WS = READERS + '''
    @gluon.jit
    def _tl_ws(base, it, k: gl.constexpr, WG: gl.constexpr):
        cta = _tl_cta(it)
        t = _tl_clock(it)
        gl.store(base + WG * {WS_AREA} + (cta * {NSTEP} + it) * {NSLOTS} + k, t,
                 mask=(cta >= 0) & (cta < {NCTA}) & (it < {NSTEP}))

'''


def _ws(k: int) -> str:
    return f"            _tl_ws(sem_ptr, it, {k}, WG)\n"


EDITS_WS = [
    # the compute partitions get the stamp buffer (the semaphore argument, unread here)
    *probe_common.WS_COMPUTE_TAKES_SEM,
    ("            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n",
     _ws(0) + "            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n" + _ws(1), 1),
    ("            lse2 = lse_smem.index(slot).load(col_layout)\n",
     _ws(2) + "            lse2 = lse_smem.index(slot).load(col_layout)\n", 1),
    ("            if not DP_EARLY:\n                dp_tok = warpgroup_mma(v_mine",
     _ws(3) + "            if not DP_EARLY:\n                dp_tok = warpgroup_mma(v_mine", 1),
    ("            delta = delta_smem.index(slot).load(col_layout)\n",
     _ws(4) + "            delta = delta_smem.index(slot).load(col_layout)\n", 1),
    ("            mbarrier.arrive(ds_ready.index(2 * ds_slot + WG), count=1)\n",
     "            mbarrier.arrive(ds_ready.index(2 * ds_slot + WG), count=1)\n" + _ws(5), 1),
    # (the stamps around the dK wait: the schedule without dv_overlap, the default)
    ("            else:\n                dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])\n",
     "            else:\n    " + _ws(6) + "                dk, ds_op = warpgroup_mma_wait(0, "
     "deps=[dk_tok, ds_op])\n" + _ws(7), 1),
    ("            mbarrier.arrive(empty.index(slot), count=ARRIVE)\n",
     "            mbarrier.arrive(empty.index(slot), count=ARRIVE)\n" + _ws(8), 1),
]


def patched_ws_module(first_cta: int = 0):
    helpers = ("    @gluon.jit\n    def _ws_loader(",
               STAMP_WS.format(cta_asm=_CTA_ASM.format(first=first_cta), NCTA=NCTA,
                               NSTEP=NSTEP, NSLOTS=NSLOTS, WS_AREA=WS_AREA)
               + "    @gluon.jit\n    def _ws_loader(", 1)
    return probe_common.patched_module(SRC_WS, [helpers, *EDITS_WS], "bwd-timeline-ws")


WS_NAMES = ["Q/dO ready wait", "S wait", "exponentials", "dP + dV wait", "dS store, publish",
            "dK issue + dQ", "dK wait", "release"]


def report_ws(stamps: torch.Tensor, label: str):
    """Per warpgroup: median cycles of each phase and of a whole step (start to the next
    step's start) over the stamped steps."""
    raw = stamps.cpu().to(torch.int64).reshape(2, NCTA, NSTEP, NSLOTS)
    print(f"== {label}")
    for wg in range(2):
        phases, totals = [[] for _ in WS_NAMES], []
        for c in range(NCTA):
            for t in range(NSTEP):
                s = [int(x) for x in raw[wg, c, t]]
                if not any(s):
                    continue
                for i in range(NSLOTS - 1):
                    phases[i].append((s[i + 1] - s[i]) % 2**32)
                if t + 1 < NSTEP and any(int(x) for x in raw[wg, c, t + 1]):
                    totals.append((int(raw[wg, c, t + 1, 0]) - s[0]) % 2**32)
        print(f"  warpgroup {wg} ({len(phases[0])} steps stamped)")
        for name, vals in zip(WS_NAMES, phases):
            print(f"    {name:19s} median {_med(vals)} cycles")
        print(f"    {'step total':19s} median {_med(totals)} cycles")


NAMES = ["Q/dO wait", "S wait", "exponentials", "dP wait", "dS, dK issue, fence",
         "store_wait+barrier", "dQ MMA (+dK), wait", "dQ stage+reduce"]


def _med(vals):
    return f"{statistics.median(vals):8.0f}" if vals else "       -"


def report(stamps: torch.Tensor, label: str):
    raw = stamps.cpu().to(torch.int64)
    steps = raw[:CTA_AREA].reshape(NCTA, NSTEP, NSLOTS)
    ctas = raw[CTA_AREA:].reshape(NCTA, NSLOTS)
    phases = [[] for _ in NAMES]
    gaps, totals, prologue, per_step, epilogue, n_steps_seen = [], [], [], [], [], set()
    for c in range(NCTA):
        n_steps = int(ctas[c, 4]) - 1
        if n_steps < 0:
            continue
        n_steps_seen.add(n_steps)
        cs = [int(x) for x in ctas[c]]
        prologue.append((cs[1] - cs[0]) % 2**32)
        epilogue.append((cs[3] - cs[2]) % 2**32)
        if n_steps > 0:
            per_step.append(((cs[2] - cs[1]) % 2**32) / n_steps)
        stamped = min(n_steps, NSTEP)
        for t in range(stamped):
            s = [int(x) for x in steps[c, t]]
            d = [(s[i + 1] - s[i]) % 2**32 for i in range(NSLOTS - 1)]
            for i, v in enumerate(d):
                phases[i].append(v)
            if t + 1 < stamped:
                gap = (int(steps[c, t + 1, 0]) - s[8]) % 2**32
                gaps.append(gap)
                totals.append(sum(d) + gap)
    if not n_steps_seen:
        print(label, "no stamps")
        return
    print(f"== {label}: {len(prologue)} CTAs, steps per CTA {sorted(n_steps_seen)}, "
          f"{len(phases[0])} steps stamped")
    for name, vals in zip(NAMES, phases):
        print(f"  {name:19s} median {_med(vals)} cycles")
    print(f"  {'to next step':19s} median {_med(gaps)} cycles")
    print(f"  {'step total':19s} median {_med(totals)} cycles (start -> next step's start)")
    print(f"  {'loop / steps':19s} median {_med(per_step)} cycles (loop start -> end over all steps)")
    print(f"  {'prologue':19s} median {_med(prologue)} cycles (body start -> K/V arrived)")
    print(f"  {'epilogue':19s} median {_med(epilogue)} cycles (loop end -> after store_key_grads)")


def kernel_us(fn, name="_attn_bwd_kernel", reps=10) -> float | None:
    """Mean device time of the kernels called `name` over `reps` calls (profiler)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        times = [getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                 for e in prof.key_averages() if name in e.key]
        return sum(times) / reps if times else None
    except Exception as e:  # the profiler is a convenience here
        print("  (profiler failed:", e, ")")
        return None


# ---------------------------------------------------------------------------------------------
# --compile: sm_90a builds of the plain and the stamped kernel, no GPU
# ---------------------------------------------------------------------------------------------

def _main_loop_local(sass: str) -> int:
    """Local-memory instructions in the main loop: the longest backward branch's span (those
    placed after the last EXIT, the out-of-line retries of mbarrier waits, do not count)."""
    addr, pending, pos = {}, [], []
    for ln in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            pending.append(m[1])
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/", ln)
        if m:
            for label in pending:
                addr[label] = int(m[1], 16)
            pending = []
            pos.append((int(m[1], 16), ln))
    last_exit = max((a for a, ln in pos if "EXIT" in ln), default=0)
    span = (0, -1)
    for a, ln in pos:
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and a < last_exit and addr.get(m[1], a) < a and a - addr[m[1]] > span[1] - span[0]:
            span = (addr[m[1]], a)
    return sum(1 for a, ln in pos if span[0] <= a <= span[1] and re.search(r"\b(LDL|STL)\b", ln))


def sass_summary(kernel) -> dict:
    """As tests/sass_report.py: registers, local-memory instructions (all; between the first
    and last HGMMA, the tests' `local_in_loop`; in the whole loop body, `local_loop_body`), HGMMA, clock reads
    and CTA barriers in SASS; ptxas -v's spill bytes (stores/loads) and warnings (ptxas run
    again on the PTX, as triton does)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "k.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([bin_dir / "nvdisasm", "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([bin_dir / "cuobjdump", "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([bin_dir / "ptxas", "-lineinfo", "-v", "--gpu-name=sm_90a", ptx,
                              "-o", Path(tmp, "k.o")], capture_output=True, text=True).stderr
    loop = sass[sass.find("HGMMA"):sass.rfind("HGMMA")]
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(
        regs=int(re.findall(r"REG:(\d+)", res)[0]),
        local=len(re.findall(r"\b(LDL|STL)\b", sass)),
        local_in_loop=len(re.findall(r"\b(LDL|STL)\b", loop)),
        local_loop_body=_main_loop_local(sass),
        spill_bytes=f"{spill[1]}/{spill[2]}" if spill else "?",
        hgmma=sass.count("HGMMA"),
        clock_reads=len(re.findall(r"SR_CLOCK", sass)),
        bar_sync=sass.count("BAR.SYNC"),
        shared=kernel.metadata.shared,
        ptxas_warnings=[ln.strip() for ln in log.splitlines() if "arning" in ln or "Performance" in ln])


def compile_check(mod):
    from asymflash.backends.sm90.bwd import host as bwd

    for d in (128, 64):
        for label, m in (("plain  ", bwd), ("stamped", mod)):
            # non-causal, bwd.py's kernel (the default config, without bwd_ws at d=128)
            k = m.compile_for_target(head_dim=d, cfg=replace(m.select_config(d),
                                                             split_warpgroups=False))
            r = sass_summary(k)
            warn = r.pop("ptxas_warnings")
            print(f"d={d} {label} compiled {k.metadata.name}: " + ", ".join(f"{a} {b}" for a, b in r.items()))
            for w in warn:
                print("    ptxas:", w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true",
                    help="build plain and stamped kernels for sm_90a on the CPU, print registers/spills")
    ap.add_argument("--first-cta", type=int, default=0,
                    help="stamp CTAs N..N+7 (linear id) instead of the first wave's 0-7")
    ap.add_argument("--ws", action="store_true",
                    help="stamp bwd_ws.py's warp-specialised kernel (d=128) per warpgroup")
    a = ap.parse_args()
    if a.compile and os.environ.get("TRITON_INTERPRET"):
        # the interpreter cannot compile for a GPU target: run again without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if a.ws:
        return main_ws(a)
    mod = patched_module(a.first_cta)
    mod.TIMELINE = torch.zeros(TIMELINE_WORDS, dtype=torch.int32,
                               device="cuda" if torch.cuda.is_available() else "cpu")
    if a.compile:
        compile_check(mod)
        return
    from triton.testing import do_bench

    from asymflash.backends.sm90.bwd import host as bwd

    for d, seqlen, causal in ((128, 512, False), (128, 512, True), (64, 512, False),
                              (128, 2048, False), (128, 16384, False)):
        args, b, h = probe_common.backward_cell(d, seqlen, causal)
        # bwd.py's kernel (d=128 calls run bwd_ws.py's by default, which is not stamped)
        args = (*args, replace(bwd.select_config(d), split_warpgroups=False))
        plain = do_bench(lambda: bwd.backward(*args), warmup=10, rep=40)
        stamped = do_bench(lambda: mod.backward(*args), warmup=10, rep=40)
        kp, ks = kernel_us(lambda: bwd.backward(*args)), kernel_us(lambda: mod.backward(*args))
        kern = (f", kernel {kp:.1f} / {ks:.1f} us plain / stamped" if kp and ks else "")
        mod.TIMELINE.zero_()
        mod.backward(*args)
        torch.cuda.synchronize()
        report(mod.TIMELINE.clone(),
               f"d={d} seqlen {seqlen} batch {b} heads {h} causal={causal}: call "
               f"{plain * 1e3:.1f} us plain, {stamped * 1e3:.1f} us stamped{kern}")


def main_ws(a):
    """--ws: the real host path (bwd.backward) launching the stamped copy of bwd_ws's kernel,
    the stamp buffer passed where the (unread) semaphore goes."""
    from asymflash.backends.sm90.bwd import host as bwd

    ws = patched_ws_module(a.first_cta)
    if a.compile:
        real = bwd._kernel_for
        for label, kern in (("plain  ", None), ("stamped", ws.attn_bwd_ws_kernel)):
            if kern is not None:
                bwd._kernel_for = lambda d, split=False, _k=kern: _k if split else real(d)
            try:
                k = bwd.compile_for_target(head_dim=128, cfg=replace(
                    bwd.select_config(128), ws_persistent=False))  # the plain grid
            finally:
                bwd._kernel_for = real
            r = sass_summary(k)
            r.pop("ptxas_warnings")
            print(f"d=128 ws {label}: " + ", ".join(f"{x} {y}" for x, y in r.items()))
        return
    stamps = torch.zeros(WS_WORDS, dtype=torch.int32, device="cuda")
    for seqlen, causal in ((512, False), (512, True), (2048, False), (16384, False),
                           (16384, True)):
        args, b, _ = probe_common.backward_cell(128, seqlen, causal)
        plain, stamped = probe_common.time_stamped_ws(
            ws.attn_bwd_ws_kernel, stamps, args,
            replace(bwd.select_config(128, masked=causal), ws_persistent=False))
        report_ws(stamps.clone(), f"d=128 seqlen {seqlen} batch {b} causal={causal}: call "
                  f"{plain * 1e3:.1f} us plain, {stamped * 1e3:.1f} us stamped")


if __name__ == "__main__":
    main()
