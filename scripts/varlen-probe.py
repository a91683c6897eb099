"""Packed documents on the sm90 forward: its grid choices side by side, beside FA4 (H200).

The models suite's varlen case (bench/models.py: log-normal document lengths) runs the sm90
forward on the plain grid, one CTA per (query tile, head, document), because the persistent
grid was never measured there (fwd/config.py: use_persistent). This times, on the same
inputs and in one process, the forward with the default config and with `persistent` and
`lpt` forced each way, and FA4's varlen forward where `flash_attn.cute` imports. Every
variant's output is compared with the default's first (a grid changes which CTA computes a
tile, not a row's arithmetic: equal bits are expected; more than a bf16 rounding is WRONG).

    PYTHONPATH=. python scripts/varlen-probe.py [--case varlen-docs-llama3-8b] [--seed 0 1 2]

Several seeds draw other document mixes of the same distribution: tune to the kind, not to
one draw. --replay (no GPU) replays the plain grid's longest-first launch order on the host
instead, each CTA to the first SM that frees up: how balanced it is against the bound
(total work / SMs), and how many of its CTAs find no rows (tiles past their document's end).

Prints one table row per (seed, variant): ms, TFLOP/s (causal pairs only), ratio to the
default; JSON under $OUT (or ./out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch


def _variants(default_cfg):
    yield "default", None
    for persistent in (False, True):
        for lpt in (False, True):
            yield (f"persistent={int(persistent)} lpt={int(lpt)}",
                   dataclasses.replace(default_cfg, persistent=persistent, lpt=lpt))


def _probe_draw(case, seed, fa4, rep, only=None) -> list:
    """Rows of one document mix: every variant checked against the default, then timed."""
    from triton.testing import do_bench

    from asymflash.backends.sm90.fwd import config as fwd_config
    from asymflash.backends.sm90.fwd import host as fwd
    from asymflash.bench.models import make_model_inputs
    from asymflash.core.params import AttnParams, MaskSpec, SeqInfo

    inp = make_model_inputs(case, "cuda", seed)
    q, k, v = inp.q, inp.k, inp.v
    cu, n = inp.aux["cu_seqlens"], inp.aux["max_seqlen"]
    seq = SeqInfo(cu, cu, n, n, None, False)
    params = AttnParams(q.shape[-1] ** -0.5, MaskSpec(-1, 0))
    flops = 4 * sum(x * (x + 1) / 2 for x in case.doc_lens) * case.nheads * case.hdim
    want = fwd.forward(q, k, v, seq, params, None)[0]
    results = {}
    for name, cfg in _variants(fwd_config.select_config(q.shape[-1], v.shape[-1], params)):
        if only is not None and name not in only:
            continue
        try:
            out = fwd.forward(q, k, v, seq, params, None, cfg=cfg)[0]
        except ValueError as e:  # check_config's refusal of a combination
            print(f"seed {seed} {name}: refused: {e}")
            continue
        diff = (out.float() - want.float()).abs().max().item()
        wrong = diff > 2 ** -7 * max(want.abs().max().item(), 1.0)
        ms = do_bench(lambda c=cfg: fwd.forward(q, k, v, seq, params, None, cfg=c),
                      warmup=25, rep=rep)
        results[name] = (ms, diff, wrong)
    if fa4 is not None:
        ms = do_bench(lambda: fa4.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
            causal=True), warmup=25, rep=rep)
        results["FA4"] = (ms, None, False)
    ref_ms = results["default"][0]
    return [dict(seed=seed, docs=len(case.doc_lens), longest=max(case.doc_lens), variant=name,
                 ms=ms, tflops=flops / ms / 1e9, vs_default=ref_ms / ms, max_diff=diff,
                 wrong=wrong) for name, (ms, diff, wrong) in results.items()]


def replay(case, seed, sms=132, block_m=128, block_n=128, overhead=1.5, dead=0.05) -> dict:
    """The plain grid's schedule of one document mix on the host, work in key blocks per
    tile (+ `overhead` for the Q load, the first wait and the epilogue; a CTA past its
    document's end costs `dead`): makespan over the bound, and the same for the ideal
    longest-first order of live tiles only."""
    import heapq

    lens, heads = case.doc_lens, case.nheads

    def cost(m, n):  # causal: a tile sees the key blocks up to its last row
        return -(-min((m + 1) * block_m, n) // block_n) + overhead

    num_m_blocks = -(-max(lens) // block_m)
    launch = [cost(m, n) if m * block_m < n else dead
              for m in range(num_m_blocks - 1, -1, -1) for n in lens for _ in range(heads)]
    live = sorted((c for c in launch if c != dead), reverse=True)
    # the default since the packed grid (`sched.packed_tile`): document by document, heads
    # outer, query blocks in order, no tile past a document's end
    packed = [cost(m, n) for n in lens for _ in range(heads)
              for m in range(-(-n // block_m))]

    def makespan(costs):
        free = [0.0] * sms
        for c in costs:
            heapq.heapreplace(free, free[0] + c)
        return max(free)

    bound = max(sum(live) / sms, live[0])
    return dict(seed=seed, docs=len(lens), longest=max(lens), live=len(live),
                empty=len(launch) - len(live), plain_lpt=makespan(launch) / bound,
                ideal_lpt=makespan(live) / bound, packed_in_order=makespan(packed) / bound,
                overhead_share=overhead * len(live) / sum(live))


def main(argv=None) -> int:
    from asymflash.bench.models import doc_lengths, models_suite, select_cases

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="varlen-docs-llama3-8b")
    p.add_argument("--seed", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rep", type=int, default=100, help="ms of timing per variant")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--replay", action="store_true", help="host replay of the plain grid only")
    p.add_argument("--only", default=None,
                   help="variants beside the default, comma-separated names as in the table "
                        "(e.g. 'persistent=0 lpt=1')")
    args = p.parse_args(argv)
    base = select_cases(models_suite(), [args.case])[0]
    median, sigma, cap, _ = base.doc_dist
    if args.replay:
        print("| seed | docs | longest | live CTAs | empty CTAs | plain LPT / bound | "
              "ideal LPT / bound | packed in order / bound | fixed share |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for seed in args.seed:
            lens = doc_lengths(base.seqlen_q, cap, median, sigma, seed)
            r = replay(dataclasses.replace(base, doc_lens=lens), seed)
            print(f"| {seed} | {r['docs']} | {r['longest']} | {r['live']} | {r['empty']} | "
                  f"{r['plain_lpt']:.3f} | {r['ideal_lpt']:.3f} | {r['packed_in_order']:.3f} | "
                  f"{r['overhead_share']:.2f} |")
        return 0
    if not torch.cuda.is_available():
        print("varlen-probe: needs the GPU", file=sys.stderr)
        return 2
    try:
        import flash_attn.cute as fa4
    except ImportError:
        fa4 = None
    rows = []
    for seed in args.seed:
        lens = doc_lengths(base.seqlen_q, cap, median, sigma, seed)
        case = dataclasses.replace(base, doc_lens=lens, doc_dist=(median, sigma, cap, seed))
        rows += _probe_draw(case, seed, fa4, args.rep,
                            None if args.only is None else {"default", *args.only.split(",")})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "varlen-probe.json"), "w") as f:
        json.dump(dict(case=args.case, torch=torch.__version__, rows=rows), f, indent=1)
    print(f"{args.case}: causal, {base.seqlen_q} tokens, {base.nheads}:{base.nheads_kv} heads, "
          f"d={base.hdim}; bf16; do_bench median")
    print("| seed | docs | longest | variant | ms | TFLOP/s | default / this | max diff |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        diff = "-" if r["max_diff"] is None else f"{r['max_diff']:.2g}" + \
            (" WRONG" if r["wrong"] else "")
        print(f"| {r['seed']} | {r['docs']} | {r['longest']} | {r['variant']} | {r['ms']:.3f} "
              f"| {r['tflops']:.0f} | {r['vs_default']:.3f} | {diff} |")
    return int(any(r["wrong"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
