"""Where a forward tile's time goes: SM clock stamps inside the persistent sm90 forward.

A copy of `backends/sm90/fwd.py` is patched at run time (the kernel in the package is never
changed): consumer warpgroup 0 of CTAs 0-7 stamps `%clock64` at seven points of each of its
first 16 tiles, into a buffer passed where the sink would go (calls without a sink only):

    0 tile start  1 Q arrived  2 first key block done (S, mask, softmax)  3 key loops done
    4 last P·V done  5 lse stored  6 O stored (TMA-store epilogue only);  slot 7 = key blocks of the tile

It prints, per phase, the median cycles over the stamped tiles, and the kernel time with and
without the stamps (the stamps themselves perturb the schedule a little).

    PYTHONPATH=. python scripts/fwd-timeline.py            # H200, 512-row cells and two longer
    PYTHONPATH=. python scripts/fwd-timeline.py --compile  # CPU: the patched kernel builds
"""

# ruff: noqa: E501, B023
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "asymflash" / "backends" / "sm90" / "fwd.py"

STAMP = '''
    @gluon.jit
    def _stamp(base, tc, k: gl.constexpr, WG: gl.constexpr):
        if WG == 0:
            pid = gl.program_id(0)
            if pid < 8:
                if tc < 16:
                    t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [tc],
                                                  dtype=gl.int64, is_pure=False, pack=1)
                    gl.store(base + (pid * 16 + tc) * 8 + k,
                             t.to(gl.int32).to(gl.float32, bitcast=True))

    @gluon.jit
    def _stamp_value(base, tc, k: gl.constexpr, value, WG: gl.constexpr):
        if WG == 0:
            pid = gl.program_id(0)
            if pid < 8:
                if tc < 16:
                    gl.store(base + (pid * 16 + tc) * 8 + k,
                             value.to(gl.int32).to(gl.float32, bitcast=True))
'''

# (old, new, count): exact edits of fwd.py's text
EDITS = [
    ("    @gluon.jit\n    def _take_turn(", STAMP + "\n    @gluon.jit\n    def _take_turn(", 1),
    ("                       RESCALE_THRESHOLD: gl.constexpr, RELEASE_Q: gl.constexpr,\n"
     "                       PINGPONG: gl.constexpr):\n",
     "                       RESCALE_THRESHOLD: gl.constexpr, RELEASE_Q: gl.constexpr,\n"
     "                       PINGPONG: gl.constexpr, tl_base=None, tl_tc=0):\n", 1),
    ("        mbarrier.wait(q_bar.index(WG), q_phase)\n        q = q_smem.index(WG)\n",
     "        mbarrier.wait(q_bar.index(WG), q_phase)\n        _stamp(tl_base, tl_tc, 1, WG)\n"
     "        q = q_smem.index(WG)\n", 1),
    ("        p_op = gl.convert_layout(p.to(q.dtype), p_layout)\n\n        base = it0 - n_lo\n",
     "        p_op = gl.convert_layout(p.to(q.dtype), p_layout)\n"
     "        _stamp(tl_base, tl_tc, 2, WG)\n\n        base = it0 - n_lo\n", 1),
    ("        if RELEASE_Q:\n            # Every S wgmma",
     "        _stamp(tl_base, tl_tc, 3, WG)\n        if RELEASE_Q:\n            # Every S wgmma", 1),
    ("        mbarrier.arrive(v_empty.index(slot), count=1)\n\n        # Epilogue.",
     "        mbarrier.arrive(v_empty.index(slot), count=1)\n        _stamp(tl_base, tl_tc, 4, WG)"
     "\n\n        # Epilogue.", 1),
    ("        gl.store(lse_ptr + lse_off, lse, mask=valid)\n",
     "        gl.store(lse_ptr + lse_off, lse, mask=valid)\n        _stamp(tl_base, tl_tc, 5, WG)\n",
     1),
    ("            if not RELEASE_Q:  # a one-tile CTA",
     "            _stamp(tl_base, tl_tc, 6, WG)\n            if not RELEASE_Q:  # a one-tile CTA", 1),
    # the persistent consumer: tile start and block count; the call passes the buffer
    ("                _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,\n",
     "                _stamp(sink_ptr, tc, 0, WG)\n"
     "                _stamp_value(sink_ptr, tc, 7, n_hi - n_lo, WG)\n"
     "                _consumer_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,\n",
     1),
    ("                               RESCALE_THRESHOLD, True, PINGPONG)\n",
     "                               RESCALE_THRESHOLD, True, PINGPONG, sink_ptr, tc)\n", 1),
    # the host passes the stamp buffer where the (absent) sink would go
    ("sink if sink is not None else lse,", "TIMELINE,", 1),
]


def patched_module():
    text = SRC.read_text()
    for old, new, count in EDITS:
        found = text.count(old)
        if found != count:
            sys.exit(f"fwd-timeline: expected {count} of {old[:60]!r}, found {found}")
        text = text.replace(old, new)
    path = SRC.with_name("_fwd_timeline.py")
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("asymflash.backends.sm90._fwd_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    path.unlink()
    return mod


NAMES = ["Q wait", "first block", "key loops", "last PV", "lse", "O store", "to next tile"]


def report(stamps: torch.Tensor, label: str):
    raw = stamps.view(torch.int32).reshape(8, 16, 8).to(torch.int64).cpu()
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    mod = patched_module()
    mod.TIMELINE = torch.zeros(8 * 16 * 8, device="cuda" if torch.cuda.is_available() else "cpu")
    if a.compile:
        k = mod.compile_for_target(head_dim=128, has_right=True,
                                   cfg=mod.FwdConfig(persistent=True, lpt=True))
        print("compiled:", k.metadata.name, "shared", k.metadata.shared)
        return
    from triton.testing import do_bench

    from asymflash.backends.sm90 import fwd
    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    # (the persistent grid only: d=128 non-causal runs it up to 1k, causal below 8k)
    for d, seqlen, causal in ((128, 512, False), (128, 512, True), (64, 512, False),
                              (64, 512, True), (128, 2048, True)):
        if True:
            b, h = 16384 // seqlen, 2048 // d
            q = torch.randn(b * seqlen, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            seq = SeqInfo.dense(b, seqlen, seqlen, q.device)
            params = AttnParams(d ** -0.5, MaskSpec(-1, 0 if causal else -1), 0.0, False)
            plain = do_bench(lambda: fwd.forward(q, k, v, seq, params, None), warmup=10,
                             rep=40)
            stamped = do_bench(lambda: mod.forward(q, k, v, seq, params, None), warmup=10,
                               rep=40)
            mod.TIMELINE.fill_(0)
            mod.forward(q, k, v, seq, params, None)
            torch.cuda.synchronize()
            report(mod.TIMELINE.clone(),
                   f"d={d} seqlen {seqlen} causal={causal}: {plain * 1e3:.1f} us plain, "
                   f"{stamped * 1e3:.1f} us stamped")


if __name__ == "__main__":
    main()
