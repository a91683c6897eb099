"""Where a CTA's time goes in bwd_ws's backward, beyond its steps: clock stamps per CTA.

    PYTHONPATH=. python scripts/bwd-ws-ctas.py [--cells 64:0:512,128:1:2048,...]
    PYTHONPATH=. python scripts/bwd-ws-ctas.py --compile     # CPU: the stamped kernel builds

A copy of `backends/sm90/bwd_ws.py` is patched at run time (the package's kernel is never
changed) and launched through the real host path (`bwd.backward`, its launcher and the unread
semaphore argument swapped for the stamped kernel and the stamp buffer, as
`bwd-timeline.py --ws` does). Thread 0 of compute warpgroup 0 of every CTA writes, at int32
index cta·8 + k (cta = x + X·(y + Y·z) of the grid):

    0 %smid   1 warpgroup entry (%clock, low 32 bits)   2 K/V arrived   3 step 0's Q/dO and
    statistics arrived   4 loop end   5 dK/dV stored (end of the warpgroup's work)
    6 n_steps   7 1 (the CTA stamped)   8 the late warpgroup's last dQ done (d=64, 128:
    warpgroup 0 is late)   9 past the warpgroups' barrier before the dK/dV stores
    10, 11: warpgroup 1's 8 and 9   12 the load warp's entry (before it issues K/V)

Clocks are per SM, so CTAs are compared on their own SM only: sorted by entry, the gap from
one CTA's stamp 5 to the next one's stamp 1 holds the CTA's remaining tail (warpgroup 1, the
dQ warp's last reduce, teardown) and the next one's launch and setup. Per cell it prints the
median cycles of each phase, the loop's cycles per step, and the fixed cost per CTA in steps
(everything but the loop, divided by the loop's cycles per step).
"""

# ruff: noqa: E501, B023
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_common  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "asymflash" / "backends" / "sm90" / "bwd" / "kernel_ws.py"
WORDS = 16

STAMPS = '''
    @gluon.jit
    def _cs_cta(x):
        return gl.inline_asm_elementwise(
            "{ .reg .u32 a, b, c, nx, ny; mov.u32 a, %ctaid.x; mov.u32 b, %ctaid.y; "
            "mov.u32 c, %ctaid.z; mov.u32 nx, %nctaid.x; mov.u32 ny, %nctaid.y; "
            "mad.lo.u32 b, c, ny, b; mad.lo.u32 $0, b, nx, a; }",
            "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


    @gluon.jit
    def _cs_put(base, x, value, k: gl.constexpr, WG: gl.constexpr, pred=True,
                ONLY: gl.constexpr = 0):
        # warpgroup ONLY's stamp (WG -1: the load warp's); x: any int32 operand, orders the
        # reads after it
        if WG == ONLY:
            cta = _cs_cta(x)
            gl.store(base + cta * 16 + k, value, mask=pred)

    @gluon.jit
    def _cs_clock(base, x, k: gl.constexpr, WG: gl.constexpr, pred=True,
                  ONLY: gl.constexpr = 0):
        _cs_put(base, x, _stamp_read(x, "%clock"), k, WG, pred, ONLY)

'''


def _stamp(indent: int, call: str) -> str:
    return " " * indent + call + "\n"


EDITS = [
    *probe_common.WS_COMPUTE_TAKES_SEM,
    ("         softcap_pre, window_left, window_right) = shared\n",
     "         softcap_pre, window_left, window_right) = shared\n"
     + _stamp(8, "_cs_clock(sem_ptr, n0, 1, WG)")
     + _stamp(8, "_cs_put(sem_ptr, n0, _stamp_read(n0, \"%smid\"), 0, WG)")
     + _stamp(8, "_cs_put(sem_ptr, n0, n_steps, 6, WG)")
     + _stamp(8, "_cs_put(sem_ptr, n0, n0 * 0 + 1, 7, WG)"), 1),
    ("        mbarrier.wait(kv_bar.index(0), tile & 1)\n",
     "        mbarrier.wait(kv_bar.index(0), tile & 1)\n" + _stamp(8, "_cs_clock(sem_ptr, n0, 2, WG)"), 1),
    ("            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n",
     "            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n"
     + _stamp(12, "_cs_clock(sem_ptr, it, 3, WG, it == 0)"), 1),
    ("        if WG == LATE_WG:\n            if n_steps > 0:\n",
     _stamp(8, "_cs_clock(sem_ptr, n0, 4, WG)")
     + "        if WG == LATE_WG:\n            if n_steps > 0:\n", 1),
    ("        tma.store_wait(0)  # the last reduce reads dq_buf\n",
     _stamp(8, "_cs_clock(sem_ptr, n0, 8, WG)") + _stamp(8, "_cs_clock(sem_ptr, n0, 10, WG, True, 1)")
     + "        tma.store_wait(0)  # the last reduce reads dq_buf\n", 1),
    ("        mbarrier.wait(done.index(0), tile & 1)\n",
     "        mbarrier.wait(done.index(0), tile & 1)\n" + _stamp(8, "_cs_clock(sem_ptr, n0, 9, WG)")
     + _stamp(8, "_cs_clock(sem_ptr, n0, 11, WG, True, 1)"), 1),
    ("    def _ws_loader(q_desc,", "    def _ws_loader(sem_ptr, q_desc,", 1),
    ("(_ws_loader, (q_desc,", "(_ws_loader, (sem_ptr, q_desc,", 1),
    ("        load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(0), k_row, hk, HEAD_DIM,\n",
     _stamp(8, "_cs_clock(sem_ptr, k_row, 12, -1, True, -1)")
     + "        load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(0), k_row, hk, HEAD_DIM,\n", 1),
    ("        if PERSISTENT and EPI == 0:\n            # the stores have read",
     _stamp(8, "_cs_clock(sem_ptr, n0, 5, WG)")
     + "        if PERSISTENT and EPI == 0:\n            # the stores have read", 1),
]


