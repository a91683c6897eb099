"""Where a forward tile's time goes: SM clock stamps inside the persistent sm90 forward.

A copy of `backends/sm90/fwd.py` is patched at run time (the kernel in the package is never
changed): consumer warpgroup 0 of CTAs 0-7 stamps `%clock64` at seven points of each of its
first 16 tiles, into a buffer passed where the sink would go (calls without a sink only):

    0 tile start  1 Q arrived  2 first key block done (S, mask, softmax)  3 key loops done
    4 last P·V done  5 lse stored  6 O stored (TMA-store epilogue only);  slot 7 = key blocks of the tile

Stamp 0 is taken in `_consumer_role_persistent` as the tile begins (before its Q wait), the
others in the tile's pieces (`_tile_begin` 1, `_tile_run` 2 and 3, `_tile_finish` 4,
`_tile_store` 5 and 6), which receive the tile's row of the buffer through `_consumer_tile`.
With uniform lengths "Q wait" (0 -> 1) also covers reading the tile's coordinates from the
loader (`_read_tile`) and its key-block range. Only the persistent grid is stamped.

It prints, per phase, the median cycles over the stamped tiles, and the kernel time with and
without the stamps (the stamps themselves perturb the schedule a little).

    PYTHONPATH=. python scripts/fwd-timeline.py            # H200, 512-row cells and one longer
    PYTHONPATH=. python scripts/fwd-timeline.py --compile  # CPU: the patched kernels build
                                                           # (sm_90a), local memory vs unpatched
"""

# ruff: noqa: E501, B023
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_common  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "asymflash" / "backends" / "sm90" / "fwd" / "kernel.py"

STAMP = '''
    @gluon.jit
    def _stamp(ptr, k: gl.constexpr, WG: gl.constexpr, ON: gl.constexpr):
        if ON:
            if WG == 0:
                t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r",
                                              [gl.program_id(0)], dtype=gl.int64,
                                              is_pure=False, pack=1)
                gl.store(ptr + k, t.to(gl.int32).to(gl.float32, bitcast=True))

    @gluon.jit
    def _stamp_value(ptr, k: gl.constexpr, value, WG: gl.constexpr, ON: gl.constexpr):
        if ON:
            if WG == 0:
                gl.store(ptr + k, value.to(gl.int32).to(gl.float32, bitcast=True))

    @gluon.jit
    def _stamp_row(base, tc):
        """The 8 stamps of tile tc of this CTA: row pid·16 + tc (CTAs 0-7, tiles 0-15), else
        the CTA's scratch row 128 + pid (written, never read: no branch, no tile counter to
        keep alive through the key loops)."""
        pid = gl.program_id(0)
        return base + gl.where(pid < 8, gl.where(tc < 16, pid * 16 + tc, 128 + pid),
                               128 + pid) * 8
'''

# The tile pieces take the tile's stamp row and a constexpr switch as trailing defaults
# (TL=False: no stamps), so only the persistent grid's call passes them, TL = not HAS_SINK.
# One pointer computed at the tile's start instead of (buffer, tile counter): the d=128 causal
# build (LPT) spilled 17 local-memory instructions with the pair, against 2 unpatched.
TL_PARAMS = ", tl_ptr=None, TL: gl.constexpr = False"

