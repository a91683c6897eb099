"""Where the microseconds of a small decode go (H200 diagnostics, not the benchmark).

    PYTHONPATH=. python3 scripts/decode-probe.py             # fixed costs, floors, step graph
    PYTHONPATH=. python3 scripts/decode-probe.py --timeline  # per-CTA phases (globaltimer)
    PYTHONPATH=. python3 scripts/decode-probe.py --sweep     # tiles x warps x stages x splits

Default mode, bf16, d=128, GQA 32:4, batch 8, CUDA-graph replay (do_bench, L2 flushed): an
empty kernel (the launch floor of a one-node graph); a read-only kernel streaming the same
K/V bytes with the decode's grid; the decode per split count; 8 decode calls on 8 caches in
one graph (the per-call cost inside a serving step's graph).

--once runs three eager calls (contiguous, first length) and exits: the target for a profiler,
e.g. `ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:decode_kernel -s 2
-c 1 python3 scripts/decode-probe.py --once --lengths 4096`.

--timeline builds a copy of the portable decode kernel with %globaltimer stamps (program
start, loop start, loop end, split ticket, merge end), runs it eagerly and prints the
min / median / max over programs of each phase.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from probe_common import forced_decode_config  # noqa: E402

from asymflash import dispatch, flash_attn_with_kvcache  # noqa: E402
from asymflash.bench.core import capture_graph  # noqa: E402

HQ, HKV, D, PAGE, BATCH = 32, 4, 128, 64, 8
DECODE = "asymflash.backends.portable.decode"


def bench(fn):
    return do_bench(fn, warmup=10, rep=30, return_mode="median")


def graph(fn):
    return bench(capture_graph(fn).replay)


def pct(nbytes, ms, copy_gbs):
    return 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs


def make_cache(seqlen, paged, dev="cuda"):
    q = torch.randn(BATCH, 1, HQ, D, device=dev, dtype=torch.bfloat16)
    lens = torch.full((BATCH,), seqlen, dtype=torch.int32, device=dev)
    k = torch.randn(BATCH, seqlen, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kw = dict(cache_seqlens=lens, check_values=False)
    if paged:
        pages = BATCH * seqlen // PAGE
        kw["page_table"] = torch.randperm(pages, device=dev).view(BATCH, -1).to(torch.int32)
        k, v = k.view(pages, PAGE, HKV, D), v.view(pages, PAGE, HKV, D)
    return q, k, v, kw


@triton.jit
def read_floor(K, V, OUT, S, per_split, HKV: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Sum of one kv head's K and V rows [split * per_split, +per_split): the decode's reads
    and grid without its arithmetic."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    base = ((bh // HKV).to(tl.int64) * S * HKV + bh % HKV) * D
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for n0 in range(split * per_split, (split + 1) * per_split, BLOCK_N):
        rows = (n0 + offs_n).to(tl.int64)[:, None] * (HKV * D) + offs_d[None, :]
        acc += tl.load(K + base + rows).to(tl.float32) + tl.load(V + base + rows).to(tl.float32)
    tl.store(OUT + bh * tl.num_programs(1) + split, tl.sum(acc))


@triton.jit
def empty_kernel(X):
    pass


def copy_bandwidth():
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench(partial(dst.copy_, src)) * 1e-3) / 1e9


def fixed_costs(lengths):
    copy = copy_bandwidth()
    x = torch.zeros(1, device="cuda")
    print(f"copy {copy:.0f} GB/s; empty kernel, graph replay "
          f"{graph(lambda: empty_kernel[(1,)](x)) * 1e3:.1f} us", flush=True)
    for seqlen in lengths:
        kv_bytes = BATCH * seqlen * HKV * 2 * D * 2
        for paged in (False, True):
            q, k, v, kw = make_cache(seqlen, paged)
            if not paged:
                for splits in (4, 8, 16):
                    out = torch.empty(BATCH * HKV * splits, device="cuda")
                    ms = graph(partial(read_floor[(BATCH * HKV, splits)], k, v, out, seqlen,
                                       seqlen // splits, HKV, D, 128, num_warps=4,
                                       num_stages=3))
                    print(f"read floor b{BATCH} {seqlen} splits {splits}: {ms * 1e3:.1f} us "
                          f"{pct(kv_bytes, ms, copy):.0f}%", flush=True)
            line = []
            for splits in (0, 1, 2, 4, 8, 16):
                ms = graph(partial(flash_attn_with_kvcache, q, k, v, num_splits=splits, **kw))
                line.append(f"s{splits}:{ms * 1e3:.1f}us/{pct(kv_bytes, ms, copy):.0f}%")
            print(f"decode {'paged' if paged else 'contig'} b{BATCH} {seqlen}: "
                  + " ".join(line), flush=True)
            caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(7)]

            def step(caches=caches, q=q, kw=kw):
                for kc, vc in caches:
                    flash_attn_with_kvcache(q, kc, vc, **kw)
            ms = graph(step) / len(caches)
            print(f"8-call step graph {'paged' if paged else 'contig'} b{BATCH} {seqlen}: "
                  f"{ms * 1e3:.1f} us per call {pct(kv_bytes, ms, copy):.0f}%", flush=True)


# (anchor in decode.py, text inserted after it): where the stamped copy reads the clock.
_STAMPS = [
    ("    pid_bh = tl.program_id(0)\n",
     "    flat = (pid_bh * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) "
     "+ tl.program_id(2)\n    tl.store(STAMPS + flat * 8 + 0, _now(pid_bh))\n"),
    ("    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)\n    for start_n in range(start, "
     "full_end, BLOCK_N):\n", None),
    ("    q_rows = (q_start + pos).to(tl.int64)\n",
     "    tl.store(STAMPS + flat * 8 + 2, _now(pid_bh + tl.sum(acc).to(tl.int32)))\n"),
    ("        ticket = tl.atomic_add(COUNTERS + tile, 1, sem=\"acq_rel\", scope=\"gpu\")\n",
     "        tl.store(STAMPS + flat * 8 + 3, _now(ticket))\n"),
    ("            tl.atomic_xchg(COUNTERS + tile, 0)  # ready for the next call\n",
     "            tl.store(STAMPS + flat * 8 + 4, _now(pid_bh))\n"),
]


def stamped_decode_module():
    """A copy of backends/portable/decode.py whose kernel writes %globaltimer stamps."""
    src = (ROOT / "asymflash/backends/portable/decode.py").read_text()
    for anchor, text in _STAMPS:
        assert src.count(anchor) == 1, anchor
        if text is None:  # loop start: stamped before the loop, after the q load
            loop = anchor.split("\n", 1)[1]
            src = src.replace(loop, "    tl.store(STAMPS + flat * 8 + 1, _now(pid_bh + "
                              "tl.sum(q.to(tl.float32)).to(tl.int32)))\n" + loop)
        else:
            src = src.replace(anchor, anchor + text)
    src = src.replace("def decode_kernel(\n    Q,", "def decode_kernel(\n    STAMPS, Q,")
    src = src.replace("    _DECODE[grid](\n        q,",
                      "    LAST['stamps'] = torch.zeros(grid[0] * grid[1] * grid[2] * 8, "
                      "dtype=torch.int64, device=dev)\n    LAST['grid'] = grid\n"
                      "    _DECODE[grid](\n        LAST['stamps'], q,")
    src = src.replace("@triton.jit\ndef decode_kernel(", '''LAST = {}


@triton.jit
def _now(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def decode_kernel(''')
    assert len(re.findall(r"STAMPS \+ flat", src)) == 5
    path = Path(tempfile.mkdtemp()) / "decode_stamped.py"
    path.write_text(src)
    name = DECODE + "_stamped"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return name, mod


def timeline(lengths):
    name, mod = stamped_decode_module()
    dispatch._DECODE_MODULES["portable"] = name
    scrub = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for seqlen in lengths:
        for paged in (False, True):
            q, k, v, kw = make_cache(seqlen, paged)
            for _ in range(3):
                scrub.zero_()  # the cache is read from HBM, as in a decode step
                flash_attn_with_kvcache(q, k, v, **kw)
            torch.cuda.synchronize()
            s = mod.LAST["stamps"].view(-1, 8).cpu().double()
            rel = (s - s[:, 0].min()) / 1e3
            merged = s[:, 4] > 0

            def spread(x):
                x = sorted(x.tolist())
                return f"{x[0]:.1f}/{statistics.median(x):.1f}/{x[-1]:.1f}" if x else "-"
            print(f"timeline {'paged' if paged else 'contig'} b{BATCH} {seqlen} grid "
                  f"{mod.LAST['grid']}, us from the first program's start, min/median/max: "
                  f"loop start {spread(rel[:, 1])}, loop end {spread(rel[:, 2])}, ticket "
                  f"{spread(rel[:, 3])}, merge end {spread(rel[merged, 4])}; phases: prologue "
                  f"{spread(rel[:, 1] - rel[:, 0])}, loop {spread(rel[:, 2] - rel[:, 1])}, "
                  f"merge {spread(rel[merged, 4] - rel[merged, 3])}", flush=True)
    dispatch._DECODE_MODULES["portable"] = DECODE


def sweep(lengths):
    from asymflash.backends.portable import decode as dec

    for seqlen in lengths:
        kv_bytes = BATCH * seqlen * HKV * 2 * D * 2
        for paged in (False, True):
            q, k, v, kw = make_cache(seqlen, paged)
            for block_n, warps, stages in [(128, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3),
                                           (64, 4, 3), (64, 8, 3), (64, 4, 4)]:
                cfg = dec.DecodeConfig(16, block_n, True, warps, stages)
                line = []
                for splits in (4, 8, 16):
                    with forced_decode_config(cfg):
                        ms = graph(partial(flash_attn_with_kvcache, q, k, v, num_splits=splits,
                                           **kw))
                    line.append(f"s{splits}:{ms * 1e3:.1f}us/{pct(kv_bytes, ms, 4240):.0f}%")
                print(f"sweep {'paged' if paged else 'contig'} b{BATCH} {seqlen} n{block_n} "
                      f"w{warps} st{stages}: " + " ".join(line), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--lengths", default="4096,16384")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.once:
        q, k, v, kw = make_cache(lengths[0], False)
        for _ in range(3):
            flash_attn_with_kvcache(q, k, v, **kw)
        torch.cuda.synchronize()
    elif args.timeline:
        timeline(lengths)
    elif args.sweep:
        sweep(lengths)
    else:
        fixed_costs(lengths)


if __name__ == "__main__":
    main()
