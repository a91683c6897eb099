"""Where a persistent bwd_ws CTA's time goes between its tiles: clock stamps per tile.

    PYTHONPATH=. python scripts/bwd-ws-tiles.py [64:0:512,128:0:2048,...]   # d:causal:seqlen

The persistent twin of `bwd-ws-ctas.py` (BwdConfig.ws_persistent). A copy of
`backends/sm90/bwd_ws.py` is patched at run time and launched through `bwd.backward` with the
cell's default config made persistent. Its stamps go past the tile counter in the rows the
preprocess zeroes after dQ_acc (`bwd.PERSISTENT_ROWS`, raised for the call): thread 0 of
compute warpgroup 0 writes, at int32 index (program · 64 + tile) · 16 + k (a CTA's first 64
tiles):

    0 %smid   1 tile entry (%clock)   2 K/V arrived   3 step 0's Q/dO and statistics arrived
    4 loop end   5 dK/dV stored   6 n_steps   7 1 (stamped)   8 the late warpgroup's last dQ
    done   9 past the warpgroups' barrier   12 the load warp issues the tile's K/V
    13 the load warp past epi_done (only where dK/dV stage through the ring)

Per cell: the call plain and persistent, then medians of each phase and of the gaps from the
previous tile's stores to this tile's K/V and step 0 (what the persistent grid overlaps).
"""
# ruff: noqa: E501, B023
from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_common  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "asymflash" / "backends" / "sm90" / "bwd" / "kernel_ws.py"
MAXT = 64
W = 16

HELPERS = '''

    @gluon.jit
    def _ps_put(base, tile, value, k: gl.constexpr, WG: gl.constexpr, pred=True,
                ONLY: gl.constexpr = 0):
        if WG == ONLY:
            gl.store(base + (gl.program_id(0) * 64 + tile) * 16 + k, value,
                     mask=pred & (tile < 64))

    @gluon.jit
    def _ps_clock(base, tile, k: gl.constexpr, WG: gl.constexpr, pred=True,
                  ONLY: gl.constexpr = 0):
        _ps_put(base, tile, _stamp_read(tile, "%clock"), k, WG, pred, ONLY)

'''


def st(indent, call):
    return " " * indent + call + "\n"


EDITS = [
    ("    @gluon.jit\n    def _ws_loader(", probe_common.STAMP_READ + HELPERS
     + "    @gluon.jit\n    def _ws_loader(", 1),
    # compute: stamp pointer after the PERSISTENT flag
    ("PERSISTENT: gl.constexpr = False, EPI: gl.constexpr = 0, dv_stage=None):\n",
     "PERSISTENT: gl.constexpr = False, EPI: gl.constexpr = 0, dv_stage=None, sp=None):\n", 1),
    ("DK_AFTER_DQ, it0, tile, kv_free, epi_done, True, EPI,\n                        dv_stage)\n",
     "DK_AFTER_DQ, it0, tile, kv_free, epi_done, True, EPI,\n                        dv_stage, counter_ptr + 32)\n", 1),
    ("tile_smem, tile_full, tile_empty, dv_stage)\n        gl.warp_specialize",
     "tile_smem, tile_full, tile_empty, dv_stage, counter_ptr)\n        gl.warp_specialize", 1),
    ("         tile_empty, dv_stage) = shared\n",
     "         tile_empty, dv_stage, counter_ptr) = shared\n", 1),
    ("         softcap_pre, window_left, window_right) = shared\n",
     "         softcap_pre, window_left, window_right) = shared\n"
     + st(8, "_ps_clock(sp, tile, 1, WG)")
     + st(8, "_ps_put(sp, tile, _stamp_read(tile, \"%smid\"), 0, WG)")
     + st(8, "_ps_put(sp, tile, n_steps, 6, WG)")
     + st(8, "_ps_put(sp, tile, tile * 0 + 1, 7, WG)"), 1),
    ("        mbarrier.wait(kv_bar.index(0), tile & 1)\n",
     "        mbarrier.wait(kv_bar.index(0), tile & 1)\n" + st(8, "_ps_clock(sp, tile, 2, WG)"), 1),
    ("            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n",
     "            mbarrier.wait(ready.index(slot), (g // RING) & 1)\n" + st(12, "_ps_clock(sp, tile, 3, WG, it == 0)"), 1),
    ("        if WG == LATE_WG:\n            if n_steps > 0:\n",
     st(8, "_ps_clock(sp, tile, 4, WG)") + "        if WG == LATE_WG:\n            if n_steps > 0:\n", 1),
    ("        tma.store_wait(0)  # the last reduce reads dq_buf\n",
     st(8, "_ps_clock(sp, tile, 8, WG)") + "        tma.store_wait(0)  # the last reduce reads dq_buf\n", 1),
    ("        mbarrier.wait(done.index(0), tile & 1)\n",
     "        mbarrier.wait(done.index(0), tile & 1)\n" + st(8, "_ps_clock(sp, tile, 9, WG)"), 1),
    ("        if PERSISTENT and EPI == 0:\n            # the stores have read",
     st(8, "_ps_clock(sp, tile, 5, WG)") + "        if PERSISTENT and EPI == 0:\n            # the stores have read", 1),
    # loader
    ("                   PERSISTENT: gl.constexpr = False, EPI: gl.constexpr = 0):\n",
     "                   PERSISTENT: gl.constexpr = False, EPI: gl.constexpr = 0, sp=None):\n", 1),
    ("epi_done, True, _epilogue_mode(BLOCK_M, HEAD_DIM, HEAD_DIM_V, DQ_WARP))\n",
     "epi_done, True, _epilogue_mode(BLOCK_M, HEAD_DIM, HEAD_DIM_V, DQ_WARP),\n                       counter_ptr + 32)\n", 1),
    ("        load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(0), k_row, hk, HEAD_DIM,\n",
     "        if PERSISTENT:\n" + st(12, "_ps_clock(sp, tile, 12, -1, True, -1)")
     + "        load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar.index(0), k_row, hk, HEAD_DIM,\n", 1),
    ("                mbarrier.wait(epi_done.index(0), (tile - 1) & 1)\n",
     "                mbarrier.wait(epi_done.index(0), (tile - 1) & 1)\n" + st(12, "_ps_clock(sp, tile, 13, -1, True, -1)"), 1),
]