# (old, new, count): exact edits of fwd.py's text
EDITS = [
    ("    @gluon.jit\n    def _take_turn(", STAMP + "\n    @gluon.jit\n    def _take_turn(", 1),
    # _tile_begin: 1 Q arrived
    ("                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):\n"
     "        \"\"\"Wait for the tile's Q",
     "                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr"
     + TL_PARAMS + "):\n        \"\"\"Wait for the tile's Q", 1),
    ("        mbarrier.wait(q_bar.index(q_slot), q_phase)\n        q = q_smem.index(q_slot)\n",
     "        mbarrier.wait(q_bar.index(q_slot), q_phase)\n"
     "        _stamp(tl_ptr, 1, WG, TL)\n        q = q_smem.index(q_slot)\n", 1),
    # _tile_run: 2 first key block done, 3 key loops done
    ("                  RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr, ARRIVE: gl.constexpr):\n"
     "        \"\"\"From S_0",
     "                  RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr, ARRIVE: gl.constexpr"
     + TL_PARAMS + "):\n        \"\"\"From S_0", 1),
    ("        p_op = gl.convert_layout(_to_16bit(p, q.dtype), p_layout)\n\n        base = it0 - n_lo\n",
     "        p_op = gl.convert_layout(_to_16bit(p, q.dtype), p_layout)\n"
     "        _stamp(tl_ptr, 2, WG, TL)\n\n        base = it0 - n_lo\n", 1),
    ("        if RELEASE_Q:\n            # Every S wgmma",
     "        _stamp(tl_ptr, 3, WG, TL)\n        if RELEASE_Q:\n            # Every S wgmma", 1),
    # _tile_finish: 4 last P·V done (it has no WG: one more default)
    ("    def _tile_finish(o_tok, p_op, v_empty, slot, ARRIVE: gl.constexpr):\n",
     "    def _tile_finish(o_tok, p_op, v_empty, slot, ARRIVE: gl.constexpr, WG: gl.constexpr = 0"
     + TL_PARAMS + "):\n", 1),
    ("        mbarrier.arrive(v_empty.index(slot), count=ARRIVE)\n        return acc\n",
     "        mbarrier.arrive(v_empty.index(slot), count=ARRIVE)\n"
     "        _stamp(tl_ptr, 4, WG, TL)\n        return acc\n", 1),
    # _tile_store: 5 lse stored, 6 O stored (TMA-store epilogue: the store issued)
    ("                    RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr):\n"
     "        \"\"\"Epilogue:",
     "                    RELEASE_Q: gl.constexpr, PINGPONG: gl.constexpr" + TL_PARAMS + "):\n"
     "        \"\"\"Epilogue:", 1),
    ("        gl.store(lse_ptr + lse_off, lse, mask=valid)\n",
     "        gl.store(lse_ptr + lse_off, lse, mask=valid)\n"
     "        _stamp(tl_ptr, 5, WG, TL)\n", 1),
    ("            if not RELEASE_Q:  # a one-tile CTA",
     "            _stamp(tl_ptr, 6, WG, TL)\n            if not RELEASE_Q:  # a one-tile CTA",
     1),
    # _consumer_tile: takes the row and the switch and hands them to the pieces
    ("                       PINGPONG: gl.constexpr, ARRIVE: gl.constexpr, TAIL_SKIP: gl.constexpr):\n"
     "        \"\"\"One 64-row query tile",
     "                       PINGPONG: gl.constexpr, ARRIVE: gl.constexpr, TAIL_SKIP: gl.constexpr"
     + TL_PARAMS + "):\n        \"\"\"One 64-row query tile", 1),
    ("                               BLOCK_N, STAGES, PINGPONG)\n",
     "                               BLOCK_N, STAGES, PINGPONG, tl_ptr, TL)\n", 1),
    ("            HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY, RESCALE_THRESHOLD, RELEASE_Q, PINGPONG,\n"
     "            ARRIVE)\n        acc = _tile_finish(o_tok, p_op, v_empty, slot, ARRIVE)\n",
     "            HAS_LEFT, HAS_RIGHT, SOFTCAP, EMU_EVERY, RESCALE_THRESHOLD, RELEASE_Q, PINGPONG,\n"
     "            ARRIVE, tl_ptr, TL)\n"
     "        acc = _tile_finish(o_tok, p_op, v_empty, slot, ARRIVE, WG, tl_ptr, TL)\n", 1),
    ("                    HAS_SINK, RELEASE_Q, PINGPONG)\n",
     "                    HAS_SINK, RELEASE_Q, PINGPONG, tl_ptr, TL)\n", 1),
    # the persistent consumer: 0 tile start (before its Q wait, with uniform lengths), slot 7
    # the tile's key blocks; its call passes the tile's row of the buffer (sink_ptr)
    ("            if live:\n                q_slot = (tc % Q_BUFS) * NUM_WG + WG\n",
     "            if live:\n                tl_ptr = _stamp_row(sink_ptr, tc)\n"
     "                _stamp(tl_ptr, 0, WG, not HAS_SINK)\n"
     "                q_slot = (tc % Q_BUFS) * NUM_WG + WG\n", 1),
    ("                _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,\n",
     "                _stamp_value(tl_ptr, 7, n_hi - n_lo, WG, not HAS_SINK)\n"
     "                _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,\n",
     1),
    ("                               EMU_EVERY, RESCALE_THRESHOLD, True, PINGPONG, ARRIVE,\n"
     "                               TAIL_SKIP)\n",
     "                               EMU_EVERY, RESCALE_THRESHOLD, True, PINGPONG, ARRIVE,\n"
     "                               TAIL_SKIP, tl_ptr, not HAS_SINK)\n", 1),
    # the host passes the stamp buffer where the (absent) sink would go (`_launch`)
    ("sink if sink is not None else lse,", "sink if sink is not None else TIMELINE,", 1),
]