def plain_grid(bwd, d: int, causal: bool):
    """The cell's default config as a plain grid (persistent CTAs: `bwd-ws-tiles.py`)."""
    from dataclasses import replace
    return replace(bwd.select_config(d, masked=causal), ws_persistent=False)


def patched():
    helpers = ("    @gluon.jit\n    def _ws_loader(", probe_common.STAMP_READ + STAMPS + "    @gluon.jit\n    def _ws_loader(", 1)
    return probe_common.patched_module(SRC, [helpers, *EDITS], "bwd-ws-ctas")


def _med(vals):
    return statistics.median(vals) if vals else float("nan")


def report(stamps: torch.Tensor, label: str):
    raw = stamps.cpu().to(torch.int64).reshape(-1, WORDS)
    per_sm = defaultdict(list)
    for row in raw.tolist():
        if row[7] == 1:
            per_sm[row[0]].append(row)
    phases = defaultdict(list)
    step_cycles = []
    for rows in per_sm.values():
        base = rows[0][1]
        rows.sort(key=lambda r: (r[1] - base) % 2**32)
        for i, r in enumerate(rows):
            d = lambda a, b: (r[b] - r[a]) % 2**32  # noqa: E731 - this CTA's phase
            phases["entry -> K/V"].append(d(1, 2))
            phases["K/V -> step 0 ready"].append(d(2, 3) if r[6] > 0 else 0)
            phases["loop (all steps)"].append(d(2, 4))
            phases["loop end -> dK/dV stored"].append(d(4, 5))
            phases["  of which: last dQ (late wg 0)"].append(d(4, 8))
            phases["  barrier wait (wg 0)"].append(d(8, 9))
            phases["  dK/dV stores (wg 0)"].append(d(9, 5))
            phases["wg 1: its loop end -> barrier"].append(d(10, 11))
            phases["load warp entry -> wg 0 entry"].append((r[1] - r[12] + 2**31) % 2**32 - 2**31)
            if r[6] > 0:
                step_cycles.append((d(3, 4)) / r[6])
            if i + 1 < len(rows):
                phases["dK/dV stored -> next CTA entry"].append((rows[i + 1][1] - r[5]) % 2**32)
    n = sum(len(v) for v in per_sm.values())
    steps = sorted({r[6] for v in per_sm.values() for r in v})
    print(f"== {label}: {n} CTAs on {len(per_sm)} SMs, steps per CTA {steps[:6]}{'...' if len(steps) > 6 else ''}")
    for name, vals in phases.items():
        print(f"  {name:34s} median {_med(vals):9.0f} cycles")
    per_step = _med(step_cycles)
    fixed = (_med(phases["entry -> K/V"]) + _med(phases["K/V -> step 0 ready"])
             + _med(phases["loop end -> dK/dV stored"])
             + _med(phases["dK/dV stored -> next CTA entry"]))
    print(f"  {'cycles per step (step 0 ready -> loop end)':32s} median {per_step:9.0f}")
    print(f"  fixed cost per CTA: {fixed:.0f} cycles = {fixed / per_step:.2f} steps")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64:0:512,64:1:2048,128:0:512,128:1:512,64:0:16384")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.compile and os.environ.get("TRITON_INTERPRET"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from asymflash.backends.sm90.bwd import host as bwd

    ws = patched()
    if a.compile:
        real = bwd._kernel_for
        bwd._kernel_for = lambda d, split=False: ws.attn_bwd_ws_kernel if split else real(d)
        try:
            for d, right in ((64, False), (128, True)):
                k = bwd.compile_for_target(head_dim=d, has_right=right)
                sass = k.asm.get("sass") or ""
                print(f"d={d} causal={right}: stamped build {k.metadata.name}, "
                      f"{k.metadata.shared} B shared, {k.asm['ptx'].count('%clock')} clock "
                      f"reads in its PTX{', SASS ' + str(len(sass)) if sass else ''}")
        finally:
            bwd._kernel_for = real
        return

    for cell in a.cells.split(","):
        d, causal, seqlen = (int(x) for x in cell.split(":"))
        args, b, h = probe_common.backward_cell(d, seqlen, bool(causal))
        plan = bwd.launch_plan(d, d, seqlen, seqlen, True, False, -1, 0 if causal else -1,
                               False, False, b, h, torch.cuda.get_device_properties(0)
                               .multi_processor_count, plain_grid(bwd, d, causal), h)
        if not plan.split:
            print(f"== d={d} causal={causal} seqlen={seqlen}: not on bwd_ws by default, skipped")
            continue
        ncta = plan.grid[0] * plan.grid[1] * plan.grid[2]
        stamps = torch.zeros(ncta * WORDS, dtype=torch.int32, device="cuda")
        plain, stamped = probe_common.time_stamped_ws(ws.attn_bwd_ws_kernel, stamps, args,
                                                      plain_grid(bwd, d, causal))
        report(stamps, f"d={d} causal={causal} seqlen={seqlen} batch {b} heads {h}: call "
               f"{plain * 1e3:.1f} us plain, {stamped * 1e3:.1f} us stamped")


if __name__ == "__main__":
    main()