def med(v):
    return statistics.median(v) if v else float("nan")


def report(raw, label):
    rows = raw.to(torch.int64).reshape(-1, MAXT, W).tolist()
    ph = defaultdict(list)
    steps = []
    ntile = 0
    for cta in rows:
        tiles = [r for r in cta if r[7] == 1]
        ntile += len(tiles)
        for i, r in enumerate(tiles):
            d = lambda a, b: (r[b] - r[a]) % 2**32  # noqa: E731
            ph["tile entry -> K/V arrived"].append(d(1, 2))
            ph["K/V -> step 0 ready"].append(d(2, 3))
            ph["loop (all steps)"].append(d(2, 4))
            ph["loop end -> late dQ done"].append(d(4, 8))
            ph["late dQ -> barrier passed"].append(d(8, 9))
            ph["barrier -> dK/dV stored"].append(d(9, 5))
            if i > 0:
                ph["loader: K/V issue - prev loop end"].append((r[12] - tiles[i - 1][4] + 2**31) % 2**32 - 2**31)
                ph["loader: epi_done - prev stored"].append((r[13] - tiles[i - 1][5] + 2**31) % 2**32 - 2**31)
                ph["K/V arrived - prev stored"].append((r[2] - tiles[i - 1][5] + 2**31) % 2**32 - 2**31)
                ph["step 0 ready - prev stored"].append((r[3] - tiles[i - 1][5] + 2**31) % 2**32 - 2**31)
            if r[6] > 0:
                steps.append(d(3, 4) / r[6])
            if i + 1 < len(tiles):
                ph["stored -> next tile entry"].append((tiles[i + 1][1] - r[5]) % 2**32)
                ph["tile period (entry -> next entry)"].append((tiles[i + 1][1] - r[1]) % 2**32)
    print(f"== {label}: {ntile} tiles stamped")
    for k, v in ph.items():
        print(f"  {k:36s} median {med(v):9.0f}  p10 {sorted(v)[len(v)//10] if v else 0:7.0f}  p90 {sorted(v)[9*len(v)//10] if v else 0:7.0f}")
    print(f"  cycles per step (step 0 ready -> loop end) median {med(steps):.0f}")


def main():
    from triton.testing import do_bench

    from asymflash.backends import portable
    from asymflash.backends.sm90.bwd import host as bwd
    from asymflash.runtime.launch import DirectLaunch

    ws = probe_common.patched_module(SRC, EDITS, "bwd-ws-tiles")
    launcher = DirectLaunch(ws.attn_bwd_ws_kernel)
    real_launcher, real_delta = bwd._launcher_for, portable.row_delta
    cells = sys.argv[1] if len(sys.argv) > 1 else "64:0:512,128:0:512,128:1:512,128:0:2048"
    for cell in cells.split(","):
        d, causal, seqlen = (int(x) for x in cell.split(":"))
        args, b, h = probe_common.backward_cell(d, seqlen, bool(causal))
        cfg = bwd.select_config(d, masked=bool(causal))
        for pers in (False, True):
            c = replace(cfg, ws_persistent=pers)
            t = do_bench(lambda: bwd.backward(*args, cfg=c), warmup=10, rep=40)
            print(f"d={d} causal={causal} {seqlen}: persistent={pers} {t * 1e3:.1f} us")
        c = replace(cfg, ws_persistent=True)
        ref = bwd.backward(*args, cfg=replace(cfg, ws_persistent=False))
        cap = {}

        def delta(*a, zero=None, **k):
            cap["buf"] = zero
            return real_delta(*a, zero=zero, **k)
        bwd.PERSISTENT_ROWS = -(-(32 + 132 * MAXT * W) // (h * d)) + 1  # as `rows` below
        bwd._launcher_for = lambda w, split=False: launcher if split else real_launcher(w, split)
        portable.row_delta = delta
        try:
            t = do_bench(lambda: bwd.backward(*args, cfg=c), warmup=10, rep=40)
            g = bwd.backward(*args, cfg=c)
            torch.cuda.synchronize()
        finally:
            bwd._launcher_for, portable.row_delta = real_launcher, real_delta
            bwd.PERSISTENT_ROWS = 1
        err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(g[:3], ref[:3]))
        buf = cap["buf"]
        rows = -(-(32 + 132 * MAXT * W) // (h * d)) + 1
        raw = buf[-rows:].reshape(-1).view(torch.int32)
        raw = raw[32:32 + 132 * MAXT * W].cpu()
        report(raw, f"d={d} causal={causal} seqlen={seqlen} stamped {t * 1e3:.1f} us, max diff vs plain {err:.3g}")


if __name__ == "__main__":
    main()