def patched_module():
    return probe_common.patched_module(SRC, EDITS, "fwd-timeline")


NAMES = ["Q wait", "first block", "key loops", "last PV", "lse", "O store", "to next tile"]


def report(stamps: torch.Tensor, label: str):
    raw = stamps[:8 * 16 * 8].view(torch.int32).reshape(8, 16, 8).to(torch.int64).cpu()
    rows = []
    for cta in range(8):
        for t in range(16):
            s = raw[cta, t]
            if s[7] <= 0 or s[7] > 10000:
                continue
            d = [(int(s[i + 1]) - int(s[i])) % 2**32 for i in range(6)]
            nxt = raw[cta, t + 1] if t + 1 < 16 else None
            gap = (int(nxt[0]) - int(s[6])) % 2**32 if nxt is not None and nxt[7] > 0 else None
            rows.append((int(s[7]), d, gap))
    if not rows:
        print(label, "no stamps")
        return
    print(f"== {label}: {len(rows)} tiles, key blocks per tile "
          f"{sorted({r[0] for r in rows})}")
    for i, name in enumerate(NAMES[:6]):
        vals = [r[1][i] for r in rows]
        print(f"  {name:14s} median {statistics.median(vals):8.0f} cycles")
    gaps = [r[2] for r in rows if r[2] is not None]
    if gaps:
        print(f"  {'to next tile':14s} median {statistics.median(gaps):8.0f} cycles")
    per_block = [r[1][2] / max(r[0] - 1, 1) for r in rows if r[0] > 1]
    if per_block:
        print(f"  key loop per block median {statistics.median(per_block):8.0f} cycles")
    total = [sum(r[1]) + (r[2] or 0) for r in rows]
    print(f"  tile total median {statistics.median(total):8.0f} cycles")


# (d, seqlen, causal), bf16, model dim 2048, 16k rows: all on the persistent grid by default
# (`fwd.use_persistent`: d=64 always, d=128 non-causal up to 1k rows, causal below 16k, d=256
# causal; d=64 three consumer warpgroups only from 2k non-causal rows; causal 512 rows on
# 64-key blocks, `fwd.SHORT_MASKED`)
SHAPES = ((128, 512, False), (128, 512, True), (64, 512, False), (64, 512, True),
          (128, 2048, True), (256, 512, True))
H200_SMS = 132


def plan_of(mod, d, seqlen, causal):
    """The launch plan (config, grid) `forward` picks for a SHAPES entry on an H200."""
    b, h = 16384 // seqlen, 2048 // d
    return mod.launch_plan(d, d, seqlen, seqlen, True, False, -1, 0 if causal else -1, False,
                           False, b, h, h, H200_SMS, None)


def local_memory(kernel) -> str:
    """Local-memory (spill) instructions of a compiled kernel's SASS, all / between the first
    and the last HGMMA (the key loops; as tests/sass_report.py counts them), "?" without
    Triton's nvdisasm."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return "?"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    spills = r"\b(LDL|STL)\b"
    loops = sass[sass.find("HGMMA"):sass.rfind("HGMMA")]
    return f"{len(re.findall(spills, sass))} / {len(re.findall(spills, loops))} in the loops"


def compile_only(mod):
    """CPU: build the patched kernel (and the package's, for comparison) for sm_90a in the
    configurations SHAPES runs, and check the stamps are in it."""
    from asymflash.backends.sm90.fwd import host as fwd

    done = set()
    for d, seqlen, causal in SHAPES:
        cfg = plan_of(mod, d, seqlen, causal).cfg
        if (d, causal, cfg) in done:
            continue
        done.add((d, causal, cfg))
        kw = {"head_dim": d, "has_right": causal}
        plain = fwd.compile_for_target(cfg=plan_of(fwd, d, seqlen, causal).cfg, **kw)
        k = mod.compile_for_target(cfg=cfg, **kw)
        stamps = k.asm["ptx"].count("%clock64")
        print(f"d={d} causal={causal} (persistent={cfg.persistent}, {cfg.consumer_wgs} "
              f"warpgroups, q_buffers={cfg.q_buffers}, stages={cfg.stages}, lpt={cfg.lpt}): "
              f"compiled {k.metadata.name}, shared {k.metadata.shared} (plain "
              f"{plain.metadata.shared}), local-memory instructions {local_memory(k)} (plain "
              f"{local_memory(plain)}), clock reads in PTX {stamps}")
        if not stamps:
            sys.exit("fwd-timeline: the patched kernel has no clock stamps")
    # With a sink the buffer is the sink: no stamps.
    k = mod.compile_for_target(head_dim=128, cfg=plan_of(mod, 128, 512, False).cfg,
                               has_sink=True)
    print(f"with a sink (d=128 non-causal): clock reads in PTX {k.asm['ptx'].count('%clock64')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    mod = patched_module()
    if a.compile:
        compile_only(mod)
        return
    from triton.testing import do_bench

    from asymflash.backends.sm90.fwd import host as fwd
    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    # 8 CTAs x 16 tiles x 8 stamps, then a scratch row per CTA
    mod.TIMELINE = torch.zeros((128 + torch.cuda.get_device_properties(0).multi_processor_count) * 8,
                               device="cuda")
    for d, seqlen, causal in SHAPES:
        b, h = 16384 // seqlen, 2048 // d
        q = torch.randn(b * seqlen, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        seq = SeqInfo.dense(b, seqlen, seqlen, q.device)
        params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1), 0.0, False)
        plan = mod._launch_plan_of(d, d, q, k, seq, params, None, None)
        if not plan.cfg.persistent:  # stamps are only placed on the persistent grid
            print(f"d={d} seqlen {seqlen} causal={causal}: plain grid, skipped")
            continue
        plain = do_bench(lambda: fwd.forward(q, k, v, seq, params, None), warmup=10, rep=40)
        stamped = do_bench(lambda: mod.forward(q, k, v, seq, params, None), warmup=10, rep=40)
        mod.TIMELINE.fill_(0)
        mod.forward(q, k, v, seq, params, None)
        torch.cuda.synchronize()
        report(mod.TIMELINE.clone(),
               f"d={d} seqlen {seqlen} causal={causal} ({plan.cfg.consumer_wgs} warpgroups, "
               f"q_buffers={plan.cfg.q_buffers}, grid {plan.grid}): {plain * 1e3:.1f} us plain, "
               f"{stamped * 1e3:.1f} us stamped")


if __name__ == "__main__":
    main()
